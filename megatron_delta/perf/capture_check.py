"""What a replay of the routed step needs (CUDA graphs), checked on the CPU: ``tools/host_work.py --capture-check``.

A captured step replays the kernels the host launched at capture, with the grids, constants and addresses it
passed then, and none of the host's work in between. So a routed step can be captured only where the host's
launches repeat exactly from one iteration to the next, where it copies nothing to the device and never waits
for the device after the first iteration, and (for ``torch.compile``) where the routed stream traces without a
graph break. Per routed mode this module measures, on today's code, the seven figures of :data:`FIELDS`; the
targets (:data:`TARGETS`) are what the step must reach before a capture can replay it.

The stream (:func:`stream_case`): a chunk's routed stream as perf/host_work.py's ``per_call`` builds it (every
router and source operation of the chunk: SourceBuffer over identity sublayers, one [8, 1, 16] micro-batch,
:data:`CAPTURE_LAYERS` layers, forward + backward into the parameters' .grad), in :data:`CASES`: ``plain``
(no null source, no gate); ``null_gate`` (the null source, and the gate where the mode has one: delta,
delta_block); ``recompute`` (every layer recomputed in
backward, its sources handed to it as explicit inputs as core/block.py's full recompute does, through
torch.utils.checkpoint's re-entrant checkpoint, the form of Megatron's tensor_parallel.checkpoint); ``pp2`` (two
pipeline stages cut at layer :data:`CUT`, inside a block in the block modes: the first stage's payload goes to
the second as new leaves, the second's backward runs first and hands the payload's gradients back, one
micro-batch in flight, so the positions repeat from one micro-batch to the next); ``pp2_in_flight`` (the same cut
with two micro-batches in the non-interleaved 1F1B order: the first stage's forward of both, then the second
stage's forward and backward of each, then the first stage's backward of each). Not reachable here: interleaved
chunks with the source cache (Megatron's interleaved schedule), sequence and tensor
parallelism, MoE and MTP.

The figures (per mode; ``iterations`` forward + backward of every case, under Triton's interpreter with the
launches made no-ops, as perf/host_work.py measures host work):

- ``launches_per_step``: ``{"cases": {case: [Triton launches of each iteration]}, "fixed": bool}``, fixed when
  every case launches as many kernels in every iteration.
- ``launch_signatures_differ``: how many launches differ from the launch at the same position of the iteration
  before (iteration i + 1 against i, every pair from the first; a launch without a counterpart counts), summed
  over the cases. A launch's signature (:class:`LaunchRecorder`): the kernel's name, its grid, every argument
  that is not a tensor (scalars and constexprs, by name, the launch options such as num_warps among them), and
  every tensor argument's data_ptr; of an int64 tensor argument (the launch tables of
  triton_router.device_tables: tensor addresses, flags and slots) its entries too. Addresses are the CPU
  allocator's, which, like CUDA's caching allocator, may hand a freed block out again: a tensor made anew each
  iteration may or may not land at its old address, so only addresses fixed by construction hold in every run.
  Which part differed is in the result's ``detail``.
- ``table_copies_after_first``: host-to-device table copies (calls of triton_router.device_tables) after the
  first iteration, summed over the cases.
- ``syncs``: operations after the first iteration that, on a GPU, make the host wait for the device (or are an
  error under capture), summed over the cases (:func:`counting_syncs`): the dispatched ops of :data:`SYNC_OPS`
  (a value read back: ``.item()``, ``bool()``/``int()``/``float()`` of a tensor, a Python branch on one; an
  output whose shape depends on the values: ``nonzero``, ``masked_select``, ``unique``...), ``lift_fresh`` (a
  tensor made from host data, as ``torch.tensor(list)``: on a GPU a copy from pageable memory) outside
  device_tables (whose copy is pinned and non-blocking, and counted as a table copy), a copy between devices,
  and the calls of ``Tensor.tolist``, ``Tensor.numpy`` and ``Tensor.__array__`` (on CPU these dispatch
  nothing). Ops of Triton's interpreter are not counted (its launches are no-ops here).
- ``compile_graph_breaks``: ``torch._dynamo.explain``'s graph breaks over the forward of the ``plain`` and
  ``null_gate`` cases (:data:`COMPILE_LAYERS` layers) on the routers' CPU path (``kernels="auto"``: the C
  kernels on fp32 CPU tensors, what a CPU run takes; the Triton path launches through the interpreter, which is
  no kernel Dynamo can trace), the backward as far as Dynamo speculates each autograd Function's backward while
  tracing the forward (the AOTAutograd backward graph itself is not traced), with Dynamo's recompile limit at 1
  (:func:`graph_breaks`: the break sites met, each once); a tracing error counts as one break.
- ``ops_per_call``: PyTorch ops dispatched per router call of the routed stream on the Triton kernels
  (perf/host_work.per_call's ``torch_ops``, at tools/host_work.py's --stream-layers).
- ``step_host_ratio``: a training step's host time against the baseline's (perf/host_work.step_ratios, at
  tools/host_work.py's --num-layers; this CPU's, moving with its load), None where it was skipped.

Beside the figures, ``full_iteration`` (:func:`full_iteration_replay`) says per mode whether the step is what a
``--cuda-graph-impl full_iteration`` replay needs: launches fixed, no sync, and no launch that differs between
iterations in more than its tensor addresses and table entries (a replay repeats its capture's launches at the
capture's addresses; the launch tables copied during the capture are kept for the graph).

Targets (:data:`TARGETS`): launches fixed, 0 signatures that differ, 0 copies, 0 syncs, 0 breaks, at most 8 ops
per call, a step ratio of at most 1.15 (delta) and 1.10 (delta_block); attnres takes delta_block's, full_attnres
delta's (the block modes' and the fine-grained modes').
"""
from __future__ import annotations

