"""The router kernels' rates and where the GPU's time goes, run by tools/gpu_check.py's optional parts
(``--parts bandwidth kernels``; not in the acceptance run, tools/gpu_acceptance.sh): (b2) one router call's and a
routed stream's counted bytes over their time against this machine's copy rate; (k) the routed stream at the 1B
shape's width and depth under torch.profiler, each Triton kernel's device time and counted bytes. Each function
takes gpu_check's Env (dry, device, shapes, gpu_kind)."""
import time

from megatron_delta.core.modes import DELTA, DELTA_BLOCK
from megatron_delta.perf.gpu_check import free, router_kernels
from megatron_delta.perf.routed_stream import routed_stream
from megatron_delta.perf.shapes import SHAPES as MODEL_SHAPES

BANDWIDTH_SOURCES = (5, 17)  # (b2): sources per router call (delta_block's K + 1 at K = 4; a deep delta router)


def copy_bandwidth(env, nbytes=1 << 30, reps=10):
    """This machine's device-to-device copy rate in GB/s (bytes read + written), the ceiling (b2) sets each
    router kernel's rate against (the dry run: a CPU copy of 64 MiB)."""
    import torch

    n = (nbytes if not env.dry else 1 << 26) // 2
    a = torch.empty(n, dtype=torch.bfloat16, device=env.device)
    b = torch.empty_like(a)
    b.copy_(a)
    seconds = _timed(env, lambda: b.copy_(a), reps)
    out = 2 * 2 * n / seconds / 1e9
    free(env, a, b)
    return out


def _timed(env, fn, reps):
    """Seconds per call of fn() over ``reps`` calls after one more (CUDA events on a GPU, wall clock in the dry
    run)."""
    import torch

    fn()
    if env.dry:
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        return (time.perf_counter() - t0) / reps
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / reps


def _rate(env, call, row_numel, reps, copy_gbps):
    """(b2): one call()'s counted bytes (core.traffic: the tensors of ``row_numel`` elements or more its kernels
    read and write, and the Triton kernels' per-program partial sums, smaller but priced by the cost model too:
    partial_bytes) over its time (_timed): ms, bytes, partial_bytes, gbps, of_copy (the share of the copy rate)."""
    from megatron_delta.core import traffic, triton_router

    with traffic.counting() as count:
        call()
    partial = sum(rd + wr for (kernel, _), (rd, wr) in count.bytes().items() if kernel == triton_router.REDUCE_KERNEL)
    moved = partial + sum(rd + wr for (kernel, _), (rd, wr) in count.bytes(row_numel).items()
                          if kernel != triton_router.REDUCE_KERNEL)
    seconds = _timed(env, call, reps)
    gbps = moved / seconds / 1e9
    return {"ms": 1e3 * seconds, "bytes": moved, "partial_bytes": partial, "gbps": gbps, "of_copy": gbps / copy_gbps,
            "ok": True}


def kernel_bandwidth(opts, env, kernel, shape_name, n_sources, copy_gbps, reps=20):
    """(b2): one router call's forward + backward on ``kernel`` (torch / fla / triton): ``n_sources`` bf16 sources
    of [seq, 1, hidden] at the shape's width (the dry run: fp32, tiny), x added (delta's u = x + r). Its time per
    call, its counted bytes (core.traffic: every tensor of [tokens, hidden] or more that its kernels read or
    write), so its rate in GB/s and that rate's share of the copy bandwidth: near 1, the call moves its bytes as
    fast as a copy does; the cost model assumes exactly that."""
    import torch

    from megatron_delta.core.router import DepthRouter, make_source

    s = env.shapes[shape_name]
    t, d = s["seq"], s["hidden"]
    dtype = torch.float32 if env.dry else torch.bfloat16
    g = torch.Generator(device="cpu").manual_seed(7)
    vals = [torch.randn(t, 1, d, generator=g).to(env.device, dtype).requires_grad_() for _ in range(n_sources)]
    x = torch.randn(t, 1, d, generator=g).to(env.device, dtype).requires_grad_()
    grad = torch.randn(t, 1, d, generator=g).to(env.device, dtype)
    r = DepthRouter(d, null_source=False, gate=False, eps=1e-6, kernels=kernel).to(env.device)
    with torch.no_grad():
        r.query.copy_(0.1 * torch.randn(d, generator=g).to(env.device))

    def call():
        out = r([make_source(v, 1e-6) for v in vals], base=x, apply_gate=True)
        return torch.autograd.grad(out, [*vals, x, r.query], grad)

    out = dict(kernel=kernel, shape=shape_name, sources=n_sources, **_rate(env, call, t * d, reps, copy_gbps))
    free(env, vals, x, grad, r)
    return out


STACK_LAYERS = 8  # (b2): layers of delta's routed stream timed whole (16 routers, the last reading 16 sources)


def stack_runs(env):
    """(b2)'s runs of delta's whole routed stream: (router backend, group size) - one router per pass on each
    backend, and the group router (``auto``) on triton (group_router.GroupRouting: its sizes for 16 routers)."""
    return [("torch", 1)] + [(k, g) for k in router_kernels(env) for g in ((1, "auto") if k == "triton" else (1,))]


