"""Which sources each sublayer reads, per residual mode (DESIGN.md section 1), and the per-micro-batch
state that holds them (:class:`SourceBuffer`).

Sublayers are numbered globally j = 0..2L-1 (even: attention of layer j//2, odd: its MLP). Layers
form K = num_blocks blocks of L/K consecutive layers (delta_block, attnres).

Source names (they are also the names of the pipeline payload tensors):

==================  ==========================================================================
mode                names
==================  ==========================================================================
delta               x (the residual stream, where held), h0, v0, v1, ... (sublayer outputs)
delta_block exact   x, h0, D0, D1, ... (completed block sums), P<b> (partial sum of block b)
delta_block authors x, A0, A1, ... (the public code's list: A0 = H0, A<c> = H_c - A<c-1>)
attnres             B0 (= h0), B1, ... (completed block representations), p (partial)
full_attnres        B0 (= h0), B1 (= v0), ..., p (the latest sublayer output)
==================  ==========================================================================

At the very start (first_layer 0) every mode's state is just the embedding output, named ``h0``.

The residual stream x of the additive modes: with exact sources it is their sum (delta: h0 + sum v;
delta_block: h0 + sum Delta + P). A plan with ``x_from_sources`` (the model's choice when there is no
gate: ``SourcePlan.from_config``) holds no separate x: each router forms u = x + r = sum_i (1 + alpha_i)
s_i in the pass that reads the sources anyway, x is summed from the sources only where it is handed
out (the last layer's output), and it does not travel in the pipeline payload. Equal to DESIGN.md's
update rule in exact arithmetic; it saves the router's read of x, the separate x chain and its
gradient additions (about one point of delta_block's step on CPU) and one [s, b, h] tensor per
pipeline boundary. With the gate x is kept: u = x + a r must equal the baseline's x bitwise at a = 0.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional, Sequence, Union

import torch
from torch import Tensor

from megatron_delta.core.router import DepthRouter, Source, make_source

__all__ = ["MODES", "SOURCE_DEFINITIONS", "SourcePlan", "SourceBuffer"]

MODES = ("delta", "delta_block", "attnres", "full_attnres")
ADDITIVE_MODES = ("delta", "delta_block")
SOURCE_DEFINITIONS = ("exact", "authors-code")


@dataclass(frozen=True)
class SourcePlan:
    """Static description of the sources: who reads what, and what crosses a stage boundary."""

    mode: str
    num_layers: int
    num_blocks: int
    sources: str = "exact"
    x_from_sources: bool = False  # additive modes, exact sources: x is the sum of the sources, not held

    @classmethod
    def from_config(cls, cfg, mode: Optional[str] = None) -> "SourcePlan":
        """From a DeltaTransformerConfig or parsed flags (same field names); `mode` overrides residual.
        The additive modes with exact sources and no gate keep x as their sources (module docstring),
        except where the routers run on fla's fused kernel, which cannot fold x = sum of the sources into
        its pass (fla_router.plan_keeps_x; objects without ``delta_router_kernels`` count as not)."""
        mode = mode or cfg.residual
        return cls(mode=mode, num_layers=cfg.num_layers, num_blocks=cfg.delta_num_blocks or cfg.num_layers,
                   sources=cfg.delta_sources,
                   x_from_sources=(mode in ADDITIVE_MODES and cfg.delta_sources == "exact"
                                   and getattr(cfg, "delta_gate", "none") == "none"
                                   and not _kernel_keeps_x(getattr(cfg, "delta_router_kernels", "torch"))))

    def __post_init__(self) -> None:
        if self.mode == "baseline":
            raise ValueError("--residual baseline has no depth sources; build no SourcePlan for it")
        if self.mode not in MODES:
            raise ValueError(
                f"--residual must be one of {('baseline',) + MODES}, got {self.mode!r}")
        if self.sources not in SOURCE_DEFINITIONS:
            raise ValueError(
                f"--delta-sources must be one of {SOURCE_DEFINITIONS}, got {self.sources!r}")
        if self.sources == "authors-code" and self.mode not in ADDITIVE_MODES:
            raise ValueError(
                f"--delta-sources authors-code applies only to --residual delta / delta_block, "
                f"not --residual {self.mode}")
        if not isinstance(self.num_layers, int) or self.num_layers < 1:
            raise ValueError(f"the number of layers must be a positive integer, got {self.num_layers!r}")
        if not isinstance(self.num_blocks, int) or self.num_blocks < 1:
            raise ValueError(
                f"--delta-num-blocks must be a positive integer, got {self.num_blocks!r}")
        if self.x_from_sources and not (self.additive and not self.authors):
            raise ValueError(
                f"x_from_sources: only the additive modes' exact sources sum to the residual stream, not "
                f"--residual {self.mode} --delta-sources {self.sources}")
        if self.blocked and self.num_layers % self.num_blocks != 0:
            raise ValueError(
                f"--delta-num-blocks ({self.num_blocks}) must divide the number of layers "
                f"({self.num_layers}) for --residual {self.mode}")

    # ------------------------------------------------------------------ basic facts
    @property
    def additive(self) -> bool:
        """delta / delta_block keep the residual stream x; attnres / full_attnres replace it."""
        return self.mode in ADDITIVE_MODES

    @property
    def blocked(self) -> bool:
        return self.mode in ("delta_block", "attnres")

    @property
    def authors(self) -> bool:
        return self.sources == "authors-code"

    @property
    def num_sublayers(self) -> int:
        return 2 * self.num_layers

    @property
    def layers_per_block(self) -> int:
        return self.num_layers // self.num_blocks if self.blocked else 1

    def block_of(self, j: int) -> int:
        """Block index of sublayer j (block modes)."""
        return (j // 2) // self.layers_per_block

    def is_block_start(self, j: int) -> bool:
        """j is the attention sublayer of a layer that starts a block."""
        return j % 2 == 0 and (j // 2) % self.layers_per_block == 0

    def is_block_end(self, j: int) -> bool:
        """j is the MLP sublayer of the last layer of a block."""
        return j % 2 == 1 and (j // 2 + 1) % self.layers_per_block == 0

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
            cache[j] = tuple(self._compute_reads(j))
        return cache[j]

    def _compute_reads(self, j: int) -> List[str]:
        self._check_j(j)
        if self.mode == "delta":
            if self.authors and j == 0:
                return []  # the public code gives layer 0's attention no sources
            return ["h0"] + [f"v{i}" for i in range(j)]
        if self.mode == "delta_block":
            b = self.block_of(j)
            if self.authors:
                # One entry per block start before (or, for later sublayers of block b, at) j.
                m = b if self.is_block_start(j) else b + 1
                return [f"A{c}" for c in range(m)]
            names = ["h0"] + [f"D{c}" for c in range(b)]
            if not self.is_block_start(j):
                names.append(f"P{b}")
            return names
        if self.mode == "attnres":
            b = self.block_of(j)
            nb = b if self.is_block_start(j) else b + 1
            return [f"B{c}" for c in range(nb)] + ["p"]
        # full_attnres
        return [f"B{c}" for c in range(j)] + ["p"]

    def value_readers(self, name: str, j: Union[int, str]) -> tuple:
        """The receivers (sublayer indices >= j, then 'final') that read the VALUE that source
        ``name`` holds when receiver ``j`` reads it. P<b> and p are rewritten at every commit, so
        their value has one reader - except p at a replacement-mode block start, which then lives
        on as the next B<c>."""
        cache = self.__dict__.setdefault("_value_readers_cache", {})
        key = (name, j)
        if key not in cache:
            cache[key] = tuple(self._compute_value_readers(name, j))
        return cache[key]

    def _compute_value_readers(self, name: str, j: Union[int, str]) -> List[Union[int, str]]:
        if j == "final":
            return ["final"]
        if name == "p" and (self.mode == "full_attnres" or self.is_block_start(j)):
            # p becomes B<c>, c = the number of B sources j reads (all but p)
            return [j] + list(self.value_readers(f"B{len(self._reads(j)) - 1}", j + 1))
        if name == "p" or (name.startswith("P") and self.mode == "delta_block"):
            return [j]
        out: List[Union[int, str]] = [k for k in range(j, self.num_sublayers) if name in self._reads(k)]
        if name in self.final_reads():
            out.append("final")
        return out

    def num_sources_read(self, j: int) -> int:
        """How many sources sublayer j's router reads (excluding the null source)."""
        return len(self.reads(j))

    def final_reads(self) -> List[str]:
        """Sources of the final router (replacement modes); [] for the additive modes."""
        if self.additive:
            return []
        return self.payload_names(self.num_layers)

    def max_sources(self) -> int:
        """The largest number of sources any router reads (the final router included for the
        replacement modes; the null source excluded)."""
        m = max(self.num_sources_read(j) for j in range(self.num_sublayers))
        return max(m, len(self.final_reads()))

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
            return ["h0"]  # the embedding output: x = h0 (additive) / p = h0 (replacement)
        lb = self.layers_per_block
        if self.additive:
            if f == L:
                return ["x"]
            x = [] if self.x_from_sources else ["x"]
            if self.mode == "delta":
                return x + ["h0"] + [f"v{i}" for i in range(2 * f)]
            if self.authors:
                return x + [f"A{c}" for c in range(-(-f // lb))]
            names = x + ["h0"] + [f"D{c}" for c in range(f // lb)]
            if f % lb:
                names.append(f"P{f // lb}")
            return names
        if self.mode == "attnres":
            return [f"B{c}" for c in range(-(-f // lb))] + ["p"]
        return [f"B{c}" for c in range(2 * f)] + ["p"]


def _kernel_keeps_x(choice: str) -> bool:
    if choice not in ("auto", "fla"):
        return False
    from megatron_delta.core import fla_router

    return fla_router.plan_keeps_x(choice)


class _Entry:
    """A held source: its value and (lazily, once) its Source: 1/rms and its readers' logits."""

    __slots__ = ("value", "source")

    def __init__(self, value: Tensor, source: Optional[Source] = None) -> None:
        self.value = value
        self.source = source


class SourceBuffer:
    """The sources of ONE micro-batch on ONE pipeline stage (or virtual chunk).

    Protocol per sublayer j (in increasing order)::

        u = buf.routed_input(j, routers[j])   # the input of f_j (its own input norm included)
        buf.commit(j, f_j(u))                 # v_j: the addend of the bias-dropout-add

    then ``buf.output(final_router)`` on the last stage or ``buf.to_tensors()`` at a stage (or
    recompute-chunk) boundary, i.e. after an MLP sublayer.

    ``readers`` maps each receiver of this buffer's scope (sublayer index j, and 'final') to its
    router: the chunk's layers, or the layers of one recomputed group. A source is projected
    (make_source: 1/rms and the logits of ALL its readers in the scope, one pass) lazily, the first
    time a router reads it; so :meth:`from_tensors` is cheap and, inside a recomputed function,
    rebuilds everything as functions of its explicit tensor inputs. A router missing from
    ``readers`` still works (it projects the source itself), at the cost of an extra pass.
    """

    def __init__(self, plan: SourcePlan, first_layer: int, eps: float, *,
                 record_routing: bool = False, readers: Optional[Mapping] = None) -> None:
        self.plan = plan
        self.eps = float(eps)
        self.first_layer = first_layer
        self.next_sublayer = 2 * first_layer
        self._x: Optional[Tensor] = None  # the residual stream (additive modes); see the x property
        self._x_own = False  # _x was made by commit and nobody else holds it: the next commit adds in place
        self._entries: Dict[str, _Entry] = {}  # insertion order = payload order
        self._pending: Optional[int] = None
        self.record_routing = record_routing
        self.routing: Dict[Union[int, str], Tensor] = {}  # j (or 'final') -> alpha [s, b, N(+1)]
        self.readers: Mapping = dict(readers or {})  # j (or 'final') -> DepthRouter
        self._queries: Dict[DepthRouter, Tensor] = {}  # one q = w * g per router, shared by its sources

    # ------------------------------------------------------------------ construction
    @classmethod
    def start(cls, plan: SourcePlan, h0: Tensor, eps: float, *, record_routing: bool = False,
              readers: Optional[Mapping] = None) -> "SourceBuffer":
        """The first stage's state, from the embedding output h0 [s, b, d]."""
        buf = cls(plan, 0, eps, record_routing=record_routing, readers=readers)
        if plan.additive:
            if not plan.x_from_sources:
                buf._x = h0
            if not (plan.mode == "delta_block" and plan.authors):
                buf._entries["h0"] = _Entry(h0)
        else:
            buf._entries["p"] = _Entry(h0)
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
            if name == "x":
                buf._x = t
            else:
                buf._entries[name] = _Entry(t)
        return buf

    # ------------------------------------------------------------------ export
    def _at_boundary(self, what: str) -> int:
        if self._pending is not None:
            raise RuntimeError(f"{what}: sublayer {self._pending} was routed but not committed")
        if self.next_sublayer % 2:
            raise RuntimeError(f"{what}: only at a layer boundary (next sublayer {self.next_sublayer})")
        return self.next_sublayer // 2

    def _named(self, name: str, f: int) -> _Entry:
        if name == "h0" and f == 0:
            if self.plan.additive:
                return self._entries.get("h0") or _Entry(self.x)
            return self._entries["p"]
        if name == "x":
            return _Entry(self.x)  # handed out (payload, checkpoint output): shared from now on
        return self._entries[name]

    def payload_names(self) -> List[str]:
        """Names of :meth:`to_tensors` at the current position."""
        return self.plan.payload_names(self._at_boundary("payload_names"))

    def to_tensors(self) -> List[Tensor]:
        """The tensors ``plan.payload_names(next_first_layer)`` in order (the held tensors
        themselves, no copies): a pipeline payload or the outputs of a checkpointed chunk."""
        f = self._at_boundary("to_tensors")
        return [self._named(n, f).value for n in self.plan.payload_names(f)]

    @property
    def x(self) -> Optional[Tensor]:
        """The residual stream (additive modes). Commit adds each v_j into it in place while the
        buffer alone holds it; reading it here marks it shared, so a tensor once read never changes
        (the next commit makes a new one). With ``plan.x_from_sources`` it is the sum of the held
        sources, in payload order (the same additions on every pipeline layout)."""
        self._x_own = False
        if self._x is None and self.plan.x_from_sources and self._entries:
            values = [e.value for e in self._entries.values()]
            x = values[0] + values[1] if len(values) > 1 else values[0]
            for v in values[2:]:
                x = x.add_(v) if x.dtype == v.dtype else x + v  # x is a fresh sum nobody saved
            return x
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
            if len(readers) <= 1 or any(r.routes_in_kernel(e.value) for r in readers):
                # One reader here (P<b>, p, or a scope's last reader): its router projects the source in
                # the pass that routes it (router._RouteFunction, "local" source), no separate pass.
                # Likewise for routers on fla's kernel, which computes every logit in its own pass.
                e.source = Source(e.value, None, {}, self.eps, None)
                return e.source
            for r in readers:
                if r not in self._queries:
                    with torch.autocast(device_type=e.value.device.type, enabled=False):
                        self._queries[r] = r.query_vector()
            e.source = make_source(e.value, self.eps, readers, self._queries)
        return e.source

    def read(self, j: int) -> List[Source]:
        """The sources sublayer j's router reads (null source excluded), in order."""
        names = self.plan._reads(j)
        missing = [n for n in names if n not in self._entries]
        if missing:
            raise RuntimeError(
                f"sublayer {j} reads {missing}, which this buffer (holding {self.names}) lacks")
        return [self._source(n, j) for n in names]

    def _expect(self, j: int) -> None:
        if self._pending is not None:
            raise RuntimeError(f"sublayer {self._pending} was routed but not committed")
        if j != self.next_sublayer:
            raise RuntimeError(f"expected sublayer {self.next_sublayer}, got {j}")

    def _route(self, key, router: DepthRouter, sources: List[Source], *, base: Optional[Tensor],
               apply_gate: bool) -> Tensor:
        # delta_block's exact sources sum to x (h0 + sum Delta + P), so the router may rebuild the
        # partial sum P from its output in backward instead of keeping it (router._RouteFunction);
        # with x_from_sources (base None) the router forms x from them in its pass.
        base_sums = self.plan.x_from_sources or (
            base is not None and self.plan.mode == "delta_block" and not self.plan.authors)
        if self.record_routing:
            r, alpha = router(sources, True, base=base, apply_gate=apply_gate, base_sums=base_sums)
            self.routing[key] = alpha.detach()
            return r
        return router(sources, base=base, apply_gate=apply_gate, base_sums=base_sums)

    def routed_input(self, j: int, router: DepthRouter) -> Tensor:
        """The input u of sublayer j: additive modes ``x + gated(r_j(S))``, replacement modes
        ``r_j(B + [p])`` (and their block-start bookkeeping)."""
        self._expect(j)
        plan = self.plan
        sources = self.read(j)
        if plan.additive:
            u = self._route(j, router, sources, base=self._x, apply_gate=True)  # x + G(r), one pass
            # (x_from_sources: self._x is None and the router forms x from the sources, same pass)
            if plan.mode == "delta_block" and plan.authors and plan.is_block_start(j):
                # The public code appends, after routing and before the output is added,
                # x (first time) or x - blocks[-1] (later).
                b = plan.block_of(j)
                val = self.x if b == 0 else self._x - self._entries[f"A{b - 1}"].value  # A0 is x itself
                self._entries[f"A{b}"] = _Entry(val)
        else:
            u = self._route(j, router, sources, base=None, apply_gate=False)
            if plan.mode == "full_attnres" or plan.is_block_start(j):
                p = self._entries.pop("p")
                nb = len(self._entries)
                self._entries[f"B{nb}"] = p
        self._pending = j
        return u

    def commit(self, j: int, out: Tensor) -> None:
        """Record sublayer j's output (v_j for the additive modes, f_j(u) for replacement)."""
        if self._pending != j:
            raise RuntimeError(f"commit({j}) without routed_input({j})")
        plan = self.plan
        if plan.additive:
            last = j + 1 == plan.num_sublayers
            if plan.x_from_sources:
                pass  # x is the sum of the sources, below (NOT u + v_j)
            elif self._x_own and out.dtype == self._x.dtype:  # nothing saved x (routers do not save their base)
                self._x.add_(out)  # NOT u + v_j
            else:
                self._x, self._x_own = self._x + out, True
            if plan.mode == "delta":
                if not last or plan.x_from_sources:  # v_{2L-1} is read by nobody (but is part of x)
                    self._entries[f"v{j}"] = _Entry(out)
            elif not plan.authors:
                b = plan.block_of(j)
                key = f"P{b}"
                prev = self._entries.pop(key, None)
                val = out if prev is None else prev.value + out
                if plan.is_block_end(j):
                    if b + 1 < plan.num_blocks or plan.x_from_sources:  # the last block's sum: only in x
                        self._entries[f"D{b}"] = _Entry(val)
                else:
                    self._entries[key] = _Entry(val)
        else:
            prev = self._entries.pop("p", None)
            if plan.mode == "attnres" and prev is not None:
                out = prev.value + out
            self._entries["p"] = _Entry(out)
        self._pending = None
        self.next_sublayer = j + 1

    def output(self, final_router: Optional[DepthRouter] = None) -> Tensor:
        """After the last layer: x (additive), final_router(B + [p]) (replacement)."""
        f = self._at_boundary("output")
        if f != self.plan.num_layers:
            raise RuntimeError(f"output(): only after the last layer (next layer is {f})")
        if self.plan.additive:
            return self.x
        if final_router is None:
            raise ValueError(f"--residual {self.plan.mode} needs a final router")
        names = self.plan.final_reads()
        return self._route("final", final_router, [self._source(n, "final") for n in names],
                           base=None, apply_gate=False)
