"""The router's memory traffic per training step, in closed form, and its share of a step on a GPU.

step_traffic() counts, per kernel and phase, the bytes every pass of the routed residual stream moves for one
micro-batch: each router call (router.py's PyTorch path, the C kernels of cpu_kernels.py, fla-core's
fused_attnres around fla_router.py, the Triton kernels of triton_router.py with their block passes over the
completed block sources' gradients), the group router's passes (delta and full_attnres on torch / c / triton,
group_router.py), each shared source projection, the sublayers' partial sums
(delta_block's P + v, the replacement modes' p + v: a PyTorch add, or formed in the Triton pass of their one
reader), authors-code delta_block's differences x - A<b-1>, the residual adds x + v, the sum that hands x out
(delta in a scope of grouped routers: one pass on c / triton, whose gradient seeds the group passes' sinks
instead of an autograd addition per source), the null source, and autograd's own additions of gradient
contributions (a tensor read by several autograd nodes). Unit: "u", one [tokens, hidden] tensor in the activation
dtype read or written once (an fp32 tensor of that size is 4 / a u).
The same quantities are counted from the real tensors by megatron_delta.core.traffic (tests/unit/test_traffic.py
holds the two equal for every mode x backend, with and without recompute; tests/helpers/triton_cases.py for triton,
under Triton's interpreter).

The structure (which router reads which source, which are projected once for several readers, what each
commit adds) is the modes' own: a symbolic SourceBuffer (_Ledger) runs modes.RoutedMode's rules over
stand-in tensors; the cost of each pass is the closed form below (_route_pass, _PROJECT, ...).

router_share() prices one step's traffic at HBM speed against the layers' GEMM FLOPs (layer_gemm_flops) at
datasheet peaks (GPUS) derated by GEMM_EFFICIENCY and HBM_EFFICIENCY, and predicts the tokens/s ratio to the
baseline; tools/memory_plan.py --router-share prints it and tools/gpu_check.py sets it beside its
measurement. No model is built and nothing here imports torch at import time.
"""
from collections import defaultdict

from megatron_delta.core.modes import ADDITIVE_MODES, BASELINE, BLOCK_MODES, REPLACEMENT_MODES
from megatron_delta.perf.shapes import SHAPES

GPUS = {  # name: (HBM bytes/s, dense bf16 FLOP/s) - datasheet peaks of the SXM parts
    "H100": (3.35e12, 989e12),  # NVIDIA H100 Tensor Core GPU datasheet (SXM5): 3.35 TB/s HBM3, 989 TFLOPS BF16 dense
    "H200": (4.8e12, 989e12),   # NVIDIA H200 Tensor Core GPU datasheet (SXM): 4.8 TB/s HBM3e, same Hopper core
    "B200": (8.0e12, 2250e12),  # NVIDIA HGX B200 datasheet (1000 W): 8 TB/s HBM3e, 2.25 PFLOPS BF16 dense (4.5 sparse)
}
SMS = {"H100": 132, "H200": 132, "B200": 148}  # streaming multiprocessors (the same datasheets)
GEMM_EFFICIENCY = 0.75  # fraction of peak FLOP/s Megatron's GEMMs reach at these shapes (H200: ~790 of 989)
HBM_EFFICIENCY = 0.85   # fraction of peak bandwidth a streaming elementwise pass reaches
BACKENDS = ("torch", "c", "fla", "triton")  # router backends the closed form knows (--delta-router-kernels)
GPU_BACKENDS = ("torch", "fla", "triton")  # those that run on a GPU (the C kernels are CPU-only, fp32)
GROUP_BACKENDS = ("torch", "c", "triton")  # routers the group router (--delta-router-group-size auto) groups
COMPUTE_BYTES = 4  # the routers' math is fp32 whatever the activation dtype


# ------------------------------------------------------------------------------------------- one pass each
def _conv(a, c):
    """A dtype conversion of one [T, d] tensor (router._as): read a, write c - nothing when they agree."""
    return a + c if a != c else 0


