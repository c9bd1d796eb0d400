#!/usr/bin/env python
"""Side-by-side cost of the residual modes: one process, same seed, fp32, mock tokens.

    python tools/benchmark.py [--num-layers 12 --hidden-size 512 --seq-length 512 --micro-batch-size 2
                               --modes baseline,delta_block,delta,attnres,full_attnres --repeats 3
                               --pp-layout 4 --output bench.json]

Per mode (a Megatron GPTModel / DeltaGPTModel built by megatron_delta.core.model, TP1/PP1):

- time: one forward + backward of a micro-batch (loss = mean token loss). Modes are run interleaved
  (round r runs every mode once, in order) after one warm-up step each, and the median over rounds
  is reported, so drifting machine load hits every mode alike. "cpu time" is the median ratio of
  the process's CPU seconds per step: with --threads 1 it is the work done, almost insensitive to
  other processes on the machine (wall time is not: on a shared machine read the cpu column).
- saved bytes: bytes of the tensors autograd saves for backward during the forward, counted with
  torch.autograd.graph.saved_tensors_hooks over UNIQUE storages (views of one storage count once)
  and without the parameters (weights are saved by every mode; they are not activation memory).
- peak memory: the CPU allocator's peak of allocated bytes during forward + backward, above what
  was allocated when the step started (parameters). Measured with torch.profiler(profile_memory=True):
  every allocation/free of the c10 CPU allocator is an instant event carrying the allocator's
  running "Total Allocated"; the maximum over the step minus the value at its start is the peak.
  This counts tensor bytes exactly (no RSS / glibc arena noise) and includes the parameter gradients
  created in backward (same for every mode, plus the routers'). It runs in its own, untimed step.
- added parameters: parameters beyond the baseline's (the routers).
- routing alone: the same model's routers and SourceBuffer run over stand-in sublayers
  (v_j = u_j * s_j, one cheap pass) for the 2L sublayers, forward + backward, minus the baseline's
  residual loop over the same stand-ins (x = x + x * s_j): the router's own cost in ms per step and
  as a share of the baseline model's step, far less noisy than the difference of two model steps
  (the model step also shows indirect costs: the router's traffic evicts the backbone's data from cache).
  --routing-breakdown splits it by running the same loop with the router's kernels replaced by
  stand-ins: the routers' fused passes (_RouteFunction: weighted sums, projections of one-reader
  sources, softmax), the shared source projections (_ProjectSource) and the rest (SourceBuffer
  bookkeeping, partial sums, autograd, Python), and adds the least a router
  touching each [tokens, hidden] tensor once could cost: the rest plus its passes over memory
  (fused_router_passes) at the measured cost of one pass.
- --model-breakdown: the same split for the whole model: each routed model's step is also timed
  (interleaved, CPU time) with the router's fused passes stood in, and with the shared projections
  stood in as well; the differences of the CPU-time ratios split the model's extra cost into the
  fused passes, the shared projections, and the rest (bookkeeping and indirect costs such as the
  backbone's data evicted from cache). Read it with --threads 1, where CPU time is the work done.
- operator costs and stream rate: ms per [tokens, hidden] fp32 tensor of an in-place multiply-add,
  an add into a new tensor that is kept, a row-wise dot product and a read-only row norm, on
  tensors cycled through more memory than the caches below L3 hold, and the in-place multiply-add's
  GB/s (read a, read c, write c): what this machine charges for the router's kind of work, for
  estimating what a fused router kernel could reach. The memory rate is the same kind of pass over
  tensors cycled through twice the last-level cache: what a pass costs when its tensors come from
  memory, as most of a step's sources do (a step saves several times the cache for backward); the
  --routing-breakdown floor is printed at both rates.
- pipeline payload: bytes per micro-batch crossing each boundary of the layout --pp-layout P (or
  PxV for P stages with V virtual chunks each), from SourcePlan.payload_names, vs. the baseline's
  one [s, b, h] tensor. With V > 1 what the source cache sends (core/source_cache.py), and in
  brackets what the uncached path (--delta-pp-source-cache off) would send.

Prints a markdown table of ratios to the baseline with the issue's targets and a pass/miss column,
and writes every number to --output (JSON). Performance is judged from this table, never by timed
unit tests. CPU timings move with machine load: read ratios, not absolute numbers, and rerun with
more --repeats on a busy machine.
"""

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from megatron_delta.core.modes import (ADDITIVE_MODES, BASELINE, BLOCK_MODES, DELTA, DELTA_BLOCK, GATES,  # noqa: E402
                                       RESIDUAL_MODES, ROUTED_MODES)

