#!/usr/bin/env python
"""Side-by-side cost of the residual modes: one process, same seed, fp32, mock tokens.

    python tools/benchmark.py [--num-layers 12 --hidden-size 512 --seq-length 512 --micro-batch-size 2
                               --modes baseline,delta_block,delta,attnres,full_attnres --repeats 3
                               --pp-layout 4 --output bench.json]

What is measured and how: megatron_delta/perf/benchmark.py (the harness), router_breakdown.py (the
stand-in kernels of the breakdowns, the touch-once floor) and machine_rates.py (operator costs, stream and
memory rates).

Prints a markdown table of ratios to the baseline with the issue's targets and a pass/miss column,
and writes every number to --output (JSON). Performance is judged from this table, never by timed
unit tests. CPU timings move with machine load: read ratios, not absolute numbers, and rerun with
more --repeats on a busy machine.
"""

import argparse
import json
import os
import sys

from megatron_delta.core.modes import ADDITIVE_MODES, BASELINE, BLOCK_MODES, GATES
from megatron_delta.perf.benchmark import (
    MODES,
    TRAFFIC_BACKENDS,
    finalize,
    fla_missing,
    mode_config,
    run,
    traffic_report,
)


def build_parser():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-layers", type=int, default=12)
    p.add_argument("--hidden-size", type=int, default=512)
    p.add_argument("--num-attention-heads", type=int, default=8)
    p.add_argument("--num-query-groups", type=int, default=None, help="default: the model default (GQA 2)")
    p.add_argument("--ffn-hidden-size", type=int, default=None)
    p.add_argument("--seq-length", type=int, default=512)
    p.add_argument("--micro-batch-size", type=int, default=2)
    p.add_argument("--vocab-size", type=int, default=1024, help="mock tokens' vocabulary")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--delta-num-blocks", type=int, default=None,
                   help=f"K for {' / '.join(BLOCK_MODES)} (default 4, L when L <= 4; needed when 4 does not divide L)")
    p.add_argument("--delta-gate", choices=GATES, default=GATES[0],
                   help=f"as pretrain_gpt.py's flag, for {' and '.join(ADDITIVE_MODES)} (scalar: they also hold "
                        "the residual stream x, see README)")
    p.add_argument("--delta-router-kernels", choices=["auto", "c", "torch"], default="auto",
                   help="the routers' kernels, as pretrain_gpt.py's flag (torch: PyTorch ops, for A/B runs)")
    p.add_argument("--delta-router-group-size", default="auto", metavar="S",
                   help="as pretrain_gpt.py's flag, for delta and full_attnres (1: one router per pass, for A/B runs)")
    p.add_argument("--delta-cpu-allocator", choices=["cache", "system"], default="cache",
                   help="as pretrain_gpt.py's flag (system: glibc's defaults, for A/B runs)")
    p.add_argument("--repeats", type=int, default=3, help="timed rounds (median reported)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--pp-layout", default="4", help="P or PxV: pipeline stages (x virtual chunks) for payloads")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    p.add_argument("--no-memory", action="store_true", help="skip the profiler peak-memory step")
    p.add_argument("--routing-breakdown", action="store_true",
                   help="split the routing alone into the routers' fused passes, shared source projections and the "
                        "rest (stand-in kernels), and print what a router touching each tensor once would cost")
    p.add_argument("--model-breakdown", action="store_true",
                   help="also time each routed model with the router's kernels replaced by stand-ins (as "
                        "--routing-breakdown does for the routing alone) and split its CPU-time ratio")
    p.add_argument("--traffic", action="store_true",
                   help="instead of timing: count the memory traffic of one step per mode and router backend (torch, "
                        "c, fla) in rows of [tokens, hidden], per sublayer and per step, beside the closed form of "
                        "perf/cost_model.step_traffic")
    p.add_argument("--recompute-method", choices=["uniform", "block"], default=None,
                   help="full activation recompute, as pretrain_gpt.py's flag (with --recompute-num-layers)")
    p.add_argument("--recompute-num-layers", type=int, default=1)
    p.add_argument("--profile", default=None, metavar="MODE",
                   help="also run torch.profiler on one step of MODE and print the top ops")
    p.add_argument("--output", default=None, help="JSON results")
    p.add_argument("--render", default=None, metavar="JSON", help="only re-print the table of an earlier --output")
    return p


def _mib(b):
    return "-" if b is None else f"{b / 2**20:.2f}"


def _ratio(x):
    return "-" if x is None else f"{x:.3f}x"


