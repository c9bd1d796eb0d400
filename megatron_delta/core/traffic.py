"""Counted memory traffic of the router's kernels: the bytes each kernel call reads and writes.

On a GPU the router is memory-bound, so its cost is the bytes it moves. The router's autograd
Functions call :func:`record` with the tensors a kernel call actually reads and writes; nothing is
recorded (and :func:`record` returns at once) unless a :func:`counting` context is open.

    with traffic.counting() as count:
        loss = model(tokens).sum(); loss.backward()
    count.rows(tokens * hidden, act_bytes=2)   # per (kernel, phase): rows of [tokens, hidden] ("u")

Only tensors of ``tokens * hidden`` elements or more are the traffic the cost model counts; smaller ones
(logit columns, softmax weights, router vectors) are recorded too but reported apart.

Autograd's own gradient additions. When a tensor is read by several autograd nodes, the engine adds their
gradient contributions (each add reads the running sum and the new contribution and writes the sum: 3 rows).
No kernel of ours makes these calls, so they are counted where the residual stream's tensors are made:
SourceBuffer calls :func:`watch` on every tensor it holds or makes (sources, partial sums, x, the
sublayer outputs), and :func:`hand_out` on the tensors that leave it (``output()``, ``to_tensors()``).
hand_out walks the autograd graph back from those tensors - every consumer of a watched tensor inside the
buffer exists by then - and puts a post-hook on each node with an edge into a watched tensor: the hook sees
each contribution as it is produced and records an ``autograd_add`` call from the second one on. A handed-out
tensor has one consumer outside the buffer that the walk cannot see (the final norm, the next checkpoint, the
pipeline payload; under recompute the checkpoint's backward seeds it as a root), so hand_out counts one
contribution for it in advance - unless a later walk of the same graph meets that consumer (the first
checkpoint, seen from the block's output) or a buffer of the same graph holds the tensor again (the block's
layer-by-layer runs, whose own walk then sees its consumers).
"""
from __future__ import annotations

from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

__all__ = ["Call", "TrafficCount", "counting", "record", "active", "watch", "hand_out"]


@dataclass(frozen=True)
class Call:
    """One kernel call: its name, 'forward' or 'backward', and the (numel, element size) of each tensor
    it reads and writes."""
    kernel: str
    phase: str
    reads: Tuple[Tuple[int, int], ...]
    writes: Tuple[Tuple[int, int], ...]