MODES = RESIDUAL_MODES
# The stand-in variants of the breakdowns (_stand_ins arguments): the routers' fused passes stood in,
# and the shared source projections as well.
STAND_INS = {"route": (True, False), "both": (True, True)}
# Issue 6 targets, as ratios to the baseline: (time, saved bytes, peak memory).
TARGETS = {DELTA_BLOCK: (1.02, 1.08, 1.05), DELTA: (1.15, 1.3, 1.25)}


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
    p.add_argument("--delta-num-blocks", type=int, default=None, help="K for delta_block / attnres (default 4)")
    p.add_argument("--delta-gate", choices=GATES, default=GATES[0],
                   help="as pretrain_gpt.py's flag, for delta and delta_block (scalar: they also hold the residual "
                        "stream x, see README)")
    p.add_argument("--delta-router-kernels", choices=["auto", "c", "torch"], default="auto",
                   help="the routers' kernels, as pretrain_gpt.py's flag (torch: PyTorch ops, for A/B runs)")
    p.add_argument("--delta-cpu-allocator", choices=["cache", "system"], default="cache",
                   help="as pretrain_gpt.py's flag (system: glibc's defaults, for A/B runs)")
    p.add_argument("--repeats", type=int, default=3, help="timed rounds (median reported)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--pp-layout", default="4", help="P or PxV: pipeline stages (x virtual chunks) for payloads")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    p.add_argument("--no-memory", action="store_true", help="skip the profiler peak-memory step")
    p.add_argument("--routing-breakdown", action="store_true",
                   help="split the routing alone into the routers' fused passes, shared source projections and the rest "
                        "(stand-in kernels), and print what a router touching each tensor once would cost")
    p.add_argument("--model-breakdown", action="store_true",
                   help="also time each routed model with the router's kernels replaced by stand-ins (as "
                        "--routing-breakdown does for the routing alone) and split its CPU-time ratio")
    p.add_argument("--profile", default=None, metavar="MODE",
                   help="also run torch.profiler on one step of MODE and print the top ops")
    p.add_argument("--output", default=None, help="JSON results")
    p.add_argument("--render", default=None, metavar="JSON", help="only re-print the table of an earlier --output")
    return p


def mode_config(opts, mode):
    """(DeltaTransformerConfig, GPTModel options, padded vocabulary) of one mode, from megatron_delta.model_config:
    --num-layers etc., the rest the small CPU model's (Qwen3-style: GQA 2, SwiGLU 3 x hidden, RoPE, qk-layernorm,
    no biases)."""
    from megatron_delta.checkpoint.model_config import model_config, resolve_model_fields

    fields = dict(residual=mode, num_layers=opts.num_layers, hidden_size=opts.hidden_size,
                  num_attention_heads=opts.num_attention_heads, num_query_groups=opts.num_query_groups,
                  ffn_hidden_size=opts.ffn_hidden_size, seq_length=opts.seq_length, vocab_size=opts.vocab_size)
    if mode in BLOCK_MODES:
        fields["delta_num_blocks"] = opts.delta_num_blocks
    if mode in ADDITIVE_MODES:  # the replacement modes take no gate (pretrain_gpt.py refuses it)
        fields["delta_gate"] = opts.delta_gate
    if mode in ROUTED_MODES:
        fields["delta_router_kernels"] = opts.delta_router_kernels
    fields = resolve_model_fields(fields)
    return (*model_config(fields), fields["padded_vocab_size"])


def build_model(opts, mode):
    """(model, config): one TP1/PP1 chunk, fp32, seeded exactly like pretrain_gpt.py."""
    from megatron_delta.core.model import build_model_chunks
    from megatron_delta.platform.distributed import initialize_distributed

    config, options, vocab = mode_config(opts, mode)
    initialize_distributed(1, 1, seed=opts.seed)  # re-seeds: every mode gets the same backbone
    model = build_model_chunks(config, vocab, **options)[0]
    model.train()
    return model, config


