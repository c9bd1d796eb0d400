"""Training runs compared in one markdown table (tools/compare_runs.py table): each run directory's metrics.jsonl
(pretrain_gpt.py --delta-metrics-file) and summary.json (megatron_delta.trainer.run_summary) read into final
validation and held-out PPL, tokens/s, peak RSS, sources and parameters, each set against a baseline run.
"""
import json
import math
import os

from megatron_delta.core.modes import BASELINE


class RunComparisonError(ValueError):
    """A run directory or --baseline that cannot be compared; the message names it."""


def read_run(run_dir):
    """One run of the table: its name (the directory's), summary.json (or {}), final validation and held-out PPL,
    the last training record's tokens/s and iteration. Lines cut short by an interrupted run are skipped."""
    metrics = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(metrics):
        raise RunComparisonError(f"{metrics} does not exist")
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
    """The markdown table of read_run results against the run named ``baseline``, else the first run whose
    residual is baseline, else the first run."""
    base = None
    if baseline:
        base = next((r for r in runs if r["name"] == baseline), None)
        if base is None:
            raise RunComparisonError(f"--baseline {baseline!r} is not one of {[r['name'] for r in runs]}")
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