import contextlib
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from megatron_delta.core.modes import ADDITIVE_MODES, BLOCK_MODES

__all__ = ["FIELDS", "TARGETS", "CASES", "RUNS", "LaunchRecorder", "counting_syncs", "graph_breaks",
           "stream_case", "signature_changes", "capture_figures", "full_iteration_replay", "check", "met",
           "format_table", "format_markdown"]

FIELDS = ("launches_per_step", "launch_signatures_differ", "table_copies_after_first", "syncs",
          "compile_graph_breaks", "ops_per_call", "step_host_ratio")
CASES = ("plain", "null_gate", "recompute", "pp2", "pp2_in_flight")
# (label, mode, group size): delta and full_attnres on the group router as tools/host_work.py runs them, delta on
# one router per pass beside it
RUNS = (("attnres", "attnres", 1), ("full_attnres", "full_attnres", "auto"), ("delta", "delta", "auto"),
        ("delta S=1", "delta", 1), ("delta_block", "delta_block", 1))
CAPTURE_LAYERS = 8  # the stream's layers: two per block in the block modes (K = 4)
CUT = 3  # the pp2 cases' first stage: layers 0-2 (inside block 1 in the block modes)
ITERATIONS = 3
COMPILE_LAYERS = 4  # the traced stream's: each break site is met at any depth, and Dynamo's tracing is slow
NUM_BLOCKS = 4  # as perf/gpu_check.NUM_BLOCKS
EPS = 1e-6
SYNC_OPS = ("_local_scalar_dense", "is_nonzero", "equal", "nonzero", "nonzero_static", "masked_select",
            "_unique", "_unique2", "unique_dim", "unique_consecutive", "unique_dim_consecutive", "repeat_interleave",
            "allclose", "_assert_async")
SYNC_METHODS = ("tolist", "numpy", "__array__")
STEP_RATIO_TARGETS = {"delta": 1.15, "full_attnres": 1.15, "delta_block": 1.10, "attnres": 1.10}


def _target_text(mode: str) -> Dict[str, str]:
    return {"launches_per_step": "fixed", "launch_signatures_differ": "0", "table_copies_after_first": "0",
            "syncs": "0", "compile_graph_breaks": "0", "ops_per_call": "<= 8",
            "step_host_ratio": f"<= {STEP_RATIO_TARGETS[mode]:.2f}"}