def mock_batch(opts, vocab):
    g = torch.Generator().manual_seed(opts.seed)
    b, s = opts.micro_batch_size, opts.seq_length
    tokens = torch.randint(0, vocab, (b, s + 1), generator=g)
    pos = torch.arange(s).unsqueeze(0).expand(b, s).contiguous()
    return tokens[:, :-1].contiguous(), pos, tokens[:, 1:].contiguous()


def step(model, batch):
    tokens, pos, labels = batch
    for p in model.parameters():
        p.grad = None
    loss = model(tokens, pos, None, labels=labels).float().mean()
    loss.backward()
    return loss.detach()


def saved_bytes(model, batch):
    """Bytes autograd saves for backward in one forward (unique storages, parameters excluded)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen = {}

    def pack(t):
        st = t.untyped_storage()
        ptr = st.data_ptr()
        if ptr not in params and ptr != 0:
            seen[ptr] = max(seen.get(ptr, 0), st.nbytes())
        return t

    tokens, pos, labels = batch
    for p in model.parameters():
        p.grad = None
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(tokens, pos, None, labels=labels).float().mean()
    loss.backward()
    return sum(seen.values())


def peak_bytes(model, batch):
    """The CPU allocator's peak allocated bytes over one forward+backward, above the start."""
    from torch.profiler import ProfilerActivity, profile

    for p in model.parameters():
        p.grad = None
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step(model, batch)
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "trace.json")
        prof.export_chrome_trace(path)
        events = [e for e in json.load(open(path))["traceEvents"] if e.get("name") == "[memory]"]
    events = [e for e in events if e.get("args", {}).get("Device Type", 0) == 0]
    if not events:
        return None
    events.sort(key=lambda e: e["ts"])
    start = events[0]["args"]["Total Allocated"] - events[0]["args"]["Bytes"]
    return max(e["args"]["Total Allocated"] for e in events) - start


def parse_layout(text):
    if "x" in text:
        p, v = text.split("x")
        return int(p), int(v)
    return int(text), 1


def payloads(opts, mode, config):
    """[{boundary, first_layer, names, bytes}] per (virtual) pipeline boundary of --pp-layout."""
    from megatron_delta.core.sources import SourcePlan

    p, v = parse_layout(opts.pp_layout)
    chunks = p * v
    if opts.num_layers % chunks:
        raise SystemExit(f"--pp-layout {opts.pp_layout}: {chunks} chunks do not divide {opts.num_layers} layers")
    per = opts.num_layers // chunks
    one = opts.seq_length * opts.micro_batch_size * opts.hidden_size * 4
    if mode == BASELINE:
        return [{"boundary": k, "first_layer": k * per, "names": ["x"], "bytes": one, "bytes_without_cache": one}
                for k in range(1, chunks)]
    from megatron_delta.core.source_cache import SourceCachePlan

    # with V > 1 the interleaved schedule's source cache (--delta-pp-source-cache on) sends only what is new
    cache = SourceCachePlan.even(SourcePlan.from_config(config, mode), p, v)
    return [{"boundary": k, "first_layer": first, "names": sent, "bytes": len(sent) * one,
             "bytes_without_cache": (len(sent) + len(kept)) * one} for k, first, sent, kept in cache.boundaries()]


def max_sources(mode, config):
    if mode == BASELINE:
        return 0
    from megatron_delta.core.sources import SourcePlan

    return SourcePlan.from_config(config, mode).max_sources()


