"""The benchmark harness: every residual mode side by side in one process, same seed, fp32, mock tokens.

run(opts) measures per mode (a Megatron GPTModel / DeltaGPTModel built by megatron_delta.core.model, TP1/PP1;
opts: tools/benchmark.py's flags) and finalize() adds the ratios to the baseline and the targets' verdicts:

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
  sources, softmax; in delta / full_attnres the group router's old passes and merges), the shared
  source projections (_ProjectSource) and the rest (SourceBuffer
  bookkeeping, partial sums, autograd, Python), and adds the least a router
  touching each [tokens, hidden] tensor once could cost: the rest plus its passes over memory
  (fused_router_passes) at the measured cost of one pass (perf/router_breakdown.py).
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
  --routing-breakdown floor is printed at both rates (perf/machine_rates.py).
- pipeline payload: bytes per micro-batch crossing each boundary of the layout --pp-layout P (or
  PxV for P stages with V virtual chunks each), from SourcePlan.payload_names, vs. the baseline's
  one [s, b, h] tensor. With V > 1 what the source cache sends (core/source_cache.py), and in
  brackets what the uncached path (--delta-pp-source-cache off) would send.
"""
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time

import torch

from megatron_delta.core.modes import (
    ADDITIVE_MODES,
    BASELINE,
    BLOCK_MODES,
    DELTA,
    DELTA_BLOCK,
    RESIDUAL_MODES,
    ROUTED_MODES,
)
from megatron_delta.perf.machine_rates import op_costs
from megatron_delta.perf.router_breakdown import STAND_INS, fused_router_passes, stand_ins

MODES = RESIDUAL_MODES
# The CPU targets, as ratios to the baseline: (time, saved bytes, peak memory).
TARGETS = {DELTA_BLOCK: (1.02, 1.08, 1.05), DELTA: (1.15, 1.3, 1.25)}


def mode_config(opts, mode):
    """(DeltaTransformerConfig, GPTModel options, padded vocabulary) of one mode, from
    megatron_delta.checkpoint.model_config: --num-layers etc., the rest the small CPU model's (Qwen3-style: GQA 2,
    SwiGLU 3 x hidden, RoPE, qk-layernorm, no biases)."""
    from megatron_delta.checkpoint.model_config import model_config, resolve_model_fields

    fields = dict(residual=mode, num_layers=opts.num_layers, hidden_size=opts.hidden_size,
                  num_attention_heads=opts.num_attention_heads, num_query_groups=opts.num_query_groups,
                  ffn_hidden_size=opts.ffn_hidden_size, seq_length=opts.seq_length, vocab_size=opts.vocab_size)
    if mode in BLOCK_MODES:
        fields["delta_num_blocks"] = opts.delta_num_blocks
    if mode in ADDITIVE_MODES:  # the replacement modes take no gate (pretrain_gpt.py refuses it)
        fields["delta_gate"] = opts.delta_gate
    if mode in ROUTED_MODES and getattr(opts, "delta_null_source", False):
        fields["delta_null_source"] = True
    if mode in ROUTED_MODES:
        fields["delta_router_kernels"] = opts.delta_router_kernels
    recompute = getattr(opts, "recompute", None)  # (method, layers): full recompute (--traffic's counts)
    if recompute:
        fields.update(recompute_granularity="full", recompute_method=recompute[0], recompute_num_layers=recompute[1])
    fields = resolve_model_fields(fields)
    overrides = {}
    if mode in ("delta", "full_attnres"):  # the fine-grained modes' group router (core/group_router.py)
        overrides["delta_router_group_size"] = getattr(opts, "delta_router_group_size", "auto")
    return (*model_config(fields, **overrides), fields["padded_vocab_size"])


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
    {"total", "route", "project", "rest"} in ms, the parts by difference (see router_breakdown.stand_ins)."""
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
        with stand_ins(*stand_in):
            routed()
    plain()
    diffs = {v: [] for v in variants}
    for _ in range(rounds):
        for stand_in in variants:
            with stand_ins(*stand_in):
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


def profile_mode(model, batch, top=15):
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step(model, batch)
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top)


def _progress(msg):
    print(f"[benchmark {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _model_stand_ins(opts, mode):
    """--model-breakdown: the stand-in variants (name, stand_ins arguments) a routed model's step is
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
                    with stand_ins(*stand_in):
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
                    with stand_ins(*stand_in):
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
                memory_rotation_bytes=costs.pop("memory_rotation_bytes"), op_ms=costs, torch=torch.__version__,
                allocator=allocator, threads=torch.get_num_threads(), cpu_count=os.cpu_count(),
                loadavg=os.getloadavg() if hasattr(os, "getloadavg") else None)
    return {"config": meta, "modes": results, "profile": profile_text}


