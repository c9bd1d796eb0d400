#!/usr/bin/env python
"""The one acceptance run for a GPU on one H100 / H200. On the first H200 run
(docs/performance.md) a run of (c) took 20 s (4 layers of the 8B slice) to 70 s (8 layers, Triton compiling);
--time-budget-s (450 s) skips what no longer fits, and --num-layers-8b 4 keeps (c) short.

    python tools/gpu_check.py --out runs/gpu_check.json    # one GPU, Transformer Engine and fla-core installed
    python tools/gpu_check.py --transformer-impl local ...  # no Transformer Engine: no TE spec, FP8, MoE fusions
    python tools/gpu_check.py --dry-run --out /tmp/dry.json  # CPU: everything except CUDA / TE, tiny sizes

Prints a table per part and writes JSON (rewritten after every part: a timeout still leaves results), in order:

(a) parity: every mode built with the SAME weights on each backend - the local spec with the routers on fla's
    kernel, on PyTorch ops and on our Triton kernels (delta: the group router), and the Transformer Engine spec
    - BF16 logits against the same model in fp32 (local spec, PyTorch routers). A backend passes when its
    relative L2 error is below --parity-tol or at most 1.5x the PyTorch routers' own (sharp routing makes bf16
    rounding alone move the attention-residual modes' logits by a few per cent). TE-spec names:
    `input_layernorm.weight` -> `self_attention.linear_qkv.layer_norm_weight`, `pre_mlp_layernorm.weight` ->
    `mlp.linear_fc1.layer_norm_weight`.
(b) router: fla's fused kernel and our Triton kernels vs the PyTorch router on the same bf16 sources, with and
    without null source, gate and x: the output and every gradient (sources, x, query, key-norm weight, null,
    gate), errors relative to each tensor's scale (--router-tol), and the CUDA stream synchronisations each
    call makes (ours must make none).
(h) host time per router call: the routed streams of delta (group router, one router per pass) and delta_block on
    our Triton kernels at a tiny width, where the GPU's work is next to nothing: the host's microseconds per router
    call, and the launches, table copies and PyTorch ops per call (megatron_delta/perf/host_work.py). Where the GPU
    outruns its host, this is a router's cost.
(k) where the GPU's time goes: delta on the group router and delta_block at the 1B shape's width and depth (28
    layers: the group sizes auto takes there), one forward + backward under torch.profiler: each CUDA kernel's
    calls and device time, the wall time per router call, and the device time's share of the wall time (near 1:
    the kernels set the pace; well below: the host). Each router kernel's counted bytes over its device time,
    against the cost model's rate (tools/kernel_resources.py counts the registers, spills and bytes in flight that
    bound it).
(b2) router kernels' rate: one router call's forward + backward per backend (5 and 17 sources at the 8B and 1B
    widths), and delta's whole routed stream over 8 layers of identity sublayers (one router per pass on each
    backend; the group router on triton): counted bytes (megatron_delta.core.traffic) over time, against this
    machine's copy rate measured in the same run. The cost model assumes the kernels move their bytes at the
    copy rate.
(c) speed and memory: tokens/s of a training step's forward + backward (--speed-micro-batches micro-batches,
    8 by default; the optimizer step timed apart) and peak memory (torch.cuda.max_memory_allocated, above what
    the run found allocated) against the baseline, at an 8B layer slice (hidden 4096, FFN 12288, 32 heads / 8
    groups, seq 2048, as many layers as fit unless --num-layers-8b, a multiple of 4) and at the paper's 1B
    width (Qwen3-1.7B shape), for delta_block and delta (each shape's target mode first), on every router
    backend (fla, triton where this checkout has it, torch); beside each, tools/memory_plan.py's PREDICTED ratio
    (the counted traffic vs GEMM FLOPs on this GPU, bf16), the ratio at the shape's full depth ("full L x": 36
    layers at 8B, 28 at 1B; measured there, or from a slice, the model's full-depth prediction with the model's
    error on the slice carried over: gpu_check.full_depth_ratio) and planned memory; in BF16 and, where
    Transformer Engine has FP8, an FP8 column (hybrid, delayed scaling, each against the FP8 baseline). The block
    modes run with --delta-num-blocks 4 throughout. Targets (BF16, fused kernel), set at full depth: delta_block
    >= 0.95x tokens/s at 36 layers ("full L x") on H100, 0.96x on H200, and <= 1.10x peak memory at the 8B slice;
    delta >= 0.83x at 1B on H100, 0.87x on H200; other GPUs 0.95x and 0.85x.
(d) training: every mode trains --iters iterations in BF16 and FP8 (hybrid; delayed scaling, and current
    scaling - recipe `tensorwise` - where the installed TE has it), TE spec, routers on the fused kernel;
    the loss must be finite and fall.
(e) MoE fusions: baseline, delta_block and attnres with every MLP a Megatron-Core MoE layer (4 experts, top-2,
    alltoall) and --moe-permute-fusion --moe-router-fusion --moe-grouped-gemm (Transformer Engine's kernels,
    TEGroupedMLP experts), BF16: the loss must be finite and fall; "not available" where Transformer Engine
    lacks the kernels (and in the dry run).

--dry-run runs (a)-(d) on CPU at tiny sizes: (a) without the TE spec, (b) in fp32 and bf16, (b2) and (c) CPU
rates (no peak memory), (d) fp32 without FP8; fla's pure-PyTorch ``naive_attnres`` stands in for the Triton
kernel (megatron_delta.core.fla_router.use_kernel); our Triton kernels join (a), (b) and (b2) under
TRITON_INTERPRET=1. Without --dry-run and without CUDA, Transformer Engine (unless --transformer-impl local) or
fla it exits at once with status 2 and says why. The checks: megatron_delta/perf/gpu_check.py.
"""