def format_table(report):
    res = report["modes"]
    lines = [
        "| mode | sources (max) | added params | fwd+bwd s (median) | time | time (min) | cpu time | saved MiB | saved "
        "| peak MiB | peak | max payload MiB | payload | targets (time/saved/peak) | pass |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for mode, r in res.items():
        maxp = max((p["bytes"] for p in r["payloads"]), default=None)
        if "targets" in r:
            t = r["targets"]
            tgt = f"<= {t['time']}x / {t['saved']}x / {t['peak']}x"
            verdict = " / ".join("n/a" if r["pass"][k] is None else "pass" if r["pass"][k] else "MISS"
                                for k in ("time", "saved", "peak"))
        else:
            tgt = verdict = "-"
        lines.append(
            f"| {mode} | {r['max_sources']} | {r['added_parameters']:,} | {r['time_s']:.3f} "
            f"| {_ratio(r['time_ratio'])} "
            f"| {_ratio(r.get('time_min_ratio'))} | {_ratio(r.get('cpu_ratio'))} "
            f"| {_mib(r['saved_bytes'])} | {_ratio(r['saved_ratio'])} | {_mib(r['peak_bytes'])} "
            f"| {_ratio(r['peak_ratio'])} | {_mib(maxp)} | {_ratio(r['max_payload_ratio'])} | {tgt} | {verdict} |")
    out = ["\n".join(lines)]
    cfg = report["config"]
    # Per-boundary payloads.
    blines = ["", f"Pipeline payload per micro-batch, layout {cfg['pp_layout']} (MiB per boundary):", "",
              "| mode | " + " | ".join(f"into layer {p['first_layer']}" for p in res[BASELINE]["payloads"]) + " |",
              "|---|" + "---|" * len(res[BASELINE]["payloads"])]
    for mode, r in res.items():
        blines.append(f"| {mode} | " + " | ".join(
            f"{_mib(p['bytes'])} ({len(p['names'])})" + (f" [{_mib(p['bytes_without_cache'])} uncached]"
                                                          if p["bytes_without_cache"] != p["bytes"] else "")
            for p in r["payloads"]) + " |")
    if res[BASELINE]["payloads"]:
        out.append("\n".join(blines))
    alone = [(m, r) for m, r in res.items() if r.get("routing_alone_ms") is not None]
    if alone:
        out.append("\nRouting alone (stand-in sublayers, median), as a share of the baseline model's step: "
                   + ", ".join(f"{m} {r['routing_alone_ms']:.1f} ms = {100 * r['routing_alone_share']:.1f} %"
                               for m, r in alone))
    split = [(m, r) for m, r in alone if r.get("routing_breakdown_ms")]
    if split:
        pass_ms = cfg["op_ms"]["in-place multiply-add"] / 3  # read a, read c, write c
        tensor_bytes = 4 * cfg["seq_length"] * cfg["micro_batch_size"] * cfg["hidden_size"]
        # From memory a pass costs at least what it costs in cache (the per-operator overhead included).
        mem_ms = max(pass_ms, tensor_bytes / (cfg["memory_gbps"] * 1e9) * 1e3) if cfg.get("memory_gbps") else None
        base_ms = res[BASELINE]["time_s"] * 1e3
        out.append(f"\nRouting alone split by stand-in kernels (by difference), and the least a router touching each "
                   f"[tokens, hidden] tensor once would cost: the rest + its passes at {pass_ms:.3f} ms (a third of "
                   f"the in-place multiply-add, tensors in cache)"
                   + (f" or {mem_ms:.3f} ms (from memory, {cfg['memory_gbps']:.1f} GB/s)" if mem_ms else "") + ":")
        for m, r in split:
            b = r["routing_breakdown_ms"]
            passes = r["fused_router_passes"]
            floor = b["rest"] + passes * pass_ms
            line = (f"- {m}: {b['total']:.1f} ms = routers' fused passes {b['route']:.1f} + shared projections "
                    f"{b['project']:.1f} + the rest {b['rest']:.1f} (SourceBuffer, partial sums, autograd, "
                    f"Python); touching each tensor once: >= {floor:.1f} ms = {100 * floor / base_ms:.1f} % "
                    f"({passes} passes)")
            if mem_ms:
                mem_floor = b["rest"] + passes * mem_ms
                line += (f", from memory >= {mem_floor:.1f} ms = {100 * mem_floor / base_ms:.1f} % (the passes "
                         f"alone {100 * passes * mem_ms / base_ms:.1f} %)")
            out.append(line)
    model_split = [(m, r["model_breakdown"]) for m, r in res.items() if r.get("model_breakdown")]
    if model_split:
        out.append("\nModel step split by stand-in kernels (--model-breakdown; CPU-time ratios to the baseline, by "
                   "difference):")
        for m, b in model_split:
            out.append(f"- {m}: {b['cpu_ratio']:.3f}x = 1 + routers' fused passes {b['fused_passes']:+.3f} + shared "
                       f"projections {b['shared_projections']:+.3f} + bookkeeping and indirect costs {b['rest']:+.3f}")
    return "\n".join(out)


def format_traffic(report, opts, skipped):
    lines = [f"Memory traffic of one step (forward + backward of one micro-batch; {opts.num_layers} layers, hidden "
             f"{opts.hidden_size}, seq {opts.seq_length}, micro-batch {opts.micro_batch_size}"
             + (f", recompute {opts.recompute_method} {opts.recompute_num_layers}" if opts.recompute_method else "")
             + "), in u = one [tokens, hidden] tensor of the activation dtype read or written once:", "",
             "| mode | router backend | counted u/step (fp32) | u/sublayer | closed form u/step (fp32) | closed form "
             "u/step (bf16, GPU) | where it goes (counted, u/step) |",
             "|---|---|---|---|---|---|---|"]
    for r in report.values():
        parts = ", ".join(f"{k} {v:g}" for k, v in sorted(r["counted"].items(), key=lambda kv: -kv[1]))
        bf16 = "-" if r["closed_form_bf16_u"] is None else f"{r['closed_form_bf16_u']:g}"
        lines.append(f"| {r['mode']} | {r['backend']} | {r['counted_u']:g} | {r['counted_u'] / r['sublayers']:.2f} | "
                     f"{r['closed_form_u']:g} | {bf16} | {parts} |")
    if skipped:
        lines.append(f"\n(not counted: {skipped})")
    return "\n".join(lines)


def main(argv=None):
    opts = build_parser().parse_args(argv)
    opts.recompute = (opts.recompute_method, opts.recompute_num_layers) if opts.recompute_method else None
    if opts.render:
        report = json.load(open(opts.render))
        finalize(report["modes"])
        print(format_table(report))
        return 0
    for m in opts.modes.split(","):
        if m.strip() and m.strip() not in MODES:
            print(f"benchmark.py: error: unknown mode {m!r} (choose from {', '.join(MODES)})", file=sys.stderr)
            return 2
    from megatron_delta.checkpoint.model_config import ModelConfigError

    try:
        for m in opts.modes.split(","):  # every model's fields, before any model is built
            if m.strip():
                mode_config(opts, m.strip())
    except ModelConfigError as e:
        print(f"benchmark.py: error: {e}", file=sys.stderr)
        return 2
    if opts.traffic:
        modes = [m.strip() for m in opts.modes.split(",") if m.strip() and m.strip() != BASELINE]
        backends, skipped = list(TRAFFIC_BACKENDS), None
        why = fla_missing()
        if why:
            backends.remove("fla")
            skipped = f"fla, whose package does not import here ({why}); pip install '.[gpu]'"
        report = traffic_report(opts, modes, backends, opts.recompute)
        print(format_traffic(report, opts, skipped))
        if opts.output:
            os.makedirs(os.path.dirname(os.path.abspath(opts.output)), exist_ok=True)
            with open(opts.output, "w") as f:
                json.dump({"config": vars(opts), "traffic": report}, f, indent=1)
        return 0
    report = run(opts)
    cfg = report["config"]
    print(f"\n{cfg['num_layers']} layers, hidden {cfg['hidden_size']}, seq {cfg['seq_length']}, micro-batch "
          f"{cfg['micro_batch_size']}, fp32, router kernels {cfg['delta_router_kernels']}, router group size "
          f"{cfg.get('delta_router_group_size', 'auto')}, gate {cfg['delta_gate']}, "
          f"{cfg['repeats']} interleaved rounds (median), {cfg['threads']} "
          f"threads, load average {cfg['loadavg']}, stream rate {cfg['stream_gbps']:.1f} GB/s (in cache), "
          f"memory rate {cfg['memory_gbps']:.1f} GB/s ({cfg['memory_rotation_bytes'] >> 20} MiB in rotation)\n"
          f"{cfg.get('allocator', '')}\n")
    print(format_table(report))
    print("\nOperator costs per [tokens, hidden] fp32 tensor, not in cache (ms): " + ", ".join(
        f"{k} {v:.3f}" for k, v in cfg["op_ms"].items()))
    if report["profile"]:
        print(f"\ntorch.profiler, one step of {opts.profile}:\n{report['profile']}")
    if opts.output:
        os.makedirs(os.path.dirname(os.path.abspath(opts.output)), exist_ok=True)
        with open(opts.output, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
