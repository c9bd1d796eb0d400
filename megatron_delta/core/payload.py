"""One tensor per micro-batch across a pipeline (or virtual-chunk) boundary.

Megatron's schedules send ONE tensor per micro-batch between stages. The state of a
:class:`~megatron_delta.core.sources.SourceBuffer` (x and the sources, or B and p) is packed by
concatenating its [s, b, d] tensors along the sequence dimension (dim 0); the receiving stage
unpacks views of it. Gradients flow through both (``torch.cat`` / ``split`` autograd).
"""
from __future__ import annotations

from typing import List, Optional, Sequence

import torch
from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator
from torch import Tensor

from megatron_delta.core.modes import BASELINE
from megatron_delta.core.sources import SourcePlan

__all__ = ["pack_stage_payload", "unpack_stage_payload", "payload_seq_length", "payload_num_tensors",
           "PayloadP2PCommunicator", "payload_padding", "payload_shapes_travel", "rank_payload_tensors",
           "schedule_communication_kwargs", "describe_stage_payloads"]


def pack_stage_payload(tensors: Sequence[Tensor], pad_to: Optional[int] = None) -> Tensor:
    """[t_0; t_1; ...] along dim 0. Every tensor must have the same shape [s, b, d] and dtype.
    A single tensor is returned as is (no copy). ``pad_to``: zeros after them up to that many tensors' length
    (:func:`payload_padding`: a length fixed for every boundary; they carry no gradient back)."""
    tensors = list(tensors)
    if not tensors:
        raise ValueError("pack_stage_payload: nothing to pack")
    shape, dtype = tensors[0].shape, tensors[0].dtype
    for t in tensors[1:]:
        if t.shape != shape or t.dtype != dtype:
            raise ValueError(
                f"pack_stage_payload: all tensors must share shape/dtype, got {tuple(shape)}/{dtype} "
                f"and {tuple(t.shape)}/{t.dtype}")
    if pad_to is not None and pad_to < len(tensors):
        raise ValueError(f"pack_stage_payload: {len(tensors)} tensors do not fit a payload padded to {pad_to}")
    if pad_to is not None and pad_to > len(tensors):
        tensors.append(tensors[0].new_zeros((pad_to - len(tensors)) * shape[0], *shape[1:]))
    if len(tensors) == 1:
        return tensors[0]
    return torch.cat(tensors, dim=0)


