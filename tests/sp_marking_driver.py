"""Rank function for tests/test_sp_marking.py (a module of its own: ranks import it by name)."""
from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")


def router_param_marks(mode: str) -> dict:
    """Build a TP2+SP model of `mode` on this rank; {router parameter: [sequence_parallel, tensor_model_parallel]}."""
    from megatron_delta.arguments import parse_args
    from megatron_delta.cpu_platform import activate_cpu_platform, initialize_distributed
    from megatron_delta.arguments import model_options, transformer_config_from_args
    from megatron_delta.core.model import build_model_chunks

    args = parse_args(["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "16",
                       "--micro-batch-size", "2", "--mock-data", "--vocab-size", "256", "--residual", mode,
                       "--delta-null-source", "--tensor-model-parallel-size", "2", "--sequence-parallel"]
                      + (["--delta-gate", "scalar"] if mode in ("delta", "delta_block") else []), world_size=2)
    activate_cpu_platform()
    initialize_distributed(2, 1, seed=args.seed)
    (model,) = build_model_chunks(transformer_config_from_args(args), 256, **model_options(args))
    return {n: [bool(getattr(p, "sequence_parallel", False)), bool(getattr(p, "tensor_model_parallel", False))]
            for n, p in model.named_parameters() if getattr(p, "is_delta_router", False)}
