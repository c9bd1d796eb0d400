"""Which sources each sublayer reads (:class:`SourcePlan`) and the per-micro-batch state that holds them
(:class:`SourceBuffer`), for the routed residual modes (docs/design.md section 1).

What differs between the modes - the source names, what a commit adds, what crosses a stage boundary, how
the input u and the residual stream are formed - is the mode's class in megatron_delta/core/modes.py
(``plan.rules``); this module is the machinery common to all of them: the protocol of a micro-batch, the
stage payload, the lazy projections of the sources for their readers, and x's in-place bookkeeping.

At the very start (first_layer 0) every mode's state is just the embedding output, named ``h0``.

The residual stream x of the additive modes: with exact sources it is their sum (delta: h0 + sum v;
delta_block: h0 + sum Delta + P). A plan with ``x_from_sources`` (the model's choice when there is no
gate: ``SourcePlan.from_config``) holds no separate x: each router forms u = x + r = sum_i (1 + alpha_i)
s_i in the pass that reads the sources anyway, x is summed from the sources only where it is handed
out (the last layer's output), and it does not travel in the pipeline payload. Equal to docs/design.md's
update rule in exact arithmetic; it saves the router's read of x, the separate x chain and its
gradient additions (about one point of delta_block's step on CPU) and one [s, b, h] tensor per
pipeline boundary. With the gate x is kept: u = x + a r must equal the baseline's x bitwise at a = 0.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Dict, List, Mapping, Optional, Sequence, Union

import torch
from torch import Tensor

from megatron_delta.core import group_plan, group_router, traffic
from megatron_delta.core.modes import RoutedMode, default_num_blocks, routed_mode, routed_mode_class
from megatron_delta.core.router import DepthRouter, PendingSum, Source, _no_autocast, make_source

__all__ = ["SourcePlan", "SourceBuffer"]


@dataclass(frozen=True)
class SourcePlan:
    """Static description of the sources: who reads what, and what crosses a stage boundary. The mode's
    rules are ``self.rules`` (a modes.RoutedMode, built and validated from the fields)."""

    mode: str
    num_layers: int
    num_blocks: int
    sources: str = "exact"
    x_from_sources: bool = False  # additive modes, exact sources: x is the sum of the sources, not held
    router_group_size: Union[int, str] = 1  # delta / full_attnres: routers per group pass (core/group_router.py)
    rules: RoutedMode = field(init=False, repr=False, compare=False)  # the mode object, from the fields above

    @classmethod
    def from_config(cls, cfg, mode: Optional[str] = None) -> "SourcePlan":
        """From a DeltaTransformerConfig or parsed flags (same field names); `mode` overrides residual.
        The modes whose sources sum to x keep x as their sources when there is no gate (module docstring),
        except where the routers run on fla's fused kernel, which cannot fold x = sum of the sources into
        its pass (fla_router.plan_keeps_x; objects without ``delta_router_kernels`` count as not; the Triton
        kernels fold it)."""
        mode = mode or cfg.residual
        num_blocks = cfg.delta_num_blocks
        if num_blocks is None:  # the block modes' default (refused where 4 does not divide L > 4)
            num_blocks = default_num_blocks(mode, cfg.num_layers)
        return cls(mode=mode, num_layers=cfg.num_layers,
                   num_blocks=cfg.num_layers if num_blocks is None else num_blocks,  # outside the block modes: unused
                   sources=cfg.delta_sources,
                   x_from_sources=(routed_mode_class(mode, cfg.delta_sources).sources_sum_to_x
                                   and getattr(cfg, "delta_gate", "none") == "none"
                                   and not _kernel_keeps_x(getattr(cfg, "delta_router_kernels", "torch"))),
                   router_group_size=getattr(cfg, "delta_router_group_size", 1))

    def __post_init__(self) -> None:
        object.__setattr__(self, "rules", routed_mode(self.mode, self.num_layers, self.num_blocks, self.sources,
                                                      self.x_from_sources))
        object.__setattr__(self, "router_group_size", group_plan.check_group_size(
            self.router_group_size, self.mode, self.sources))

    @property
    def groups_routers(self) -> bool:
        """The routers of a buffer's scope route in groups (core/group_router.py): a fine-grained mode's exact
        sources, with a group size other than 1."""
        return (self.router_group_size != 1 and self.mode in group_plan.FINE_GRAINED_MODES
                and self.sources == "exact")

    # ------------------------------------------------------------------ basic facts
    @property
    def additive(self) -> bool:
        """The additive modes (delta, delta_block) keep the residual stream x; the replacement modes replace it."""
        return self.rules.additive

    @property
    def blocked(self) -> bool:
        return self.rules.blocked

    @property
    def authors(self) -> bool:
        return self.sources == "authors-code"

    @property
    def num_sublayers(self) -> int:
        return 2 * self.num_layers

    @property
    def layers_per_block(self) -> int:
        return self.rules.layers_per_block

    def block_of(self, j: int) -> int:
        """Block index of sublayer j (block modes)."""
        return self.rules.block_of(j)

    def is_block_start(self, j: int) -> bool:
        """j is the attention sublayer of a layer that starts a block."""
        return self.rules.is_block_start(j)

    def is_block_end(self, j: int) -> bool:
        """j is the MLP sublayer of the last layer of a block."""
        return self.rules.is_block_end(j)

    def _check_j(self, j: int) -> None:
        if not 0 <= j < self.num_sublayers:
            raise ValueError(f"sublayer index {j} out of range [0, {self.num_sublayers})")

    # ------------------------------------------------------------------ readers
    def reads(self, j: int) -> List[str]:
        """Names of the sources sublayer j's router reads, in order (the null source excluded)."""
        return list(self._reads(j))

    def _reads(self, j: int) -> tuple:
        cache = self.__dict__.setdefault("_reads_cache", {})
        if j not in cache:
            self._check_j(j)
            cache[j] = tuple(self.rules.reads(j))
        return cache[j]

    def value_readers(self, name: str, j: Union[int, str]) -> tuple:
        """The receivers (sublayer indices >= j, then 'final') that read the VALUE that source
        ``name`` holds when receiver ``j`` reads it. A value that j's commit rewrites (P<b>, p) has one
        reader - unless j's routing first renames it (p at a replacement-mode block start becomes the
        next B<c>), then it lives on under that name."""
        cache = self.__dict__.setdefault("_value_readers_cache", {})
        key = (name, j)
        if key not in cache:
            cache[key] = tuple(self._compute_value_readers(name, j))
        return cache[key]

    def _compute_value_readers(self, name: str, j: Union[int, str]) -> List[Union[int, str]]:
        if j == "final":
            return ["final"]
        if name == self.rules.rewritten_by_commit(j):
            renamed = self.rules.renamed_by_routing(j)
            return [j] + (list(self.value_readers(renamed, j + 1)) if renamed is not None else [])
        out: List[Union[int, str]] = [k for k in range(j, self.num_sublayers) if name in self._reads(k)]
        if name in self.final_reads():
            out.append("final")
        return out

    def num_sources_read(self, j: int) -> int:
        """How many sources sublayer j's router reads (excluding the null source)."""
        return len(self.reads(j))

    def final_reads(self) -> List[str]:
        """Sources of the final router (replacement modes); [] for the additive modes."""
        return self.rules.final_reads()

    def max_sources(self) -> int:
        """The largest number of sources any router reads (the final router included for the
        replacement modes; the null source excluded)."""
        m = max(self.num_sources_read(j) for j in range(self.num_sublayers))
        return max(m, len(self.final_reads()))

    def is_stable(self, name: str) -> bool:
        """Source ``name`` keeps its value from the moment it is made: not the residual stream ``x``, not a
        source some commit rewrites (a partial sum P<b>, p). A stable source need not travel twice to one
        rank (core/source_cache.py)."""
        mutable = self.__dict__.get("_mutable")
        if mutable is None:
            mutable = {"x"} | {self.rules.rewritten_by_commit(j) for j in range(self.num_sublayers)} - {None}
            self.__dict__["_mutable"] = mutable
        return name not in mutable

    # ------------------------------------------------------------------ pipeline payloads
    def payload_names(self, first_layer: int) -> List[str]:
        """Ordered names of the tensors that must travel into a stage (or virtual chunk) whose first
        global layer (0-based) is ``first_layer``; ``first_layer == num_layers`` is the state after
        the last layer (additive: ['x']; replacement: what the final router reads).

        Exactly what this and later stages read, plus the residual stream x of the additive modes
        (sent rather than re-derived from the sources, which would round differently) unless the plan
        keeps x as its sources (``x_from_sources``: then ['x'] after the last layer is their sum).
        """
        f = first_layer
        L = self.num_layers
        if not isinstance(f, int) or not 0 <= f <= L:
            raise ValueError(f"first_layer must be an integer in [0, {L}], got {f!r}")
        if f == 0:
            return ["h0"]  # the embedding output, whatever the mode holds it as (rules.start_names)
        return self.rules.payload_names(f)


