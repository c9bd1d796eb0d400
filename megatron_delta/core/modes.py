"""The residual modes: their names, the one check of which residual options go together, and one class per
routed mode that owns what differs between the modes (docs/design.md section 1).

Standard library only: the argument parsers, DeltaTransformerConfig, SourcePlan / SourceBuffer, the HF
configuration, conversion and tools take mode names and rules from here, and an exported HF model carries a
copy of this file (megatron_delta.hf.write_remote_code_model), so it must run without torch or Megatron.

Sublayers are numbered globally j = 0..2L-1 (even: attention of layer j//2, odd: its MLP); layers form
K = num_blocks blocks of L/K consecutive layers (the block modes). The source names (also the names of the
pipeline payload tensors; ``x`` is the residual stream of the additive modes, where held):

==================  ==========================================================================
mode                sources
==================  ==========================================================================
delta               h0, v0, v1, ... (sublayer outputs)
delta_block exact   h0, D0, D1, ... (completed block sums), P<b> (partial sum of block b)
delta_block authors A0, A1, ... (the public code's list: A0 = H0, A<c> = H_c - A<c-1>)
attnres             B0 (= h0), B1, ... (completed block representations), p (partial)
full_attnres        B0 (= h0), B1 (= v0), ..., p (the latest sublayer output)
==================  ==========================================================================

A mode object acts on one micro-batch's SourceBuffer (megatron_delta/core/sources.py) through its small
interface: ``hold(name, value)`` (name ``x``: the residual stream), ``take(name)``, ``value(name)``,
``rename(old, new)``, ``held_x``, ``x``, ``add_to_x(v)``, ``hold_sum(name, partial, v)`` (hold partial + v,
or v without a partial; SourceBuffer lets the sum's one reader form it in its kernel), ``hold_difference(name,
minuend, subtrahend)`` (hold minuend - subtrahend: authors-code delta_block's A<b>) and ``route(j, router,
base=, apply_gate=, base_sums=)``; SourceBuffer keeps the protocol, the projections and the tensor
bookkeeping. The HF model applies the same objects to its DepthSources (megatron_delta/hf/modeling_delta.py),
the same interface over a dict of tensors. A new mode is a subclass registered here (and its float64 reference in
tests/helpers/reference_delta.py): no other production file.

Messages name the command-line flag (``FLAGS``) or, for the HF configuration, its field (``HF_FIELDS``).
"""
from __future__ import annotations

from typing import ClassVar, Dict, List, Mapping, Optional, Tuple

BASELINE, ATTNRES, FULL_ATTNRES, DELTA, DELTA_BLOCK = "baseline", "attnres", "full_attnres", "delta", "delta_block"
EXACT, AUTHORS_CODE = "exact", "authors-code"
SOURCE_DEFINITIONS = (EXACT, AUTHORS_CODE)
GATES = ("none", "scalar")
# --delta-router-kernels: 'auto' (C kernels for fp32 CPU tensors, the Triton kernels for CUDA ones - fla's
# when Triton does not import), 'c', 'torch', 'fla', 'triton' (here, torch-free, for the planning tools' flags)
KERNEL_CHOICES = ("auto", "c", "torch", "fla", "triton")


class Spelling:
    """How a message names an option: as the flag the user typed, or as the field of the HF configuration."""

    def __init__(self, names: Mapping[str, str], between: str) -> None:
        self.names, self.between = dict(names), between

    def __call__(self, option: str, value: object = None) -> str:
        """``option``'s name, with ``value`` when given: ``--delta-gate scalar`` / ``delta_gate=scalar``."""
        name = self.names[option]
        return name if value is None else f"{name}{self.between}{value}"


FLAGS = Spelling({"residual": "--residual", "num_layers": "--num-layers", "num_blocks": "--delta-num-blocks",
                  "null_source": "--delta-null-source", "gate": "--delta-gate", "sources": "--delta-sources",
                  "delta_router_lr_mult": "--delta-router-lr-mult", "router_kernels": "--delta-router-kernels"}, " ")
HF_FIELDS = Spelling({"residual": "residual", "num_layers": "num_hidden_layers", "num_blocks": "delta_num_blocks",
                      "null_source": "delta_null_source", "gate": "delta_gate", "sources": "delta_sources",
                      "delta_router_lr_mult": "delta_router_lr_mult", "router_kernels": "delta_router_kernels"}, "=")


def _names(prefix: str, n: int) -> List[str]:
    return [f"{prefix}{i}" for i in range(n)]


def _listing(names, last: str = "and") -> str:
    names = list(names)
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} {last} {names[-1]}"