@dataclass
class TrafficCount:
    calls: List[Call] = field(default_factory=list)
    # gradient edge (node, output_nr) of each watched tensor -> [contributions seen, contributions counted
    # in advance for a consumer outside the walked graph (hand_out)]
    _watched: Dict[tuple, List[int]] = field(default_factory=dict, repr=False)
    _hooked: Dict[object, None] = field(default_factory=dict, repr=False)  # nodes already hooked (kept alive)

    def _watch(self, edge: tuple) -> None:
        state = self._watched.setdefault(edge, [0, 0])
        if state[1]:  # handed out, then held again in the same graph: its consumers are walked from there
            state[1] -= 1

    def _contribution(self, edge: tuple, grad: Tensor) -> None:
        state = self._watched[edge]
        prior = state[0] + state[1]
        state[0] += 1
        if prior:  # autograd adds this contribution into the running sum: read both, write the sum
            self.calls.append(Call("autograd_add", "backward", _sizes([grad, grad]), _sizes([grad])))

    def _hook_graph(self, roots: Sequence[Tensor]) -> None:
        stack = [t.grad_fn for t in roots if t.grad_fn is not None]
        seen = set()
        while stack:
            node = stack.pop()
            if node is None or node in seen:
                continue
            seen.add(node)
            nexts = node.next_functions
            mine = [(k, (n, nr)) for k, (n, nr) in enumerate(nexts) if n is not None and (n, nr) in self._watched]
            if mine and node not in self._hooked:
                self._hooked[node] = None
                for _, edge in mine:  # a reader counted in advance by an earlier hand_out, now seen itself
                    state = self._watched[edge]
                    if state[1]:
                        state[1] -= 1

                def hook(grad_inputs, _grad_outputs, mine=mine):
                    for k, edge in mine:
                        if k < len(grad_inputs) and grad_inputs[k] is not None:
                            self._contribution(edge, grad_inputs[k])

                node.register_hook(hook)
            stack.extend(n for n, _ in nexts if n is not None)

    def bytes(self, min_numel: int = 0) -> Dict[Tuple[str, str], Tuple[int, int]]:
        """(kernel, phase) -> (bytes read, bytes written), counting tensors of at least ``min_numel`` elements."""
        out: Dict[Tuple[str, str], List[int]] = defaultdict(lambda: [0, 0])
        for c in self.calls:
            acc = out[(c.kernel, c.phase)]
            acc[0] += sum(n * e for n, e in c.reads if n >= min_numel)
            acc[1] += sum(n * e for n, e in c.writes if n >= min_numel)
        return {k: (r, w) for k, (r, w) in out.items()}

    def rows(self, row_numel: int, act_bytes: int = 2) -> Dict[Tuple[str, str], float]:
        """(kernel, phase) -> traffic in rows "u": one u is one [tokens, hidden] tensor of ``act_bytes``-byte
        elements read or written once (an fp32 tensor of that size counts 4 / act_bytes u). Kernels that moved
        no row-sized tensor are left out."""
        return {k: (r + w) / (row_numel * act_bytes) for k, (r, w) in self.bytes(row_numel).items() if r + w}

    def total_rows(self, row_numel: int, act_bytes: int = 2, phase: Optional[str] = None) -> float:
        return sum(v for (_, p), v in self.rows(row_numel, act_bytes).items() if phase in (None, p))


_counts: List[TrafficCount] = []


def active() -> bool:
    return bool(_counts)


@contextmanager
def counting() -> Iterator[TrafficCount]:
    """Record every router kernel call made inside the block (nested contexts each see every call)."""
    count = TrafficCount()
    _counts.append(count)
    try:
        yield count
    finally:
        _counts.remove(count)
        count._watched.clear()  # the graph's nodes: nothing to count once the block is left
        count._hooked.clear()


def _sizes(tensors: Iterable[Optional[Tensor]]) -> Tuple[Tuple[int, int], ...]:
    return tuple((t.numel(), t.element_size()) for t in tensors if t is not None)


def record(kernel: str, phase: str, reads: Iterable[Optional[Tensor]], writes: Iterable[Optional[Tensor]]) -> None:
    """Note one kernel call's reads and writes (the tensors themselves; None entries are skipped).
    Free when no :func:`counting` context is open."""
    if not _counts:
        return
    call = Call(kernel, phase, _sizes(reads), _sizes(writes))
    for count in _counts:
        count.calls.append(call)


def _edge(t: Tensor) -> Optional[tuple]:
    if not t.requires_grad or not torch.is_grad_enabled():
        return None
    e = torch.autograd.graph.get_gradient_edge(t)
    return e.node, e.output_nr


def watch(*tensors: Optional[Tensor]) -> None:
    """Count the gradient contributions these tensors will receive (module docstring). Free when off."""
    if not _counts:
        return
    for t in tensors:
        edge = None if t is None else _edge(t)
        if edge is not None:
            for count in _counts:
                count._watch(edge)


def hand_out(tensors: Sequence[Optional[Tensor]]) -> None:
    """``tensors`` leave the buffer that made or held them: hook every node that feeds a watched tensor, and
    count one contribution per handed-out watched tensor for its consumer outside (module docstring)."""
    if not _counts:
        return
    live = [t for t in tensors if t is not None and _edge(t) is not None]
    for count in _counts:
        count._hook_graph(live)
        for t in live:
            state = count._watched.get(_edge(t))
            if state is not None:
                state[1] += 1