def stack_bandwidth(opts, env, kernel, group_size, shape_name, copy_gbps, layers=STACK_LAYERS, reps=5):
    """(b2): delta's routed stream alone over ``layers`` layers (2 layers' routers each, x the sum of the sources,
    as delta runs) with identity sublayers (each sublayer's output is its routed input, so no GEMM runs), forward
    + backward, at the shape's width and sequence: its time, its counted bytes (every router pass, the sums of
    x and autograd's adds: core/traffic.py), their rate against the copy rate, and the time per router call.
    For the group router this is the one measurement of its kernels at full width (the old pass's tile holds S
    partial mixes of a whole row)."""
    import torch

    s = env.shapes[shape_name]
    t, d = s["seq"], s["hidden"]
    call, held = routed_stream(DELTA, layers, kernel, group_size, t, d, env.device,
                               torch.float32 if env.dry else torch.bfloat16, seed=8)
    out = dict(kernel=kernel, group_size=group_size, shape=shape_name, layers=layers,
               **_rate(env, call, t * d, reps, copy_gbps))
    out["ms_per_router"] = out["ms"] / (2 * layers)
    free(env, *held)
    return out


# (k): the Triton kernel each traffic record of the routed stream is (core/traffic.py's kernel and phase)
KERNEL_OF_RECORD = {("group_old_pass", "forward"): "_old_forward", ("group_old_pass", "backward"): "_old_backward",
                    ("group_merge", "forward"): "_merge_forward", ("group_merge", "backward"): "_merge_backward",
                    ("x_sum", "forward"): "_final_sum", ("triton_route", "forward"): "_forward",
                    ("triton_route", "backward"): "_backward", ("triton_block_grad", "backward"): "_block_grad"}


def kernel_time_runs(env):
    """(k)'s runs: (mode, group size) of the routed streams at the 1B shape's width and depth on our Triton kernels
    (none where this checkout or the dry run has none): delta on the group router, and delta_block. Not delta with
    one router per pass: its per-router kernels take the number of sources as a compile-time constant, so the 1B
    depth would compile 2 x 56 variants first, minutes of a GPU session's time."""
    return [(DELTA, "auto"), (DELTA_BLOCK, 1)] if "triton" in router_kernels(env) else []


def kernel_times(opts, env, mode, group_size, shape_name="1B", reps=3):
    """(k): where the GPU's time goes in ``mode``'s routed stream (identity sublayers) at the shape's width AND
    depth (at 1B: 28 layers, so 56 routers and the group sizes ``auto`` takes there; (b2)'s stream has 8 layers).
    One forward + backward under torch.profiler gives each CUDA kernel's calls and device time; the same call
    unprofiled gives the wall time. device_share = device time / wall time says what sets the pace: near 1 the
    kernels, well below 1 the host. For each of our Triton kernels, its counted bytes (core.traffic, mapped by
    KERNEL_OF_RECORD) over its device time, against the rate the cost model assumes (cost_model.HBM_EFFICIENCY of
    the GPU's peak) and against tools/kernel_resources.py's ceiling. The dry run: the wall time only (no CUDA)."""
    import torch

    from megatron_delta.core import traffic
    from megatron_delta.perf.cost_model import GPUS, HBM_EFFICIENCY

    s = env.shapes[shape_name]
    layers = s["layers"] or MODEL_SHAPES[shape_name]["num_layers"]
    t, d = s["seq"], s["hidden"]
    call, held = routed_stream(mode, layers, "triton", group_size, t, d, env.device,
                               torch.float32 if env.dry else torch.bfloat16, seed=9)
    with traffic.counting() as count:
        call()
    moved, records = {}, count.bytes(t * d)
    for (name, phase), (rd, wr) in records.items():
        kernel = KERNEL_OF_RECORD.get((name, phase))
        if kernel == "_final_sum" and ("group_old_pass", "forward") not in records:
            continue  # x summed by PyTorch's adds: the final-sum kernel runs only where the routers route in groups
        if kernel is not None:
            moved[kernel] = moved.get(kernel, 0) + rd + wr
    wall = _timed(env, call, reps)
    kernels = []
    if not env.dry:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            call()
            torch.cuda.synchronize()
        modelled = HBM_EFFICIENCY * GPUS[env.gpu_kind()][0]
        for e in prof.key_averages():
            us = getattr(e, "self_device_time_total", None)
            if us is None:
                us = getattr(e, "self_cuda_time_total", 0)
            if us <= 0:
                continue
            row = dict(name=e.key, calls=e.count, ms=us / 1e3)
            if e.key in moved:
                row.update(bytes=moved[e.key], of_modelled_rate=moved[e.key] / (us * 1e-6) / modelled)
            kernels.append(row)
        kernels.sort(key=lambda r: -r["ms"])
    device_ms = sum(r["ms"] for r in kernels)
    out = dict(mode=mode, group_size=group_size, shape=shape_name, layers=layers, routers=2 * layers,
               wall_ms=1e3 * wall, wall_ms_per_router=1e3 * wall / (2 * layers), device_ms=device_ms,
               device_share=device_ms / (1e3 * wall) if kernels else None, kernels=kernels,
               counted_bytes=moved, ok=wall > 0 and (env.dry or bool(kernels)))
    free(env, *held)
    return out