def _route_pass(backend, a, c, kinds, base, null, gate_on, grad, formed=False):
    """Bytes per [T, d] element of one router call (DepthRouter.forward) of ``backend`` over sources of
    ``kinds`` ('local': projected in this pass; 'fresh' / 'accumulate': projected once for several readers,
    this router's backward writes / adds into the source's gradient sink), a base x or not, the null source,
    the gate, ``formed``: the last source is a partial sum this call forms (triton): {(kernel, phase): bytes}.
    a: activation bytes, c: compute bytes (4)."""
    n = len(kinds)
    loc = kinds.count("local")
    fresh, acc = kinds.count("fresh"), kinds.count("accumulate")
    cv = _conv(a, c)
    out = defaultdict(float)
    if backend == "torch":  # router._RouteFunction, PyTorch ops: every eager op is a pass
        # local: fp32 copy, norm and logit (2 reads); weighted sum from an fp32 accumulator: the first
        # source into it (with the base x: base converted, read with v0), each further source a + 2c
        # (read acc and v, write acc), the null source 2c, then one cast to the activation dtype
        out["route", "forward"] = (loc * (cv + 2 * c) + ((cv + 2 * c + a) if base else (a + c))
                                   + (n - 1) * (a + 2 * c) + 2 * c * null + cv)
        if grad:
            # grad to fp32; per source a row-wise dot (product into a buffer: a + 2c, its row sums: c);
            # the null source's dot and its gradient (2c); a sink's first write (mul + cast) or its add
            # (read sink and grad, write sink); a local source's whole gradient (mul, + c q, + e v with
            # its fp32 copy, cast: 8c + 2 conv) and its query-gradient share (copy, mv: c + conv)
            out["route", "backward"] = (cv + n * (a + 3 * c) + 2 * c * null + fresh * (2 * c + cv)
                                        + acc * (2 * a + c) + loc * (8 * c + 3 * cv))
    elif backend == "c":  # csrc/router_kernels.c: one loop over the token rows each way (fp32 only)
        if a != c:
            raise ValueError("the C kernels take fp32 tensors only (act_bytes=4)")
        out["route", "forward"] = n * a + a * bool(base) + a  # sources and base read once, u written
        if grad:
            # grad and each source read once; each gradient target written (fresh, local) or read and
            # written (a sink some later reader already wrote); the null source's gradient (torch.mv)
            out["route", "backward"] = a + n * a + (fresh + loc) * a + acc * 2 * a + a * null
    elif backend == "fla":  # fla_router.route around fused_attnres (_record_fused_attnres)
        m = n + null
        out["fla", "forward"] = m * a + a
        out["fla_null", "forward"] = a * null  # z broadcast to every token: one more residual
        if grad:
            out["fla", "backward"] = a + 3 * m * a + 2 * c  # do, residuals twice, a dv each, dqw fp32 w + r
            out["fla_null", "backward"] = a * null  # its per-token gradient summed
        if base and not gate_on:
            out["fla_combine", "forward"] = 3 * a  # u = x + r
        elif base:
            # _Combine: r * gate into fp32, + x, cast; backward: grad to fp32, * gate, cast, and the gate's
            # gradient <grad, r> with r in fp32
            out["fla_combine", "forward"] = (a + c) + (2 * c + a) + cv
            if grad:
                out["fla_combine", "backward"] = cv + 2 * c + cv + cv + 2 * c
    elif backend == "triton":  # triton_router._TritonRoute: its kernels' traffic per call (call_rows)
        from megatron_delta.core.triton_router import KERNEL, call_rows

        # every source gets its gradient (written; added in place where an earlier reader's is in the buffer),
        # except those deferred to their block's pass (kinds 'deferred': read once, for the dot products only);
        # the formed partial's own gradient, read where it has later readers, is added in _Ledger.settle
        rows = call_rows(n, has_base=bool(base), grads=n - kinds.count("deferred"), accumulated=acc,
                         forms_partial=formed, partial_grad=False)
        out[KERNEL, "forward"] = a * rows["forward"]
        if grad:
            out[KERNEL, "backward"] = a * rows["backward"]
    else:
        raise ValueError(f"router backend {backend!r}: one of {', '.join(BACKENDS)}")
    return out


def _group_old_pass_torch(a, c, n, s, unit, null, first_u=False):
    """group_router._OldPass on PyTorch ops over n older sources for S = s routers (each with a gradient), the
    sources' gradient sinks aside (_Ledger.settle_groups). Forward: per source an fp32 copy, its norm and its
    GEMM (2 reads); per router r_k = the first source times its weight (a + c), each further one added in
    (a + 2c), the null source (2c); X (unit, in the sources' dtype): a copy and an add per further source.
    Backward: the G_k to fp32;
    per source an fp32 copy, per router <G_k, s_i> (product: 3c, row sums: c); the null source's <G_k, z_k> and
    its value gradient (c each); the sum of the G_k (unit); per source again an fp32 copy, dq (c), its gradient
    (GEMM write, + e s_i: 4c), + each G_k (3c), + the sum of the G_k (3c). ``first_u``: the first router's u,
    r_0 + X (unit: 2c + a) cast to the activation dtype."""
    cv = _conv(a, c)
    chain = (a + c) + (n - 1) * (a + 2 * c)  # a sum over the n sources into an fp32 accumulator
    forward = (n * (cv + 2 * c) + s * (chain + 2 * c * null) + unit * (2 * a + (n - 1) * 3 * a)
               + first_u * (unit * (2 * c + a) + cv))
    backward = (s * cv + n * (cv + 4 * c * s) + 2 * null * s * c + unit * (2 * c + (s - 1) * 3 * c)
                + n * (cv + c + 4 * c + 3 * c * s + 3 * c * unit))
    return {("group_old_pass", "forward"): forward, ("group_old_pass", "backward"): backward}


