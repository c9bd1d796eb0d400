"""One tensor per micro-batch across a pipeline (or virtual-chunk) boundary.

Megatron's schedules send ONE tensor per micro-batch between stages. The state of a
:class:`~megatron_delta.core.sources.SourceBuffer` (x and the sources, or B and p) is packed by
concatenating its [s, b, d] tensors along the sequence dimension (dim 0); the receiving stage
unpacks views of it. Gradients flow through both (``torch.cat`` / ``split`` autograd).
"""
from __future__ import annotations

from typing import List, Sequence

import torch
from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator
from torch import Tensor

from megatron_delta.core.sources import SourcePlan

__all__ = ["pack_stage_payload", "unpack_stage_payload", "payload_seq_length", "payload_num_tensors",
           "PayloadP2PCommunicator", "schedule_communication_kwargs", "describe_stage_payloads"]


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


def _p2p_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


class PayloadP2PCommunicator(P2PCommunicator):
    """Megatron's P2PCommunicator, with a shape exchange that is correct when prev == next peer.

    Routed payloads differ in length from boundary to boundary, so p2p sends their shapes first
    (`variable_seq_lengths`). Messages between two ranks are matched in posting order.
    Entry ``p2p_shape_exchange`` of the registry of upstream changes (megatron_delta.platform.patches).
    """

    # Replaces P2PCommunicator._communicate_shapes: upstream posts [send_prev, recv_prev,
    # send_next, recv_next]; with PP=2 (VPP) both peers are the same rank, so a rank's send_prev
    # meets the peer's recv_prev and the shapes swap (Megatron-LM #1450). Posting sends as
    # next-then-prev and receives as prev-then-next pairs every message with its counterpart.
    def _communicate_shapes(self, tensor_send_next, tensor_send_prev, recv_prev, recv_next):
        dev = _p2p_device()
        recv_prev_shape = torch.empty(3, device=dev, dtype=torch.int64) if recv_prev else None
        recv_next_shape = torch.empty(3, device=dev, dtype=torch.int64) if recv_next else None
        isend, irecv, op = torch.distributed.isend, torch.distributed.irecv, torch.distributed.P2POp
        ops = []
        if tensor_send_next is not None:
            shape = torch.tensor(tensor_send_next.size(), device=dev, dtype=torch.int64)
            ops.append(op(isend, shape, self.next_rank, self.pp_group))
        if tensor_send_prev is not None:
            shape = torch.tensor(tensor_send_prev.size(), device=dev, dtype=torch.int64)
            ops.append(op(isend, shape, self.prev_rank, self.pp_group))
        if recv_prev_shape is not None:
            ops.append(op(irecv, recv_prev_shape, self.prev_rank, self.pp_group))
        if recv_next_shape is not None:
            ops.append(op(irecv, recv_next_shape, self.next_rank, self.pp_group))
        if ops:
            for req in torch.distributed.batch_isend_irecv(ops):
                req.wait()
        return ([0, 0, 0] if recv_prev_shape is None else recv_prev_shape.tolist(),
                [0, 0, 0] if recv_next_shape is None else recv_next_shape.tolist())


def schedule_communication_kwargs(config, pg_collection=None) -> dict:
    """Extra arguments for Megatron's forward_backward_func (and pretrain): our p2p communicator when payload
    shapes travel (routed modes with PP > 1), over the pipeline group of ``pg_collection`` (default:
    Megatron-Core's collection of the model-parallel state, ProcessGroupCollection.use_mpu_process_groups).
    {} otherwise: Megatron builds its own."""
    if not getattr(config, "variable_seq_lengths", False):
        return {}
    if pg_collection is None:
        from megatron.core.process_groups_config import ProcessGroupCollection

        pg_collection = ProcessGroupCollection.use_mpu_process_groups()
    return {"p2p_communicator": PayloadP2PCommunicator(pp_group=pg_collection.pp, config=config),
            "pg_collection": pg_collection}


def describe_stage_payloads(config, seq_length: int, micro_batch_size: int) -> List[str]:
    """Start-up lines: what crosses each (virtual) pipeline boundary of a DeltaTransformerConfig, and its size
    per micro-batch. Under the interleaved schedule with the source cache (core/source_cache.py) a line counts
    what is sent and adds what the uncached path would send."""
    from megatron_delta.core.source_cache import SourceCachePlan, cache_applies

    plan = SourcePlan.from_config(config)
    seq = seq_length // (config.tensor_model_parallel_size if config.sequence_parallel else 1)
    tensor_bytes = seq * micro_batch_size * config.hidden_size * (2 if config.bf16 or config.fp16 else 4)
    if getattr(config, "pipeline_model_parallel_layout", None):  # the chunks are the layout's: not planned here
        return [" pipeline payloads: chunks from --pipeline-model-parallel-layout (not described)"]
    chunks = SourceCachePlan.from_config(config, plan, cached=cache_applies(config))
    lines = []
    for k, first, sent, taken in chunks.boundaries():
        size = len(sent) * tensor_bytes / 2**20
        line = (f" pipeline payload into layer {first} (chunk {k}): {len(sent)} tensors [{', '.join(sent)}] = "
                f"{size:.2f} MiB per micro-batch (x{len(sent)} the baseline's)")
        if chunks.cached:
            full = len(sent) + len(taken)
            line += (f" (without the cache: {full * tensor_bytes / 2**20:.2f} MiB; kept on the rank: "
                     f"[{', '.join(taken)}])")
        lines.append(line)
    return lines
