#!/usr/bin/env python
"""What the routers' Triton kernels ask of a GPU's SM, counted on a machine without a GPU.

    python tools/kernel_resources.py [--shape 1B 8B --modes delta,delta_block --gpu H200 --format table|json]

For each launch configuration of a mode's routed stream at the shape's width and depth (bf16 sources; delta on the
group router, ``--delta-router-group-size auto``, unless --group-size says otherwise), it prints:

- the kernel, its group size S and tokens per program BT, and its warps;
- the registers per thread and the stack bytes per thread (spilled registers), read from the binary that Triton's
  compiler and ptxas make for the GPU's architecture (sm_90 for H100 / H200, sm_100 for B200);
- the programs one SM holds at once (CUDA's occupancy rules), and the bytes one SM has in flight per step of the
  kernel's loop over the sources (programs x BT x hidden x 2);
- the bandwidth those bytes allow by Little's law at --latency-ns, as a fraction of the rate the cost model assumes
  (cost_model.HBM_EFFICIENCY of the GPU's peak). The latency is an assumption, not a count.

The counts are exact for this checkout's kernels and the installed Triton. How: megatron_delta/perf/kernel_resources.py.
"""
import argparse
import json
import sys

from megatron_delta.core.group_plan import FINE_GRAINED_MODES
from megatron_delta.perf.kernel_resources import ARCHS, DEFAULT_LATENCY_NS, kernel_resources
from megatron_delta.perf.shapes import SHAPES


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--modes", default="delta,delta_block")
    p.add_argument("--group-size", default="auto", help="--delta-router-group-size of delta's stream (auto, or S)")
    p.add_argument("--num-layers", type=int, default=None, help="the stream's layers (default: the shape's)")
    p.add_argument("--gpu", default="H200", choices=list(ARCHS))
    p.add_argument("--latency-ns", type=float, default=DEFAULT_LATENCY_NS,
                   help="the load latency assumed for the bandwidth ceiling (not counted)")
    p.add_argument("--format", choices=("table", "json"), default="table")
    p.add_argument("--all", action="store_true", help="one row per launch configuration (default: one per kernel)")
    p.add_argument("--output", default=None, help="also write the rows as JSON here")
    return p.parse_args(argv)


def _span(values, fmt="{}"):
    lo, hi = min(values), max(values)
    return fmt.format(lo) if lo == hi else f"{fmt.format(lo)}-{fmt.format(hi)}"


def summary(out) -> str:
    """One row per shape, mode and kernel: its launch configurations (S, BT, warps), how many spill and by how
    much, and the ranges of registers, programs per SM, bytes in flight per SM and the ceiling."""
    lines = ["| shape | mode | kernel | configurations (S) | BT | warps | registers / thread | spilling (max bytes "
             "/ thread) | programs / SM | in flight / SM (KiB) | ceiling x modelled rate | launches per stream |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for key, rows in out.items():
        shape, mode = key.split("/")
        kernels = {}
        for r in rows:
            kernels.setdefault(r["kernel"], []).append(r)
        for name, rs in kernels.items():
            sizes = sorted({r["constants"]["S"] for r in rs if "S" in r["constants"]})
            spills = [r["stack"] for r in rs]
            lines.append(
                f"| {shape} | {mode} | {name.lstrip('_')} | {len(rs)}"
                f"{' (' + ', '.join(map(str, sizes)) + ')' if sizes else ''} | "
                f"{_span([r['constants'].get('BT', 1) for r in rs])} | {_span([r['warps'] for r in rs])} | "
                f"{_span([r['registers'] for r in rs])} | {sum(x > 0 for x in spills)} ({max(spills)}) | "
                f"{_span([r['programs_per_sm'] for r in rs])} | "
                f"{_span([r['in_flight_per_sm'] / 1024 for r in rs], '{:.0f}')} | "
                f"{_span([r['of_modelled_rate'] for r in rs], '{:.2f}')} | {sum(r['launches'] for r in rs)} |")
    return "\n".join(lines)


def main(argv=None):
    o = parse(argv)
    group = int(o.group_size) if o.group_size.isdigit() else o.group_size
    out = {}
    for shape in o.shape:
        layers = o.num_layers or SHAPES[shape]["num_layers"]
        hidden = SHAPES[shape]["hidden_size"]
        for mode in o.modes.split(","):
            size = group if mode in FINE_GRAINED_MODES else 1
            if o.format == "table":
                print(f"... {shape} {mode} (S = {size}, {layers} layers, hidden {hidden}): capturing and compiling",
                      file=sys.stderr, flush=True)
            out[f"{shape}/{mode}"] = kernel_resources(mode, layers, hidden, o.gpu, size, latency_ns=o.latency_ns)
    if o.output:
        with open(o.output, "w") as f:
            json.dump(out, f, indent=1)
    if o.format == "json":
        print(json.dumps(out, indent=1))
        return 0
    print(f"The Triton kernels compiled for {o.gpu} (sm_{ARCHS[o.gpu]}); bandwidth ceiling at an assumed load latency "
          f"of {o.latency_ns:.0f} ns, over the cost model's rate:\n")
    if o.all:
        print("| shape | mode | kernel | S | BT | warps | registers / thread | spilled bytes / thread | "
              "programs / SM | in flight / SM (KiB) | ceiling x modelled rate | launches per stream |")
        print("|---|---|---|---|---|---|---|---|---|---|---|---|")
        for key, rows in out.items():
            shape, mode = key.split("/")
            for r in rows:
                k = r["constants"]
                print(f"| {shape} | {mode} | {r['kernel'].lstrip('_')} | {k.get('S', '-')} | {k.get('BT', '-')} | "
                      f"{r['warps']} | {r['registers']} | {r['stack']} | {r['programs_per_sm']} | "
                      f"{r['in_flight_per_sm'] / 1024:.0f} | {r['of_modelled_rate']:.2f} | {r['launches']} |")
    else:
        print(summary(out))
    spilled = sum(r["stack"] > 0 for rows in out.values() for r in rows)
    total = sum(len(rows) for rows in out.values())
    print(f"\n{spilled} of {total} configurations spill registers; "
          f"{sum(r['pipelined'] for rows in out.values() for r in rows)} pipeline their loads (cp.async).")
    return 0


if __name__ == "__main__":
    sys.exit(main())