def _group_merge_torch(a, c, k, base, unit):
    """group_router._Merge on PyTorch ops for a router with k in-group sources (each needing its gradient), the
    sinks aside. Forward: per source an fp32 copy, its norm and logit (2 reads); beta r_k (2c), + x (2c + a),
    + X (2c + a), + each source (2c + a), u cast to the activation dtype. Backward: the gradient to fp32; <G, r_k>
    and <G, v_i> (product and row sums: 4c, 3c + a); per source an fp32 copy, dq (c) and its gradient (G times
    its weight 2c, + c q 2c, + e v 3c)."""
    cv = _conv(a, c)
    forward = k * (cv + 2 * c) + 2 * c + base * (2 * c + a) + unit * (2 * c + a) + k * (2 * c + a) + cv
    backward = cv + 4 * c + k * (3 * c + a) + k * (cv + c + 7 * c)
    return {("group_merge", "forward"): forward, ("group_merge", "backward"): backward}


def _project_pass(a, c, grad):
    """router._ProjectSource (a source read by several routers, projected once for all of them): fp32 copy,
    norm and GEMM (2 reads); backward: copy, the gradient from the sink (mm, + e v, added into the sink: 5c,
    + 2a where the sink is not fp32), the query GEMM (c)."""
    cv = _conv(a, c)
    out = {("project", "forward"): cv + 2 * c}
    if grad:
        out["project", "backward"] = cv + (5 * c + 2 * a if a != c else 5 * c) + c
    return out


# ------------------------------------------------------------------------------------------- the structure
class _Tensor:
    """A stand-in [T, d] activation tensor: counts the autograd nodes that will read it (its gradient
    contributions). ``+`` is a mode's partial sum (modes.py: P + v, p + v)."""

    __slots__ = ("ledger", "readers")

    def __init__(self, ledger):
        self.ledger, self.readers = ledger, 0
        ledger.tensors.append(self)

    def __add__(self, other):
        return self.ledger.elementwise("partial_sum", self, other)


class _Router:
    def __init__(self, key):
        self.key = key


