#!/usr/bin/env python
"""Where does each sublayer route? Routing diagnostics of a trained checkpoint on held-out text.

    python tools/routing_report.py --load runs/default-delta_block --output runs/report
        [--data-path PREFIX ...] [--mock-data] [--num-batches 4] [--micro-batch-size 4]

Loads a megatron-delta checkpoint saved under any TP/PP/VPP layout into ONE process (TP1/PP1:
dist_checkpointing reshards), runs text through it with routing recording on (docs/design.md section 1,
"Routing diagnostics") and writes to --output:

  routing.json              per dataset: per receiving sublayer (j, or 'final') the number of
                            sources, their names, mean max weight, mean normalised entropy
                            H(alpha)/log N and mean weights; plus the receiver x source matrix
  routing_matrix_<ds>.png   mean routing weight, receiving sublayer x source (blank where the
                            receiver does not see that source)
  routing_curves_<ds>.png   per receiver: max weight (with the uniform 1/N reference) and
                            normalised entropy (uniform routing = 1)

Data: by default the bundled SOTU validation split and the Wikipedia held-out sample
(megatron_delta.data.corpus.ensure_default_data; the checkpoint must use that tokenizer, as the default
run does); --data-path PREFIX for other preprocessed data (tokenised with the checkpoint's
tokenizer); --mock-data for checkpoints trained on mock tokens (NullTokenizer).

--dtype auto (the default) computes in the precision the checkpoint was trained in (a --bf16 run's model in
bf16, the routers in fp32, as in training); --dtype fp32 / bf16 choose.
"""

import argparse
import os
import sys

from megatron_delta.checkpoint.integrity import add_verify_integrity_argument
from megatron_delta.core.modes import BASELINE
from megatron_delta.evaluation.precision import add_dtype_argument


def build_parser():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--load", required=True, help="a run directory (its latest checkpoint) or an iter_* directory")
    p.add_argument("--output", required=True, help="directory for routing.json and the PNGs")
    p.add_argument("--data-path", nargs="+", default=None, help="preprocessed data prefix(es) (Megatron blend)")
    p.add_argument("--mock-data", action="store_true", help="mock tokens (checkpoints trained with --mock-data)")
    p.add_argument("--tokenizer-model", default=None, help="default: the checkpoint's")
    p.add_argument("--num-batches", type=int, default=4, help="batches per dataset")
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--seq-length", type=int, default=None, help="default: the checkpoint's")
    add_dtype_argument(p)
    add_verify_integrity_argument(p)
    p.add_argument("--cache-dir", default=os.path.join("runs", "cache"), help="where the default data is built")
    return p


def main(argv=None):
    opts = build_parser().parse_args(argv)
    from megatron_delta.checkpoint.errors import CheckpointError, ConversionError
    from megatron_delta.checkpoint.reader import open_checkpoint
    from megatron_delta.evaluation.routing_report import run_from_run_config, write_routing_report

    try:
        ckpt_dir, iteration, cfg, _, _ = open_checkpoint(opts.load, opts.verify_integrity)  # verified first
    except CheckpointError as e:
        print(f"routing_report.py: error: {e}", file=sys.stderr)
        return 1
    if cfg.get("residual", BASELINE) == BASELINE:
        print("routing_report.py: error: the checkpoint is --residual baseline: it has no routing", file=sys.stderr)
        return 1
    try:
        fields, args = run_from_run_config(cfg, opts, f"--load {ckpt_dir}")
    except ConversionError as e:
        print(f"routing_report.py: error: {e}", file=sys.stderr)
        return 1

    from megatron_delta.trainer.forward_pass import collect_routing_stats

    try:
        write_routing_report(ckpt_dir, iteration, cfg, fields, args, opts, collect_routing_stats)
    except (CheckpointError, ConversionError) as e:  # a file of the checkpoint found damaged while reading it
        print(f"routing_report.py: error: {e}", file=sys.stderr)
        return 1
    print(f"\n wrote {opts.output}/routing.json and routing_*.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