TARGETS = {label: _target_text(mode) for label, mode, _ in RUNS}


def met(mode: str, field: str, value) -> Optional[bool]:
    """Whether ``value`` of ``field`` meets its target for ``mode`` (None: not measured)."""
    if value is None:
        return None
    if field == "launches_per_step":
        return bool(value["fixed"])
    if field == "ops_per_call":
        return value <= 8
    if field == "step_host_ratio":
        return value <= STEP_RATIO_TARGETS[mode]
    return value == 0


# ------------------------------------------------------------------------------------------ launch signatures
class LaunchRecorder:
    """Records every Triton launch under the interpreter as a signature (kernel, grid, scalars, tensor addresses,
    table entries) without running it, and counts the table copies (triton_router.device_tables); ``mark()``
    starts a new iteration. A context manager (``with LaunchRecorder() as rec``); undone on exit."""

    def __init__(self) -> None:
        self.iterations: List[List[tuple]] = [[]]
        self.copies: List[int] = [0]
        self.busy = False  # the recorder's own reads and device_tables' own ops: not the step's syncs

    def mark(self) -> None:
        self.iterations.append([])
        self.copies.append(0)

    def record(self, name: str, grid, args, kwargs: Dict[str, Any]) -> None:
        self.busy = True
        try:
            self.iterations[-1].append(signature(name, grid, args, kwargs))
        finally:
            self.busy = False

    def __enter__(self) -> "LaunchRecorder":
        from megatron_delta.core import triton_router

        if not triton_router.interpreting():
            raise RuntimeError("the capture check records launches under Triton's interpreter: set TRITON_INTERPRET=1 "
                               "before anything imports Triton (tools/host_work.py does)")
        import triton.runtime.interpreter as interp

        recorder = self
        tables = triton_router.device_tables

        def launch(fn_self, *args, grid, warmup, **kwargs):  # the host's side only: what it passes, no work
            names = getattr(fn_self, "arg_names", [])
            recorder.record(fn_self.fn.__name__, grid, dict(zip(names, args)) if len(names) >= len(args) else args,
                            kwargs)

        def copy(*lists, device):
            recorder.copies[-1] += 1
            recorder.busy = True
            try:
                return tables(*lists, device=device)
            finally:
                recorder.busy = False

        self._undo = contextlib.ExitStack()
        self._undo.enter_context(_patched(interp.InterpretedFunction, "run", launch))
        self._undo.enter_context(_patched(triton_router, "device_tables", copy))
        return self

    def __exit__(self, *exc) -> None:
        self._undo.close()


def _value(v):
    """A launch argument as its signature holds it: a tensor as ("tensor", data_ptr[, int64 entries])."""
    import torch

    if isinstance(v, torch.Tensor):
        entries = tuple(v.reshape(-1).tolist()) if v.dtype == torch.int64 and v.device.type == "cpu" else None
        return ("tensor", v.data_ptr(), entries)
    if isinstance(v, (list, tuple)):
        return tuple(_value(x) for x in v)
    if isinstance(v, (int, float, bool, str)) or v is None:
        return v
    return repr(v)


def signature(name: str, grid, args, kwargs: Dict[str, Any]) -> tuple:
    """(kernel, grid, scalars, tensor addresses, table entries): scalars are (name, value) of every argument that
    is not a tensor, addresses those of the tensor arguments, table entries those of the int64 tensor arguments.
    ``args``: the positional arguments by name (a dict), or a sequence (named by position)."""
    named = args.items() if isinstance(args, dict) else enumerate(args)
    values = [(k, _value(a)) for k, a in named] + [(k, _value(v)) for k, v in sorted(kwargs.items())]
    tensors = [(k, v) for k, v in values if isinstance(v, tuple) and v and v[0] == "tensor"]
    scalars = tuple((k, v) for k, v in values if not (isinstance(v, tuple) and v and v[0] == "tensor"))
    grid = tuple(grid) if isinstance(grid, (list, tuple)) else repr(grid)
    return (name, grid, scalars, tuple((k, v[1]) for k, v in tensors),
            tuple((k, v[2]) for k, v in tensors if v[2] is not None))


