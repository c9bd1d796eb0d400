"""Counted memory traffic of the router's kernels: the bytes each kernel call reads and writes.

On a GPU the router is memory-bound, so its cost is the bytes it moves. The router's autograd
Functions call :func:`record` with the tensors a kernel call actually reads and writes; nothing is
recorded (and :func:`record` returns at once) unless a :func:`counting` context is open.

    with traffic.counting() as count:
        loss = model(tokens).sum(); loss.backward()
    count.rows(tokens * hidden, act_bytes=2)   # per (kernel, phase): rows of [tokens, hidden] ("u")

Only tensors of ``tokens * hidden`` elements or more are the traffic the cost model counts; smaller ones
(logit columns, softmax weights, router vectors) are recorded too but reported apart.
"""
from __future__ import annotations

from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Dict, Iterable, Iterator, List, Optional, Tuple

from torch import Tensor

__all__ = ["Call", "TrafficCount", "counting", "record", "active"]


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
        elements read or written once (an fp32 tensor of that size counts 4 / act_bytes u)."""
        return {k: (r + w) / (row_numel * act_bytes) for k, (r, w) in self.bytes(row_numel).items()}

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
