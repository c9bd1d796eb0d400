#!/usr/bin/env python
"""Loss curves from pretrain_gpt.py --delta-metrics-file JSON lines, one line (colour) per run: the command of
megatron_delta/evaluation/loss_curves.py (its usage: --help).

    python tools/plot_metrics.py --metrics-file runs/a/metrics.jsonl runs/b/metrics.jsonl --output loss.png
"""
import sys

from megatron_delta.evaluation.loss_curves import main

if __name__ == "__main__":
    sys.exit(main())
