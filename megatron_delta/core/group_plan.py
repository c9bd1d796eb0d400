"""Group planning for the group router: pure arithmetic over counts, no torch.

Which routers of a buffer scope route together, and how the planned passes are counted. Everything here is a
function of integers (routers in a scope, sources the first one reads, the option's value), so that the plan can be
read, tested and priced without building a model:

- the option ``--delta-router-group-size`` (:func:`parse_group_size`, :func:`check_group_size`);
- the closed form of a scope's counted passes on the C kernels (:func:`passes`), which ``auto`` minimises;
- ``auto``'s split of a scope into groups (:func:`auto_group_sizes`) and the groups' sublayer spans
  (:func:`group_spans`);
- which groups defer their share of the older sources' gradients to the previous group's pass
  (:func:`deferring_groups`, :func:`deferring_starts`), and whether a block's routers defer to one pass on the
  Triton kernels (:func:`block_defers`);
- the resolution of a scope's sizes from the option and what the routers run on (:func:`resolve_sizes`).

core/group_router.py runs the plan (docstring there: the passes and their math); perf/cost_model.py prices it.
tests/unit/test_import_direction.py holds that this module imports nothing but the standard library.
"""
from __future__ import annotations

import functools
from typing import Dict, List, Sequence, Tuple, Union

AUTO = "auto"
FLAG = "--delta-router-group-size"
# auto's largest group. The Triton kernels pad S to a power of two and hold [S, hidden] fp32 tiles per program, so
# groups of 9-16 pad to 16, and their old passes spill the most registers: at the 1B width 720-1,296 bytes per thread
# in the backward and 544-584 in the forward, against at most 152 and 0 up to 8 (tools/kernel_resources.py, sm_90).
# At the 1B and 8B depths, capping at 8 moves 0.5 % and 1.4 % more counted bytes (perf/cost_model.py, Triton).
AUTO_MAX_GROUP = 8
FINE_GRAINED_MODES = ("delta", "full_attnres")


# --------------------------------------------------------------------------------------------- the option
def parse_group_size(text: Union[str, int]) -> Union[str, int]:
    """``auto`` or a positive integer (the flag's argparse type; ValueError naming the flag)."""
    if isinstance(text, str) and text == AUTO:
        return AUTO
    try:
        value = int(text)
    except (TypeError, ValueError):
        value = None
    if value is None or isinstance(text, bool) or value < 1 or str(value) != str(text).strip():
        raise ValueError(f"{FLAG} {text!r} is not 'auto' or a positive integer (1 = one router per pass)")
    return value


def check_group_size(value, residual: str, sources: str = "exact", kernels: str = "auto") -> Union[str, int]:
    """The resolved option: ``auto`` or S >= 1. An explicit S > 1 is refused (ValueError naming the flag)
    outside the fine-grained modes' exact sources, and with fla's kernel (one router per call)."""
    value = parse_group_size(value)
    if value == AUTO or value == 1:
        return value
    if residual not in FINE_GRAINED_MODES:
        raise ValueError(f"{FLAG} {value} applies to --residual delta and full_attnres (every sublayer's output "
                         f"is a source), not {residual}; drop {FLAG} or set it to 1")
    if sources != "exact":
        raise ValueError(f"{FLAG} {value} needs --delta-sources exact (the authors' delta starts with a router "
                         f"that reads no source); drop {FLAG} or set it to 1")
    if kernels == "fla":  # fla-core's kernel routes one router per call
        raise ValueError(f"{FLAG} {value} cannot run on fla's kernel (--delta-router-kernels fla routes one router "
                         f"per call); use --delta-router-kernels auto, triton, c or torch, or {FLAG} 1")
    return value


Sizes = Union[int, Tuple[int, ...]]  # one group size S, or the sizes of consecutive groups (auto_group_sizes)