# ------------------------------------------------------------------------------------------------ --traffic
TRAFFIC_BACKENDS = ("torch", "c", "fla")  # --delta-router-kernels values counted by --traffic


@contextlib.contextmanager
def router_backend(backend):
    """Run the routers of a model built with ``--delta-router-kernels backend`` here: ``fla`` on CPU routes
    through fla's pure-PyTorch naive_attnres (fla_router.use_kernel, as tests/unit/test_fla_router.py does); what
    is counted for it is fused_attnres's traffic per its source (fla_router._record_fused_attnres)."""
    if backend != "fla":
        yield
        return
    from fla.ops.attnres import naive_attnres

    from megatron_delta.core import fla_router

    with fla_router.use_kernel(naive_attnres, devices=("cpu",), name="naive_attnres"):
        yield


def counted_step(model, batch, act_bytes):
    """{(kernel, phase): u} counted (megatron_delta.core.traffic) over one forward + backward of ``model``."""
    from megatron_delta.core import traffic

    tokens, _, _ = batch
    cfg = model.config
    with traffic.counting() as count:
        step(model, batch)
    return count.rows(tokens.numel() * cfg.hidden_size, act_bytes)


def fla_missing():
    """Why fla's kernel cannot be counted here (fla-core not importable), or None."""
    try:
        import fla.ops.attnres  # noqa: F401
    except Exception as e:  # noqa: BLE001  (ImportError, or a broken Triton install)
        return f"{type(e).__name__}: {e}"
    return None


def traffic_report(opts, modes, backends=TRAFFIC_BACKENDS, recompute=None):
    """Per mode and router backend: the traffic of one step counted on the model (fp32, this machine) and the
    closed form's (perf.cost_model.step_traffic) in fp32 and in bf16 (a GPU's), per (kernel, phase) and in
    total, in u (one [tokens, hidden] tensor of the activation dtype read or written once)."""
    from megatron_delta.perf import cost_model
    from megatron_delta.platform.distributed import destroy_distributed

    out = {}
    try:
        for mode in modes:
            if mode == BASELINE:
                continue
            for backend in backends:
                with router_backend(backend):
                    o = _with(opts, delta_router_kernels=backend, recompute=recompute)
                    model, config = build_model(o, mode)
                    counted = counted_step(model, mock_batch(o, o.vocab_size), 4)
                kw = dict(num_blocks=config.delta_num_blocks, null_source=config.delta_null_source,
                          gate=config.delta_gate == "scalar", recompute=recompute)
                predicted = cost_model.step_traffic(mode, opts.num_layers, backend, act_bytes=4, **kw)
                bf16 = (cost_model.step_traffic(mode, opts.num_layers, backend, act_bytes=2, **kw)
                        if backend in cost_model.GPU_BACKENDS else None)
                out[f"{mode}/{backend}"] = {
                    "mode": mode, "backend": backend, "sublayers": 2 * opts.num_layers,
                    "counted": {f"{k}/{p}": v for (k, p), v in sorted(counted.items())},
                    "closed_form": {f"{k}/{p}": v for (k, p), v in sorted(predicted.items())},
                    "counted_u": sum(counted.values()), "closed_form_u": cost_model.total_u(predicted),
                    "closed_form_bf16_u": None if bf16 is None else cost_model.total_u(bf16)}
    finally:
        destroy_distributed()
    return out


def _with(opts, **changes):
    import argparse

    return argparse.Namespace(**{**vars(opts), **changes})
