#!/usr/bin/env python
"""The routers' host work, on CPU: what the CPU driving a GPU does per router call and per training step.

    python tools/host_work.py [--num-layers 28 --modes baseline,delta,delta_block --output host.json]

Where a layer's GEMMs take the GPU less time than its host takes to launch the layer's kernels (the 1B shape on
an H200: docs/performance.md, GPU figures), a router costs its host work, not its bytes. Prints

- per router call of each mode's routed stream (identity sublayers, Triton kernels; delta on the group router):
  kernel launches, table copies, PyTorch ops (views, allocations, the rest: each of the rest a kernel launch on a
  GPU) - exact counts - and this CPU's host microseconds per call;
- a training step of 8 micro-batches at a tiny width with L layers (Megatron's schedule, DDP and optimizer), each
  mode's host time against the baseline's in the same run: the proxy of a host-bound GPU run; and each mode with
  its router calls at their host floor ("floor": one autograd node per call, no kernel, no math), which leaves
  the routed layers' own host work, so that the rest of the mode's ratio is its router calls'.

    python tools/host_work.py --capture-check [--format json|markdown] [--skip-step]

prints, per routed mode, what a CUDA graph replay of the routed step needs (megatron_delta/perf/capture_check.py
defines each figure): {"launches_per_step", "launch_signatures_differ", "table_copies_after_first", "syncs",
"compile_graph_breaks", "ops_per_call", "step_host_ratio"}, each beside its target and whether it is met; the
JSON also holds "targets", "met", "detail" (per case: what differed, copies and syncs by name) and "seconds".
--skip-step leaves step_host_ratio out (null), the slow part.

The Triton kernels run under Triton's interpreter with their launches made no-ops (what is left is host work);
this script sets TRITON_INTERPRET=1 before anything imports Triton. How: megatron_delta/perf/host_work.py. CPU
times move with machine load: read the ratios and the counts.
"""
import os

os.environ["TRITON_INTERPRET"] = "1"  # before Triton's import: the kernels run (as no-ops) on CPU tensors

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402

from megatron_delta.core.modes import BASELINE, BLOCK_MODES, RESIDUAL_MODES  # noqa: E402
from megatron_delta.perf import capture_check, gpu_check, host_work  # noqa: E402
from megatron_delta.trainer.hooks import router_overrides  # noqa: E402  (the routers' optimizer group)

GROUPED = ("delta", "full_attnres")  # the group router's modes: S = auto, and S = 1 beside it


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-layers", type=int, default=28, help="the training step's layers (the 1B shape's 28)")
    p.add_argument("--stream-layers", type=int, default=12, help="the routed stream's layers for the per-call counts")
    p.add_argument("--modes", default=None, help="baseline,delta,delta_block (--capture-check: every routed mode)")
    p.add_argument("--iters", type=int, default=None,
                   help="training iterations per mode, the first not timed (6; --capture-check: 4)")
    p.add_argument("--micro-batches", type=int, default=None, help="per training step (8; --capture-check: 4)")
    p.add_argument("--rounds", type=int, default=2,
                   help="rounds of the training steps, in order then in reverse; each run's fastest iteration counts")
    p.add_argument("--reps", type=int, default=20, help="routed-stream rounds per timing")
    p.add_argument("--skip-step", action="store_true", help="only the per-call counts")
    p.add_argument("--output", default=None, help="JSON results")
    p.add_argument("--capture-check", action="store_true",
                   help="what a CUDA graph replay of the routed step needs, per routed mode, against its targets")
    p.add_argument("--format", choices=("table", "json", "markdown"), default="table",
                   help="--capture-check's output on stdout: a readable table, the JSON alone, or a Markdown table "
                        "(docs/performance.md's)")
    p.add_argument("--capture-iters", type=int, default=capture_check.ITERATIONS,
                   help="--capture-check: iterations of each case, each compared with the one before")
    o = p.parse_args(argv)
    if o.modes is None:
        o.modes = (",".join(sorted({m for _, m, _ in capture_check.RUNS})) if o.capture_check
                   else "baseline,delta,delta_block")
    o.modes = [m.strip() for m in o.modes.split(",") if m.strip()]
    # the capture check's step: fewer micro-batches and iterations (a ratio of forward + backward times, which the
    # count of micro-batches barely moves), so that the whole check takes minutes
    o.iters = o.iters if o.iters is not None else 4 if o.capture_check else 6
    o.micro_batches = o.micro_batches if o.micro_batches is not None else 4 if o.capture_check else 8
    if o.format != "table" and not o.capture_check:
        p.error(f"--format {o.format}: only with --capture-check (the host-work tables are written as JSON with "
                "--output)")
    if o.capture_iters < 2:
        p.error(f"--capture-iters {o.capture_iters}: at least 2 (each iteration is compared with the one before)")
    bad = [m for m in o.modes if m != BASELINE and m not in RESIDUAL_MODES]
    if bad:
        p.error(f"--modes: {', '.join(bad)} is not baseline or a routed mode ({', '.join(RESIDUAL_MODES)})")
    if o.iters < 2:
        p.error(f"--iters {o.iters}: at least 2 (the first iteration is not timed)")
    if o.rounds < 1:
        p.error(f"--rounds {o.rounds}: at least 1")
    if o.stream_layers < 1 or o.num_layers < 1:
        p.error("--num-layers and --stream-layers must be positive")
    blocks = [m for m in o.modes if m in BLOCK_MODES]
    if blocks and not o.skip_step and o.num_layers % gpu_check.NUM_BLOCKS:
        p.error(f"--num-layers {o.num_layers}: {', '.join(blocks)} train with --delta-num-blocks "
                f"{gpu_check.NUM_BLOCKS} (as tools/gpu_check.py), so it must be a multiple of {gpu_check.NUM_BLOCKS}")
    return o