def passes(n_routers: int, n_older: int, size: Sizes, unit: bool = True, base: bool = False,
           null: bool = False) -> int:
    """The closed form of the C kernels' counted traffic (core/traffic.py) for a scope of ``n_routers``
    routers whose first reads ``n_older`` sources, in groups of ``size`` (S, or the groups' sizes in order):
    [T, d] tensors read or written, each counted once (fp32 throughout; with bf16 activations r_k and the
    gradients' fp32 tensors count twice). The PyTorch ops make more passes (one per op; perf/cost_model.py prices them).
    ``unit``: x is the sum of the sources (delta without a gate: the old pass writes X, each merge reads it);
    ``base``: the merges read the held x (delta with the gate); neither: full_attnres. Per group of s routers
    with n_g older sources:

    - forward: the old pass reads the n_g sources and writes s partial mixes (+ X); merge k reads r_k (+ X or
      x) and its k in-group sources and writes u;
    - backward: merge k reads G_k, r_k and its k in-group sources, and updates the gradient of its newest one
      (read + write) with its own share and the shares merges k + 1 .. s - 1 deferred to it (reading their
      G_k again: group_router._Merge); the old pass reads the n_g sources and the s G_k and updates the n_g sources'
      gradients;

    4 n_g + s (6 + unit + base) + unit + (s - 1)(3 s + 2) / 2 per group, less 4 + unit where the group's first
    router has no base (its u comes from the old pass, written in place of r_0: no merge reads r_0 and X and writes
    u, and no merge backward reads G_0 and r_0; group_router._OldPass's first_u), less one per source read with a
    gradient (its first gradient, the last reader's in forward order, is written, not updated). Where x is handed
    out as the sum of the sources in the same scope (unit), group_router._FinalSum seeds every sink and each first
    gradient adds the seed; the call that writes a sink first reads the seed once for all the sinks it writes
    first - the last group's old pass (every older source) - so less all but one of that call's seed reads
    instead. ``null``: the null source's value gradient reads each G_k once more (s per group); its value and the
    weight tables are [d] and [T]-sized and not counted. Less, for each group that defers to the one before
    (:func:`deferring_groups`), what that saves (:func:`_deferral_savings`)."""
    total, a = 0, 0
    sizes = _sizes(size, n_routers)
    for s in sizes:
        total += _group_passes(n_older + a, s, unit, base, null)
        a += s
    if unit and sizes:
        total -= _seed_reads_saved(n_older + n_routers - sizes[-1], sizes[-1])
    savings = _deferral_savings(sizes, n_older, unit)
    return total - sum(sv for sv, defers in zip(savings, deferring_groups(sizes, n_older, unit)) if defers)


def _deferral_savings(sizes: Sequence[int], n_older: int, unit: bool) -> List[int]:
    """Passes saved where group j defers its share of the gradients of the previous group's older sources
    (n_{j-1} of them) to that group's old pass (group_router.OldShare): their sinks are not read and written here
    (2 n_{j-1}), and the previous pass reads this group's s_j output gradients again; where x's gradient seeds the
    sinks (unit) and j is the scope's last group, the seed is read once more (by the previous pass too)."""
    out, a = [0], n_older + (sizes[0] if sizes else 0)
    for j in range(1, len(sizes)):
        out.append(_deferral_saving(a - sizes[j - 1], sizes[j], unit and j == len(sizes) - 1))
        a += sizes[j]
    return out


def _deferral_saving(n_prev: int, s: int, seed_read: bool) -> int:
    """What one group of ``s`` routers saves by deferring to the previous group's pass over ``n_prev`` sources
    (:func:`_deferral_savings`); ``seed_read``: that pass reads x's seed once more."""
    return 2 * n_prev - s - int(seed_read)


def deferring_groups(sizes: Sequence[int], n_older: int, unit: bool = True) -> Tuple[bool, ...]:
    """Which groups of a scope (``sizes`` in order, the first reading ``n_older`` sources) defer their share of
    the gradients of the previous group's older sources to the previous group's old pass (group_router.OldShare; on
    the C and Triton kernels): the set with the most passes saved (:func:`_deferral_savings`) in which no group
    both defers and receives (a receiving pass writes every sink it reads), by dynamic programming along the
    groups. A scope's later groups read more older sources, so the pairs run from its end: (last, one before),
    and so on."""
    sav = _deferral_savings(sizes, n_older, unit)
    best: List[Tuple[int, Tuple[bool, ...]]] = [(0, ())]  # best[j + 1]: the groups 0 .. j
    for j in range(len(sizes)):
        skip = (best[j][0], best[j][1] + (False,))
        take = (best[j - 1][0] + sav[j], best[j - 1][1] + (False, True)) if j >= 1 and sav[j] > 0 else None
        best.append(max([skip] + ([take] if take else []), key=lambda c: c[0]))
    return best[-1][1]


def deferring_starts(spans: Dict[int, Tuple[int, int]], n_older: int, unit: bool) -> Dict[int, bool]:
    """Group start -> whether that group defers to the one before (:func:`deferring_groups`), for a scope's
    ``spans`` (:func:`group_spans`) whose first router reads ``n_older`` sources."""
    groups = sorted(set(spans.values()))
    flags = deferring_groups([b - a for a, b in groups], n_older, unit)
    return {a: f for (a, _), f in zip(groups, flags)}


def _group_passes(n_g: int, s: int, unit: bool = True, base: bool = False, null: bool = False) -> int:
    """:func:`passes` of one group of ``s`` routers over ``n_g`` older sources."""
    first_u = 0 if base else 4 + int(unit)  # the first router's u from the old pass (no merge)
    in_group = (s - 1) * (3 * s + 2) // 2  # merge k: k sources read each way, k + 1 ... s - 1's G_k, one gradient
    return 4 * n_g + s * (6 + int(unit) + int(base) + int(null)) + int(unit) + in_group - first_u


def _seed_reads_saved(n_g: int, s: int) -> int:
    """The seed reads a scope's last group (``s`` routers over ``n_g`` older sources) saves where x's gradient seeds
    every sink (unit): its old pass reads the seed once for its n_g sinks (each merge writes one sink)."""
    return n_g - 1


