#!/usr/bin/env python
"""The throughput part of the GPU acceptance run (tools/gpu_acceptance.sh runs it after the CUDA tests,
tests/gpu/), on one H100 / H200, Megatron's local layers (no Transformer Engine needed):

    python tools/gpu_check.py --out runs/gpu_check.json             # one GPU
    TRITON_INTERPRET=1 python tools/gpu_check.py --dry-run --out /tmp/dry.json  # CPU: every code path, tiny sizes

Prints a table per part and writes JSON (rewritten after every run: a timeout still leaves results). Parts
(--parts; speed and host by default):

speed  tokens/s of a training step's forward + backward (--speed-micro-batches micro-batches; the optimizer step
       timed apart) and peak memory (torch.cuda.max_memory_allocated, above what the run found allocated) of the
       baseline, delta on the group router and delta_block (K = 4), routers on the project's Triton kernels, at an
       8B layer slice (hidden 4096, as many layers as fit unless --num-layers-8b, a multiple of 4) and at the 1B
       shape (28 layers, hidden 2048); each eager and with CUDA graphs (--cuda-graph-impl full_iteration: the
       schedule captured once, then replayed) where Megatron and this project accept them - a refused
       configuration gets its refusal line instead of a figure. Ratios against the baseline run the same way,
       beside each the cost model's predicted ratio, the ratio at the shape's full depth (36 layers at 8B: from a
       slice, the model's error on the slice carried over, perf/speed_targets.full_depth_ratio), the memory plan
       and the target: delta >= 0.87x tokens/s at 1B on H200, 0.83x on H100; delta_block >= 0.96x at the 8B
       shape on H200, 0.95x on H100, and <= 1.10x peak memory (eager, BF16).
host   the host's microseconds per router call: the routed streams of delta (group router, one router per pass)
       and delta_block on the Triton kernels at a tiny width, where the GPU's work is next to nothing, with the
       launches, table copies and PyTorch ops per call (perf/host_work.py).
bandwidth, kernels (not run by default): the router kernels' counted bytes over their time against the copy rate,
       and where the GPU's time goes in the routed stream at the 1B depth (perf/kernel_rates.py).

--time-budget-s stops starting runs once spent and records those it did not run. --dry-run runs every part on CPU
at tiny sizes (fp32, the Triton kernels under the interpreter; a graphed baseline is recorded as not run: CUDA
graphs need a GPU). Without --dry-run and without CUDA it exits at once with status 2 and says why.
"""

import argparse
import os
import sys
from functools import partial

from megatron_delta.core.modes import BASELINE
from megatron_delta.perf import gpu_check as checks
from megatron_delta.perf import host_work, kernel_rates, speed_targets
from megatron_delta.platform.patches import known_warnings_quieted


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None, help="the JSON (default $OUT/gpu_check.json, else runs/gpu_check.json)")
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny sizes, the Triton kernels under the interpreter")
    p.add_argument("--parts", nargs="+", default=["speed", "host"], choices=checks.PARTS)
    p.add_argument("--vocab-size", type=int, default=None, help="default 32000 (dry run 64)")
    p.add_argument("--speed-iters", type=int, default=None, help="iterations per run (default 6, dry 3)")
    p.add_argument("--speed-micro-batches", type=int, default=checks.SPEED_MICRO_BATCHES,
                   help="micro-batches per timed step (a training step, not one micro-batch)")
    p.add_argument("--warmup", type=int, default=None,
                   help="iterations excluded from the timing (default 2, dry 1; a graphed run captures at the second)")
    p.add_argument("--lr", type=float, default=None, help="default 3e-4 (dry run 3e-3)")
    p.add_argument("--num-layers-8b", type=int, default=None,
                   help=f"a multiple of {checks.NUM_BLOCKS} (the block modes' K); default as many as fit (memory plan)")
    p.add_argument("--time-budget-s", type=float, default=240, help="start no run after this many seconds")
    o = p.parse_args(argv)
    if o.speed_micro_batches < 1:
        p.error(f"--speed-micro-batches {o.speed_micro_batches} must be a positive number of micro-batches")
    if o.num_layers_8b is not None and (o.num_layers_8b < 1 or o.num_layers_8b % checks.NUM_BLOCKS):
        p.error(f"--num-layers-8b {o.num_layers_8b} must be a positive multiple of {checks.NUM_BLOCKS}: the block "
                f"modes run with --delta-num-blocks {checks.NUM_BLOCKS} (the targets' K)")
    if o.dry_run and os.environ.get("TRITON_INTERPRET") != "1":
        p.error("--dry-run runs the routers on the project's Triton kernels under Triton's interpreter: set "
                "TRITON_INTERPRET=1 in the environment")
    for name, full, small in (("vocab_size", 32000, 64), ("speed_iters", 6, 3), ("warmup", 2, 1), ("lr", 3e-4, 3e-3)):
        if getattr(o, name) is None:
            setattr(o, name, small if o.dry_run else full)
    if o.warmup >= o.speed_iters:
        p.error(f"--warmup {o.warmup} leaves none of --speed-iters {o.speed_iters} iterations timed")
    o.out = o.out or os.path.join(os.environ.get("OUT") or "runs", "gpu_check.json")
    o.iters = o.speed_iters
    return o


