"""Loss curves from pretrain_gpt.py --delta-metrics-file JSON lines, one line (colour) per run.

    python tools/plot_metrics.py --metrics-file runs/a/metrics.jsonl runs/b/metrics.jsonl --output loss.png
        [--labels a b] [--smooth 10]

Solid: training lm loss per iteration (optionally a running mean over --smooth iterations);
dashed with markers: validation lm loss; dotted: held-out lm loss (when present). A run's label is
--labels or its file's parent directory name.
"""

import argparse
import json
import os
import sys


def read_metrics(path):
    """{'train': [(it, loss)], 'valid': [(it, loss)], 'heldout': [(it, loss)]} from one metrics file."""
    out = {"train": [], "valid": [], "heldout": []}
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut short by an interrupted run
            if "lm_loss" not in rec or rec.get("lm_loss") is None:
                continue
            split = rec.get("split", "train")
            if split in out:
                out[split].append((rec["iteration"], rec["lm_loss"]))
    return out


def _smooth(values, n):
    if n <= 1:
        return values
    out, acc = [], []
    for v in values:
        acc.append(v)
        if len(acc) > n:
            acc.pop(0)
        out.append(sum(acc) / len(acc))
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--metrics-file", nargs="+", required=True)
    p.add_argument("--labels", nargs="+", default=None)
    p.add_argument("--output", required=True, help="PNG path")
    p.add_argument("--smooth", type=int, default=1, help="running mean of the training loss over N iterations")
    p.add_argument("--title", default="lm loss")
    opts = p.parse_args(argv)
    if opts.labels and len(opts.labels) != len(opts.metrics_file):
        p.error("--labels needs one label per --metrics-file")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    plotted = 0
    for i, path in enumerate(opts.metrics_file):
        if not os.path.isfile(path):
            print(f"plot_metrics.py: error: {path} does not exist", file=sys.stderr)
            return 1
        m = read_metrics(path)
        label = opts.labels[i] if opts.labels else os.path.basename(os.path.dirname(os.path.abspath(path)))
        color = f"C{i % 10}"
        if m["train"]:
            xs, ys = zip(*m["train"])
            ax.plot(xs, _smooth(list(ys), opts.smooth), "-", color=color, lw=1.2, label=f"{label} train")
            plotted += 1
        if m["valid"]:
            xs, ys = zip(*m["valid"])
            ax.plot(xs, ys, "o--", color=color, ms=4, label=f"{label} valid")
            plotted += 1
        if m["heldout"]:
            xs, ys = zip(*m["heldout"])
            ax.plot(xs, ys, "s:", color=color, ms=4, label=f"{label} held-out")
            plotted += 1
    if not plotted:
        print("plot_metrics.py: error: no lm_loss records in the metrics files", file=sys.stderr)
        return 1
    ax.set_xlabel("iteration")
    ax.set_ylabel("lm loss")
    ax.set_title(opts.title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(opts.output)), exist_ok=True)
    fig.savefig(opts.output, dpi=120)
    plt.close(fig)
    print(f" wrote {opts.output}")
    return 0