# --------------------------------------------------------------------------------------------- the modes
class RoutedMode:
    """A routed residual mode on a model of ``num_layers`` layers (``num_blocks`` blocks in a block mode).

    Static rules (SourcePlan): which sources sublayer j reads, what crosses a stage boundary, how long a
    source value lives. Per micro-batch (SourceBuffer): :meth:`start`, :meth:`routed_input`, :meth:`commit`,
    :meth:`output`, acting on the buffer through its interface (module docstring)."""

    name: ClassVar[str]
    additive: ClassVar[bool]  # u = x + G(r) over a residual stream x, or u = r (the stream is replaced)
    blocked: ClassVar[bool] = False  # sources are sums over blocks of L/K layers (--delta-num-blocks)
    source_definitions: ClassVar[Tuple[str, ...]] = (EXACT,)  # the --delta-sources the mode defines
    sources_sum_to_x: ClassVar[bool] = False  # x = the sum of what each router reads: x_from_sources allowed
    router_rebuilds_from_x: ClassVar[bool] = False  # x held: tell the router x sums its sources (base_sums)
    definition: ClassVar[str] = EXACT  # the source definition this class implements

    @classmethod
    def for_sources(cls, sources: str) -> type:
        """The class implementing source definition ``sources`` of this mode (itself for exact)."""
        return cls

    def __init__(self, num_layers: int, num_blocks: int, x_from_sources: bool = False) -> None:
        if not isinstance(num_layers, int) or num_layers < 1:
            raise ValueError(f"the number of layers must be a positive integer, got {num_layers!r}")
        if self.blocked:
            _check_num_blocks(num_layers, num_blocks, FLAGS)
        if x_from_sources and not self.sources_sum_to_x:
            raise ValueError(f"x_from_sources: only the additive modes' exact sources sum to the residual "
                             f"stream, not --residual {self.name} --delta-sources {self.definition}")
        self.num_layers, self.num_blocks, self.x_from_sources = num_layers, num_blocks, x_from_sources
        self.layers_per_block = num_layers // num_blocks if self.blocked else 1

    # ------------------------------------------------------------------ geometry
    def block_of(self, j: int) -> int:
        """Block index of sublayer j (block modes)."""
        return (j // 2) // self.layers_per_block

    def is_block_start(self, j: int) -> bool:
        """j is the attention sublayer of a layer that starts a block."""
        return j % 2 == 0 and (j // 2) % self.layers_per_block == 0

    def is_block_end(self, j: int) -> bool:
        """j is the MLP sublayer of the last layer of a block."""
        return j % 2 == 1 and (j // 2 + 1) % self.layers_per_block == 0

    # ------------------------------------------------------------------ static rules
    def reads(self, j: int) -> List[str]:
        """Names of the sources sublayer j's router reads, in order (the null source excluded)."""
        raise NotImplementedError

    def sources_at(self, f: int) -> List[str]:
        """Names of the sources held at the start of layer f (0 < f <= L), those later receivers read."""
        raise NotImplementedError

    def payload_names(self, f: int) -> List[str]:
        """What travels into a stage whose first layer is f (0 < f <= L; SourcePlan handles f = 0)."""
        raise NotImplementedError

    def final_reads(self) -> List[str]:
        """Sources of the final router (replacement modes); [] for the additive modes."""
        return []

    def start_names(self) -> Tuple[str, ...]:
        """The names the embedding output h0 is held under at the start; the last one is what a payload
        at first layer 0 (named ``h0``) hands out."""
        raise NotImplementedError

    def rewritten_by_commit(self, j: int) -> Optional[str]:
        """The source j reads whose value j's commit replaces (so the value has one reader), if any."""
        return None

    def renamed_by_routing(self, j: int) -> Optional[str]:
        """The name the rewritten source takes when j routes (then it lives on), if it does."""
        return None

    # ------------------------------------------------------------------ one micro-batch
    def start(self, buf, h0) -> None:
        for name in self.start_names():
            buf.hold(name, h0)

    def routed_input(self, buf, j: int, router):
        """The input u of sublayer j (and the bookkeeping of its routing)."""
        raise NotImplementedError

    def commit(self, buf, j: int, out) -> None:
        """Record sublayer j's output."""
        raise NotImplementedError

    def output(self, buf, final_router):
        """What the decoder hands to the final norm after the last layer."""
        raise NotImplementedError


class AdditiveMode(RoutedMode):
    """u = x + G(r) over the residual stream x; x <- x + v_j (docs/design.md's update rule). With
    ``x_from_sources`` x is not held: the router forms it from the sources, and it is summed from them only
    where it is handed out (SourceBuffer.x)."""

    additive = True
    embedding_sources: ClassVar[Tuple[str, ...]] = ("h0",)  # sources h0 is held as at the start

    def start_names(self) -> Tuple[str, ...]:
        return (() if self.x_from_sources else ("x",)) + self.embedding_sources

    def payload_names(self, f: int) -> List[str]:
        # x is sent rather than re-derived from the sources (which would round differently), unless the
        # sources are x; after the last layer only x is left.
        if f == self.num_layers:
            return ["x"]
        return ([] if self.x_from_sources else ["x"]) + self.sources_at(f)

    def routed_input(self, buf, j: int, router):
        base = buf.held_x  # None with x_from_sources: the router forms x from the sources in the same pass
        u = buf.route(j, router, base=base, apply_gate=True,
                      base_sums=self.x_from_sources or (base is not None and self.router_rebuilds_from_x))
        self.after_routing(buf, j)
        return u

    def after_routing(self, buf, j: int) -> None:
        """Sources made after sublayer j routed and before its output is added (authors-code)."""

    def commit(self, buf, j: int, out) -> None:
        if not self.x_from_sources:
            buf.add_to_x(out)  # NOT u + v_j
        self.keep_output(buf, j, out)

    def keep_output(self, buf, j: int, out) -> None:
        """What the sources keep of v_j."""
        raise NotImplementedError

    def output(self, buf, final_router):
        return buf.x


class DeltaMode(AdditiveMode):
    """Every sublayer's output is a source: S = [h0, v0, ..., v_{j-1}]."""

    name = DELTA
    source_definitions = (EXACT, AUTHORS_CODE)
    sources_sum_to_x = True

    @classmethod
    def for_sources(cls, sources: str) -> type:
        return DeltaAuthorsCodeMode if sources == AUTHORS_CODE else cls

    def reads(self, j: int) -> List[str]:
        return ["h0"] + _names("v", j)

    def sources_at(self, f: int) -> List[str]:
        return ["h0"] + _names("v", 2 * f)

    def keep_output(self, buf, j: int, out) -> None:
        if j + 1 < 2 * self.num_layers or self.x_from_sources:  # v_{2L-1} is read by nobody (but is in x)
            buf.hold(f"v{j}", out)


class DeltaAuthorsCodeMode(DeltaMode):
    """delta as the public code: layer 0's attention reads no source (u = x)."""

    definition = AUTHORS_CODE
    sources_sum_to_x = False

    def reads(self, j: int) -> List[str]:
        return [] if j == 0 else super().reads(j)


class DeltaBlockMode(AdditiveMode):
    """Sources: h0, the sums D_c of the outputs of each completed block c < b, and the partial sum P_b of
    block b (when it has one)."""

    name = DELTA_BLOCK
    blocked = True
    source_definitions = (EXACT, AUTHORS_CODE)
    sources_sum_to_x = True
    router_rebuilds_from_x = True  # the router may rebuild P from u in backward instead of keeping it

    @classmethod
    def for_sources(cls, sources: str) -> type:
        return DeltaBlockAuthorsCodeMode if sources == AUTHORS_CODE else cls

    def reads(self, j: int) -> List[str]:
        b = self.block_of(j)
        return ["h0"] + _names("D", b) + ([] if self.is_block_start(j) else [f"P{b}"])

    def sources_at(self, f: int) -> List[str]:
        lb = self.layers_per_block
        return ["h0"] + _names("D", f // lb) + ([f"P{f // lb}"] if f % lb else [])

    def rewritten_by_commit(self, j: int) -> Optional[str]:
        return None if self.is_block_start(j) else f"P{self.block_of(j)}"

    def keep_output(self, buf, j: int, out) -> None:
        b = self.block_of(j)
        partial = buf.take(f"P{b}")
        if not self.is_block_end(j):
            buf.hold_sum(f"P{b}", partial, out)
        elif b + 1 < self.num_blocks or self.x_from_sources:  # the last block's sum: only in x
            buf.hold_sum(f"D{b}", partial, out)


class DeltaBlockAuthorsCodeMode(DeltaBlockMode):
    """delta_block as the public code: at the first layer of each block, after its attention routed and
    before its output is added, the list gains x (first time) or x - (its last entry); no partial source."""

    definition = AUTHORS_CODE
    embedding_sources = ()  # A0 is made at sublayer 0 (as x itself)
    sources_sum_to_x = False
    router_rebuilds_from_x = False

    def reads(self, j: int) -> List[str]:
        b = self.block_of(j)
        return _names("A", b if self.is_block_start(j) else b + 1)

    def sources_at(self, f: int) -> List[str]:
        return _names("A", -(-f // self.layers_per_block))

    def rewritten_by_commit(self, j: int) -> Optional[str]:
        return None

    def after_routing(self, buf, j: int) -> None:
        if self.is_block_start(j):
            b = self.block_of(j)
            if b == 0:
                buf.hold("A0", buf.x)  # A0 is x itself
            else:
                buf.hold_difference(f"A{b}", buf.held_x, buf.value(f"A{b - 1}"))

    def keep_output(self, buf, j: int, out) -> None:
        pass  # the output is only in x


class ReplacementMode(RoutedMode):
    """u = r over B + [p]: the routed mix replaces the residual stream. p accumulates the outputs since it
    last became a completed source B_c; a final router mixes B + [p] before the final norm."""

    additive = False

    def start_names(self) -> Tuple[str, ...]:
        return ("p",)

    def payload_names(self, f: int) -> List[str]:
        return self.sources_at(f)

    def final_reads(self) -> List[str]:
        return self.sources_at(self.num_layers)

    def rewritten_by_commit(self, j: int) -> Optional[str]:
        return "p"

    def routed_input(self, buf, j: int, router):
        u = buf.route(j, router, base=None, apply_gate=False, base_sums=False)
        completed = self.renamed_by_routing(j)
        if completed is not None:
            buf.rename("p", completed)
        return u

    def commit(self, buf, j: int, out) -> None:
        buf.hold_sum("p", buf.take("p"), out)

    def output(self, buf, final_router):
        if final_router is None:
            raise ValueError(f"--residual {self.name} needs a final router")
        return buf.route("final", final_router, base=None, apply_gate=False, base_sums=False)


class AttnResMode(ReplacementMode):
    """Block attention residuals: B_c are the completed block representations (B0 = h0)."""

    name = ATTNRES
    blocked = True

    def reads(self, j: int) -> List[str]:
        b = self.block_of(j)
        return _names("B", b if self.is_block_start(j) else b + 1) + ["p"]

    def sources_at(self, f: int) -> List[str]:
        return _names("B", -(-f // self.layers_per_block)) + ["p"]

    def renamed_by_routing(self, j: int) -> Optional[str]:
        return f"B{self.block_of(j)}" if self.is_block_start(j) else None


class FullAttnResMode(ReplacementMode):
    """Full attention residuals: every sublayer output becomes a source (B_{c+1} = v_c)."""

    name = FULL_ATTNRES

    def reads(self, j: int) -> List[str]:
        return _names("B", j) + ["p"]

    def sources_at(self, f: int) -> List[str]:
        return _names("B", 2 * f) + ["p"]

    def renamed_by_routing(self, j: int) -> Optional[str]:
        return f"B{j}"


# The registry: routed mode name -> its class (in the order --residual lists them).
ROUTED_MODE_CLASSES: Dict[str, type] = {cls.name: cls for cls in (AttnResMode, FullAttnResMode, DeltaMode,
                                                                    DeltaBlockMode)}
RESIDUAL_MODES = (BASELINE,) + tuple(ROUTED_MODE_CLASSES)
ROUTED_MODES = RESIDUAL_MODES[1:]
ADDITIVE_MODES = tuple(m for m in ROUTED_MODES if ROUTED_MODE_CLASSES[m].additive)
REPLACEMENT_MODES = tuple(m for m in ROUTED_MODES if not ROUTED_MODE_CLASSES[m].additive)
BLOCK_MODES = tuple(m for m in ADDITIVE_MODES + REPLACEMENT_MODES if ROUTED_MODE_CLASSES[m].blocked)


# --------------------------------------------------------------------------------------------- the rules
def _check_choice(option: str, value, choices, spell: Spelling) -> None:
    if value not in choices:
        raise ValueError(f"{spell(option, repr(value))} is not one of {', '.join(choices)}")


def _check_defined(residual: str, sources: str, spell: Spelling) -> None:
    if sources not in ROUTED_MODE_CLASSES[residual].source_definitions:
        defining = [m for m, cls in ROUTED_MODE_CLASSES.items() if sources in cls.source_definitions]
        raise ValueError(f"{spell('sources', sources)} is defined for {spell('residual')} "
                         f"{_listing(defining)} only")


def _check_num_blocks(num_layers: int, num_blocks, spell: Spelling) -> None:
    if not isinstance(num_blocks, int) or isinstance(num_blocks, bool) or num_blocks < 1 or num_layers % num_blocks:
        raise ValueError(f"{spell('num_blocks', num_blocks)} must be a positive divisor of "
                         f"{spell('num_layers', num_layers)} (each block holds L/K consecutive layers)")


def routed_mode_class(residual: str, sources: str = EXACT, spell: Spelling = FLAGS) -> type:
    """The class of routed mode ``residual`` with source definition ``sources`` (ValueError naming the flag)."""
    _check_choice("residual", residual, (BASELINE,) + tuple(ROUTED_MODE_CLASSES), spell)
    if residual == BASELINE:
        raise ValueError(f"{spell('residual', BASELINE)} has no depth sources (no routers)")
    _check_choice("sources", sources, SOURCE_DEFINITIONS, spell)
    _check_defined(residual, sources, spell)
    return ROUTED_MODE_CLASSES[residual].for_sources(sources)


def routed_mode(residual: str, num_layers: int, num_blocks: int, sources: str = EXACT,
                x_from_sources: bool = False) -> RoutedMode:
    """The mode object of a SourcePlan."""
    return routed_mode_class(residual, sources)(num_layers, num_blocks, x_from_sources)


DEFAULT_NUM_BLOCKS = 4  # the paper's K


def default_num_blocks(residual: str, num_layers: int, spell: Spelling = FLAGS) -> int | None:
    """K of a block mode given no number of blocks: 4 (the paper's choice), L for a model of at most 4 layers;
    None outside the block modes. Never more than 4 blocks: blocks are equal (L/K layers each), so a model of
    more than 4 layers that 4 does not divide has no default, and the ValueError names the option and the
    values that divide L. Every path that resolves K (configs, conversion, the perf models) comes here."""
    cls = ROUTED_MODE_CLASSES.get(residual)
    if cls is None or not cls.blocked:
        return None
    if not isinstance(num_layers, int) or num_layers <= DEFAULT_NUM_BLOCKS:
        return num_layers  # a bad L: refused by the caller's divisor check, which names both options
    if num_layers % DEFAULT_NUM_BLOCKS == 0:
        return DEFAULT_NUM_BLOCKS
    divisors = ", ".join(str(k) for k in range(1, num_layers + 1) if num_layers % k == 0)
    raise ValueError(f"{spell('residual', residual)} with {spell('num_layers', num_layers)} needs "
                     f"{spell('num_blocks')} K with K dividing {num_layers} ({divisors}); the default, "
                     f"{DEFAULT_NUM_BLOCKS} blocks, does not divide {num_layers}")


def check_delta_options(residual: str, num_layers: int, num_blocks: int | None, null_source: bool,
                        gate: str, sources: str, delta_router_lr_mult: float = 1.0,
                        router_kernels: str = "auto", *, spell: Spelling = FLAGS) -> int | None:
    """Validate one combination of residual options; returns the resolved number of blocks. ``spell``
    names the options in the messages (FLAGS, or HF_FIELDS for the HF configuration)."""
    _check_choice("residual", residual, (BASELINE,) + tuple(ROUTED_MODE_CLASSES), spell)
    _check_choice("gate", gate, GATES, spell)
    _check_choice("sources", sources, SOURCE_DEFINITIONS, spell)
    if residual == BASELINE:
        used = [name for name, on in [(spell("num_blocks"), num_blocks is not None),
                                      (spell("null_source"), null_source),
                                      (spell("gate", gate), gate != "none"),
                                      (spell("sources", sources), sources != EXACT),
                                      (spell("delta_router_lr_mult"), delta_router_lr_mult != 1.0),
                                      (spell("router_kernels"), router_kernels != "auto")] if on]
        if used:
            verb = "needs" if len(used) == 1 else "need"
            raise ValueError(f"{', '.join(used)} {verb} a routed residual mode; {spell('residual', BASELINE)} has "
                             f"no routers (choose {spell('residual')} {_listing(ROUTED_MODE_CLASSES, 'or')})")
        return None
    mode = ROUTED_MODE_CLASSES[residual]
    if gate != "none" and not mode.additive:
        raise ValueError(f"{spell('gate', gate)} only applies to the additive modes ({', '.join(ADDITIVE_MODES)}): "
                         f"{spell('residual', residual)} replaces the residual stream, so a zero gate would erase it")
    _check_defined(residual, sources, spell)
    if mode.blocked:
        if num_blocks is None:
            num_blocks = default_num_blocks(residual, num_layers, spell)
        _check_num_blocks(num_layers, num_blocks, spell)
    elif num_blocks is not None:
        raise ValueError(f"{spell('num_blocks')} applies to {spell('residual')} {_listing(BLOCK_MODES)}, "
                         f"not {residual} (every sublayer is its own source there)")
    if delta_router_lr_mult <= 0:
        raise ValueError(f"{spell('delta_router_lr_mult')} must be positive (got {delta_router_lr_mult})")
    return num_blocks