class _Ledger:
    """One buffer's worth of SourceBuffer over stand-in tensors (the interface modes.RoutedMode acts on),
    adding each pass's bytes to ``totals``. ``grad``: this pass builds a graph (backward costs and autograd
    adds), else it is the no-grad first forward of a recomputed chunk."""

    def __init__(self, plan, scope, totals, tensors, backend, a, c, null, gate, grad):
        self.plan, self.scope, self.totals, self.tensors = plan, set(scope), totals, tensors
        self.backend, self.a, self.c, self.null, self.gate, self.grad = backend, a, c, null, gate, grad
        self.entries = {}  # name -> [tensor, projection]; projection: None, "local" or [readers seen]
        self._x = None
        self.group_size = None  # the group router's S or groups' sizes here (core/group_router.py), once resolved
        self.spans = None  # sublayer -> [a, b) of its group (group_plan.group_spans)
        self._group = None  # the number of sources older than the group routing now
        self._defers = None  # group start -> it defers to the previous group (group_plan.deferring_groups)
        self._touches = {}  # a source the groups read -> the passes whose backward update its gradient, in order
        self._seeded = set()  # sources of _touches whose sink x's gradient seeds (group_router._FinalSum)
        self._formed = []  # partial sums a Triton kernel formed in its pass (their gradient is read if read later)
        self.defer_blocks = True  # triton: the completed sources' gradients deferred to one pass per block
        self._blocks = {}  # block -> ids of the sink entries its pass writes (empty: not deferred)
        self._sink_writers = {}  # id(sink entry) -> (kernel, call) writing its gradient, in forward order
        self._kernel_seeded = set()  # id(sink entry) whose KernelSink x's gradient seeds (_SeededSum)
        self.reductions = []  # triton: (S, [hidden]-wide rows per router) of each backward's partial sums

    def reduce(self, s, rows):
        """A Triton backward call that sums gradients over the tokens through per-program partials
        (triton_router.reducing_programs): ``s`` routers in its tile, ``rows`` fp32 [hidden] rows per router
        (padded, as the tile, to a power of two of routers: reduction_bytes)."""
        if self.grad and self.backend == "triton":
            self.reductions.append((s, rows))

    def new(self):
        return _Tensor(self)

    def add(self, parts):
        for key, v in parts.items():
            if key[1] == "forward" or self.grad:
                self.totals[key] += v

    def read(self, *tensors):
        if self.grad:
            for t in tensors:
                t.readers += 1

    def elementwise(self, kernel, x, y):
        self.add({(kernel, "forward"): 3 * self.a})
        self.read(x, y)
        return self.new()

    # the buffer interface (sources.SourceBuffer)
    def hold(self, name, value):
        if name == "x":
            self._x = value
        else:
            self.entries[name] = [value, None, None]

    def hold_sum(self, name, partial, v):
        """SourceBuffer.hold_sum: partial + v, pending until its one reader's Triton kernel forms it in its pass or
        its value is needed (router.PendingSum.form, a PyTorch add)."""
        if partial is None:
            self.hold(name, v)
        else:
            self.entries[name] = [None, None, (partial, v)]

    def hold_difference(self, name, minuend, subtrahend):
        """SourceBuffer.hold_difference: minuend - subtrahend, a PyTorch subtraction."""
        self.hold(name, self.elementwise("source_difference", minuend, subtrahend))

    def _value(self, entry):
        if entry[0] is None:
            entry[0], entry[2] = self.elementwise("partial_sum", *entry[2]), None
        return entry[0]

    def take(self, name):
        e = self.entries.pop(name, None)
        return None if e is None else self._value(e)

    def value(self, name):
        return self.x if name == "x" else self._value(self.entries[name])

    def rename(self, old, new):
        self.entries[new] = self.entries.pop(old)

    @property
    def held_x(self):
        return self._x

    @property
    def x(self):
        if self._x is None and self.plan.x_from_sources and self.entries:
            values = [self._value(e) for e in self.entries.values()]
            if len(values) == 1:
                return values[0]
            # group_router._FinalSum: the last group's X (the sum of the sources its old pass read) and the later
            # sources; without groups, every source
            later = len(values) - self._group if self.group_size not in (None, 1) and self._group else None
            terms = len(values) if later is None or later < 1 else 1 + later
            # the Triton kernels' sinks (several readers; no groups): one pass, x's gradient seeds the sinks
            kernel_sinks = [] if self.group_size not in (None, 1) or self.backend != "triton" else [
                e for e in self.entries.values() if isinstance(e[1], list)]
            for e in kernel_sinks:
                self._kernel_seeded.add(id(e))
            if kernel_sinks or (self.group_size not in (None, 1) and self.backend != "torch"):
                # on the C / Triton kernels: each term read once, x written once
                self.add({("x_sum", "forward"): (terms + 1) * self.a})
            else:  # the first two terms added, then one in-place add per further term: each term read once
                self.add({("x_sum", "forward"): 3 * self.a * (terms - 1)})
            seeded = {id(e[0]) for e in kernel_sinks}
            for v in values:
                if id(v) in seeded:
                    continue  # its sink token is its one autograd reader (counted where the sink was made)
                if self.group_size not in (None, 1) and v in self._touches:
                    # the groups' scope: x's gradient seeds the source's sink (no autograd reader, no add); its
                    # first group pass in backward reads the seed as it writes the sink (settle_groups)
                    self._seeded.add(v)
                else:
                    self.read(v)
            return self.new()
        return self._x

    def add_to_x(self, v):
        self._x = self.elementwise("x_add", self._x, v)

    def route(self, key, router, *, base, apply_gate, base_sums):
        if self._grouped(key, base is None and not (apply_gate and self.gate)):
            return self._group_route(key, base, base_sums, apply_gate)
        names = self.plan.final_reads() if key == "final" else self.plan.reads(key)
        if not names:  # authors-code's first router (DepthRouter._no_sources): x + a vector broadcast to every
            # token (reads x, writes u); backward reads u's gradient once, summing it into the vector
            if base is None:
                return self.new()
            self.read(base)
            self.add({("route", "forward"): 2 * self.a, ("route", "backward"): self.a})
            return self.new()
        kinds = []
        formed = False
        sinks = []  # the entries of this router's sources with a KernelSink (triton)
        for name in names:
            entry = self.entries[name]
            if self.backend == "triton":
                readers = [k for k in self.plan.value_readers(name, key) if k in self.scope]
                if entry[0] is None and len(readers) == 1 and name == names[-1]:
                    formed = True  # its one reader's kernel reads both parts and writes the sum (SourceBuffer._source)
                    self.read(*entry[2])
                    entry[0], entry[2] = self.new(), None
                    self._formed.append(entry[0])
                    kinds.append("local")
                    continue
                self._value(entry)
                if entry[1] is None:  # one reader: its kernel's own; several: a KernelSink (one token reads it)
                    entry[1] = "local" if len(readers) <= 1 else []
                    if entry[1] == []:
                        self.read(entry[0])
                if entry[1] != "local":
                    sinks.append(entry)
                    continue
            self._value(entry)
            if entry[1] is None:  # projected at its first read, for its readers in scope (SourceBuffer._source)
                readers = [k for k in self.plan.value_readers(name, key) if k in self.scope]
                if len(readers) <= 1 or self.backend == "fla":
                    entry[1] = "local"
                else:
                    entry[1] = []
                    self.add(_project_pass(self.a, self.c, self.grad))
                    self.read(entry[0])
            if entry[1] == "local":
                kinds.append("local")
                self.read(entry[0])
            else:
                kinds.append("accumulate" if entry[1] else "fresh")
                entry[1].append(key)
        if sinks:
            kinds += self._sink_kinds(key, sinks)
        unit = base_sums and base is None
        if unit and self.backend == "fla":
            raise ValueError("fla keeps x as a stream (fla_router.plan_keeps_x): no router forms it from its sources")
        if base is not None:
            self.read(base)
        self.add(_route_pass(self.backend, self.a, self.c, kinds, base is not None, self.null,
                             apply_gate and self.gate, self.grad, formed))
        self.reduce(1, 1 + int(self.null))  # the query's (and the null value's) gradient
        return self.new()

    # the Triton kernels' sinks and their block passes (triton_router.BlockDeferral, SourceBuffer._deferral)
    def _sink_kinds(self, key, sinks):
        """The kinds of this router's KernelSink sources ('fresh': its backward writes the gradient, or adds it in
        place where an earlier writer's is in the buffer - counted in settle_groups; 'deferred': its block's pass
        does), and the block's pass, at the block's first router in this scope."""
        from megatron_delta.core.group_plan import block_defers
        from megatron_delta.core.triton_router import DEFERRED_KERNEL

        group = None
        if key != "final" and self.plan.blocked and self.defer_blocks:
            b = self.plan.block_of(key)
            if b not in self._blocks:
                routers = sum(1 for k in self.scope if isinstance(k, int) and self.plan.block_of(k) == b)
                ids = [id(e) for e in sinks]
                self._blocks[b] = set(ids) if block_defers(routers, len(ids)) else set()
                if self._blocks[b]:  # backward: each router's output gradient, each source once, its gradient
                    self.add({(DEFERRED_KERNEL, "backward"): (routers + 2 * len(ids)) * self.a})
                    for e in sinks:
                        self._sink_touch(e, DEFERRED_KERNEL, ("block", b))
            group = self._blocks[b]
        kinds = []
        for e in sinks:
            if group and id(e) in group:
                kinds.append("deferred")
            else:
                kinds.append("fresh")
                self._sink_touch(e, "triton_route")
        return kinds

    def _sink_touch(self, entry, kernel, call=None):
        if self.grad:
            self._sink_writers.setdefault(id(entry), []).append((kernel, call))

    # the group router (group_router.GroupRouting): delta / full_attnres with S > 1
    def _grouped(self, key, first_u=True):
        from megatron_delta.core import group_plan

        if not self.plan.groups_routers or key == "final" or self.backend not in GROUP_BACKENDS:
            return False  # fla: S = 1 (its kernel routes one router per call)
        if self.group_size is None:
            subs = sorted(k for k in self.scope if isinstance(k, int))
            # as group_router.GroupRouting.resolve: fla is ruled out above, torch has no fused passes
            self.group_size = group_plan.resolve_sizes(self.plan.router_group_size, len(subs),
                                                       len(self.plan.reads(subs[0])), one_router_per_call=False,
                                                       fused_passes=self.backend != "torch", first_u=first_u)
            self.spans = group_plan.group_spans(subs, self.group_size)
        return self.group_size != 1

    def _touch(self, t, kernel, call):
        """Source ``t`` read by group pass ``call`` (one kernel call) of ``kernel``: its gradient written there."""
        if self.grad:
            if t not in self._touches:
                self.read(t)  # one autograd reader per source the scope's groups read (its _Collect alias)
            self._touches.setdefault(t, []).append((kernel, call))

    def _group_route(self, key, base, base_sums, apply_gate):
        """One router of a group: at the group's first router the pass over the older sources, then this
        router's merge (module docstring of group_router.py). The C and Triton kernels: the old pass reads each
        older source once, writes S fp32 partial mixes r_k and, with x as the sources, their sum X in the sources'
        dtype (backward
        reads them and the S output gradients G_k); the merge reads r_k, X or x, its k in-group sources and
        writes u (backward reads its gradient, r_k and the k sources). The C kernels read G_k and write u in
        fp32, the Triton kernels in the activation dtype. The PyTorch ops: each op a pass
        (_group_old_pass_torch, _group_merge_torch). The null source's value gradient reads each G_k once more
        (torch.mv) on torch and c; the Triton old pass sums it per program. The sources' gradients are counted
        per pass in settle_groups. A group's first router without a gate or a base takes its u from the old pass (in
        place of r_0; _OldPass's first_u): no merge runs for it."""
        a_, b_ = self.spans[key]
        s = b_ - a_
        unit = base_sums and base is None
        first_u = base is None and not (apply_gate and self.gate)
        A, C = self.a, self.c
        U = A if self.backend == "triton" else C  # G_k read and u written: activation dtype or fp32
        values = [self.entries[n][0] for n in self.plan.reads(key)]
        if key == a_:
            n_prev, self._group = self._group, len(values)
            n = len(values)
            deferred = 0  # the previous group's older sources, whose shares this group defers to it (OldShare)
            if self.backend == "torch":
                self.add(_group_old_pass_torch(A, C, n, s, unit, self.null, first_u))
            else:
                null_reads = self.null * s * C if self.backend == "c" else 0
                self.add({("group_old_pass", "forward"): n * A + (s - first_u) * C + first_u * U + unit * A,
                          ("group_old_pass", "backward"): n * A + s * U + null_reads})
                if self._defers_to_previous(a_, unit):
                    deferred = n_prev  # the previous group's pass reads this group's s G_k again
                    self.add({("group_old_pass", "backward"): s * U})
            self.reduce(s, 1 + int(self.null))  # the S queries' (and null values') gradients
            for v in values[deferred:]:
                self._touch(v, "group_old_pass", ("old", a_))
            if first_u:
                return self.new()
        inside = values[self._group:]
        if base is not None:
            self.read(base)
        if self.backend == "torch":
            self.add(_group_merge_torch(A, C, len(inside), base is not None, unit))
            written = inside
        else:  # the kernels write the newest in-group source's gradient only, with the later merges' shares
            later = b_ - 1 - key if inside else 0  # (their output gradients read again: group_router._Merge)
            self.add({("group_merge", "forward"): C + unit * A + (A if base is not None else 0) + len(inside) * A + U,
                      ("group_merge", "backward"): A + C + len(inside) * A + later * U})
            written = inside[-1:]
        self.reduce(1, 1)  # the query's gradient
        for v in written:
            self._touch(v, "group_merge", ("merge", key))
        return self.new()

    def _defers_to_previous(self, a, unit):
        """group_router.GroupRouting._deferring: the group starting at sublayer ``a`` defers to the one before."""
        from megatron_delta.core import group_plan

        if self._defers is None:
            first = min(self.spans)
            self._defers = group_plan.deferring_starts(self.spans, len(self.plan.reads(first)), unit)
        return self._defers.get(a, False)

    def settle_groups(self):
        """Each source's gradient in the group passes: written by the first pass to reach it in backward (its last
        reader in forward order), read and written by every other one (in place into its sink)."""
        # PyTorch ops: the first gradient becomes the sink (cast to the source's dtype where it differs); every
        # later one is added into it (reads the sink and the fp32 gradient, writes the sink)
        first, later = ((_conv(self.c, self.a), 2 * self.a + self.c) if self.backend == "torch"
                        else (self.a, 2 * self.a))
        seed_reads = {}  # a kernel call that adds the seed to sinks it writes first -> its kernel
        for t, passes in self._touches.items():
            for i, (kernel, call) in enumerate(passes):
                if i < len(passes) - 1:
                    self.totals[kernel, "backward"] += later
                elif t not in self._seeded:
                    self.totals[kernel, "backward"] += first
                elif self.backend == "torch":  # one add per sink: the seed and the gradient read, the sink written
                    self.totals[kernel, "backward"] += later
                else:  # C / Triton: the sink written; the call reads the seed once for all the sinks it seeds
                    self.totals[kernel, "backward"] += first
                    seed_reads[call] = kernel
        for kernel in seed_reads.values():
            self.totals[kernel, "backward"] += self.a
        self._touches, self._seeded = {}, set()
        seed_calls = set()  # block passes that read x's seed (triton_group_kernels._SeededSum), once each
        for key, writers in self._sink_writers.items():  # each writer but the first in backward (the last) adds in
            for kernel, _ in writers[:-1]:  # place
                self.totals[kernel, "backward"] += self.a
            if key in self._kernel_seeded:
                kernel, call = writers[-1]
                if kernel == "triton_route":  # a router call copies the seed into the buffer and adds to it
                    self.totals[kernel, "backward"] += 3 * self.a
                else:
                    seed_calls.add(call)
        if seed_calls:
            self.totals["triton_block_grad", "backward"] += self.a * len(seed_calls)
        self._sink_writers, self._kernel_seeded = {}, set()
        for t in self._formed:  # a formed partial with later readers: its gradient read by the forming call
            if t.readers:
                self.totals["triton_route", "backward"] += self.a
        self._formed = []

    def hand_out(self, tensors):
        """Tensors leaving the buffer: one consumer each outside it (traffic.hand_out)."""
        self.read(*tensors)


