#!/usr/bin/env python
"""Pretrain a GPT with Megatron-LM's trainer (megatron.training.pretrain) and an optional Delta residual mode.

    python pretrain_gpt.py                          # embedded default: bundled corpus, tiny Qwen3-style model, CPU
    python pretrain_gpt.py --residual delta_block   # the same with Delta Block routing
    torchrun --nproc-per-node 8 pretrain_gpt.py <a Megatron-LM job's flags> --residual delta_block

Every Megatron-LM flag means what it means in Megatron-LM; the project adds `--residual` and the
`--delta-*` flags (`python pretrain_gpt.py --help` lists all). The model, dataset and forward-step
providers are in megatron_delta/trainer/.
"""
import sys

if __name__ == "__main__":  # dist_checkpointing starts a multiprocessing manager: keep the guard.
    from megatron_delta.trainer.main import main

    sys.exit(main())