def _fmt(v, spec):
    return "-" if v is None else format(v, spec)


def speed_row(r):
    """One run's table row: measured, predicted, at full depth, memory, target."""
    tgt = speed_targets.target(r.get("gpu"), r["shape"], r["mode"]) if r["kernels"] == "triton" else None
    tg = "" if not tgt or r["graphs"] else (f">= {tgt[0]}x tok/s at L={r['full_depth_layers']}"
                                            + (f", <= {tgt[1]}x mem" if tgt[1] else ""))
    if tg and "target_ok" in r:
        tg += " MET" if r["target_ok"] else " MISSED"
    return (f"{r['num_layers']:3d} {r['tokens_per_sec']:10,.0f} {r['throughput_ratio']:7.3f} "
            f"{_fmt(r['predicted_ratio'], '.3f'):>9s} {_fmt(r['full_depth_ratio'], '.3f'):>8s} "
            f"{_fmt(r['gemm_paced_ratio'], '.3f'):>7s} {r['optimizer_ms']:8.1f} {_fmt(r['peak_mem_gib'], '.2f'):>9s} "
            f"{_fmt(r['peak_mem_ratio'], '.3f'):>7s} {_fmt(r['planned_mem_gib'], '.2f'):>8s} {tg}")


def run_speed(opts, env, run, overrides):
    print(f"\nspeed: tokens/s of {opts.speed_micro_batches} micro-batches' forward + backward (optimizer step apart) "
          f"and peak memory against the baseline run the same way (eager / graphs: --cuda-graph-impl "
          f"{checks.GRAPH_IMPL}); PREDICTED = the cost model on {env.gpu_kind()} (bf16); {run.result['layers']}",
          flush=True)
    print(f"  {'shape':5s} {'mode':12s} {'run':14s} {'L':>3s} {'tok/s':>10s} {'x base':>7s} {'PREDICTED':>9s} "
          f"{'full L x':>8s} {'x GEMMs':>7s} {'optim ms':>8s} {'peak GiB':>9s} {'x base':>7s} {'plan GiB':>8s} target",
          flush=True)
    for shape_name in ("8B", "1B"):
        shape = speed_targets.speed_shape(opts, env, shape_name)
        base = {}
        for mode, group, graphs in checks.speed_runs(shape_name):
            kern = "-" if mode == BASELINE else "triton"
            label = f"{'graphs' if graphs else 'eager'}{'' if group is None else ' S=' + str(group)}"
            fields = dict(shape=shape_name, mode=mode, kernels=kern, group_size=group, graphs=graphs)
            refusal = checks.graph_refusal(opts, env, mode, shape, group) if graphs else None
            if refusal or (graphs and env.dry):
                r = dict(fields, ok=True, refused=refusal) if refusal else dict(
                    fields, ok=True, not_run="dry run: CUDA graphs need a GPU")
                run.result["speed"].append(r)
                print(f"  {shape_name:5s} {mode:12s} {label:14s} {refusal or r['not_run']}", flush=True)
                continue
            r = run.attempt("speed", f"speed {shape_name} {mode} {label}",
                            lambda: checks.train(opts, env, mode, shape=shape, overrides=overrides,
                                                 kernels="triton", iters=opts.speed_iters, warmup=opts.warmup,
                                                 micro_batches=opts.speed_micro_batches, group_size=group,
                                                 graphs=graphs), **fields)
            if r is None:
                continue
            r.update(fields, gpu=env.gpu_kind())
            if mode == BASELINE and "tokens_per_sec" in r:
                base[graphs] = r
            if "tokens_per_sec" not in r or graphs not in base:
                print(f"  {shape_name:5s} {mode:12s} {label:14s} {r.get('error', 'no baseline run the same way')}",
                      flush=True)
                continue
            speed_targets.compare_speed(env, r, base[graphs], shape_name, mode, kern, shape["layers"], group)
            if graphs:  # the targets are judged on the eager runs
                r.pop("target_ok", None)
            print(f"  {shape_name:5s} {mode:12s} {label:14s} {speed_row(r)}", flush=True)
            run.save()