def routing_alone_ms(model, opts, rounds=15, breakdown=False):
    """Median ms of one forward + backward of the routing alone (see the module docstring).

    With ``breakdown`` also the same loop with the router's two kernels replaced by stand-ins
    (fused passes; fused passes and shared projections), interleaved round by round: returns
    {"total", "route", "project", "rest"} in ms, the parts by difference (see _stand_ins)."""
    from megatron_delta.core.sources import SourceBuffer

    block = model.decoder
    g = torch.Generator().manual_seed(opts.seed)
    h0 = torch.randn(opts.seq_length, opts.micro_batch_size, opts.hidden_size, generator=g, requires_grad=True)
    n = 2 * len(block.layers)
    scales = [torch.full((opts.hidden_size,), 0.5, requires_grad=True) for _ in range(n)]
    eps = block.config.delta_router_eps

    def routed():
        buf = SourceBuffer.start(block.plan, h0 * 1.0, eps, readers=block.readers(block.layers, final=True))
        for layer in block.layers:
            j = layer.first_sublayer
            for k, router in ((j, layer.self_attention_router), (j + 1, layer.mlp_router)):
                buf.commit(k, buf.routed_input(k, router) * scales[k])
        buf.output(block.final_router).sum().backward()

    def plain():
        x = h0 * 1.0
        for k in range(n):
            x = x + x * scales[k]
        x.sum().backward()

    variants = [(False, False)] + (list(STAND_INS.values()) if breakdown else [])
    for stand_in in variants:
        with _stand_ins(*stand_in):
            routed()
    plain()
    diffs = {v: [] for v in variants}
    for _ in range(rounds):
        for stand_in in variants:
            with _stand_ins(*stand_in):
                t0 = time.perf_counter()
                routed()
                t1 = time.perf_counter()
            plain()
            diffs[stand_in].append((t1 - t0) - (time.perf_counter() - t1))
    ms = {v: statistics.median(d) * 1e3 for v, d in diffs.items()}
    if not breakdown:
        return ms[(False, False)]
    total, no_route, neither = ms[(False, False)], ms[STAND_INS["route"]], ms[STAND_INS["both"]]
    return {"total": total, "route": total - no_route, "project": no_route - neither, "rest": neither}


class _RouteStandIn(torch.autograd.Function):
    """In place of router._RouteFunction (--routing-breakdown): no weighted sum, no projection of the
    local sources, only a copy of the base (the first value in the replacement modes) so the buffer's
    bookkeeping runs unchanged; its backward hands the gradient to that input and zero logit
    gradients to the projections (which then do their full backward work, but receive nothing in
    their gradient sinks)."""

    @staticmethod
    def forward(ctx, n, out_dtype, lib, sinks, base_sums, eps, base, gate, null_logit, null_value, query,
                *tensors):
        ref = base if base is not None else tensors[0]
        rows = ref.numel() // ref.shape[-1]
        ctx.n, ctx.has_base = n, base is not None
        ctx.local = [c is None for c in tensors[n:]]
        alpha = torch.softmax(torch.stack([torch.zeros(rows) if c is None else c for c in tensors[n:]]), dim=0)
        ctx.zero = alpha.new_zeros(rows)
        ctx.mark_non_differentiable(alpha)
        return ref.to(out_dtype or ref.dtype, copy=True), alpha

    @staticmethod
    def backward(ctx, grad, _grad_alpha):
        n = ctx.n
        first = [None] * n
        if not ctx.has_base:
            first[0] = grad
        return (None, None, None, None, None, None, grad if ctx.has_base else None, None, None, None, None, *first,
                *[None if local else ctx.zero for local in ctx.local])


class _ProjectStandIn(torch.autograd.Function):
    """In place of router._ProjectSource (--routing-breakdown): no norm, no GEMM (1/rms = 1, zero
    logits); its backward passes on what the routers left in the source's gradient sink."""

    @staticmethod
    def forward(ctx, value, eps, sink, *queries):
        rows = value.numel() // value.shape[-1]
        ctx.sink, ctx.shape, ctx.nq = sink, value.shape, len(queries)
        inv = torch.ones(rows, dtype=torch.float32, device=value.device)
        ctx.mark_non_differentiable(inv)
        return (inv, *torch.zeros(len(queries), rows, dtype=torch.float32, device=value.device).unbind(0))

    @staticmethod
    def backward(ctx, _grad_inv, *_grad_z):
        acc, ctx.sink.grad = ctx.sink.grad, None
        return (None if acc is None else acc.view(ctx.shape), None, None, *([None] * ctx.nq))


@contextlib.contextmanager
def _stand_ins(route, project):
    """Swap the router's kernels for the stand-ins above while the block runs: routing alone with
    both kernels minus routing alone without the fused passes is what the fused passes cost, and
    so on. Attribution is by difference and approximate (the parts share caches; with the weighted
    sums gone the projections' backward gets no sink to add to). Always restored on exit."""
    from megatron_delta.core import router

    saved = router._RouteFunction, router._ProjectSource
    try:
        if route:
            router._RouteFunction = _RouteStandIn
        if project:
            router._ProjectSource = _ProjectStandIn
        yield
    finally:
        router._RouteFunction, router._ProjectSource = saved


