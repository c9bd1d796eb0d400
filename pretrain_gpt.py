#!/usr/bin/env python
"""Pretrain a GPT (Qwen3-style by default) with Megatron-Core and an optional Delta residual mode.

    python pretrain_gpt.py                          # embedded default: bundled corpus, tiny model, CPU
    python pretrain_gpt.py --residual delta_block   # the same with Delta Block routing
    torchrun --nproc-per-node 4 pretrain_gpt.py --tensor-model-parallel-size 2 \
        --pipeline-model-parallel-size 2 --sequence-parallel ...

Flags follow Megatron-LM's pretrain_gpt.py; `python pretrain_gpt.py --help` lists them.
"""
import sys

if __name__ == "__main__":  # dist_checkpointing starts a multiprocessing manager: keep the guard.
    from megatron_delta.training import main

    sys.exit(main())
