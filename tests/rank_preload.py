"""What the fork server of tests/dist_utils.py imports before it forks ranks: what every rank of the suite
imports first (torch, Megatron-Core, Megatron-LM through megatron_delta.platform.patches.import_megatron, which
quiets their import-time notices as the trainer does, and the rank-side test code). Nothing here runs torch
ops or starts a Python thread: the server forks from here.

Megatron-Core torch.compile's a few small helpers (the SwiGLU fusion, the MoE router's top-k). On CPU, inductor
first probes which vector instruction sets the host C++ compiler builds (compiler runs in subprocesses, ~4 s a
process) and caches the answer in the process: probed once here, every forked rank inherits it.
"""
from torch._inductor import cpu_vec_isa

from megatron_delta.platform.patches import import_megatron

import_megatron(training=True)

import megatron.core.tokenizers.text  # noqa: E402,F401  (transformers: every run builds its tokenizer)
import megatron.core.transformer.moe.moe_layer  # noqa: E402,F401

import megatron_delta.trainer.main  # noqa: E402,F401
import tests.dist_utils  # noqa: E402,F401
import tests.rank_runner  # noqa: E402,F401

cpu_vec_isa.valid_vec_isa_list()
