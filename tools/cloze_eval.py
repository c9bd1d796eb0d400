#!/usr/bin/env python
"""Offline LAMBADA-style last-word cloze on held-out text, run with lm-evaluation-harness: the command of
megatron_delta/evaluation/cloze_eval.py (its usage: --help).

    python tools/cloze_eval.py --hf hf/delta_block --output cloze.json
"""
import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch is imported

from megatron_delta.evaluation.cloze_eval import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