def fused_router_passes(mode, config):
    """Passes over a [tokens, hidden] tensor per step that a router touching each tensor once would
    make BEYOND what the stand-in loop (the "rest" of --routing-breakdown) already does. Per router
    with N sources: forward N + 2 (read the sources and the base x, write u) or N + 1 in the
    replacement modes and where x is the sum of the sources (no base), of which the stand-in's copy
    already does 2; backward 3N + 1 (read
    the output gradient and each source, read and write each source's gradient). Per source with
    several readers (projected once for all of them, make_source): 1 forward (its norm and logit
    columns in one read), 3 backward (read it, read and write its gradient); a source with one
    reader is projected inside that router's passes (a local source), at no extra pass."""
    from megatron_delta.core.router import DepthRouter
    from megatron_delta.core.sources import SourceBuffer, SourcePlan

    plan = SourcePlan.from_config(config, mode)
    counts = [plan.num_sources_read(j) for j in range(plan.num_sublayers)] + [len(plan.final_reads())]
    base = 1 if plan.additive and not plan.x_from_sources else 0  # a router that reads x
    route = sum((nj + base - 1) + (3 * nj + 1) for nj in counts if nj)
    # The sources made, as SourceBuffer makes them (tiny tensors): which are projected for several readers.
    readers = {j: DepthRouter(1, null_source=False, gate=False, eps=1e-6) for j in [*range(plan.num_sublayers), "final"]}
    buf = SourceBuffer.start(plan, torch.zeros(1, 1, 1), 1e-6, readers=readers)
    shared = {}
    with torch.no_grad():
        for j in range(plan.num_sublayers):
            for src in buf.read(j):
                shared[id(src)] = (src, len(src.logits) > 1)  # keep src alive: ids stay unique
            buf.routed_input(j, readers[j])
            buf.commit(j, torch.ones(1, 1, 1))
        if not plan.additive:
            for name in plan.final_reads():
                src = buf._source(name, "final")
                shared[id(src)] = (src, len(src.logits) > 1)
    return route + 4 * sum(multi for _, multi in shared.values())