def _nth_size(size: Sizes, i: int) -> int:
    """The size of group ``i``: S, or the i-th of the given sizes, the last one repeated."""
    return size if isinstance(size, int) else size[min(i, len(size) - 1)]


def _sizes(size: Sizes, n: int) -> List[int]:
    """The sizes of the groups that cut ``n`` consecutive routers (:func:`_nth_size`), the last group clipped."""
    out, a = [], 0
    while a < n:
        s = min(_nth_size(size, len(out)), n - a)
        out.append(s)
        a += s
    return out


@functools.lru_cache(maxsize=256)  # every micro-batch's SourceBuffer asks again: O(n^2) in Python per ask
def auto_group_sizes(n_routers: int, n_older: int, first_u: bool = True) -> Sizes:
    """The groups of ``auto``: the split of ``n_routers`` consecutive routers (the first reads ``n_older``
    sources) into consecutive groups with the fewest counted passes (:func:`passes`; the only terms a split
    changes are 4 n_g per group, its old pass's sources read and their gradients, against (s - 1)(3 s + 2) / 2 in its
    merges and one X per group, the last group's seed reads, and what each group saves by deferring to the one before
    it, :func:`deferring_groups`), by dynamic programming over where each group starts, the size of the group before
    it and whether that one defers, each group of at most AUTO_MAX_GROUP routers. The sizes grow along the scope (to
    that cap); 1 where single routers are cheapest (one router per pass). ``first_u``: each group's first router
    takes its u from the old pass (no gate, no base: group_router._OldPass), 4 + 1 passes less per group; else the
    merges read the base."""
    n = n_routers
    # state (a, size of the group ending at a, whether it defers) -> (passes of routers 0 .. a - 1, sizes)
    states: List[Dict[Tuple[int, bool], Tuple[int, Tuple[int, ...]]]] = [{} for _ in range(n + 1)]
    states[0][0, False] = (0, ())
    for a in range(n):
        for (s_prev, prev_defers), (cost, sizes) in states[a].items():
            for s in range(1, min(n - a, AUTO_MAX_GROUP) + 1):
                last = a + s == n
                c = cost + _group_passes(n_older + a, s, base=not first_u) - (
                    _seed_reads_saved(n_older + a, s) if last else 0)
                options = [(c, False)]
                if s_prev and not prev_defers:  # defer to the group before (it receives, so it did not defer)
                    saved = _deferral_saving(n_older + a - s_prev, s, last)
                    if saved > 0:
                        options.append((c - saved, True))
                for c2, defers in options:
                    key, best = (s, defers), states[a + s]
                    if key not in best or (c2, sizes + (s,)) < best[key]:
                        best[key] = (c2, sizes + (s,))
    sizes = min(states[n].values())[1]
    return 1 if all(s == 1 for s in sizes) else sizes


def group_spans(sublayers: Sequence[int], size: Sizes) -> Dict[int, Tuple[int, int]]:
    """Sublayer -> [a, b) of its group: consecutive runs of ``sublayers`` cut into groups of ``size`` (S, or the
    groups' sizes in order, as :func:`_nth_size`); a group never crosses a gap in the run (the next group starts
    after it with the next size)."""
    out: Dict[int, Tuple[int, int]] = {}
    js = sorted(sublayers)
    start = groups = 0
    while start < len(js):
        limit = _nth_size(size, groups)
        groups += 1
        end = start
        while end + 1 < len(js) and js[end + 1] == js[end] + 1 and end + 1 - start < limit:
            end += 1
        span = (js[start], js[end] + 1)
        for j in js[start:end + 1]:
            out[j] = span
        start = end + 1
    return out


def block_defers(routers: int, sources: int) -> bool:
    """Whether a block's ``routers`` (those of one buffer scope) defer the gradients of the ``sources`` they all
    read through the Triton kernels' sinks to one pass (triton_router.BlockDeferral): where it moves fewer rows. In
    place, each router reads and writes each source's gradient (2 rows per router and source); deferred, the pass
    reads each router's output gradient once, and each source and its gradient once and writes it (routers + 3 per
    source). The one fresh write per source (its first writer in backward writes without reading) is the same
    either way."""
    return sources > 0 and 2 * routers * sources > routers + 3 * sources


def resolve_sizes(size: Union[int, str], n_routers: int, n_older: int, *, one_router_per_call: bool,
                  fused_passes: bool, first_u: bool = True) -> Sizes:
    """A scope's group sizes from the option's ``size`` (``auto`` or S): S as given; ``auto`` is 1 where a router
    routes one per call (``one_router_per_call``: fla's kernel) or where no fused kernel runs the passes
    (``fused_passes`` False: on PyTorch ops, counted per op, a group moves more bytes than one router per pass),
    else :func:`auto_group_sizes` for ``n_routers`` routers whose first reads ``n_older`` sources."""
    if size != AUTO:
        return size
    if one_router_per_call or not fused_passes:
        return 1
    return auto_group_sizes(n_routers, n_older, first_u)