SIGNATURE_PARTS = ("kernel", "grid", "scalars", "tensor_addresses", "table_entries")


def signature_changes(iterations: Sequence[Sequence[tuple]]) -> Tuple[int, Dict[str, int]]:
    """Launches of iteration i + 1 that differ from the launch at the same position of iteration i, over every
    pair (one without a counterpart counts), and per part of the signature how many launches differ in it; under
    ``beyond_addresses``, how many differ in more than their tensor addresses and table entries (a kernel, grid or
    scalar: what a full-iteration graph's replay, which repeats its capture's launches at the capture's addresses,
    would do differently from the eager step)."""
    differ, parts = 0, dict.fromkeys(SIGNATURE_PARTS + ("beyond_addresses",), 0)
    for before, after in zip(iterations, iterations[1:]):
        for k in range(max(len(before), len(after))):
            a = before[k] if k < len(before) else None
            b = after[k] if k < len(after) else None
            if a == b:
                continue
            differ += 1
            for i, part in enumerate(SIGNATURE_PARTS):
                if a is None or b is None or a[i] != b[i]:
                    parts[part] += 1
            if a is None or b is None or a[:3] != b[:3]:
                parts["beyond_addresses"] += 1
    return differ, parts


# ------------------------------------------------------------------------------------------ syncs
@contextlib.contextmanager
def counting_syncs(ignore: Callable[[], bool] = lambda: False):
    """Counts (a Counter, by op or method name) what would make the host wait for a GPU (the module docstring's
    ``syncs``) while inside; ``ignore()`` true: not counted (the recorder's own reads, device_tables' copy)."""
    from collections import Counter

    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    counts: Counter = Counter()

    class Syncs(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            name = func.overloadpacket.__name__
            if not ignore():
                if name in SYNC_OPS or name in ("lift_fresh", "lift_fresh_copy"):
                    counts[name] += 1
                elif name in ("_to_copy", "copy_", "to") and _crosses_devices(args, kwargs):
                    counts[name + " (between devices)"] += 1
            return func(*args, **kwargs)

    def wrap(method_name):
        method = getattr(torch.Tensor, method_name)

        def counted(self, *args, **kwargs):
            if not ignore():
                counts["Tensor." + method_name] += 1
            return method(self, *args, **kwargs)

        return _patched(torch.Tensor, method_name, counted)

    with contextlib.ExitStack() as stack:
        for m in SYNC_METHODS:
            stack.enter_context(wrap(m))
        stack.enter_context(Syncs())
        yield counts


def _crosses_devices(args, kwargs) -> bool:
    import torch

    devices = {a.device for a in args if isinstance(a, torch.Tensor)}
    if kwargs.get("device") is not None:
        devices.add(torch.device(kwargs["device"]))
    return len(devices) > 1


# ------------------------------------------------------------------------------------------ the stream
def stream_case(mode: str, case: str, kernels: str = "triton", group_size="auto", layers: int = CAPTURE_LAYERS,
                seq: int = 8, hidden: int = 16, seed: int = 5):
    """``mode``'s routed stream in ``case`` (:data:`CASES`): a function running one forward + backward (the
    module docstring), and ``forward(h0)``, the plain and null_gate cases' forward alone (None for the others)."""
    import torch

    from megatron_delta.core.modes import routed_mode_class
    from megatron_delta.core.router import DepthRouter
    from megatron_delta.core.sources import SourceBuffer, SourcePlan

    if case not in CASES:
        raise ValueError(f"case {case!r} is not one of {', '.join(CASES)}")
    null = case == "null_gate"
    gate = null and mode in ADDITIVE_MODES
    blocks = NUM_BLOCKS if mode in BLOCK_MODES and layers % NUM_BLOCKS == 0 else layers
    plan = SourcePlan(mode, layers, blocks, x_from_sources=routed_mode_class(mode, "exact").sources_sum_to_x
                      and not gate, router_group_size=group_size)
    keys = [*range(2 * layers)] + (["final"] if plan.final_reads() else [])
    g = torch.Generator().manual_seed(seed)
    routers = {}
    for k in keys:
        r = DepthRouter(hidden, null_source=null, gate=gate, eps=EPS, kernels=kernels)
        with torch.no_grad():
            r.query.copy_(0.1 * torch.randn(hidden, generator=g))
            if null:
                r.null_source.copy_(torch.randn(hidden, generator=g))
            if gate:
                r.gate.fill_(0.3)
        routers[k] = r
    h0 = torch.randn(seq, 1, hidden, generator=g).requires_grad_()
    grad = torch.randn(seq, 1, hidden, generator=g)
    h0_second = torch.randn(seq, 1, hidden, generator=g).requires_grad_()  # pp2_in_flight's second micro-batch

    def scope(first, end):
        return {k: routers[k] for k in keys if (k == "final" and end == layers)
                or (k != "final" and first <= k // 2 < end)}

    def layers_of(buf, first, end):
        for j in range(2 * first, 2 * end):
            buf.commit(j, buf.routed_input(j, routers[j]))  # identity sublayers: v_j = u_j

    def forward(x):
        buf = SourceBuffer.start(plan, x, EPS, readers=scope(0, layers))
        layers_of(buf, 0, layers)
        return buf.output(routers.get("final"))

    def grads(out):  # into .grad, as a training step's backward (the re-entrant checkpoint takes no inputs=)
        out.backward(grad)

    if case in ("plain", "null_gate"):
        return (lambda: grads(forward(h0))), forward, h0

    if case == "recompute":
        from torch.utils.checkpoint import checkpoint

        def run_layer(i):
            def fn(*ts):
                buf = SourceBuffer.from_tensors(plan, i, list(ts), EPS, readers=scope(i, i + 1))
                layers_of(buf, i, i + 1)
                return tuple(buf.to_tensors())
            return fn

        def call():
            tensors = [h0]
            for i in range(layers):
                tensors = list(checkpoint(run_layer(i), *tensors, use_reentrant=True))
            buf = SourceBuffer.from_tensors(plan, layers, tensors, EPS, readers=scope(layers, layers))
            return grads(buf.output(routers.get("final")))

        return call, None, h0

    def first_stage(x):  # its payload, and the second stage's leaves of it
        first = SourceBuffer.start(plan, x, EPS, readers=scope(0, CUT))
        layers_of(first, 0, CUT)
        sent = first.to_tensors()
        return sent, [t.detach().requires_grad_() for t in sent]

    def second_stage(received):
        second = SourceBuffer.from_tensors(plan, CUT, received, EPS, readers=scope(CUT, layers))
        layers_of(second, CUT, layers)
        second.output(routers.get("final")).backward(grad)

    def first_stage_backward(sent, received):
        pairs = [(t, r.grad) for t, r in zip(sent, received) if r.grad is not None]
        torch.autograd.backward([t for t, _ in pairs], [gr for _, gr in pairs])

    def call():  # pp2
        sent, received = first_stage(h0)
        second_stage(received)
        first_stage_backward(sent, received)

    def call_in_flight():  # pp2_in_flight: 1F1B over two micro-batches
        first = [first_stage(h0), first_stage(h0_second)]
        for _, received in first:
            second_stage(received)
        for sent, received in first:
            first_stage_backward(sent, received)

    return (call if case == "pp2" else call_in_flight), None, h0


# ------------------------------------------------------------------------------------------ graph breaks
def graph_breaks(fn: Callable, *args) -> int:
    """Dynamo's graph breaks tracing ``fn(*args)`` (torch._dynamo.explain, nothing compiled), with Dynamo's
    recompile limit at 1 meanwhile: each function is traced once, so a break is counted once where it is met
    (the break sites of the stream, not one per router call); a tracing error counts as one break."""
    import logging
    import warnings

    import torch

    torch._dynamo.reset()
    limit = torch._dynamo.config.recompile_limit
    level = logging.getLogger("torch._dynamo").level
    torch._dynamo.config.recompile_limit = 1  # each function traced once: a break counted once per site
    logging.getLogger("torch._dynamo").setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return int(torch._dynamo.explain(fn)(*args).graph_break_count)
    except Exception:  # noqa: BLE001 - an untraceable stream: one break (the whole stream runs eagerly)
        return 1
    finally:
        torch._dynamo.config.recompile_limit = limit
        logging.getLogger("torch._dynamo").setLevel(level)
        torch._dynamo.reset()


# ------------------------------------------------------------------------------------------ the figures
def capture_figures(mode: str, group_size, iterations: int = ITERATIONS, layers: int = CAPTURE_LAYERS,
                    compile_layers: Optional[int] = COMPILE_LAYERS) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """The capture figures of ``mode`` (all of FIELDS but ops_per_call and step_host_ratio) over :data:`CASES`,
    and their detail per case (launches, signature parts that differ, copies and syncs by name).
    ``compile_layers`` None: graph breaks not traced (``compile_graph_breaks`` None)."""

    if iterations < 2:
        raise ValueError(f"iterations {iterations}: at least 2 (each compared with the one before)")
    launches, detail = {}, {}
    differ = copies = syncs = 0
    for case in CASES:
        call, _, _ = stream_case(mode, case, "triton", group_size, layers)
        with LaunchRecorder() as rec:
            call()
            with counting_syncs(lambda: rec.busy) as counted:
                for _ in range(iterations - 1):
                    rec.mark()
                    call()
        n, parts = signature_changes(rec.iterations)
        launches[case] = [len(it) for it in rec.iterations]
        differ += n
        copies += sum(rec.copies[1:])
        syncs += sum(counted.values())
        detail[case] = dict(launches=launches[case], signatures_differ=n, differ_in=parts,
                            table_copies=rec.copies, syncs=dict(counted))
    breaks = None if compile_layers is None else 0
    for case in ("plain", "null_gate") if compile_layers is not None else ():
        _, forward, h0 = stream_case(mode, case, "auto", group_size, compile_layers)
        b = graph_breaks(forward, h0)
        detail[case]["compile_graph_breaks"] = b
        breaks += b
    fixed = all(len(set(v)) == 1 for v in launches.values())
    figures = dict(launches_per_step=dict(cases=launches, fixed=fixed), launch_signatures_differ=differ,
                   table_copies_after_first=copies, syncs=syncs, compile_graph_breaks=breaks)
    return figures, detail


def full_iteration_replay(figures: Dict[str, Any], detail: Dict[str, Any]) -> Dict[str, Any]:
    """What a full-iteration graph (--cuda-graph-impl full_iteration) needs of the routed step, from one mode's
    figures and detail: the same number of launches in every iteration, no synchronisation, and launches that
    differ from one iteration to the next in nothing but their tensor addresses and table entries (a replay
    repeats the capture's launches at the capture's addresses, with the tables copied during the capture).
    ``ready`` when all three hold."""
    beyond = sum(d["differ_in"]["beyond_addresses"] for d in detail.values())
    fixed = bool(figures["launches_per_step"]["fixed"])
    return dict(launches_fixed=fixed, syncs=figures["syncs"], differ_beyond_addresses=beyond,
                ready=fixed and figures["syncs"] == 0 and beyond == 0)


def check(runs=RUNS, *, iterations: int = ITERATIONS, layers: int = CAPTURE_LAYERS, stream_layers: int = 12,
          step: Optional[Callable[[List[tuple]], Dict[tuple, float]]] = None, progress=print) -> Dict[str, Any]:
    """Every run's figures: ``{"modes": {label: {FIELDS}}, "targets": ..., "met": ..., "detail": ...,
    "seconds": ...}``. ``step(runs)``: the step host ratio of each (mode, group size), or None (skipped)."""
    from megatron_delta.perf import host_work

    t0 = time.perf_counter()
    modes, detail, replay = {}, {}, {}
    for label, mode, group in runs:
        figures, detail[label] = capture_figures(mode, group, iterations, layers)
        replay[label] = full_iteration_replay(figures, detail[label])
        figures["ops_per_call"] = round(host_work.per_call(mode, stream_layers, "triton", group, reps=1)["torch_ops"],
                                        2)
        figures["step_host_ratio"] = None
        modes[label] = {f: figures[f] for f in FIELDS}
        progress(f"  {label}: measured", flush=True)
    if step is not None:
        ratios = step([(mode, group) for _, mode, group in runs])
        for label, mode, group in runs:
            modes[label]["step_host_ratio"] = round(ratios[mode, group], 3)
    mode_of = {label: mode for label, mode, _ in runs}
    return dict(modes=modes, targets={label: TARGETS[label] for label in modes},
                met={label: {f: met(mode_of[label], f, v[f]) for f in FIELDS} for label, v in modes.items()},
                full_iteration=replay, detail=detail, seconds=round(time.perf_counter() - t0, 1))


def _value_text(field: str, value) -> str:
    """One figure as the tables print it: launches as fixed/varies with the distinct per-iteration counts."""
    if field == "launches_per_step":
        counts = sorted({n for ns in value["cases"].values() for n in ns})
        return f"{'fixed' if value['fixed'] else 'varies'} ({'/'.join(map(str, counts))})"
    return "skipped" if value is None else str(value)


def format_table(result: Dict[str, Any]) -> str:
    """The readable table: per mode each figure, its target and whether it is met."""
    lines = [f"  {'mode':13s} {'field':25s} {'value':>24s}  {'target':>8s}  met"]
    for label, figures in result["modes"].items():
        for f in FIELDS:
            ok = result["met"][label][f]
            lines.append(f"  {label:13s} {f:25s} {_value_text(f, figures[f]):>24s}  {result['targets'][label][f]:>8s}  "
                         f"{'-' if ok is None else 'yes' if ok else 'NO'}")
        replay = result.get("full_iteration", {}).get(label)
        if replay is not None:
            lines.append(f"  {label:13s} {'full_iteration replay':25s} "
                         f"{replay['differ_beyond_addresses']:>14d} beyond addr  {'0':>8s}  "
                         f"{'yes' if replay['ready'] else 'NO'}")
    return "\n".join(lines)


def format_markdown(result: Dict[str, Any]) -> str:
    """The same figures as a Markdown table for docs (--format markdown): a row per mode, a column per figure, each
    cell the value and, against its target, "yes" or "NO" (nothing where the figure was not measured), then the
    full_iteration replay verdict where the result has one; the targets in a row of their own per distinct set."""
    replay = result.get("full_iteration")
    lines = ["| mode | " + " | ".join(f"`{f}`" for f in FIELDS) + (" | `full_iteration` replay" if replay else "")
             + " |", "|---" * (len(FIELDS) + 1 + bool(replay)) + "|"]
    targets = []
    for label, figures in result["modes"].items():
        cells = []
        for f in FIELDS:
            ok = result["met"][label][f]
            cells.append(_value_text(f, figures[f]) + ("" if ok is None else ": yes" if ok else ": NO"))
        if replay:
            r = replay[label]
            cells.append("ready" if r["ready"] else f"NO ({r['differ_beyond_addresses']} beyond addresses)")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
        row = tuple(result["targets"][label][f] for f in FIELDS) + (("ready",) if replay else ())
        if row not in [t for t, _ in targets]:
            targets.append((row, []))
        next(labels for t, labels in targets if t == row).append(label)
    for row, labels in targets:
        lines.append(f"| target ({', '.join(labels)}) | " + " | ".join(row) + " |")
    return "\n".join(lines)


@contextlib.contextmanager
def _patched(owner, name: str, value):
    """``owner.name = value`` (a class or module) while inside; an inherited attribute is shadowed, then unshadowed."""
    own = name in vars(owner)
    old = vars(owner).get(name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        if own:
            setattr(owner, name, old)
        else:
            delattr(owner, name)
