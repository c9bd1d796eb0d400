"""What the trainer evaluates beside validation, on Megatron-LM's trainer (called from trainer/hooks.py).

- ``--delta-heldout-data-path``: another distribution. Its dataset is built with the others (every rank),
  and at every evaluation its first ``--eval-iters`` global batches (the same ones every time, so the
  numbers compare across evaluations) go through upstream's ``evaluate_and_print_results`` (its printout
  and loss reduction).
- routing statistics (routed modes): the first validation global batch through upstream's
  ``evaluate`` (Megatron's forward_backward_func with forward_only, on the model the run built, with
  the run's p2p communicator) while every DeltaTransformerBlock records its routing weights
  (block.py's record_routing / routing_records); RoutingStatsAccumulator merges them over all ranks.
"""
from __future__ import annotations

import torch


def build_heldout_dataset(args, tokenizer):
    """GPTDataset of --delta-heldout-data-path: --eval-iters evaluation global batches (all of it train split)."""
    from megatron_delta.data.datasets import build_gpt_datasets
    from megatron_delta.data.indexed import validate_indexed_prefix

    for entry in args.delta_heldout_data_path:
        try:
            float(entry)  # a blend weight
        except ValueError:
            validate_indexed_prefix(entry, "--delta-heldout-data-path")
    samples = args.eval_iters * (getattr(args, "eval_global_batch_size", None) or args.global_batch_size)
    heldout, _, _ = build_gpt_datasets(
        args.delta_heldout_data_path, "100,0,0", args.seq_length, args.seed, (samples, 0, 0), tokenizer,
        cache_dir=args.data_cache_path, reset_position_ids=args.reset_position_ids,
        reset_attention_mask=args.reset_attention_mask, eod_mask_loss=args.eod_mask_loss,
        create_attention_mask=args.create_attention_mask_in_dataloader)
    return heldout


def fresh_iterator(dataset, n_chunks: int):
    """Iterators from the dataset's first sample on (one per virtual pipeline chunk, as upstream's)."""
    from megatron.training.datasets.data_samplers import build_pretraining_data_loader

    if dataset is None:
        return None
    its = [iter(build_pretraining_data_loader(dataset, 0)) for _ in range(n_chunks)]
    return its if n_chunks > 1 else its[0]


def delta_blocks(model):
    from megatron.core.utils import unwrap_model

    from megatron_delta.core.block import DeltaTransformerBlock

    for m in unwrap_model(list(model)):
        if isinstance(getattr(m, "decoder", None), DeltaTransformerBlock):
            yield m.decoder


def routing_statistics(evaluate, forward_step_func, dataset, model, config, **kwargs):
    """{"stats", "text"} of one validation global batch, gathered from every rank; None without routers
    anywhere. `evaluate` is upstream's megatron.training.training.evaluate."""
    from megatron_delta.evaluation.routing_stats import RoutingStatsAccumulator

    blocks = list(delta_blocks(model))
    for b in blocks:
        b.record_routing, b.routing_records = True, []
    acc = RoutingStatsAccumulator()
    try:
        evaluate(forward_step_func, fresh_iterator(dataset, len(model)), model, None, config, verbose=False,
                 eval_iters=1, **kwargs)
        for b in blocks:
            for buffer in b.routing_records:
                acc.add_buffer(buffer)
    finally:
        for b in blocks:
            b.record_routing, b.routing_records = False, []
    # Each stage holds its own receivers; TP replicas hold identical copies (equal weights leave the
    # averages unchanged); DP ranks saw different tokens (token-weighted).
    gathered = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, acc)
    merged = RoutingStatsAccumulator()
    for other in gathered:
        merged.merge(other)
    if not merged.receivers():
        return None
    return {"stats": merged.to_dict(), "text": merged.format_text()}
