"""Rank function for tests/integration/test_sp_marking.py (a module of its own: ranks import it by name)."""
from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")


def router_param_marks(mode: str) -> dict:
    """Build a TP2+SP model of `mode` on this rank; {router parameter: [sequence_parallel, tensor_model_parallel]}."""
    from megatron_delta.checkpoint.model_config import model_config
    from megatron_delta.core.model import build_model_chunks
    from megatron_delta.core.modes import ADDITIVE_MODES
    from megatron_delta.platform.cpu import activate_cpu_platform
    from megatron_delta.platform.distributed import initialize_distributed

    activate_cpu_platform()
    initialize_distributed(2, 1, seed=1234)
    config, options = model_config(dict(
        num_layers=2, hidden_size=32, num_attention_heads=2, seq_length=16, vocab_size=256, residual=mode,
        delta_null_source=True, tensor_model_parallel_size=2, sequence_parallel=True,
        delta_gate="scalar" if mode in ADDITIVE_MODES else "none"))
    (model,) = build_model_chunks(config, 256, **options)
    return {n: [bool(getattr(p, "sequence_parallel", False)), bool(getattr(p, "tensor_model_parallel", False))]
            for n, p in model.named_parameters() if getattr(p, "is_delta_router", False)}
