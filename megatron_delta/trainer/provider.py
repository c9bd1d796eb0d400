"""Model provider, dataset provider, forward step and loss: the parts of Megatron-LM's pretrain_gpt.py
(and gpt_builders.py) that know the model, written for the project's models.

- baseline: Megatron-Core's GPTModel with the project's sequence-parallel-capable local spec
  (core/specs.get_gpt_layer_local_spec_sp; LocalNorm instead of WrappedTorchNorm), or the TE spec.
- routed modes: DeltaGPTModel with the Delta layer spec; same backbone weights for one --seed.
The TransformerConfig comes from Megatron-LM's own flag mapping (core_transformer_config_from_args)
with DeltaTransformerConfig as the class (DeltaMLATransformerConfig for --multi-latent-attention,
DeltaHeterogeneousTransformerConfig for --heterogeneous-layers-config-path), so every
Megatron-LM flag means what it means upstream and
the `--delta-*` fields map by name.
"""
from __future__ import annotations

import contextlib
from functools import partial

import torch

from megatron_delta.core.modes import BASELINE


def transformer_config(args):
    """Megatron-LM's args -> its config class with the delta_* fields (upstream mapping) + what routing needs:
    DeltaTransformerConfig, or DeltaMLATransformerConfig for --multi-latent-attention, or
    DeltaHeterogeneousTransformerConfig for --heterogeneous-layers-config-path."""
    from megatron.training.argument_utils import core_transformer_config_from_args

    from megatron_delta.core.config import DeltaTransformerConfig

    with delta_config_classes():
        config = core_transformer_config_from_args(args, config_class=DeltaTransformerConfig)
    if needs_variable_payload(args):
        # Routed payloads differ in length from boundary to boundary: p2p sends shapes first where a rank holds
        # several chunks; with one chunk per rank the plan gives each length (core/payload.py)
        from megatron_delta.core.payload import payload_shapes_travel

        config.variable_seq_lengths = payload_shapes_travel(config)
    return config


@contextlib.contextmanager
def delta_config_classes():
    """While the block runs, Megatron-Core's MLATransformerConfig (in megatron.core.transformer) and
    HeterogeneousTransformerConfig (in megatron.core.transformer.heterogeneous.heterogeneous_config) are their
    subclasses with the delta_* fields. core_transformer_config_from_args replaces the config_class it is given by
    the class it imports from there when args.multi_latent_attention / args.heterogeneous_layers_config_path is
    set; with this, the rest of its mapping (fields by name, Megatron's checks) stays upstream's. Registry entry
    delta_config_classes of megatron_delta.platform.patches."""
    import megatron.core.transformer as transformer
    import megatron.core.transformer.heterogeneous.heterogeneous_config as heterogeneous

    from megatron_delta.core.config import DeltaHeterogeneousTransformerConfig, DeltaMLATransformerConfig

    swaps = ((transformer, "MLATransformerConfig", DeltaMLATransformerConfig),
             (heterogeneous, "HeterogeneousTransformerConfig", DeltaHeterogeneousTransformerConfig))
    originals = [(module, name, getattr(module, name)) for module, name, _ in swaps]
    for module, name, ours in swaps:
        setattr(module, name, ours)
    try:
        yield
    finally:
        for module, name, original in originals:
            setattr(module, name, original)


def needs_variable_payload(args) -> bool:
    return args.residual != BASELINE and args.pipeline_model_parallel_size > 1


def model_provider(pre_process=True, post_process=True, vp_stage=None, config=None, pg_collection=None):
    """Megatron's model_provider signature (get_model calls it once per virtual pipeline chunk)."""
    from megatron.training import get_args, print_rank_0

    from megatron_delta.core.model import gpt_model

    args = get_args()
    if config is None:
        config = transformer_config(args)
    blocks = f", --delta-num-blocks {args.delta_num_blocks}" if args.delta_num_blocks is not None else ""
    print_rank_0(f"building GPT model (--residual {args.residual}{blocks}) ...")
    return gpt_model(
        config, args.padded_vocab_size, pre_process=pre_process, post_process=post_process, vp_stage=vp_stage,
        transformer_impl=args.transformer_impl, max_sequence_length=args.max_position_embeddings,
        fp16_lm_cross_entropy=args.fp16_lm_cross_entropy,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type, rotary_percent=args.rotary_percent,
        rotary_base=args.rotary_base, rope_scaling=args.use_rope_scaling, pg_collection=pg_collection)


# ------------------------------------------------------------------------------------------ data
def train_valid_test_datasets_provider(train_val_test_num_samples, vp_stage=None):
    """Megatron's BlendedMegatronDatasetBuilder + GPTDataset (MockGPTDataset with --mock-data), through
    megatron_delta.data.datasets.build_gpt_datasets (its checks name the flag), with Megatron's global tokenizer.
    Every rank builds (cheap index files; rank 0 first, then the others, as upstream): each rank
    then reads its own micro-batches, so no TP broadcast is needed."""
    from megatron.training import get_args, get_tokenizer, print_rank_0

    from megatron_delta.data.datasets import build_gpt_datasets

    args = get_args()
    blend_valid = args.valid_data_path
    print_rank_0("> building train, validation, and test datasets for GPT ...")
    # --data-path, or Megatron-LM's per-split --train-data-path (with --valid-data-path / --test-data-path)
    data_path = args.data_path or args.train_data_path
    train, valid, test = build_gpt_datasets(
        data_path, args.split, args.seq_length, args.seed, tuple(int(n) for n in train_val_test_num_samples),
        get_tokenizer(), mock=args.mock_data, cache_dir=args.data_cache_path, valid_data_path=blend_valid,
        test_data_path=args.test_data_path, reset_position_ids=args.reset_position_ids,
        reset_attention_mask=args.reset_attention_mask, eod_mask_loss=args.eod_mask_loss,
        create_attention_mask=args.create_attention_mask_in_dataloader)
    return train, valid, test


# Megatron builds the datasets on every rank itself when the provider says so (pretrain_gpt.py does).
train_valid_test_datasets_provider.is_distributed = True


def get_batch(data_iterator):
    batch = next(data_iterator)
    if torch.cuda.is_available():
        batch = {k: v.cuda(non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
    return batch


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Upstream's 3-tuple: summed loss, token count, and the [loss sum, tokens] report (token-weighted)."""
    losses = output_tensor.view(-1).float()
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask)
    num_tokens = mask.sum().clone().detach().to(torch.int)
    report = {"lm loss": torch.cat([loss.clone().detach().view(1), num_tokens.view(1)])}
    return loss, num_tokens, report


def forward_step(data_iterator, model):
    """Megatron's forward_step_func: (output, loss function)."""
    from megatron.training import get_timers

    timers = get_timers()
    timers("batch-generator", log_level=2).start()
    batch = get_batch(data_iterator)
    timers("batch-generator").stop()
    return model_output(model, batch), partial(loss_func, batch["loss_mask"])


def model_output(model, batch):
    """One micro-batch through the model, called as Megatron-LM's pretrain_gpt.py calls it: with the labels
    (per-token losses come back) and the loss mask, which the MTP loss (--mtp-num-layers) applies, rolled
    with the labels at each depth, as the main loss applies it in loss_func."""
    return model(batch["tokens"], batch["position_ids"], batch.get("attention_mask"), labels=batch["labels"],
                 loss_mask=batch["loss_mask"])