def _kernel_keeps_x(choice: str) -> bool:
    # The Triton kernels form x from the sources in their pass (triton_router.py); fla's cannot.
    if choice not in ("auto", "fla"):
        return False
    if choice == "auto" and torch.cuda.is_available():
        from megatron_delta.core import triton_router

        if triton_router.available():
            return False
    from megatron_delta.core import fla_router

    return fla_router.plan_keeps_x(choice)


class _Entry:
    """A held source: its value and (lazily, once) its Source: 1/rms and its readers' logits. A sum held with
    hold_sum is ``pending`` until its one reader's kernel forms it, or ``value`` is first asked for."""

    __slots__ = ("_value", "source", "pending")

    def __init__(self, value: Optional[Tensor], source: Optional[Source] = None,
                 pending: Optional[PendingSum] = None) -> None:
        self._value = value
        self.source = source
        self.pending = pending

    @property
    def value(self) -> Tensor:
        return self.pending.form() if self.pending is not None else self._value


class SourceBuffer:
    """The sources of ONE micro-batch on ONE pipeline stage (or virtual chunk).

    Protocol per sublayer j (in increasing order)::

        u = buf.routed_input(j, routers[j])   # the input of f_j (its own input norm included)
        buf.commit(j, f_j(u))                 # v_j: the addend of the bias-dropout-add

    then ``buf.output(final_router)`` on the last stage or ``buf.to_tensors()`` at a stage (or
    recompute-chunk) boundary, i.e. after an MLP sublayer. What each step does is the plan's mode
    (``plan.rules``), which works through hold / take / value / rename / held_x / add_to_x / route.

    ``readers`` maps each receiver of this buffer's scope (sublayer index j, and 'final') to its
    router: the chunk's layers, or the layers of one recomputed group. A source is projected
    (make_source: 1/rms and the logits of ALL its readers in the scope, one pass) lazily, the first
    time a router reads it; so :meth:`from_tensors` is cheap and, inside a recomputed function,
    rebuilds everything as functions of its explicit tensor inputs. A router missing from
    ``readers`` still works (it projects the source itself), at the cost of an extra pass.

    In the block modes, the routers of one block in this scope that read its completed sources through the
    Triton kernels' sinks write those sources' gradients in one pass for the block, where that moves fewer rows
    (triton_router.defer_block); a block cut by a chunk or recompute boundary has one pass per part.

    With ``plan.groups_routers`` (delta / full_attnres, ``router_group_size`` not 1) the scope's sublayers
    route in groups (core/group_router.py): groups of consecutive sublayers of this scope, so they never
    cross a chunk or recompute boundary; they read the sources' values (:meth:`values_read`), not their
    projections. The final router routes alone.
    """

    def __init__(self, plan: SourcePlan, first_layer: int, eps: float, *,
                 record_routing: bool = False, readers: Optional[Mapping] = None) -> None:
        self.plan = plan
        self.eps = float(eps)
        self.first_layer = first_layer
        self.next_sublayer = 2 * first_layer
        self._x: Optional[Tensor] = None  # the residual stream (additive modes); see the x property
        self._x_own = False  # _x was made by add_to_x and nobody else holds it: the next add is in place
        self._entries: Dict[str, _Entry] = {}  # insertion order = payload order
        self._pending: Optional[int] = None
        self.record_routing = record_routing
        self.routing: Dict[Union[int, str], Tensor] = {}  # j (or 'final') -> alpha [s, b, N(+1)]
        self.readers: Mapping = dict(readers or {})  # j (or 'final') -> DepthRouter
        self._queries: Dict[DepthRouter, Tensor] = {}  # one q = w * g per router, shared by its sources
        sublayers = [k for k in self.readers if isinstance(k, int)]
        self._groups = (group_router.GroupRouting(plan.router_group_size, sublayers)
                        if plan.groups_routers and sublayers else None)
        # block -> its routers' deferred pass over the completed sources' gradients (triton_router.defer_block)
        self._deferrals: Dict[int, Optional[dict]] = {}
        self._block_routers: Optional[Counter] = None  # block -> its routers in this buffer

    # ------------------------------------------------------------------ construction
    @classmethod
    def start(cls, plan: SourcePlan, h0: Tensor, eps: float, *, record_routing: bool = False,
              readers: Optional[Mapping] = None) -> "SourceBuffer":
        """The first stage's state, from the embedding output h0 [s, b, d]."""
        buf = cls(plan, 0, eps, record_routing=record_routing, readers=readers)
        plan.rules.start(buf, h0)
        return buf

    @classmethod
    def from_tensors(cls, plan: SourcePlan, first_layer: int, tensors: Sequence[Tensor], eps: float,
                     *, record_routing: bool = False,
                     readers: Optional[Mapping] = None) -> "SourceBuffer":
        """Rebuild the state at the start of layer ``first_layer`` from the tensors named
        ``plan.payload_names(first_layer)`` (in that order)."""
        names = plan.payload_names(first_layer)
        tensors = list(tensors)
        if len(tensors) != len(names):
            raise ValueError(
                f"from_tensors: expected {len(names)} tensors {names} for first_layer={first_layer}, "
                f"got {len(tensors)}")
        if first_layer == 0:
            return cls.start(plan, tensors[0], eps, record_routing=record_routing, readers=readers)
        buf = cls(plan, first_layer, eps, record_routing=record_routing, readers=readers)
        for name, t in zip(names, tensors):
            buf.hold(name, t)
        return buf

    # ------------------------------------------------------------------ what the modes work through
    def hold(self, name: str, value: Tensor) -> None:
        """Hold ``value`` as source ``name`` (after those held), or as the residual stream (name ``x``)."""
        traffic.watch(value)
        if name == "x":
            self._x, self._x_own = value, False
        else:
            self._entries[name] = _Entry(value)

    def hold_sum(self, name: str, partial: Optional[Tensor], addend: Tensor) -> None:
        """Hold ``partial + addend`` as source ``name`` (``addend`` when there is no partial). The sum is formed
        when first needed: by the kernel of its one reader where that router forms sums in its pass (the Triton
        kernels: no separate add), else by a PyTorch add, as ``hold(name, partial + addend)``."""
        if partial is None:
            self.hold(name, addend)
        else:
            self._entries[name] = _Entry(None, pending=PendingSum(partial, addend))

    def hold_difference(self, name: str, minuend: Tensor, subtrahend: Tensor) -> None:
        """Hold ``minuend - subtrahend`` as source ``name`` (authors-code delta_block's A<b> = x - A<b-1>): a
        PyTorch subtraction, its own pass."""
        value = minuend - subtrahend
        traffic.record("source_difference", "forward", [minuend, subtrahend], [value])
        self.hold(name, value)

    def take(self, name: str) -> Optional[Tensor]:
        """Remove source ``name``; its value, or None if it is not held."""
        entry = self._entries.pop(name, None)
        return None if entry is None else entry.value

    def value(self, name: str) -> Tensor:
        """The value of source ``name`` (``x``: the residual stream, handed out as the x property does)."""
        return self.x if name == "x" else self._entries[name].value

    def rename(self, old: str, new: str) -> None:
        """Source ``old`` lives on as ``new`` (after those held), its projection included."""
        self._entries[new] = self._entries.pop(old)

    @property
    def held_x(self) -> Optional[Tensor]:
        """The residual stream as held (None with x_from_sources), for arithmetic that makes a new tensor
        or reads it as a router's base; unlike :attr:`x` it does not hand it out."""
        return self._x

    def add_to_x(self, v: Tensor) -> None:
        """x <- x + v: in place while nothing else holds x (routers do not save their base), else a new x."""
        old = self._x
        if self._x_own and v.dtype == self._x.dtype:
            self._x.add_(v)
        else:
            self._x, self._x_own = self._x + v, True
        if traffic.active():
            traffic.record("x_add", "forward", [old, v], [self._x])
            traffic.watch(self._x)

    def route(self, key: Union[int, str], router: DepthRouter, *, base: Optional[Tensor], apply_gate: bool,
              base_sums: bool) -> Tensor:
        """Receiver ``key`` (j or 'final') routes over the sources it reads: ``base + gated(r)`` with a base
        (base_sums: the base is the sum of those sources; without a base the router forms that sum),
        else r. Records alpha when the buffer records routing."""
        if self._groups is not None:  # the scope's routers in groups (core/group_router.py)
            routed = self._groups.route(self, key, router, base=base, apply_gate=apply_gate, base_sums=base_sums,
                                        record=self.record_routing)
            if routed is not None:
                if self.record_routing:
                    self.routing[key] = routed[1]
                return routed[0]
        sources = self.read(key)
        if self.plan.blocked and key != "final" and any(s.sink is not None for s in sources):
            from megatron_delta.core import triton_router  # a source with a sink: kernels or a shared projection

            b = self.plan.block_of(key)
            if self._block_routers is None:  # once per buffer, not per router call (O(readers) each)
                self._block_routers = Counter(self.plan.block_of(k) for k in self.readers if k != "final")
            sources = triton_router.defer_block(sources, self._block_routers[b], self._deferrals, b)
        if self.record_routing:
            r, alpha = router(sources, True, base=base, apply_gate=apply_gate, base_sums=base_sums)
            self.routing[key] = alpha.detach()
            return r
        return router(sources, base=base, apply_gate=apply_gate, base_sums=base_sums)

    # ------------------------------------------------------------------ export
    def _at_boundary(self, what: str) -> int:
        if self._pending is not None:
            raise RuntimeError(f"{what}: sublayer {self._pending} was routed but not committed")
        if self.next_sublayer % 2:
            raise RuntimeError(f"{what}: only at a layer boundary (next sublayer {self.next_sublayer})")
        return self.next_sublayer // 2

    def payload_names(self) -> List[str]:
        """Names of :meth:`to_tensors` at the current position."""
        return self.plan.payload_names(self._at_boundary("payload_names"))

    def to_tensors(self) -> List[Tensor]:
        """The tensors ``plan.payload_names(next_first_layer)`` in order (the held tensors
        themselves, no copies): a pipeline payload or the outputs of a checkpointed chunk."""
        f = self._at_boundary("to_tensors")
        if f == 0:  # 'h0': the embedding output, held under the last of the mode's start names
            out = [self.value(self.plan.rules.start_names()[-1])]
        else:
            out = [self.value(n) for n in self.plan.payload_names(f)]
        traffic.hand_out(out)
        return out

    @property
    def x(self) -> Optional[Tensor]:
        """The residual stream (additive modes). add_to_x adds each v_j into it in place while the
        buffer alone holds it; reading it here marks it shared, so a tensor once read never changes
        (the next commit makes a new one). With ``plan.x_from_sources`` it is the sum of the held
        sources, in payload order (the same additions on every pipeline layout)."""
        self._x_own = False
        if self._x is None and self.plan.x_from_sources and self._entries:
            values = [e.value for e in self._entries.values()]
            if self._groups is not None:  # one pass, and x's gradient seeds the groups' sinks (group_router._FinalSum)
                x = self._groups.final_sum(values)
                if x is not None:
                    return x
            sinks = [None if e.source is None else e.source.sink for e in self._entries.values()]
            if any(s is not None for s in sinks):  # the Triton kernels' sinks: one pass, x's gradient seeds them
                from megatron_delta.core import triton_group_kernels, triton_router

                sinks = [s if isinstance(s, triton_router.KernelSink) else None for s in sinks]
                x = triton_group_kernels.sum_seeding_sinks(values, sinks) if any(sinks) else None
                if x is not None:
                    return x
            return group_router.sum_in_order(values)
        return self._x

    @property
    def names(self) -> List[str]:
        """Debug view of what is held: 'x' (additive modes) and the source names, in order."""
        return (["x"] if self._x is not None else []) + list(self._entries)

    # ------------------------------------------------------------------ reading
    def _source(self, name: str, j: Union[int, str]) -> Source:
        """The Source of ``name`` as receiver j reads it, projected for all its readers in scope."""
        e = self._entries[name]
        if e.source is None:
            readers = [self.readers[k] for k in self.plan.value_readers(name, j) if k in self.readers]
            if e.pending is not None and e.pending.value is None:
                if len(readers) == 1 and readers[0].forms_sums_in_kernel(e.pending.base):
                    e.source = Source(e.pending.base, None, {}, self.eps, None, e.pending)  # its kernel forms it
                    return e.source
                e.pending.form()
            if len(readers) <= 1 or any(r.routes_in_kernel(e.value) for r in readers):
                # One reader here (P<b>, p, or a scope's last reader): its router projects the source in
                # the pass that routes it (router._RouteFunction, "local" source), no separate pass.
                # Likewise for routers on a fused GPU kernel, which computes every logit in its own pass;
                # the Triton kernels add the gradients of a source with several readers into one buffer.
                sink = readers[0].kernel_sink(e.value) if len(readers) > 1 else None
                e.source = Source(e.value, None, {}, self.eps, sink)
                return e.source
            for r in readers:
                self.query(r)
            e.source = make_source(e.value, self.eps, readers, self._queries)
        return e.source

    def values_read(self, j: int) -> List[Tensor]:
        """The values of the sources receiver j reads, in order, unprojected (the group router projects them)."""
        self.read_names_check(j)
        return [self._entries[n].value for n in self.plan._reads(j)]

    def query(self, router: DepthRouter) -> Tensor:
        """The router's q = w * g, made once per buffer and shared by every pass that reads it."""
        if router not in self._queries:
            with _no_autocast(router.query.device.type):
                self._queries[router] = router.query_vector()
        return self._queries[router]

    def read_names_check(self, j: Union[int, str]) -> None:
        names = self.plan.final_reads() if j == "final" else self.plan._reads(j)
        missing = [n for n in names if n not in self._entries]
        if missing:
            raise RuntimeError(
                f"{'the final router' if j == 'final' else f'sublayer {j}'} reads {missing}, which this buffer "
                f"(holding {self.names}) lacks")

    def read(self, j: Union[int, str]) -> List[Source]:
        """The sources receiver j's router reads (sublayer j, or 'final'; null source excluded), in order."""
        self.read_names_check(j)
        names = self.plan.final_reads() if j == "final" else self.plan._reads(j)
        return [self._source(n, j) for n in names]

    def _expect(self, j: int) -> None:
        if self._pending is not None:
            raise RuntimeError(f"sublayer {self._pending} was routed but not committed")
        if j != self.next_sublayer:
            raise RuntimeError(f"expected sublayer {self.next_sublayer}, got {j}")

    def routed_input(self, j: int, router: DepthRouter) -> Tensor:
        """The input u of sublayer j: additive modes ``x + gated(r_j(S))``, replacement modes
        ``r_j(B + [p])`` (and their block-start bookkeeping): ``plan.rules.routed_input``."""
        self._expect(j)
        u = self.plan.rules.routed_input(self, j, router)
        self._pending = j
        return u

    def commit(self, j: int, out: Tensor) -> None:
        """Record sublayer j's output (v_j for the additive modes, f_j(u) for replacement)."""
        if self._pending != j:
            raise RuntimeError(f"commit({j}) without routed_input({j})")
        traffic.watch(out)
        self.plan.rules.commit(self, j, out)
        self._pending = None
        self.next_sublayer = j + 1

    def output(self, final_router: Optional[DepthRouter] = None) -> Tensor:
        """After the last layer: x (additive), final_router(B + [p]) (replacement)."""
        f = self._at_boundary("output")
        if f != self.plan.num_layers:
            raise RuntimeError(f"output(): only after the last layer (next layer is {f})")
        out = self.plan.rules.output(self, final_router)
        traffic.hand_out([out])
        return out
