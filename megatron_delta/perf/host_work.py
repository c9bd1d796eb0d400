"""The routers' host work: what the CPU that drives a GPU does per router call and per training step, measured on
the CPU with the project's Triton kernels under Triton's interpreter, their launches made no-ops.

Where a layer's GEMMs take the GPU less time than its host takes to launch the layer's kernels, the host's time is
the step's, and a router costs its host work, not its bytes: the 1B shape on an H200 ran so (docs/performance.md,
GPU figures), where the cost model (perf/cost_model.py, bytes against FLOPs) predicts a GPU-bound step. Two
measurements, both in one process with TRITON_INTERPRET=1 set before Triton is imported (tools/host_work.py):

- :func:`step_ratios`: a training step - Megatron's schedule, DDP and optimizer, as tools/gpu_check.py (c) runs it
  (perf.gpu_check.train) - at a tiny width with the launches made no-ops, so that what is left is host work; each
  mode's time against the baseline's. It stands for a run whose GPU waits on its host: on the H200 at 1B,
  delta on the Triton kernels ran at 1 / 0.605 = 1.65x the baseline's step time, and this proxy gave 1.63x for
  the same build.
- the same step with every router call replaced by its host floor (:func:`floor_routers`: one autograd node that
  makes u, no kernel and no math): the routed layers' own host work (the source buffer, the queries) against the
  baseline's, so that the rest of a mode's ratio is its router calls' own;
- :func:`per_call`: the routed stream alone (identity sublayers, as gpu_check's (b2)), counted per router call:
  kernel launches, table copies (triton_router.device_tables: one pinned copy each on a GPU) and the PyTorch ops
  dispatched, split into views, allocations and the rest (on a GPU each of the rest is a kernel launch of its
  own). Counts are exact and the same on every machine; the host time per call beside them is this CPU's.
"""
from __future__ import annotations

import contextlib
import time
import types
from collections import Counter
from typing import Dict, List, Optional

from megatron_delta.core.modes import BASELINE

__all__ = ["noop_launches", "counted_launches", "floor_routers", "per_call", "step_ratios", "host_runs", "host_time",
           "HOST_SHAPE", "HOST_STREAM_LAYERS", "FLOOR"]

HOST_SHAPE = dict(hidden=32, ffn=64, heads=4, groups=2, seq=16)  # tiny: the GEMMs cost next to nothing
ALLOCATIONS = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "zeros", "zeros_like",
               "new_zeros", "ones", "ones_like", "full", "full_like", "lift_fresh", "scalar_tensor"}


class _Counts:
    """What one measured region dispatched: launches per kernel, table copies, PyTorch ops per kind."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.launches: Counter = Counter()
        self.tables = 0
        self.ops: Counter = Counter()

    def per(self, n: int) -> Dict[str, float]:
        views = sum(v for k, v in self.ops.items() if k[1])
        allocs = sum(v for k, v in self.ops.items() if not k[1] and k[0] in ALLOCATIONS)
        total = sum(self.ops.values())
        return dict(launches=sum(self.launches.values()) / n, table_copies=self.tables / n, torch_ops=total / n,
                    views=views / n, allocations=allocs / n, other_ops=(total - views - allocs) / n)


@contextlib.contextmanager
def noop_launches(counts: Optional[_Counts] = None):
    """Triton's interpreter launches nothing inside (each launch counted in ``counts``), and every table copy is
    counted; undone on exit. Needs TRITON_INTERPRET=1 from before Triton's import."""
    from megatron_delta.core import triton_router

    if not triton_router.interpreting():
        raise RuntimeError("host work is measured under Triton's interpreter: set TRITON_INTERPRET=1 before anything "
                           "imports Triton (tools/host_work.py does)")
    import triton.runtime.interpreter as interp

    counts = counts if counts is not None else _Counts()

    def launch(self, *args, grid, warmup, **kwargs):  # the host's side of a launch only: arguments bound, no work
        counts.launches[self.fn.__name__] += 1

    with _patched(interp.InterpretedFunction, "run", launch), _counting_tables(counts):
        yield counts


@contextlib.contextmanager
def counted_launches(counts: Optional[_Counts] = None):
    """On a GPU: every Triton launch runs, counted in ``counts`` (JITFunction.run), and every table copy is
    counted; undone on exit."""
    from triton.runtime.jit import JITFunction

    counts = counts if counts is not None else _Counts()
    run = JITFunction.run

    def launch(self, *args, **kwargs):
        counts.launches[self.fn.__name__] += 1
        return run(self, *args, **kwargs)

    with _patched(JITFunction, "run", launch), _counting_tables(counts):
        yield counts