def op_costs(opts, rounds=5):
    """Median ms per [tokens, hidden] fp32 tensor of the operators a router is made of, on tensors
    cycled through more memory than the caches below L3 hold, and the stream rate (GB/s) of the
    in-place multiply-add (bytes: read a, read c, write c). See the module docstring."""
    t, h = opts.seq_length * opts.micro_batch_size, opts.hidden_size
    sets = max(4, (64 << 20) // (3 * 4 * t * h))  # >= 64 MiB in rotation: beyond L2
    g = torch.Generator().manual_seed(opts.seed)
    data = [(torch.randn(t, h, generator=g), torch.randn(t, h, generator=g), torch.rand(t, 1, generator=g))
            for _ in range(sets)]
    kept = []
    ops = {
        "in-place multiply-add": lambda a, c, w: c.addcmul_(a, w),
        "add into a new tensor that is kept": lambda a, c, w: kept.append(torch.add(a, c)),
        "row-wise dot product": lambda a, c, w: torch.linalg.vecdot(a, c),
        "row-wise norm (read only)": lambda a, c, w: torch.linalg.vector_norm(a, dim=-1),
    }
    out = {}
    for name, op in ops.items():
        times = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            for a, c, w in data:
                op(a, c, w)
            times.append((time.perf_counter() - t0) / sets)
            kept.clear()
        out[name] = statistics.median(times) * 1e3
    out["stream_gbps"] = 3 * 4 * t * h / (out["in-place multiply-add"] / 1e3) / 1e9
    del data, kept
    out["memory_gbps"], out["memory_rotation_bytes"] = memory_rate(rounds)
    return out


def last_level_cache_bytes(root="/sys/devices/system/cpu/cpu0/cache"):
    """The largest CPU cache's size in bytes (Linux sysfs: index*/size such as "2048K"), or None where
    it cannot be read."""
    sizes = []
    for entry in sorted(os.listdir(root)) if os.path.isdir(root) else []:
        try:
            text = open(os.path.join(root, entry, "size")).read().strip()
        except OSError:
            continue
        unit = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        digits = text.rstrip("KMG")
        if digits.isdigit():
            sizes.append(int(digits) * unit)
    return max(sizes, default=None)


def memory_rate(rounds=5, chunk=8 << 20):
    """GB/s of an in-place scaled add (read a, read c, write c) over 8 MiB tensors cycled through twice
    the last-level cache (256 MiB to 2 GiB): what a pass costs when its tensors come from memory, as
    a step's sources mostly do (a step's saved activations are several times the cache). Returns
    (GB/s, bytes in rotation)."""
    llc = last_level_cache_bytes()
    total = min(max(2 * (llc or 256 << 20), 256 << 20), 2 << 30)
    n = chunk // 4
    data = [(torch.ones(n), torch.ones(n)) for _ in range(max(2, total // (2 * chunk)))]
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for a, c in data:
            c.add_(a, alpha=0.5)
        times.append(time.perf_counter() - t0)
    return 3 * chunk * len(data) / statistics.median(times) / 1e9, 2 * chunk * len(data)


def profile_mode(model, batch, top=15):
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step(model, batch)
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top)


def _progress(msg):
    print(f"[benchmark {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _model_stand_ins(opts, mode):
    """--model-breakdown: the stand-in variants (name, _stand_ins arguments) a routed model's step is
    also timed with (STAND_INS)."""
    return list(STAND_INS.items()) if opts.model_breakdown and mode != BASELINE else []


def finalize(results):
    """Medians, minima and ratios to the baseline, and the target verdicts (from times_s etc.)."""
    for r in results.values():
        r["time_s"] = statistics.median(r["times_s"])
        r["time_min_s"] = min(r["times_s"])
        r["cpu_s"] = statistics.median(r["cpu_times_s"]) if r.get("cpu_times_s") else None
    base = results[BASELINE]
    for mode, r in results.items():
        r["time_min_ratio"] = r["time_min_s"] / base["time_min_s"]
        r["time_ratio"] = r["time_s"] / base["time_s"]
        r["cpu_ratio"] = r["cpu_s"] / base["cpu_s"] if r["cpu_s"] and base.get("cpu_s") else None
        r["saved_ratio"] = r["saved_bytes"] / base["saved_bytes"] if base["saved_bytes"] else None
        r["peak_ratio"] = (r["peak_bytes"] / base["peak_bytes"]
                           if r["peak_bytes"] is not None and base["peak_bytes"] else None)
        r["max_payload_ratio"] = (max(p["bytes"] for p in r["payloads"]) / max(p["bytes"] for p in base["payloads"])
                                  if r["payloads"] else None)
        if r.get("routing_alone_ms") is not None:
            r["routing_alone_share"] = r["routing_alone_ms"] / 1e3 / base["time_s"]
        if r.get("stand_in_cpu_s"):
            # CPU-time ratios of the model as is, with the fused passes stood in, and with the shared
            # projections stood in as well: their differences split the model's extra cost
            full = r["cpu_ratio"]
            route, both = (statistics.median(r["stand_in_cpu_s"][k]) / base["cpu_s"] for k in ("route", "both"))
            r["model_breakdown"] = {"cpu_ratio": full, "route_stand_in_ratio": route, "both_stand_ins_ratio": both,
                                    "fused_passes": full - route, "shared_projections": route - both,
                                    "rest": both - 1.0}
        tg = TARGETS.get(mode)
        if tg:
            checks = [(r["time_ratio"], tg[0]), (r["saved_ratio"], tg[1]), (r["peak_ratio"], tg[2])]
            r["targets"] = {"time": tg[0], "saved": tg[1], "peak": tg[2]}
            r["pass"] = {k: (None if v is None else v <= t) for k, (v, t) in zip(("time", "saved", "peak"), checks)}


def run(opts):
    from megatron_delta.platform.cpu import set_cpu_allocator
    from megatron_delta.platform.distributed import destroy_distributed

    allocator = set_cpu_allocator(opts.delta_cpu_allocator)  # as pretrain_gpt.py does on CPU
    if opts.threads:
        torch.set_num_threads(opts.threads)
    modes = [m.strip() for m in opts.modes.split(",") if m.strip()]
    if BASELINE not in modes:
        modes.insert(0, BASELINE)
    models, results, config_of = {}, {}, {}
    try:
        for mode in modes:
            model, config = build_model(opts, mode)
            batch = mock_batch(opts, opts.vocab_size)
            models[mode] = (model, batch)
            config_of[mode] = config
            results[mode] = {
                "parameters": sum(p.numel() for p in model.parameters()),
                "max_sources": max_sources(mode, config),
                "delta_num_blocks": config.delta_num_blocks,  # resolved: None outside the block modes
                "payloads": payloads(opts, mode, config),
                "times_s": [],
                "cpu_times_s": [],
            }
        base_params = results[BASELINE]["parameters"]
        for mode in modes:
            model, batch = models[mode]
            r = results[mode]
            r["added_parameters"] = r["parameters"] - base_params
            for _ in range(opts.warmup):
                r["loss"] = float(step(model, batch))
                for _, stand_in in _model_stand_ins(opts, mode):
                    with _stand_ins(*stand_in):
                        step(model, batch)
            r["saved_bytes"] = saved_bytes(model, batch)
            r["peak_bytes"] = None if opts.no_memory else peak_bytes(model, batch)
            _progress(f"{mode}: warm-up and memory done")
        for _ in range(opts.repeats):
            for mode in modes:
                model, batch = models[mode]
                t0, c0 = time.perf_counter(), time.process_time()
                step(model, batch)
                results[mode]["times_s"].append(time.perf_counter() - t0)
                results[mode]["cpu_times_s"].append(time.process_time() - c0)
                _progress(f"{mode}: step {results[mode]['times_s'][-1]:.2f} s")
                for name, stand_in in _model_stand_ins(opts, mode):
                    with _stand_ins(*stand_in):
                        c0 = time.process_time()
                        step(model, batch)
                        results[mode].setdefault("stand_in_cpu_s", {}).setdefault(name, []).append(
                            time.process_time() - c0)
        for mode in modes:
            if mode != BASELINE:
                alone = routing_alone_ms(models[mode][0], opts, breakdown=opts.routing_breakdown)
                if opts.routing_breakdown:
                    results[mode]["routing_breakdown_ms"] = alone
                    results[mode]["fused_router_passes"] = fused_router_passes(mode, config_of[mode])
                    alone = alone["total"]
                results[mode]["routing_alone_ms"] = alone
                _progress(f"{mode}: routing alone {results[mode]['routing_alone_ms']:.1f} ms")
        profile_text = None
        if opts.profile:
            model, batch = models[opts.profile]
            profile_text = profile_mode(model, batch)
    finally:
        destroy_distributed()
    finalize(results)
    meta = {k: v for k, v in vars(opts).items()}
    costs = op_costs(opts)
    meta.update(stream_gbps=costs.pop("stream_gbps"), memory_gbps=costs.pop("memory_gbps"),
                memory_rotation_bytes=costs.pop("memory_rotation_bytes"), op_ms=costs, torch=torch.__version__, allocator=allocator,
                threads=torch.get_num_threads(), cpu_count=os.cpu_count(),
                loadavg=os.getloadavg() if hasattr(os, "getloadavg") else None)
    return {"config": meta, "modes": results, "profile": profile_text}


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
            f"| {mode} | {r['max_sources']} | {r['added_parameters']:,} | {r['time_s']:.3f} | {_ratio(r['time_ratio'])} "
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
        out.append("\nRouting alone (stand-in sublayers, median), as a share of the baseline model's step: " + ", ".join(
            f"{m} {r['routing_alone_ms']:.1f} ms = {100 * r['routing_alone_share']:.1f} %" for m, r in alone))
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


def main(argv=None):
    opts = build_parser().parse_args(argv)
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
    report = run(opts)
    cfg = report["config"]
    print(f"\n{cfg['num_layers']} layers, hidden {cfg['hidden_size']}, seq {cfg['seq_length']}, micro-batch "
          f"{cfg['micro_batch_size']}, fp32, router kernels {cfg['delta_router_kernels']}, gate {cfg['delta_gate']}, "
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