def run_host(env, run):
    print(f"\nhost: microseconds per router call of the routed stream of {host_work.HOST_STREAM_LAYERS} layers on "
          f"the Triton kernels at a tiny width (the GPU's work next to nothing), launches, table copies and PyTorch "
          f"ops per call", flush=True)
    for mode, group in host_work.host_runs(env):
        r = run.attempt("host", f"host {mode} S={group}", lambda: host_work.host_time(env, mode, group),
                        mode=mode, group_size=group)
        if r and "host_us" in r:
            print(f"  {mode:12s} S={group!s:5s} {r['host_us']:8.0f} us  launches {r['launches']:.2f}  copies "
                  f"{r['table_copies']:.2f}  ops {r['torch_ops']:.1f}", flush=True)
        elif r:
            print(f"  {mode:12s} S={group!s:5s} {r.get('error')}", flush=True)


def run_bandwidth(opts, env, run):
    copy_gbps = kernel_rates.copy_bandwidth(env)
    run.result["copy_gbps"] = copy_gbps
    print(f"\nbandwidth: router kernels' counted bytes over time against the copy rate ({copy_gbps:,.0f} GB/s)",
          flush=True)
    kernels = ["torch", *checks.router_kernels(env)]
    runs = [(s, f"{k} call, N={n}", partial(kernel_rates.kernel_bandwidth, opts, env, k, s, n, copy_gbps),
             dict(kernel=k, shape=s, sources=n)) for s in ("8B", "1B") for n in kernel_rates.BANDWIDTH_SOURCES
            for k in kernels]
    runs += [(s, f"{k} stream, S={g}", partial(kernel_rates.stack_bandwidth, opts, env, k, g, s, copy_gbps),
              dict(kernel=k, group_size=g, shape=s)) for s in ("8B", "1B") for k, g in kernel_rates.stack_runs(env)]
    for shape_name, label, fn, fields in runs:
        r = run.attempt("bandwidth", f"bandwidth {shape_name} {label}", fn, **fields)
        if r:
            print(f"  {shape_name:5s} {label:22s} " + (f"{r['ms']:8.3f} ms {r['gbps']:8.1f} GB/s x copy "
                                                       f"{r['of_copy']:.3f}" if "gbps" in r else r.get("error")),
                  flush=True)


def run_kernels(opts, env, run):
    print("\nkernels: the routed stream at the 1B width and depth, one forward + backward: ms per router call and "
          "the CUDA kernels' device time over the wall time", flush=True)
    for mode, group in kernel_rates.kernel_time_runs(env):
        r = run.attempt("kernels", f"kernels {mode} S={group}",
                        lambda: kernel_rates.kernel_times(opts, env, mode, group), mode=mode, group_size=group)
        if r:
            print(f"  {mode:12s} S={group!s:5s} " + (f"{r['wall_ms_per_router']:7.3f} ms per router call, device "
                                                     f"share {_fmt(r['device_share'], '.2f')}" if "wall_ms" in r
                                                     else r.get("error")), flush=True)


@known_warnings_quieted()
def main(argv=None):
    opts = parse(argv)
    if not opts.dry_run:
        reason = checks.missing_requirement()
        if reason:
            print(f"gpu_check: {reason}", file=sys.stderr)
            return checks.NO_GPU_EXIT
    import torch

    from megatron_delta.trainer.hooks import router_overrides  # the routers' optimizer group, as pretrain_gpt.py's

    with checks.check_session(opts) as env:
        run = checks.CheckRun(opts, env)
        print(f"{env.gpu_name}, torch {torch.__version__}, {run.result['layers']}\n{run.result['router_kernels']}",
              flush=True)
        if "speed" in opts.parts:
            run_speed(opts, env, run, router_overrides)
        if "host" in opts.parts:
            run_host(env, run)
        if "bandwidth" in opts.parts:
            run_bandwidth(opts, env, run)
        if "kernels" in opts.parts:
            run_kernels(opts, env, run)
        result = run.finish()
        print(f"\ngpu_check{' --dry-run' if env.dry else ''}: {'PASS' if result['ok'] else 'FAIL'}"
              f"{'' if env.dry else ' (targets ' + ('met' if result['targets_met'] else 'MISSED') + ')'}"
              f" in {result['wall_s']:.0f} s -> {opts.out}"
              + (f"; not run (time budget): {', '.join(result['skipped'])}" if result["skipped"] else ""))
        return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
