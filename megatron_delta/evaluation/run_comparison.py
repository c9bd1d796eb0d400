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
import json
import math
import os
import resource
import sys
import time

from megatron_delta.core.modes import BASELINE, BLOCK_MODES


# ---------------------------------------------------------------------------------------- train
def cmd_train(run_dir, flags):
    from megatron_delta.trainer import main as trainer

    os.makedirs(run_dir, exist_ok=True)
    if "--delta-metrics-file" not in flags:
        flags = flags + ["--delta-metrics-file", os.path.join(run_dir, "metrics.jsonl")]
    metrics = flags[flags.index("--delta-metrics-file") + 1]
    if os.path.exists(metrics):
        os.remove(metrics)  # a fresh run, not appended to an old one
    t0 = time.time()
    rc = trainer.main(flags)
    wall = time.time() - t0
    if rc:
        return rc
    model = trainer.LAST_RUN.model  # the model pretrain_gpt.py built: count its parameters
    captured = {"parameters": sum(p.numel() for m in model for p in m.parameters()),
                "router_parameters": sum(p.numel() for m in model for p in m.parameters()
                                         if getattr(p, "is_delta_router", False)),
                "args": trainer.LAST_RUN.args}
    args = captured["args"]
    max_sources = 0
    if args.residual != BASELINE:
        from megatron_delta.core.sources import SourcePlan

        max_sources = SourcePlan.from_config(args).max_sources() + int(bool(args.delta_null_source))
    summary = {
        "residual": args.residual,
        "delta_num_blocks": args.delta_num_blocks if args.residual in BLOCK_MODES else None,
        "num_layers": args.num_layers, "hidden_size": args.hidden_size, "seq_length": args.seq_length,
        "global_batch_size": args.global_batch_size, "train_iters": args.train_iters, "seed": args.seed,
        "parameters": captured["parameters"], "router_parameters": captured["router_parameters"],
        "max_sources": max_sources,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "wall_s": wall, "flags": flags,
    }
    with open(os.path.join(run_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    return 0


# ---------------------------------------------------------------------------------------- table
def read_run(run_dir):
    metrics = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(metrics):
        raise SystemExit(f"compare_runs.py: error: {metrics} does not exist")
    summary_path = os.path.join(run_dir, "summary.json")
    summary = json.load(open(summary_path)) if os.path.isfile(summary_path) else {}
    last = {"valid": None, "heldout": None}
    train = []
    for line in open(metrics):
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        split = rec.get("split")
        if split in last and rec.get("lm_loss") is not None:
            if last[split] is None or rec["iteration"] >= last[split]["iteration"]:
                last[split] = rec
        elif split is None and "lm_loss" in rec:
            train.append(rec)
    tps = train[-1].get("tokens_per_sec") if train else None
    ppl = {k: (math.exp(min(v["lm_loss"], 50.0)) if v else None) for k, v in last.items()}
    return {"name": os.path.basename(os.path.normpath(run_dir)), "summary": summary, "valid_ppl": ppl["valid"],
            "heldout_ppl": ppl["heldout"], "tokens_per_sec": tps,
            "iteration": train[-1]["iteration"] if train else None}


def _pct(x, base):
    if x is None or base is None:
        return "-"
    return f"{100.0 * (x / base - 1.0):+.2f}%"


def _rel(x, base):
    if x is None or not base:
        return "-"
    return f"{x / base:.3f}x"


def _f(x, fmt):
    return "-" if x is None else format(x, fmt)


def make_table(runs, baseline=None):
    base = None
    if baseline:
        base = next((r for r in runs if r["name"] == baseline), None)
        if base is None:
            raise SystemExit(f"compare_runs.py: error: --baseline {baseline!r} is not one of "
                             f"{[r['name'] for r in runs]}")
    base = base or next((r for r in runs if r["summary"].get("residual") == BASELINE), runs[0])
    bp = base["summary"].get("parameters")
    lines = [f"Baseline: {base['name']}. PPL = exp(final lm loss); tokens/s = training average; memory = "
             f"peak RSS of the training process.", "",
             "| run | mode | K | iters | valid PPL | vs base | held-out PPL | vs base | tokens/s | rel. | "
             "peak RSS MiB | rel. | sources (max) | added params |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        s = r["summary"]
        rss = s.get("peak_rss_bytes")
        added = (s["parameters"] - bp) if (s.get("parameters") is not None and bp is not None) else None
        lines.append(
            f"| {r['name']} | {s.get('residual', '?')} | {s.get('delta_num_blocks') or '-'} | {r['iteration']} "
            f"| {_f(r['valid_ppl'], '.3f')} | {_pct(r['valid_ppl'], base['valid_ppl'])} "
            f"| {_f(r['heldout_ppl'], '.3f')} | {_pct(r['heldout_ppl'], base['heldout_ppl'])} "
            f"| {_f(r['tokens_per_sec'], ',.0f')} | {_rel(r['tokens_per_sec'], base['tokens_per_sec'])} "
            f"| {_f(rss / 2**20 if rss else None, '.0f')} | {_rel(rss, base['summary'].get('peak_rss_bytes'))} "
            f"| {s.get('max_sources', '-')} | {'-' if added is None else f'{added:,}'} |")
    return "\n".join(lines)


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
        return cmd_train(opts.run_dir, flags)
    if argv and argv[0] == "table":
        argv = argv[1:]
    p = argparse.ArgumentParser(prog="compare_runs.py [table]")
    p.add_argument("run_dirs", nargs="+")
    p.add_argument("--baseline", default=None, help="name (directory basename) of the reference run")
    p.add_argument("--output", default=None, help="also write the table here")
    opts = p.parse_args(argv)
    table = make_table([read_run(d) for d in opts.run_dirs], opts.baseline)
    print(table)
    if opts.output:
        with open(opts.output, "w") as f:
            f.write(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
