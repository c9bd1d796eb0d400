"""One tensor per micro-batch across a pipeline (or virtual-chunk) boundary.

Megatron's schedules send ONE tensor per micro-batch between stages. The state of a
:class:`~megatron_delta.sources.SourceBuffer` (x and the sources, or B and p) is packed by
concatenating its [s, b, d] tensors along the sequence dimension (dim 0); the receiving stage
unpacks views of it. Gradients flow through both (``torch.cat`` / ``split`` autograd).
"""
from __future__ import annotations

from typing import List, Sequence

import torch
from torch import Tensor

from megatron_delta.sources import SourcePlan

__all__ = ["pack_stage_payload", "unpack_stage_payload", "payload_seq_length", "payload_num_tensors"]


def pack_stage_payload(tensors: Sequence[Tensor]) -> Tensor:
    """[t_0; t_1; ...] along dim 0. Every tensor must have the same shape [s, b, d] and dtype.
    A single tensor is returned as is (no copy)."""
    tensors = list(tensors)
    if not tensors:
        raise ValueError("pack_stage_payload: nothing to pack")
    shape, dtype = tensors[0].shape, tensors[0].dtype
    for t in tensors[1:]:
        if t.shape != shape or t.dtype != dtype:
            raise ValueError(
                f"pack_stage_payload: all tensors must share shape/dtype, got {tuple(shape)}/{dtype} "
                f"and {tuple(t.shape)}/{t.dtype}")
    if len(tensors) == 1:
        return tensors[0]
    return torch.cat(tensors, dim=0)


def unpack_stage_payload(payload: Tensor, num: int) -> List[Tensor]:
    """Inverse of :func:`pack_stage_payload`: ``num`` views of [s, b, d] (s = payload.size(0)/num)."""
    if num < 1:
        raise ValueError(f"unpack_stage_payload: num must be >= 1, got {num}")
    if num == 1:
        return [payload]
    total = payload.shape[0]
    if total % num:
        raise ValueError(f"unpack_stage_payload: sequence length {total} is not divisible by {num}")
    return list(torch.split(payload, total // num, dim=0))


def payload_num_tensors(plan: SourcePlan, first_layer: int) -> int:
    """How many [s, b, d] tensors travel into the stage whose first layer is ``first_layer``."""
    return len(plan.payload_names(first_layer))


def payload_seq_length(plan: SourcePlan, first_layer: int, seq_length: int) -> int:
    """The payload's dim-0 size into the stage whose first global layer is ``first_layer``.
    ``seq_length`` is the per-rank sequence length of one tensor (already divided by the TP size
    under sequence parallelism)."""
    return payload_num_tensors(plan, first_layer) * seq_length
