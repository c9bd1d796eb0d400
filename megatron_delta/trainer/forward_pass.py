"""Forward-only passes of a loaded model over a dataset, outside a training run (tools/routing_report.py).

Megatron-LM's trainer evaluates inside `pretrain`; a tool that loads a checkpoint into its own layout
runs the same schedule (Megatron-Core's forward_backward_func, forward only) over batches taken in
Megatron's global order: global sample k of pass t is index t*GBS + k, and micro-batch m of
data-parallel rank r takes [m*DP*MBS + r*MBS, +MBS) (MegatronPretrainingSampler's order).
"""
from __future__ import annotations

from functools import partial

import torch


class PretrainingBatches:
    """This data-parallel rank's micro-batches of `dataset`, in Megatron's global order, from `start` on."""

    def __init__(self, dataset, start, micro_batch_size, dp_rank, dp_size):
        self.dataset, self.next = dataset, start
        self.mbs, self.dp_rank, self.dp_size = micro_batch_size, dp_rank, dp_size

    def __iter__(self):
        return self

    def __next__(self):
        first = self.next + self.dp_rank * self.mbs
        self.next += self.mbs * self.dp_size
        samples = [self.dataset[(first + i) % len(self.dataset)] for i in range(self.mbs)]
        return {k: torch.stack([torch.as_tensor(s[k]) for s in samples])
                for k in ("tokens", "labels", "loss_mask", "position_ids")}


def _forward_step(data_iterator, model):
    from megatron_delta.trainer.provider import loss_func, model_output

    batch = next(data_iterator)
    if torch.cuda.is_available():
        batch = {k: v.cuda(non_blocking=True) for k, v in batch.items()}
    return model_output(model, batch), partial(loss_func, batch["loss_mask"])


def run_forward(args, model, data_iterator):
    """One global batch through Megatron's schedule (forward only; 1F1B or interleaved by the model list)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.utils import get_model_config

    from megatron_delta.core.payload import schedule_communication_kwargs

    return get_forward_backward_func()(
        forward_step_func=_forward_step, data_iterator=data_iterator, model=model if len(model) > 1 else model[0],
        num_microbatches=args.global_batch_size // (args.micro_batch_size * args.data_parallel_size),
        seq_length=args.seq_length, micro_batch_size=args.micro_batch_size, forward_only=True,
        **schedule_communication_kwargs(get_model_config(model[0])))


@torch.no_grad()
def collect_routing_stats(args, model, dataset, num_batches=1):
    """Routing statistics over `num_batches` global batches of `dataset`, gathered from every rank."""
    from megatron.core import parallel_state

    from megatron_delta.evaluation.in_training import delta_blocks
    from megatron_delta.evaluation.routing_stats import RoutingStatsAccumulator

    blocks = list(delta_blocks(model))
    for b in blocks:
        b.record_routing, b.routing_records = True, []
    acc = RoutingStatsAccumulator()
    for m in model:
        m.eval()
    try:
        for i in range(num_batches):
            its = [PretrainingBatches(dataset, i * args.global_batch_size, args.micro_batch_size,
                                      parallel_state.get_data_parallel_rank(),
                                      parallel_state.get_data_parallel_world_size()) for _ in model]
            run_forward(args, model, its if len(model) > 1 else its[0])
            for b in blocks:
                for buffer in b.routing_records:
                    acc.add_buffer(buffer)
                b.routing_records = []
    finally:
        for b in blocks:
            b.record_routing = False
    # Every stage holds its own receivers; TP replicas hold identical copies (they weigh equally, so
    # the averages are unchanged) and DP ranks saw different tokens (averaged, token-weighted).
    gathered = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, acc)
    merged = RoutingStatsAccumulator()
    for other in gathered:
        merged.merge(other)
    return {"stats": merged.to_dict(), "text": merged.format_text()}
