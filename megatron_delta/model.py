"""Building the model from flags: the TransformerConfig, the layer spec and one GPT model per chunk.

`baseline` is Megatron-Core's own GPTModel with its own local (or TE) layer spec. The routed modes use
`DeltaGPTModel` with `get_gpt_layer_with_delta_spec`, which build on the same Megatron submodules; the
routers consume no random numbers, so one `--seed` gives the same backbone weights in every mode.
"""

import torch
import torch.nn.functional as F

from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel

from megatron_delta.config import DeltaTransformerConfig
from megatron_delta.layer_specs import (decoder_block_spec, get_gpt_layer_local_spec_sp,
                                        get_gpt_layer_with_delta_spec, get_gpt_layer_with_delta_te_spec)
from megatron_delta.norms import LocalNorm


def transformer_config_from_args(args, **overrides) -> DeltaTransformerConfig:
    """The Megatron-LM flag -> TransformerConfig mapping, for a CPU-friendly local build."""
    dtype = torch.bfloat16 if args.bf16 else torch.float32
    kw = dict(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        ffn_hidden_size=args.ffn_hidden_size,
        num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_query_groups,
        kv_channels=args.kv_channels,
        normalization=args.normalization,
        layernorm_epsilon=args.norm_epsilon,
        gated_linear_unit=args.swiglu,
        activation_func=F.silu if args.swiglu else F.gelu,
        add_bias_linear=not args.disable_bias_linear,
        add_qkv_bias=not args.disable_bias_linear,
        qk_layernorm=args.qk_layernorm,
        init_method_std=args.init_method_std,
        hidden_dropout=args.hidden_dropout,
        attention_dropout=args.attention_dropout,
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=args.virtual_pipeline_model_parallel_size,
        context_parallel_size=args.context_parallel_size,
        sequence_parallel=args.sequence_parallel,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=args.bf16,
        fp8=getattr(args, "fp8_format", None),
        fp8_recipe=getattr(args, "fp8_recipe", "delayed"),
        fp8_amax_history_len=getattr(args, "fp8_amax_history_len", 1),
        fp8_amax_compute_algo=getattr(args, "fp8_amax_compute_algo", "most_recent"),
        recompute_granularity=args.recompute_granularity,
        recompute_method=args.recompute_method,
        recompute_num_layers=args.recompute_num_layers,
        # Fused kernels are CUDA-only; Megatron falls back to them only when asked.
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        cross_entropy_loss_fusion=False,
        use_cpu_initialization=True,
        # VPP with PP=2 and batched p2p mixes send-next/send-prev to the same peer (Megatron-LM #750).
        batch_p2p_comm=args.virtual_pipeline_model_parallel_size is None,
        residual=args.residual,
        delta_num_blocks=args.delta_num_blocks,
        delta_null_source=args.delta_null_source,
        delta_gate=args.delta_gate,
        delta_sources=args.delta_sources,
        delta_router_eps=args.delta_router_eps,
        delta_router_kernels=args.delta_router_kernels,
    )
    kw.update(overrides)
    return DeltaTransformerConfig(**kw)


def layer_spec_for(config: DeltaTransformerConfig, transformer_impl: str = "local"):
    """Megatron's GPT layer spec for `baseline`, the Delta layer spec otherwise (local or TE backend)."""
    kw = dict(qk_layernorm=config.qk_layernorm, normalization=config.normalization)
    if transformer_impl == "transformer_engine":
        if not config.routed:
            from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

            return get_gpt_layer_with_transformer_engine_spec(qk_layernorm=config.qk_layernorm)
        return get_gpt_layer_with_delta_te_spec(**kw)
    if not config.routed:
        return get_gpt_layer_local_spec_sp(**kw)
    return get_gpt_layer_with_delta_spec(**kw)


def final_norm_for(transformer_impl: str):
    if transformer_impl == "transformer_engine":
        from megatron.core.extensions.transformer_engine import TENorm

        return TENorm
    return LocalNorm


def build_model_chunks(args, config: DeltaTransformerConfig, vocab_size: int) -> list[torch.nn.Module]:
    """One GPT model per (virtual) pipeline chunk held by this rank."""
    layer_spec = layer_spec_for(config, args.transformer_impl)
    final_norm = final_norm_for(args.transformer_impl)
    if config.routed:
        from megatron_delta.block import DeltaGPTModel as model_cls
    else:
        model_cls = GPTModel
    vp_size = args.virtual_pipeline_model_parallel_size
    chunks = []
    for vp_stage in range(vp_size or 1):
        stage = vp_stage if vp_size else None
        chunks.append(model_cls(
            config=config,
            transformer_layer_spec=decoder_block_spec(config, layer_spec, stage, final_norm),
            vocab_size=vocab_size,
            max_sequence_length=args.max_position_embeddings,
            pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=stage),
            post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=stage),
            parallel_output=True,
            share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
            position_embedding_type=args.position_embedding_type,
            rotary_base=args.rotary_base,
            vp_stage=stage,
        ))
    return chunks


def padded_vocab_size(vocab_size: int, args) -> int:
    """Megatron-LM's padding: a multiple of --make-vocab-size-divisible-by x TP."""
    multiple = args.make_vocab_size_divisible_by * args.tensor_model_parallel_size
    return ((vocab_size + multiple - 1) // multiple) * multiple