def capture(o):
    """--capture-check: capture_check.check over the routed modes of --modes, the step ratios from step_ratios."""
    out = sys.stderr if o.format == "json" else sys.stdout

    def say(line, **kwargs):
        print(line, file=out, **kwargs)

    runs = [r for r in capture_check.RUNS if r[1] in o.modes]

    def step(pairs):
        say(f"Training step, {o.micro_batches} micro-batches, {o.num_layers} layers (host time; x baseline):")
        kernel_runs = [(m, "triton", g if m in GROUPED else None) for m, g in pairs]
        rows = host_work.step_ratios(kernel_runs, router_overrides, layers=o.num_layers, iters=o.iters,
                                     micro_batches=o.micro_batches, rounds=o.rounds,
                                     progress=lambda line: say(line, flush=True))
        ratios = {(r["mode"], r["group_size"]): r["ratio"] for r in rows}
        return {(m, g): ratios[m, g if m in GROUPED else None] for m, g in pairs}

    say(f"Capture check: {', '.join(label for label, _, _ in runs)}; cases {', '.join(capture_check.CASES)}, "
        f"{o.capture_iters} iterations each")
    json_out = None
    if o.format == "json":  # stdout is the JSON alone: what anything prints meanwhile (Megatron's log) goes to stderr
        sys.stdout.flush()
        json_out = os.dup(1)
        os.dup2(2, 1)
    try:
        result = capture_check.check(runs, iterations=o.capture_iters, stream_layers=o.stream_layers,
                                     step=None if o.skip_step else step, progress=say)
    finally:
        if json_out is not None:
            sys.stdout.flush()
            os.dup2(json_out, 1)
            os.close(json_out)
    if o.format == "json":
        print(json.dumps(result, indent=1))
    else:
        say((capture_check.format_markdown if o.format == "markdown" else capture_check.format_table)(result))
        say(f"({result['seconds']:.0f} s; the figures per case are in --format json's \"detail\")")
    if o.output:
        with open(o.output, "w") as f:
            json.dump(result, f, indent=1)
    return 0


def main(argv=None):
    o = parse(argv)
    if o.capture_check:
        return capture(o)
    routed = [m for m in o.modes if m != BASELINE]
    runs = [(m, "triton", g) for m in routed for g in (("auto", 1) if m in GROUPED else (None,))]
    floors = [(m, host_work.FLOOR, None) for m in routed]  # the step only: the router calls at their host floor
    result = {"per_call": [], "step": []}
    print(f"Per router call, routed stream of {o.stream_layers} layers (identity sublayers), Triton kernels under "
          "the interpreter, launches no-ops; counts are exact, us is this CPU's host time:")
    print(f"  {'mode':12s} {'S':>4s} {'launches':>8s} {'copies':>6s} {'torch ops':>9s} {'views':>6s} {'allocs':>6s} "
          f"{'other':>6s} {'host us':>8s}")
    for mode, kernels, group in runs:
        r = host_work.per_call(mode, o.stream_layers, kernels, group if group is not None else 1, reps=o.reps)
        result["per_call"].append(r)
        print(f"  {mode:12s} {group or '-'!s:>4s} {r['launches']:8.2f} {r['table_copies']:6.2f} {r['torch_ops']:9.1f} "
              f"{r['views']:6.1f} {r['allocations']:6.1f} {r['other_ops']:6.1f} {r['host_us']:8.0f}", flush=True)
    if not o.skip_step:
        print(f"\nTraining step, {o.micro_batches} micro-batches, {o.num_layers} layers at hidden "
              f"{host_work.HOST_SHAPE['hidden']}, {host_work.HOST_SHAPE['seq']} tokens (host time; x baseline):")
        result["step"] = host_work.step_ratios(runs + floors, router_overrides, layers=o.num_layers, iters=o.iters,
                                               micro_batches=o.micro_batches, rounds=o.rounds,
                                               progress=lambda line: print(line, flush=True))
    if o.output:
        with open(o.output, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