FLOOR = "floor"  # step_ratios' kernels for a run whose router calls are replaced by floor_routers' one node each


@contextlib.contextmanager
def floor_routers():
    """Every router call of a SourceBuffer replaced by the least a router call can cost the host: one autograd node
    over the router's query and its newest source that returns an uninitialised u and, in backward, hands u's
    gradient to that source (no kernel, no math, no bookkeeping, and none of the older sources among its inputs,
    which a real router takes: a lower bound). The source buffer, its queries (q = w * g, one per router and
    micro-batch) and the layers around them run as they do; undone on exit. A training step under it against the
    baseline's is what the routed layers cost the host before their routers' own work."""
    import torch

    from megatron_delta.core.sources import SourceBuffer

    class _FloorRoute(torch.autograd.Function):
        @staticmethod
        def forward(ctx, query, newest):
            return torch.empty_like(newest)

        @staticmethod
        def backward(ctx, grad):
            return None, grad

    def route(self, key, router, *, base, apply_gate, base_sums):
        names = self.plan.final_reads() if key == "final" else self.plan._reads(key)
        return _FloorRoute.apply(self.query(router), self.value(names[-1]))

    with _patched(SourceBuffer, "route", route):
        yield


@contextlib.contextmanager
def _patched(owner, name: str, value):
    old = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, old)


@contextlib.contextmanager
def _counting_tables(counts: _Counts):
    from megatron_delta.core import triton_router

    tables = triton_router.device_tables

    def copy(*lists, device):
        counts.tables += 1
        return tables(*lists, device=device)

    with _patched(triton_router, "device_tables", copy):
        yield


@contextlib.contextmanager
def _counting_ops(counts: _Counts):
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            counts.ops[(func.overloadpacket.__name__, bool(func.is_view))] += 1
            return func(*args, **(kwargs or {}))

    with Count():
        yield


def per_call(mode: str, layers: int = 14, kernels: str = "triton", group_size="auto", reps: int = 20,
             shape: Optional[Dict[str, int]] = None, device: str = "cpu") -> Dict[str, float]:
    """Per router call of ``mode``'s routed stream (2 ``layers`` routers, and the final router of the replacement
    modes): launches, table copies, PyTorch ops by
    kind (counted over one forward + backward) and the host's microseconds (the best of three rounds of ``reps``).
    On CPU the launches are no-ops under Triton's interpreter; on a GPU (``device`` cuda, at this tiny width the
    GPU's work is next to nothing) they run, and the time is the host's wherever it outruns the GPU. On a GPU the
    same stream is timed twice more, with the launches skipped (``host_us_no_launches``), then the table copies
    too (``host_us_no_launches_no_copies``: the tables are built on the host, not sent): the differences over the
    counts are what one launch and one copy cost this host, the rest is Python and the PyTorch ops."""
    import torch

    shape = dict(HOST_SHAPE, **(shape or {}))
    cuda = torch.device(device).type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    def host_us(call):
        best = float("inf")
        for _ in range(3):
            sync()
            t0 = time.perf_counter()
            for _ in range(reps):
                call()
            sync()
            best = min(best, (time.perf_counter() - t0) / reps)
        return best / n * 1e6

    with (counted_launches() if cuda else noop_launches()) as counts:
        from megatron_delta.perf.routed_stream import routed_stream

        call, (routers, _, _) = routed_stream(mode, layers, kernels, group_size, shape["seq"], shape["hidden"], device,
                                              seed=5)
        n = len(routers)  # router calls per forward
        call()  # warm: each kernel compiled (or, under the interpreter, rewritten) once
        sync()
        counts.reset()
        with _counting_ops(counts):
            call()
        out = dict(counts.per(n), host_us=host_us(call))
        if cuda:
            from triton.runtime.jit import JITFunction

            from megatron_delta.core import triton_router

            with _patched(JITFunction, "run", lambda self, *args, **kwargs: None):  # outputs left unwritten
                out["host_us_no_launches"] = host_us(call)
                with _patched(triton_router, "device_tables", _uncopied_tables(device)):
                    out["host_us_no_launches_no_copies"] = host_us(call)
    return dict(mode=mode, kernels=kernels, group_size=group_size, layers=layers, **out)


