"""The tiny GPT models with multi-token prediction depths (tests/integration/test_mtp.py and the MTP logging and
routing report tests): Megatron-Core's GPTModel on this package's config, built in-process, and their batches."""
import torch
import torch.nn.functional as F

VOCAB, SEQ = 64, 16


def mtp_config(mtp_num_layers, num_layers=2, **delta):
    from megatron_delta.core.config import DeltaTransformerConfig

    return DeltaTransformerConfig(
        num_layers=num_layers, hidden_size=32, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=64,
        normalization="RMSNorm", layernorm_epsilon=1e-6, qk_layernorm=True, gated_linear_unit=True,
        activation_func=F.silu, add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0,
        init_method_std=0.02, use_cpu_initialization=True, bias_activation_fusion=False,
        masked_softmax_fusion=False, gradient_accumulation_fusion=False, persist_layer_norm=False,
        apply_rope_fusion=False, bias_dropout_fusion=False, mtp_num_layers=mtp_num_layers, **delta)


def mtp_model(mtp_num_layers, seed=1234, num_layers=2, **delta):
    from megatron_delta.core.model import gpt_model
    from megatron_delta.platform.distributed import initialize_distributed

    initialize_distributed(seed=seed)  # re-seeds: both models start from the same random numbers
    return gpt_model(mtp_config(mtp_num_layers, num_layers, **delta), VOCAB, pre_process=True, post_process=True,
                     max_sequence_length=SEQ, position_embedding_type="rope",
                     share_embeddings_and_output_weights=True)  # Megatron-LM's default (no --untie-...)


def mtp_batch(tokens, loss_mask=None):
    labels = torch.roll(tokens, -1, dims=1)
    return {"tokens": tokens, "labels": labels, "position_ids": torch.arange(SEQ).expand_as(tokens),
            "loss_mask": torch.ones(tokens.shape) if loss_mask is None else loss_mask}


DEPTHS = 2  # the second depth reads the first one's output


def routed_mtp_model(mode, null):
    from megatron_delta.core.modes import BLOCK_MODES

    delta = dict(residual=mode)
    if mode != "baseline":
        delta.update(delta_null_source=null, delta_router_eps=1e-6)
    if mode in BLOCK_MODES:
        delta["delta_num_blocks"] = 2  # two layers per block: the partial sums matter
    return mtp_model(DEPTHS, num_layers=4, **delta)
