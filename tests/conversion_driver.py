"""Test driver for tests/test_conversion.py: train several models in ONE multi-process launch.

    run_distributed(conversion_driver.train_all, 4, [argv, argv, ...])

Every rank runs each pretrain_gpt argv in turn through tests.parity_driver._run (one
initialize_distributed per run, torch.distributed kept), so all modes share the process start-up.
"""
from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")


def train_all(argvs: list[list[str]]) -> list[dict]:
    """Run each argv (pretrain_gpt flags, with --save) on this rank; returns each run's result dict."""
    import torch

    torch.set_num_threads(1)
    from megatron_delta.platform.patches import import_megatron

    import_megatron(training=True)  # Megatron's import-time notices quieted (megatron_delta.platform.patches.KNOWN_WARNINGS)
    from tests.parity_driver import _run

    out = []
    for argv in argvs:
        result, _, _ = _run(argv)
        torch.distributed.barrier()
        out.append(result)
    return out