def _settle(tensors, totals, a):
    """Autograd's additions: a tensor with k > 1 gradient contributions costs k - 1 adds of 3 u each."""
    adds = sum(max(0, t.readers - 1) for t in tensors)
    if adds:
        totals["autograd_add", "backward"] += 3 * a * adds


def _segments(num_layers, recompute):
    """(start, end, checkpointed) layer ranges of block._checkpointed_layers; one unchekpointed range without
    recompute. ``recompute``: None, ("uniform", n) or ("block", n), as --recompute-method / -num-layers."""
    if recompute is None:
        return None
    method, step = recompute
    if method == "uniform":
        return [(s, min(s + step, num_layers), True) for s in range(0, num_layers, step)]
    if method == "block":
        return [(i, i + 1, i < step) for i in range(num_layers)]
    raise ValueError(f"recompute method {method!r}: uniform or block")


def make_plan(mode, num_layers, backend, num_blocks=None, gate=False, group_size="auto", sources="exact"):
    """The SourcePlan a model of this mode / depth / router backend / --delta-sources runs (as
    SourcePlan.from_config)."""
    from types import SimpleNamespace

    from megatron_delta.core.sources import SourcePlan

    cfg = SimpleNamespace(residual=mode, num_layers=num_layers,
                          delta_num_blocks=num_blocks if mode in BLOCK_MODES else None, delta_sources=sources,
                          delta_gate="scalar" if gate else "none",
                          delta_router_kernels=backend if backend in ("fla", "triton") else "torch",
                          delta_router_group_size=group_size if mode in ("delta", "full_attnres") else 1)
    return SourcePlan.from_config(cfg)


