#!/usr/bin/env python
"""Train runs with measurements, and compare them in one markdown table.

    # one training run (pretrain_gpt.py in this process) + a summary of what the metrics file lacks
    python tools/compare_runs.py train --run-dir runs/cmp/delta -- --residual delta --mock-data ...
    # the table
    python tools/compare_runs.py table runs/cmp/baseline runs/cmp/delta ... [--baseline baseline] [--output t.md]

`train` runs pretrain_gpt.py's main (megatron_delta.trainer.main) with the given pretrain_gpt.py flags, adding
`--delta-metrics-file RUN_DIR/metrics.jsonl` unless given, and writes RUN_DIR/summary.json: residual
mode, blocks, parameters (counted on the built model), added router parameters, the most sources
any router reads, the process's peak RSS (resource.getrusage; includes Python + torch, about the
same for every mode, so ratios understate activation differences at tiny sizes) and wall time.

`table` reads each RUN_DIR's metrics.jsonl (+ summary.json) and prints: final validation PPL,
held-out PPL, their change vs the baseline, training tokens/s and peak RSS relative to the baseline,
sources (max) and added parameters. The baseline is the run named --baseline, else the run whose
residual is `baseline`, else the first.
"""

import argparse
import sys


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "train":
        p = argparse.ArgumentParser(prog="compare_runs.py train")
        p.add_argument("--run-dir", required=True)
        rest = argv[1:]
        if "--" in rest:
            i = rest.index("--")
            own, flags = rest[:i], rest[i + 1:]
        else:
            own, flags = rest, []
        opts = p.parse_args(own)
        from megatron_delta.trainer.run_summary import train_with_summary

        return train_with_summary(opts.run_dir, flags)
    if argv and argv[0] == "table":
        argv = argv[1:]
    p = argparse.ArgumentParser(prog="compare_runs.py [table]")
    p.add_argument("run_dirs", nargs="+")
    p.add_argument("--baseline", default=None, help="name (directory basename) of the reference run")
    p.add_argument("--output", default=None, help="also write the table here")
    opts = p.parse_args(argv)
    from megatron_delta.evaluation.run_comparison import RunComparisonError, make_table, read_run

    try:
        table = make_table([read_run(d) for d in opts.run_dirs], opts.baseline)
    except RunComparisonError as err:
        print(f"compare_runs.py: error: {err}", file=sys.stderr)
        return 1
    print(table)
    if opts.output:
        with open(opts.output, "w") as f:
            f.write(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
