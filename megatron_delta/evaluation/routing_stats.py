"""Routing diagnostics (docs/design.md section 1, "Routing diagnostics").

Per receiving sublayer, from its weights alpha [s, b, N] (N sources it sees, null source included
when present): mean max weight, mean normalised entropy H(alpha)/log(N) (None for N = 1), and the
mean weight per source (one row of the receiver x source matrix of the paper's Fig. 6).
"""
from __future__ import annotations

import json
import math
import re
from typing import Dict, List, Union

import torch
from torch import Tensor

__all__ = ["routing_stats", "RoutingStatsAccumulator"]

Key = Union[int, str]


def _flat(alpha: Tensor) -> Tensor:
    alpha = alpha.detach()
    # Not reshape(-1, N): with N = 0 (authors-code: layer 0's attention reads no source) -1 is ambiguous.
    return alpha.reshape(math.prod(alpha.shape[:-1]), alpha.shape[-1]).double()


def routing_stats(alpha: Tensor) -> Dict[str, object]:
    """Stats of one receiver's weights alpha [..., N]: {'num_sources', 'tokens', 'max_weight',
    'entropy' (normalised, None for N <= 1), 'mean_weights' (list of N floats)}."""
    a = _flat(alpha)
    n = a.shape[-1]
    tokens = a.shape[0]
    if n == 0 or tokens == 0:
        return {"num_sources": n, "tokens": tokens, "max_weight": None, "entropy": None,
                "mean_weights": [0.0] * n}
    ent = None
    if n > 1:
        ent = float((-torch.special.xlogy(a, a).sum(-1) / math.log(n)).mean())
    return {
        "num_sources": n,
        "tokens": tokens,
        "max_weight": float(a.max(-1).values.mean()),
        "entropy": ent,
        "mean_weights": a.mean(0).tolist(),
    }


class _Acc:
    __slots__ = ("n", "tokens", "max_sum", "ent_sum", "w_sum")

    def __init__(self, n: int) -> None:
        self.n = n
        self.tokens = 0
        self.max_sum = 0.0
        self.ent_sum = 0.0
        self.w_sum = torch.zeros(n, dtype=torch.float64)


_MTP_KEY = re.compile(r"^mtp(\d+)\.(attn|mlp|final)$")  # core.mtp.mtp_receiver
_MTP_SUBLAYERS = ("attn", "mlp", "final")


def _key_order(k: Key):
    """The decoder's sublayers by j, its final router, then each MTP depth's attn, mlp and final routers."""
    if not isinstance(k, str):
        return (0, k, 0, "")
    m = _MTP_KEY.match(k)
    if m:
        return (2, int(m.group(1)), _MTP_SUBLAYERS.index(m.group(2)), "")
    return (1, 0, 0, k)


class RoutingStatsAccumulator:
    """Token-weighted averages of the routing stats over batches, per receiver.

    Receivers are keyed by the global sublayer index j (int), 'final' (the final router of the
    replacement modes) or 'mtp{k}.attn' / '.mlp' / '.final'
    (MTP depth k's routers, core.mtp.mtp_receiver). ``add_buffer`` takes a ``SourceBuffer(record_routing=True)``'s
    weights (or a core.mtp.MTPRouting's).
    """

    def __init__(self) -> None:
        self._acc: Dict[Key, _Acc] = {}

    def reset(self) -> None:
        self._acc.clear()

    def add(self, receiver: Key, alpha: Tensor) -> None:
        a = _flat(alpha)
        n = a.shape[-1]
        acc = self._acc.get(receiver)
        if acc is None:
            acc = self._acc[receiver] = _Acc(n)
        elif acc.n != n:
            raise ValueError(f"receiver {receiver!r}: {n} sources, previously {acc.n}")
        if a.shape[0] == 0 or n == 0:
            return
        acc.tokens += a.shape[0]
        acc.max_sum += float(a.max(-1).values.sum())
        if n > 1:
            acc.ent_sum += float((-torch.special.xlogy(a, a).sum(-1)).sum()) / math.log(n)
        acc.w_sum += a.sum(0).cpu()

    def add_buffer(self, buffer) -> None:
        for key, alpha in buffer.routing.items():
            self.add(key, alpha)

    def merge(self, other: "RoutingStatsAccumulator") -> None:
        for key, o in other._acc.items():
            acc = self._acc.get(key)
            if acc is None:
                acc = self._acc[key] = _Acc(o.n)
            if acc.n != o.n:
                raise ValueError(f"receiver {key!r}: {o.n} sources vs {acc.n}")
            acc.tokens += o.tokens
            acc.max_sum += o.max_sum
            acc.ent_sum += o.ent_sum
            acc.w_sum += o.w_sum

    def receivers(self) -> List[Key]:
        return sorted(self._acc, key=_key_order)

    def stats(self, receiver: Key) -> Dict[str, object]:
        acc = self._acc[receiver]
        t = acc.tokens
        return {
            "num_sources": acc.n,
            "tokens": t,
            "max_weight": acc.max_sum / t if t else None,
            "entropy": (acc.ent_sum / t) if (t and acc.n > 1) else None,
            "mean_weights": (acc.w_sum / t).tolist() if t else [0.0] * acc.n,
        }

    def to_dict(self) -> Dict[str, object]:
        """JSON-able: {'receivers': {str(j): stats}, 'weight_matrix': rows padded with None}."""
        keys = self.receivers()
        rec = {str(k): self.stats(k) for k in keys}
        width = max((self._acc[k].n for k in keys), default=0)
        matrix = []
        for k in keys:
            w = rec[str(k)]["mean_weights"]
            matrix.append(list(w) + [None] * (width - len(w)))
        return {"receivers": rec, "order": [str(k) for k in keys], "weight_matrix": matrix}

    def to_json(self, **kwargs) -> str:
        return json.dumps(self.to_dict(), **kwargs)

    def format_text(self) -> str:
        """One line per layer: its attention (even j) and MLP (odd j) receivers, then 'final', then one line per
        MTP depth (its attn, mlp and final routers)."""

        def fmt(k: Key) -> str:
            s = self.stats(k)
            mx = "-" if s["max_weight"] is None else f"{s['max_weight']:.3f}"
            h = "-" if s["entropy"] is None else f"{s['entropy']:.3f}"
            return f"N={s['num_sources']:<3d} max={mx} H/logN={h}"

        lines = []
        ints = sorted(k for k in self._acc if isinstance(k, int))
        for layer in sorted({j // 2 for j in ints}):
            parts = []
            for j, label in ((2 * layer, "attn"), (2 * layer + 1, "mlp")):
                if j in self._acc:
                    parts.append(f"{label} {fmt(j)}")
            lines.append(f"layer {layer:3d}: " + " | ".join(parts))
        named = sorted((k for k in self._acc if isinstance(k, str)), key=_key_order)
        for k in (k for k in named if not _MTP_KEY.match(k)):
            lines.append(f"{k:>9}: {fmt(k)}")
        depths = sorted({int(_MTP_KEY.match(k).group(1)) for k in named if _MTP_KEY.match(k)})
        for depth in depths:
            parts = [f"{r} {fmt(f'mtp{depth}.{r}')}" for r in _MTP_SUBLAYERS if f"mtp{depth}.{r}" in self._acc]
            lines.append(f"MTP depth {depth}: " + " | ".join(parts))
        return "\n".join(lines)