def step_traffic(mode, num_layers, backend, *, num_blocks=None, act_bytes=2, null_source=False, gate=False,
                 recompute=None, group_size="auto", sources="exact", defer_blocks=True, reductions=None):
    """{(kernel, phase): u} of one micro-batch's forward + backward through one pipeline chunk holding all
    ``num_layers`` layers (the embedding output in, the final norm's input out), router ``backend`` (torch, c,
    fla), activations of ``act_bytes`` bytes, with ``recompute`` (None, ("uniform", n) or ("block", n): the
    recomputed chunks run their forward twice, and each is its own buffer scope, as block.py runs them).
    ``group_size``: --delta-router-group-size of delta / full_attnres (auto: the group router on c / triton, one
    router per pass on torch and fla).
    ``sources``: --delta-sources (authors-code: delta and delta_block).
    Kernels: route, project (torch / c), fla, fla_null, fla_combine (fla), triton_route, triton_block_grad
    (triton), group_old_pass, group_merge (the group router), partial_sum, source_difference (authors-code
    delta_block), x_add, x_sum, autograd_add.
    ``defer_blocks=False`` prices the Triton kernels with every router adding the completed block sources'
    gradients in place (no block pass: triton_router.BlockDeferral), for comparison. ``reductions``: a list that
    receives (S, rows) of every Triton backward call's per-program partial sums (_Ledger.reduce;
    :func:`reduction_u` prices them for a GPU)."""
    if mode == BASELINE:
        return {}
    plan = make_plan(mode, num_layers, backend, num_blocks, gate, group_size, sources)
    a, c = act_bytes, COMPUTE_BYTES
    totals = defaultdict(float)
    tensors = []
    rules = plan.rules
    final = ["final"] if plan.final_reads() else []
    routers = {k: _Router(k) for k in [*range(plan.num_sublayers), *final]}

    ledgers = []

    def buffer(scope, grad):
        ledgers.append(_Ledger(plan, scope, totals, tensors, backend, a, c, null_source, gate, grad))
        ledgers[-1].defer_blocks = defer_blocks
        return ledgers[-1]

    def run_layers(buf, first, end, inputs):
        if first == 0:
            rules.start(buf, inputs[0])
        else:
            for name, t in zip(plan.payload_names(first), inputs):
                buf.hold(name, t)
        for j in range(2 * first, 2 * end):
            rules.routed_input(buf, j, routers[j])
            rules.commit(buf, j, buf.new())

    def sublayers(first, end):
        return list(range(2 * first, 2 * end))

    L = num_layers
    segments = _segments(L, recompute)
    if segments is None:
        buf = buffer(sublayers(0, L) + final, True)
        run_layers(buf, 0, L, [buf.new()])
        buf.hand_out([rules.output(buf, routers.get("final"))])
    else:
        start = buffer(sublayers(0, L) + final, True)
        outer = [start.new()]
        start.hand_out(outer)  # h0 into the first checkpoint
        for first, end, checkpointed in segments:
            if checkpointed:
                # the checkpoint's no-grad forward, then in backward its recompute (inputs: detached
                # leaves) whose outputs the checkpoint's backward seeds as roots; outside, its outputs are
                # new tensors, each read by the next checkpoint once
                for grad in (False, True):
                    buf = buffer(sublayers(first, end), grad)
                    run_layers(buf, first, end, [buf.new() for _ in outer])
                    out = [buf.value(n) for n in plan.payload_names(end)]
                    if grad:
                        buf.hand_out(out)
                outer = [buf.new() for _ in out]
            else:  # a layer run as is (block method): its buffer holds the previous one's tensors themselves
                buf = buffer(sublayers(first, end), True)
                run_layers(buf, first, end, outer)
                outer = [buf.value(n) for n in plan.payload_names(end)]
        last = buffer(final, True)
        run_layers(last, L, L, outer)
        last.hand_out([rules.output(last, routers.get("final"))])
    for ledger in ledgers:
        ledger.settle_groups()
        if reductions is not None:
            reductions.extend(ledger.reductions)
    _settle(tensors, totals, a)
    return {k: v / a for k, v in totals.items() if v}