def _uncopied_tables(device):
    """triton_router.device_tables without the copy: the tables' entries are laid out on the host as there, and
    views of one device buffer stand for them (what no launch reads)."""
    import torch

    from megatron_delta.core.triton_router import table_layout

    store = torch.zeros(1 << 16, dtype=torch.int64, device=device)

    def tables(*lists, device):
        flat, sizes = table_layout(lists)
        return list(store[:len(flat)].split_with_sizes(sizes))

    return tables


def step_ratios(runs: List[tuple], overrides, layers: int = 28, iters: int = 3, warmup: int = 1,
                micro_batches: int = 8, shape: Optional[Dict[str, int]] = None, rounds: int = 2,
                progress=print) -> List[Dict[str, float]]:
    """Host time of a training step (``micro_batches`` micro-batches' forward + backward, Megatron's schedule:
    perf.gpu_check.train) per (mode, kernels, group size) of ``runs`` and the baseline, launches no-ops; each with
    its ratio to the baseline and its launches per step. Kernels FLOOR: the router calls replaced by
    :func:`floor_routers`. Each run's time is its fastest timed iteration over ``rounds`` rounds, the runs in
    order, then in reverse, and so on (a shared CPU's load only ever adds time, and no run always comes first).
    ``overrides``: the routers' optimizer group, as gpu_check.train takes it (the trainer's router_overrides;
    this package never imports the trainer)."""
    from megatron_delta.perf import gpu_check

    shape = dict(HOST_SHAPE, **(shape or {}), layers=layers)
    opts = types.SimpleNamespace(dry_run=True, transformer_impl="local", vocab_size=64, iters=iters, lr=3e-3,
                                 no_fp8=True)
    order = [(BASELINE, "-", None)] + [r for r in runs if r[0] != BASELINE]
    best: Dict[tuple, float] = {}
    launches: Dict[tuple, float] = {}
    with gpu_check.check_session(opts) as env, noop_launches() as counts:
        for k in range(rounds):
            for run in (order if k % 2 == 0 else order[::-1]):
                mode, kernels, group = run
                counts.reset()
                with floor_routers() if kernels == FLOOR else contextlib.nullcontext():
                    r = gpu_check.train(opts, env, mode, shape=shape, overrides=overrides,
                                        kernels=kernels if kernels not in ("-", FLOOR) else "torch", iters=iters,
                                        warmup=warmup, micro_batches=micro_batches, group_size=group)
                best[run] = min(best.get(run, float("inf")), *r["fb_ms"])
                launches[run] = sum(counts.launches.values()) / iters
                progress(f"    round {k + 1}/{rounds}: {mode:12s} {kernels:6s} S={group}: {min(r['fb_ms']):8.1f} ms")
    base = best[order[0]]
    out = []
    for run in order:
        mode, kernels, group = run
        ms = best[run]
        out.append(dict(mode=mode, kernels=kernels, group_size=group, layers=layers, step_ms=ms, ratio=ms / base,
                        launches_per_step=launches[run]))
        progress(f"  {mode:12s} {kernels:6s} S={group}: {ms:8.1f} ms  x{ms / base:.3f}")
    return out


HOST_STREAM_LAYERS = 12  # (h): layers of the routed streams whose host time per router call is measured


def host_runs(env):
    """tools/gpu_check.py (h)'s runs: (mode, group size) of the routed streams on our Triton kernels (none where
    this checkout or the dry run has no Triton kernels): delta on the group router and on one router per pass,
    delta_block. ``env``: gpu_check's Env (dry, device)."""
    from megatron_delta.perf.gpu_check import router_kernels

    return [("delta", "auto"), ("delta", 1), ("delta_block", 1)] if "triton" in router_kernels(env) else []


def host_time(env, mode, group_size):
    """tools/gpu_check.py (h): the host's work per router call of ``mode``'s routed stream on our Triton kernels
    at a tiny width (the GPU's work next to nothing, so the time is the host's): microseconds, and the launches,
    table copies and PyTorch ops counted (:func:`per_call`; the dry run: launches as no-ops under the
    interpreter). Where a step is bound by its host (the 1B shape on an H200), this is what a router costs."""
    r = per_call(mode, HOST_STREAM_LAYERS, "triton", group_size, reps=5 if env.dry else 20, device=env.device)
    return dict(r, ok=r["launches"] == r["table_copies"] > 0)