import argparse
import sys
from functools import partial

from megatron_delta.core.modes import BASELINE
from megatron_delta.core.modes import RESIDUAL_MODES as MODES
from megatron_delta.perf import gpu_check as checks
from megatron_delta.perf import host_work
from megatron_delta.platform.patches import known_warnings_quieted


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/gpu_check.json")
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny sizes, naive_attnres for the kernel")
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    p.add_argument("--vocab-size", type=int, default=None, help="default 32000 (dry run 64)")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--speed-iters", type=int, default=None, help="(c): iterations per run (default 12, dry 2)")
    p.add_argument("--speed-micro-batches", type=int, default=checks.SPEED_MICRO_BATCHES,
                   help="(c): micro-batches per timed step (at least 8: a training step, not one micro-batch)")
    p.add_argument("--warmup", type=int, default=None, help="(c): iterations excluded (default 4, dry 1)")
    p.add_argument("--lr", type=float, default=None, help="default 3e-4 (dry run 3e-3)")
    p.add_argument("--parity-hidden-size", type=int, default=None, help="default 1024 (dry 32)")
    p.add_argument("--parity-seq-length", type=int, default=None, help="default 512 (dry 16)")
    p.add_argument("--parity-tol", type=float, default=None,
                   help="(a): relative L2 error of the logits always accepted (default 2e-2 in bf16, dry run 1e-4)")
    p.add_argument("--router-tol", type=float, default=None, help="(b): default 2e-2 in bf16 (fp32: 1e-4)")
    p.add_argument("--num-layers-8b", type=int, default=None,
                   help=f"(c): a multiple of {checks.NUM_BLOCKS} (the block modes' K); default as many as fit "
                        "(memory plan)")
    p.add_argument("--speed-routers", nargs="+", default=["fla", "triton", "torch"], choices=["fla", "triton", "torch"],
                   help="(c): the router backends to time (those this checkout has; default all)")
    p.add_argument("--skip", nargs="*", default=[],
                   choices=["parity", "router", "host", "kernels", "bandwidth", "speed", "train", "moe"])
    p.add_argument("--no-fp8", action="store_true")
    p.add_argument("--transformer-impl", default="transformer_engine", choices=["transformer_engine", "local"],
                   help="the GPU run's layers; local: Megatron's own, for a GPU without Transformer Engine (no TE "
                        "spec in (a), no FP8 in (c) and (d), no MoE fusions in (e): the run says so and does not pass)")
    p.add_argument("--time-budget-s", type=float, default=450, help="skip the remaining runs after this")
    o = p.parse_args(argv)
    if o.speed_micro_batches < 1:
        p.error(f"--speed-micro-batches {o.speed_micro_batches} must be a positive number of micro-batches")
    if o.num_layers_8b is not None and (o.num_layers_8b < 1 or o.num_layers_8b % checks.NUM_BLOCKS):
        p.error(f"--num-layers-8b {o.num_layers_8b} must be a positive multiple of {checks.NUM_BLOCKS}: the block "
                f"modes run with --delta-num-blocks {checks.NUM_BLOCKS} (the targets' K)")
    dry = o.dry_run
    for name, full, small in (("vocab_size", 32000, 64), ("speed_iters", 12, 2), ("warmup", 4, 1),
                              ("lr", 3e-4, 3e-3), ("parity_hidden_size", 1024, 32), ("parity_seq_length", 512, 16),
                              ("parity_tol", 2e-2, 1e-4)):
        if getattr(o, name) is None:
            setattr(o, name, small if dry else full)
    if o.router_tol is None:
        o.router_tol = 2e-2
    return o