def reduction_bytes(reductions, max_programs, tokens, hidden):
    """The bytes of the Triton kernels' per-program partial sums (step_traffic's ``reductions``): each backward
    call that reduces over the tokens writes [programs, rows x S padded, hidden] fp32 partials and its sum reads
    them back, programs = min(its tiles of tokens, ``max_programs``) (triton_router.reducing_programs); S and the
    hidden size are padded as the kernel's tile (triton_group_kernels._tile)."""
    from megatron_delta.core import triton_group_kernels

    total = 0
    for s, rows in reductions:
        bt, sp, bd, _ = triton_group_kernels._tile(hidden, s)
        programs = min(-(-tokens // bt), max_programs)
        total += 2 * programs * rows * sp * bd * COMPUTE_BYTES
    return total


def triton_router_programs_per_sm():
    from megatron_delta.core import triton_router

    return triton_router.REDUCING_PROGRAMS_PER_SM


def reduction_u(reductions, gpu, tokens, hidden, act_bytes=2):
    """:func:`reduction_bytes` on ``gpu`` (REDUCING_PROGRAMS_PER_SM programs per SM) in u. Priced at HBM speed,
    though a few MiB written and read back at once may stay in L2."""
    cap = triton_router_programs_per_sm() * SMS[gpu]
    return reduction_bytes(reductions, cap, tokens, hidden) / (tokens * hidden * act_bytes)


def total_u(traffic, phase=None):
    return sum(v for (_, p), v in traffic.items() if phase in (None, p))


def layer_gemm_flops(shape, tokens, micro_batch=1):
    """Training FLOPs of one layer's GEMMs (forward 2, backward 4 per multiply-add: 6 x tokens x params) plus
    causal attention (QK^T and PV: 2 x 2 x s^2/2 x heads x head_dim per sequence, x 3 for training)."""
    h, dh = shape["hidden_size"], shape["kv_channels"]
    q, kv, f = shape["num_attention_heads"] * dh, shape["num_query_groups"] * dh, shape["ffn_hidden_size"]
    params = h * (q + 2 * kv) + q * h + h * 2 * f + f * h
    s = shape["seq_length"]
    attn = 3 * 2 * 2 * (s * s / 2) * shape["num_attention_heads"] * dh * micro_batch
    return 6 * tokens * params + attn


def router_share(gpu, shape_name, mode, backend="torch", num_blocks=None, null_source=False, gate=False,
                 micro_batch=1, act_bytes=2, num_layers=None, recompute=None, group_size=None):
    """Predicted router time against the layers' GEMM time for one training step (one micro-batch):
    the counted traffic of the routed residual stream (step_traffic, every pass) / (HBM x HBM_EFFICIENCY) vs
    GEMM FLOPs / (peak x GEMM_EFFICIENCY). Returns a dict with both times, the traffic in u, the share of
    the step (router / (GEMM + router)) and the predicted tokens/s ratio to the baseline (GEMM / (GEMM +
    router): the baseline's step taken as its GEMMs, its own residual adds not counted). ``num_layers``
    overrides the shape's (gpu_check's layer slice); ``num_blocks``: the block modes' K (default: the command
    line's, modes.default_num_blocks, which refuses a layer count it cannot split into at most 4 blocks).
    ``group_size``: the fine-grained modes' --delta-router-group-size; by default ``auto``, what the flag's
    default runs: the group router on triton, one router per pass on torch (the group router's PyTorch ops,
    counted per op, move more than the per-router path) and on fla (its kernel routes one router per call)."""
    if group_size is None:
        group_size = "auto"
    bw, flops = GPUS[gpu]
    shape = dict(SHAPES[shape_name])
    if num_layers:
        shape["num_layers"] = num_layers
    L = shape["num_layers"]
    tokens = shape["seq_length"] * micro_batch
    gemm_s = L * layer_gemm_flops(shape, tokens, micro_batch) / (flops * GEMM_EFFICIENCY)
    u = reduce_u = 0.0
    if mode != BASELINE:
        reductions = []
        u = total_u(step_traffic(mode, L, backend, num_blocks=num_blocks, act_bytes=act_bytes,
                                 null_source=null_source, gate=gate, recompute=recompute, group_size=group_size,
                                 reductions=reductions))
        reduce_u = reduction_u(reductions, gpu, tokens, shape["hidden_size"], act_bytes)
        u += reduce_u
    router_s = u * tokens * shape["hidden_size"] * act_bytes / (bw * HBM_EFFICIENCY)
    return {"gpu": gpu, "shape": shape_name, "mode": mode, "backend": backend, "num_layers": L, "traffic_u": u,
            "reduction_u": reduce_u,
            "gemm_ms": gemm_s * 1e3, "router_ms": router_s * 1e3, "router_share": router_s / (gemm_s + router_s),
            "tokens_per_sec_ratio": gemm_s / (gemm_s + router_s)}


def router_share_rows(gpu, shapes=("1B", "8B"), modes=ADDITIVE_MODES + REPLACEMENT_MODES, backends=GPU_BACKENDS):
    """router_share of every shape x mode x router backend on ``gpu``, in that order."""
    return [router_share(gpu, s, m, b) for s in shapes for m in modes for b in backends]


def router_share_ratios(gpu, shapes=("1B", "8B"), modes=ADDITIVE_MODES + REPLACEMENT_MODES,
                        backends=GPU_BACKENDS):
    """{shape (lower case): {mode: {backend: predicted tokens/s ratio}}} (memory_plan.py --format json)."""
    out = {}
    for r in router_share_rows(gpu, shapes, modes, backends):
        out.setdefault(r["shape"].lower(), {}).setdefault(r["mode"], {})[r["backend"]] = r["tokens_per_sec_ratio"]
    return out
