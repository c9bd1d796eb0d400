"""The pipeline source cache: under the interleaved schedule a boundary sends only what the receiving rank
does not already hold (docs/design.md section 2, "Pipeline payloads").

With V virtual chunks per rank, global chunk k = v * P + r runs on rank r = k mod P, and that rank ran chunk
k - P of the same micro-batch before. Everything chunk k - P held at its end (the payload into chunk
k - P + 1, which it produced or passed on) is still in that rank's memory; a source among it whose value
no commit has changed since (not ``x``, not a partial sum ``P<b>`` or ``p``: :meth:`SourcePlan.is_stable`)
need not travel again into chunk k. :class:`SourceCachePlan` says, for every boundary, which payload
tensors come from the cache and which are sent; it is the same on every rank, so sender and receiver agree
without talking.

:class:`SourceCache` (one per rank, shared by its chunks: :func:`link_chunks`) keeps, per micro-batch in
flight, the tensors the rank's next chunk takes from it. A taken tensor enters its chunk as a leaf (the
same storage, detached) so that chunk's backward stops there; the chunk that kept it puts an identity
function on its own output payload whose backward hands the leaf's gradient to the kept tensor. The
schedule runs the backward of chunk k before that of chunk k - P, so the gradient is complete by then, and
it flows on through the keeping chunk's graph (to its layers, or back to the rank that sent the tensor):
the sum of gradients is that of the uncached path, in another order. A micro-batch's tensors are released
when its first chunk on the rank finishes backward (training) or its last chunk finishes forward (no
gradients).

Chunks are matched to micro-batches by count: Megatron's schedules run every chunk of a rank on every
micro-batch, each chunk in micro-batch order, chunk v - 1 before chunk v. A chunk running out of that
order is an error, not a wrong result.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from megatron_delta.core.sources import SourcePlan

__all__ = ["SourceCachePlan", "SourceCache", "link_chunks", "cache_applies"]


def cache_applies(config) -> bool:
    """The cache is used: a routed mode under the interleaved schedule with --delta-pp-source-cache on, the
    chunks split evenly or by first/last-stage sizes (not by --pipeline-model-parallel-layout, which the
    trainer refuses with the cache on)."""
    return (getattr(config, "residual", "baseline") != "baseline"
            and (config.virtual_pipeline_model_parallel_size or 1) > 1
            and config.pipeline_model_parallel_size > 1
            and not getattr(config, "pipeline_model_parallel_layout", None)
            and bool(getattr(config, "delta_pp_source_cache", False)))


@dataclass(frozen=True)
class SourceCachePlan:
    """Which payload tensors each boundary sends and which the receiver takes from its cache.

    ``first_layers[k]``: the first global layer of chunk k = v * P + r (then num_layers); ``cached`` is
    ``False`` for the plan of the uncached path (everything is sent), which describes the same boundaries."""

    plan: SourcePlan
    pipeline_size: int
    first_layers: Tuple[int, ...]
    cached: bool = True

    @classmethod
    def from_config(cls, config, plan: Optional[SourcePlan] = None, cached: Optional[bool] = None
                    ) -> "SourceCachePlan":
        """From a DeltaTransformerConfig: the chunks' first layers as Megatron-Core splits them
        (get_transformer_layer_offset, uneven first/last stages included)."""
        from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

        if getattr(config, "pipeline_model_parallel_layout", None):
            raise ValueError("SourceCachePlan: the chunks of --pipeline-model-parallel-layout are not planned; "
                             "--delta-pp-source-cache needs an even split or --decoder-first/last-pipeline-num-layers")
        P, V = config.pipeline_model_parallel_size, config.virtual_pipeline_model_parallel_size or 1
        firsts = [get_transformer_layer_offset(config, vp_stage=v if V > 1 else None, pp_rank=r)
                  for v in range(V) for r in range(P)]
        return cls(plan or SourcePlan.from_config(config), P, tuple(firsts) + (config.num_layers,),
                   cache_applies(config) if cached is None else cached)

    @classmethod
    def even(cls, plan: SourcePlan, pipeline_size: int, virtual_size: int, cached: bool = True) -> "SourceCachePlan":
        """P x V chunks of equal size (what tools plan; Megatron's default split)."""
        chunks = pipeline_size * virtual_size
        if plan.num_layers % chunks:
            raise ValueError(f"{chunks} pipeline chunks do not divide {plan.num_layers} layers")
        per = plan.num_layers // chunks
        return cls(plan, pipeline_size, tuple(k * per for k in range(chunks)) + (plan.num_layers,),
                   cached and virtual_size > 1)

    @property
    def num_chunks(self) -> int:
        return len(self.first_layers) - 1

    def payload_names(self, k: int) -> List[str]:
        """Every tensor chunk k starts from (what the uncached path sends into it)."""
        return self.plan.payload_names(self.first_layers[k])

    def taken_names(self, k: int) -> List[str]:
        """The tensors chunk k takes from its rank's cache: held at the end of chunk k - P (the payload into
        chunk k - P + 1) and unchanged since. Never all of them: a boundary sends at least one tensor (the
        schedule passes one per micro-batch)."""
        if not self.cached or k < self.pipeline_size or k >= self.num_chunks:
            return []
        held = set(self.plan.payload_names(self.first_layers[k - self.pipeline_size + 1]))
        names = self.payload_names(k)
        taken = [n for n in names if n in held and self.plan.is_stable(n)]
        return taken[:-1] if len(taken) == len(names) else taken

    def sent_names(self, k: int) -> List[str]:
        """The tensors that travel into chunk k, in payload order."""
        taken = set(self.taken_names(k))
        return [n for n in self.payload_names(k) if n not in taken]

    def kept_names(self, k: int) -> List[str]:
        """What chunk k keeps at its end for the rank's next chunk k + P."""
        return self.taken_names(k + self.pipeline_size) if k + self.pipeline_size < self.num_chunks else []

    def boundaries(self) -> List[Tuple[int, int, List[str], List[str]]]:
        """(chunk k, its first layer, names sent, names taken from the cache) for every boundary k >= 1."""
        return [(k, self.first_layers[k], self.sent_names(k), self.taken_names(k)) for k in range(1, self.num_chunks)]


class _Held:
    """A kept tensor and the leaves the next chunk made of it (their gradients go back to it)."""

    __slots__ = ("value", "leaves")

    def __init__(self, value: Tensor) -> None:
        self.value, self.leaves = value, []


class _ReturnCachedGradients(torch.autograd.Function):
    """Identity on a chunk's output payload. Backward: the gradients the rank's later chunks put into the
    leaves of the tensors this chunk kept, handed to those tensors (module docstring)."""

    @staticmethod
    def forward(ctx, payload, cache, n, held, release, *kept):
        ctx.cache, ctx.n, ctx.held, ctx.release = cache, n, held, release
        return payload.view_as(payload)

    @staticmethod
    def backward(ctx, grad):
        grads = []
        for h in ctx.held:
            leaf_grads = [leaf.grad for leaf in h.leaves if leaf.grad is not None]
            grads.append(None if not leaf_grads else leaf_grads[0] if len(leaf_grads) == 1 else sum(leaf_grads))
        if ctx.release:
            ctx.cache.release(ctx.n)
        ctx.held = None
        return (grad, None, None, None, None, *grads)


class SourceCache:
    """One rank's kept tensors of its micro-batches in flight, shared by its virtual chunks."""

    def __init__(self, plan: SourceCachePlan, pp_rank: int, num_chunks_here: int) -> None:
        self.plan, self.pp_rank = plan, pp_rank
        self._begun = [0] * num_chunks_here  # micro-batches each local chunk has started (forward)
        self._held: Dict[int, Dict[str, _Held]] = {}  # micro-batch -> name -> kept tensor

    def chunk(self, vp_stage: int) -> int:
        """The global chunk index of local chunk ``vp_stage``."""
        return vp_stage * self.plan.pipeline_size + self.pp_rank

    @property
    def in_flight(self) -> int:
        """Micro-batches whose tensors are held (0 between iterations)."""
        return len(self._held)

    def begin(self, vp_stage: int) -> int:
        """Local chunk ``vp_stage`` starts its next micro-batch: that micro-batch's number on this rank."""
        n = self._begun[vp_stage]
        if vp_stage > 0 and n >= self._begun[vp_stage - 1]:
            raise RuntimeError(
                f"pipeline source cache: virtual chunk {vp_stage} starts micro-batch {n} before chunk "
                f"{vp_stage - 1} ran it; the cache needs every chunk of a rank to run every micro-batch in order "
                f"(as Megatron's interleaved schedule does). Run it so, or pass --delta-pp-source-cache off")
        self._begun[vp_stage] += 1
        if vp_stage == 0:
            self._held[n] = {}
        return n

    def take(self, n: int, names: Sequence[str]) -> Dict[str, Tensor]:
        """The tensors ``names`` of micro-batch n, as leaves of the kept tensors (same storage)."""
        held = self._held.get(n)
        missing = [name for name in names if held is None or name not in held]
        if missing:
            raise RuntimeError(f"pipeline source cache: micro-batch {n} lacks {missing} on pipeline rank "
                               f"{self.pp_rank}; was it released early, or the chunks run out of order?")
        out = {}
        for name in names:
            h = held[name]
            leaf = h.value.detach()
            if torch.is_grad_enabled() and h.value.requires_grad:
                leaf.requires_grad_(True)
                h.leaves.append(leaf)
            out[name] = leaf
        return out

    def keep(self, n: int, vp_stage: int, payload: Tensor, tensors: Dict[str, Tensor]) -> Tensor:
        """At the end of local chunk ``vp_stage``: keep ``tensors`` (name -> value) of micro-batch n for the
        next chunk; returns the output payload, through _ReturnCachedGradients when gradients are on."""
        held = [_Held(t) for t in tensors.values()]
        self._held[n].update(zip(tensors, held))
        if not torch.is_grad_enabled():
            # a new tensor object: Megatron frees the sent output's storage (deallocate_output_tensor), and a
            # one-tensor payload is the kept tensor itself
            return payload.view_as(payload)
        return _ReturnCachedGradients.apply(payload, self, n, held, vp_stage == 0, *(h.value for h in held))

    def finish_forward(self, n: int, vp_stage: int) -> None:
        """After a chunk's forward: without gradients nothing comes back, so the last chunk releases."""
        if vp_stage == len(self._begun) - 1 and not torch.is_grad_enabled():
            self.release(n)

    def release(self, n: int) -> None:
        self._held.pop(n, None)


def link_chunks(model_chunks, pg_collection=None) -> Optional[SourceCache]:
    """Give the routed decoders of one rank's model chunks (one per virtual stage, in order) one shared
    SourceCache, where the cache applies (:func:`cache_applies`); else each decoder gets none. Called by
    build_model_chunks and by the trainer after Megatron-LM's get_model. Returns the cache (or None)."""
    from megatron.core.utils import unwrap_model  # DDP and Float16Module wrappers off

    decoders = [m.decoder for m in unwrap_model(list(model_chunks))
                if hasattr(getattr(m, "decoder", None), "source_cache")]  # DeltaTransformerBlocks (core/block.py)
    if not decoders:
        return None
    config = decoders[0].config
    if not cache_applies(config):
        for d in decoders:
            d.source_cache = None
        return None
    if len(decoders) != len(model_chunks):
        raise ValueError("link_chunks: every model chunk of the rank must be a routed GPT model")
    if pg_collection is None:
        pg_collection = decoders[0].pg_collection
    cache = SourceCache(SourceCachePlan.from_config(config, decoders[0].plan), pg_collection.pp.rank(),
                        len(decoders))
    for vp_stage, d in enumerate(decoders):
        if d.vp_stage != vp_stage:
            raise ValueError(f"link_chunks: chunk {vp_stage} of the list is virtual stage {d.vp_stage}; pass the "
                             f"chunks in order")
        d.source_cache = cache
    return cache