def unpack_stage_payload(payload: Tensor, num: int, pad_to: Optional[int] = None) -> List[Tensor]:
    """Inverse of :func:`pack_stage_payload`: ``num`` views of [s, b, d] (s = payload.size(0)/num, or
    payload.size(0)/pad_to for a payload padded to ``pad_to`` tensors, whose padding is dropped)."""
    if num < 1:
        raise ValueError(f"unpack_stage_payload: num must be >= 1, got {num}")
    if pad_to is not None:
        if pad_to < num or payload.shape[0] % pad_to:
            raise ValueError(f"unpack_stage_payload: a payload of {payload.shape[0]} rows padded to {pad_to} "
                             f"tensors cannot hold {num}")
        payload = payload[:num * (payload.shape[0] // pad_to)]
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


def _routed_pipeline(config) -> bool:
    return getattr(config, "residual", BASELINE) != BASELINE and config.pipeline_model_parallel_size > 1


def _several_chunks_per_rank(config) -> bool:
    return ((config.virtual_pipeline_model_parallel_size or 1) > 1
            or getattr(config, "pipeline_model_parallel_layout", None) not in (None, ""))


def payload_padding(config) -> Optional[int]:
    """The tensor count every routed payload is padded to, or None (not padded). Only under full-iteration CUDA
    graphs (``cuda_graph_impl == "full_iteration"``) with several chunks per rank (the interleaved schedule, a
    --pipeline-model-parallel-layout): there a rank receives payloads of different lengths in the schedule's order,
    and a capture cannot hold the host-read shape message that would tell them apart, so every boundary sends the
    longest payload's length (the most tensors any boundary of the plan carries), its tail zeros."""
    if not (_routed_pipeline(config) and _several_chunks_per_rank(config)
            and getattr(config, "cuda_graph_impl", "none") == "full_iteration"):
        return None
    plan = SourcePlan.from_config(config)
    return max(payload_num_tensors(plan, f) for f in range(1, config.num_layers))


def payload_shapes_travel(config) -> bool:
    """Whether a routed model's pipeline exchanges its payloads' shapes (Megatron's ``variable_seq_lengths``: a
    message per transfer, read on the host). Only where a rank receives the payloads of several chunks in an order
    the communicator is not told (the interleaved schedule and ``--pipeline-model-parallel-layout``) and they are not
    padded to one length (:func:`payload_padding`). Elsewhere each rank holds one chunk, and what it receives from
    either side has a length fixed by the source plan (:func:`rank_payload_tensors`): no message, no
    synchronisation, nothing a CUDA graph capture cannot hold."""
    return (_routed_pipeline(config) and _several_chunks_per_rank(config)
            and getattr(config, "cuda_graph_impl", "none") != "full_iteration")


def rank_payload_tensors(config, pp_rank: int) -> tuple:
    """(tensors received from the previous stage, tensors sent to the next stage) of pipeline rank ``pp_rank``
    holding one chunk (no interleaving, no layout): the payloads into its first layer and into the next rank's
    (Megatron's layer offsets, uneven first/last stages included); 0 where the rank has no such neighbour."""
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    plan = SourcePlan.from_config(config)
    size = config.pipeline_model_parallel_size
    into = 0 if pp_rank == 0 else payload_num_tensors(plan, get_transformer_layer_offset(config, None, pp_rank))
    out = 0 if pp_rank == size - 1 else payload_num_tensors(
        plan, get_transformer_layer_offset(config, None, pp_rank + 1))
    return into, out


class PayloadP2PCommunicator(P2PCommunicator):
    """Megatron's P2PCommunicator for the routed payloads, whose length differs from boundary to boundary.

    With one chunk per rank (``payload_tensors`` given) the length each transfer receives is the plan's: the
    schedule's per-tensor shape times the payload's tensor count, no shape message. Otherwise p2p sends shapes first
    (``variable_seq_lengths``), with a shape exchange that is correct when prev == next peer; messages between two
    ranks are matched in posting order. Entry ``p2p_shape_exchange`` of the registry of upstream changes
    (megatron_delta.platform.patches).
    """

    def __init__(self, pp_group, config, payload_tensors: Optional[tuple] = None):
        super().__init__(pp_group=pp_group, config=config)
        # (received from prev, sent to next) in [s, b, d] tensors, or None (shapes travel); padded payloads
        # (payload_padding): the padded count both ways
        self.payload_tensors = payload_tensors

    # Replaces P2PCommunicator._communicate's receive shape (one per call: the schedule's per-tensor shape) with the
    # payload's: a rank with one chunk receives from one side per call (the non-interleaved schedule); padded
    # payloads have one length both ways.
    def _communicate(self, *, tensor_send_next, tensor_send_prev, recv_prev, recv_next, tensor_shape,
                     wait_on_reqs=True):
        if self.payload_tensors is not None and (recv_prev or recv_next):
            into, out = self.payload_tensors
            if recv_prev and recv_next and into != out:
                raise RuntimeError("a rank with one pipeline chunk receives from one side per transfer")
            count = into if recv_prev else out
            tensor_shape = (count * tensor_shape[0], *tensor_shape[1:])
        return super()._communicate(tensor_send_next=tensor_send_next, tensor_send_prev=tensor_send_prev,
                                    recv_prev=recv_prev, recv_next=recv_next, tensor_shape=tensor_shape,
                                    wait_on_reqs=wait_on_reqs)

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
    """Extra arguments for Megatron's forward_backward_func (and pretrain): our p2p communicator for a routed model
    under PP > 1 (payload lengths from the plan, or shapes sent where they must travel: payload_shapes_travel), over
    the pipeline group of ``pg_collection`` (default: Megatron-Core's collection of the model-parallel state,
    ProcessGroupCollection.use_mpu_process_groups). {} otherwise: Megatron builds its own."""
    if not _routed_pipeline(config):
        return {}
    if pg_collection is None:
        from megatron.core.process_groups_config import ProcessGroupCollection

        pg_collection = ProcessGroupCollection.use_mpu_process_groups()
    travel = payload_shapes_travel(config)
    if bool(config.variable_seq_lengths) != travel:  # the schedules read it to decide whether shapes travel
        raise ValueError(f"a routed model under pipeline parallelism needs config.variable_seq_lengths = {travel} "
                         f"(payload_shapes_travel: shapes travel only under the interleaved schedule or a "
                         f"--pipeline-model-parallel-layout, without full-iteration graphs), got "
                         f"{config.variable_seq_lengths}")
    padding = payload_padding(config)
    if padding is not None:
        tensors = (padding, padding)
    else:
        tensors = None if travel else rank_payload_tensors(config, pg_collection.pp.rank())
    return {"p2p_communicator": PayloadP2PCommunicator(pg_collection.pp, config, tensors),
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
    padding = payload_padding(config)
    lines = []
    for k, first, sent, taken in chunks.boundaries():
        size = len(sent) * tensor_bytes / 2**20
        line = (f" pipeline payload into layer {first} (chunk {k}): {len(sent)} tensors [{', '.join(sent)}] = "
                f"{size:.2f} MiB per micro-batch (x{len(sent)} the baseline's)")
        if chunks.cached:
            full = len(sent) + len(taken)
            line += (f" (without the cache: {full * tensor_bytes / 2**20:.2f} MiB; kept on the rank: "
                     f"[{', '.join(taken)}])")
        if padding is not None and padding > len(sent):
            line += (f"; padded to {padding} tensors = {padding * tensor_bytes / 2**20:.2f} MiB for "
                     f"--cuda-graph-impl full_iteration")
        lines.append(line)
    return lines