@known_warnings_quieted()
def main(argv=None):
    opts = parse(argv)
    if not opts.dry_run:
        reason = checks.missing_requirement(opts.transformer_impl)
        if reason:
            print(f"gpu_check: {reason}", file=sys.stderr)
            return checks.NO_GPU_EXIT
    import torch

    from megatron_delta.trainer.hooks import router_overrides  # the routers' optimizer group, as pretrain_gpt.py's

    with checks.check_session(opts) as env:
        run = checks.CheckRun(opts, env)
        result, attempt = run.result, run.attempt
        print(f"{env.gpu_name}, torch {torch.__version__}, layers: {env.impl}, Transformer Engine: "
              f"{result['transformer_engine']}\n{result['router_kernels']}", flush=True)
        if "parity" not in opts.skip:
            print(f"\n(a) parity: relative L2 error of each backend's BF16 logits against the same model in fp32 "
                  f"(local spec, PyTorch routers, same weights); limit: --parity-tol or {checks.PARITY_SLACK}x the "
                  f"PyTorch routers' error", flush=True)
            for mode in opts.modes:
                r = attempt("parity", f"parity {mode}", lambda: checks.parity(opts, env, mode), mode=mode)
                if r:
                    errs = ("  ".join(f"{k} {v:.2e}" for k, v in r["rel_l2"].items()) + f"  (limit {r['limit']:.2e})"
                            if "rel_l2" in r else r.get("error"))
                    print(f"  {mode:13s} {'ok ' if r['ok'] else 'BAD'} {errs}", flush=True)
        if "router" not in opts.skip:
            print("\n(b) router: fused kernel vs PyTorch ops, max relative error over output and every gradient",
                  flush=True)
            dtypes = [torch.float32, torch.bfloat16] if env.dry else [torch.bfloat16]
            for kern in checks.router_kernels(env):
                for dt in dtypes:
                    for null, gate, with_x in checks.ROUTER_CASES:
                        r = attempt("router", f"router {kern} {dt} {null} {gate} {with_x}",
                                    lambda: checks.router_case(opts, env, dt, null, gate, with_x, kernel=kern),
                                    kernel=kern, dtype=str(dt))
                        if r:
                            print(f"  {kern:6s} {r['dtype']:9s} null={null!s:5s} gate={gate!s:5s} x={with_x!s:5s} "
                                  f"{'ok ' if r['ok'] else 'BAD'} {r.get('max_rel', float('nan')):.2e} "
                                  f"syncs {r.get('syncs', '-')}"
                                  f"{' ' + r['error'] if 'error' in r else ''}", flush=True)
        if "host" not in opts.skip and host_work.host_runs(env):
            print(f"\n(h) host time per router call: the routed stream of {host_work.HOST_STREAM_LAYERS} layers on our "
                  f"Triton kernels at a tiny width (the GPU's work next to nothing), and its launches, table copies "
                  f"and PyTorch ops per call", flush=True)
            for mode, group in host_work.host_runs(env):
                r = attempt("host", f"host {mode} S={group}", lambda: host_work.host_time(env, mode, group),
                            mode=mode, group_size=group)
                if r and "host_us" in r:
                    parts = ""
                    if "host_us_no_launches" in r:  # on a GPU: what the launches and the copies took of it
                        parts = (f"  (without the launches {r['host_us_no_launches']:.0f} us, without the copies "
                                 f"too {r['host_us_no_launches_no_copies']:.0f} us)")
                    print(f"  {mode:12s} S={group!s:5s} {r['host_us']:8.0f} us{parts}  launches {r['launches']:.2f}  "
                          f"copies {r['table_copies']:.2f}  ops {r['torch_ops']:.1f} (views {r['views']:.1f}, "
                          f"allocations {r['allocations']:.1f}, other {r['other_ops']:.1f})", flush=True)
                elif r:
                    print(f"  {mode:12s} S={group!s:5s} {r.get('error')}", flush=True)
        if "kernels" not in opts.skip and checks.kernel_time_runs(env):
            print("\n(k) where the GPU's time goes: the routed stream at the 1B shape's width and depth (identity "
                  "sublayers, our Triton kernels), one forward + backward: wall ms per router call, the CUDA kernels' "
                  "device time over the wall time (near 1: the kernels set the pace; well below: the host), and each "
                  "router kernel's counted bytes over its device time against the cost model's rate", flush=True)
            for mode, group in checks.kernel_time_runs(env):
                r = attempt("kernels", f"kernels {mode} S={group}",
                            lambda: checks.kernel_times(opts, env, mode, group), mode=mode, group_size=group)
                if r and "wall_ms" in r:
                    share = "-" if r["device_share"] is None else f"{r['device_share']:.2f}"
                    print(f"  {mode:12s} S={group!s:5s} {r['wall_ms_per_router']:7.3f} ms per router call, "
                          f"device share {share}", flush=True)
                    for k in r["kernels"][:6]:
                        rate = f"  x modelled rate {k['of_modelled_rate']:.2f}" if "of_modelled_rate" in k else ""
                        print(f"      {k['name'][:40]:40s} {k['calls']:5d} calls {k['ms']:8.3f} ms{rate}", flush=True)
                elif r:
                    print(f"  {mode:12s} S={group!s:5s} {r.get('error')}", flush=True)
        if "bandwidth" not in opts.skip:
            copy_gbps = checks.copy_bandwidth(env)
            result["copy_gbps"] = copy_gbps
            print(f"\n(b2) router kernels' rate, forward + backward, counted bytes over time, against this machine's "
                  f"copy rate ({copy_gbps:,.0f} GB/s): one router call over N sources, and delta's routed stream "
                  f"alone ({checks.STACK_LAYERS} layers of identity sublayers, S = group size)", flush=True)
            print(f"  {'shape':5s} {'router':22s} {'ms':>8s} {'MB moved':>9s} {'GB/s':>8s} {'x copy':>7s}", flush=True)
            kernels = ["torch", *checks.router_kernels(env)]
            runs = [(s, f"{k} call, N={n}", partial(checks.kernel_bandwidth, opts, env, k, s, n, copy_gbps),
                     dict(kernel=k, shape=s, sources=n))
                    for s in ("8B", "1B") for n in checks.BANDWIDTH_SOURCES for k in kernels]
            runs += [(s, f"{k} stream, S={g}", partial(checks.stack_bandwidth, opts, env, k, g, s, copy_gbps),
                      dict(kernel=k, group_size=g, shape=s))
                     for s in ("8B", "1B") for k, g in checks.stack_runs(env)]
            for shape_name, label, fn, fields in runs:
                r = attempt("bandwidth", f"bandwidth {shape_name} {label}", fn, **fields)
                if r and "gbps" in r:
                    print(f"  {shape_name:5s} {label:22s} {r['ms']:8.3f} {r['bytes'] / 1e6:9.1f} {r['gbps']:8.1f} "
                          f"{r['of_copy']:7.3f}", flush=True)
                elif r:
                    print(f"  {shape_name:5s} {label:22s} {r.get('error')}", flush=True)
        if "speed" not in opts.skip:
            precisions = checks.speed_precisions(opts, env)
            print(f"\n(c) tokens/s of {opts.speed_micro_batches} micro-batches' forward + backward (optimizer step "
                  f"apart) and peak memory against the baseline; PREDICTED = tools/memory_plan.py's router-share "
                  f"model on {env.gpu_kind()} (bf16)", flush=True)
            print(f"  {'shape':5s} {'mode':12s} {'router':13s} {'L':>3s} {'tok/s':>10s} {'x base':>7s} "
                  f"{'PREDICTED':>9s} {'full L x':>8s} {'x GEMMs':>7s} {'FP8 x base':>10s} {'optim ms':>8s} "
                  f"{'peak GiB':>9s} {'x base':>7s} {'plan GiB':>8s} {'left GiB':>8s} target",
                  flush=True)
            for shape_name in ("8B", "1B"):
                shape = checks.speed_shape(opts, env, shape_name)
                base = {}
                for mode, kern, group in checks.speed_runs(env, shape_name, opts.speed_routers):
                    runs = {}
                    label = kern if group is None else f"{kern} S={group}"  # S: --delta-router-group-size
                    for fp8 in precisions:
                        r = attempt("speed", f"speed {shape_name} {mode} {label} fp8={fp8}",
                                    lambda: checks.train(opts, env, mode, shape=shape, overrides=router_overrides,
                                                         kernels=kern if kern != "-" else "fla", fp8=fp8,
                                                         iters=opts.speed_iters, warmup=opts.warmup,
                                                         micro_batches=opts.speed_micro_batches, group_size=group),
                                    mode=mode, kernels=kern, group_size=group, precision=str(fp8))
                        if r:
                            r["shape"] = shape_name
                            runs[fp8] = r
                            if mode == BASELINE and "tokens_per_sec" in r:
                                base[fp8] = r
                    r = runs.get(None)
                    if not r:
                        continue
                    if "tokens_per_sec" not in r or None not in base:
                        print(f"  {shape_name:5s} {mode:12s} {label:13s} {r.get('error', 'no baseline')}", flush=True)
                        continue
                    tgt = checks.compare_speed(env, r, base[None], shape_name, mode, kern, shape["layers"], group)
                    fp8_col = "-"
                    f = runs.get("delayed")
                    if f is not None and "tokens_per_sec" in f and "delayed" in base:
                        f["throughput_ratio"] = f["tokens_per_sec"] / base["delayed"]["tokens_per_sec"]
                        r["fp8_throughput_ratio"] = f["throughput_ratio"]
                        fp8_col = f"{f['throughput_ratio']:.3f}"
                    elif f is not None:
                        fp8_col = "failed"
                    tg = "" if not tgt else (f">= {tgt[0]}x tok/s at L={r['full_depth_layers']}"
                                             + (f", <= {tgt[1]}x mem" if tgt[1] else ""))
                    if tg and "target_ok" in r:
                        tg += " MET" if r["target_ok"] else " MISSED"
                    pred = "-" if r["predicted_ratio"] is None else f"{r['predicted_ratio']:.3f}"
                    full = "-" if r["full_depth_ratio"] is None else f"{r['full_depth_ratio']:.3f}"
                    gemms = "-" if r["gemm_paced_ratio"] is None else f"{r['gemm_paced_ratio']:.3f}"
                    mem = "-" if r["peak_mem_gib"] is None else f"{r['peak_mem_gib']:.2f}"
                    memr = "-" if r["peak_mem_ratio"] is None else f"{r['peak_mem_ratio']:.3f}"
                    plan = "-" if r["planned_mem_gib"] is None else f"{r['planned_mem_gib']:.2f}"
                    left = "-" if r["resident_gib"] is None else f"{r['resident_gib']:.2f}"
                    print(f"  {shape_name:5s} {mode:12s} {label:13s} {r['num_layers']:3d} {r['tokens_per_sec']:10,.0f} "
                          f"{r['throughput_ratio']:7.3f} {pred:>9s} {full:>8s} {gemms:>7s} {fp8_col:>10s} "
                          f"{r['optimizer_ms']:8.1f} {mem:>9s} {memr:>7s} {plan:>8s} {left:>8s} {tg}", flush=True)
                    if r.get("gemm_pace"):  # what the predictions take the baseline's step to be: its GEMMs
                        g = r["gemm_pace"]
                        print(f"  {'':5s} (the baseline: {g['measured_ms']:.1f} ms per micro-batch, its GEMMs "
                              f"{g['gemm_ms']:.1f} ms at the cost model's rate: {g['pace']:.2f} of a GEMM-bound pace, "
                              f"which the predictions take to be 1)", flush=True)
                    run.save()
        if "train" not in opts.skip:
            precisions = checks.train_precisions(opts, env, result["skipped"])
            print(f"\n(d) training: {opts.iters} iterations per mode, routers on the fused kernel", flush=True)
            for fp8 in precisions:
                for mode in opts.modes:
                    r = attempt("train", f"train {mode} fp8={fp8}",
                                lambda: checks.train(opts, env, mode, shape=dict(env.shapes["1B"], layers=4), fp8=fp8,
                                                     overrides=router_overrides),
                                mode=mode, precision=str(fp8))
                    if r:
                        ls = r.get("losses") or [float("nan")]
                        print(f"  {mode:13s} {r.get('precision', str(fp8)):20s} {'ok ' if r['ok'] else 'BAD'} "
                              f"loss {ls[0]:.3f} -> {ls[-1]:.3f}{' ' + r['error'] if 'error' in r else ''}", flush=True)
        if "moe" not in opts.skip:
            print("\n(e) MoE with --moe-permute-fusion --moe-router-fusion --moe-grouped-gemm (alltoall, 4 experts, "
                  "top-2), BF16", flush=True)
            unavailable = checks.moe_fusions_unavailable(env)
            if unavailable:
                result["moe"].append({"ok": True, "available": False, "reason": unavailable})
                print(f"  not available: {unavailable}", flush=True)
            else:
                for mode in ("baseline", "delta_block", "attnres"):
                    r = attempt("moe", f"moe fusions {mode}",
                                lambda: checks.train(opts, env, mode, shape=dict(env.shapes["1B"], layers=4),
                                                     overrides=router_overrides, moe=True),
                                mode=mode, moe=True)
                    if r:
                        ls = r.get("losses") or [float("nan")]
                        print(f"  {mode:13s} {'ok ' if r['ok'] else 'BAD'} loss {ls[0]:.3f} -> {ls[-1]:.3f}"
                              f"{' ' + r['error'] if 'error' in r else ''}", flush=True)
            run.save()
        run.finish()
        print(f"\ngpu_check{' --dry-run' if env.dry else ''}: {'PASS' if result['ok'] else 'FAIL'}"
              f"{'' if env.dry else ' (targets ' + ('met' if result['targets_met'] else 'MISSED') + ')'}"
              f" in {result['wall_s']:.0f} s -> {opts.out}")
        return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
