"""Layer specs: Megatron-Core's own GPT submodules, with depth routers for the routed modes.

- `get_gpt_layer_local_spec_sp`: Megatron's local spec with norms that support sequence parallelism (with
  ``multi_latent_attention``: its MLA spec, MLASelfAttention, whose latent norms are swapped too).
- `get_gpt_layer_with_delta_spec`: the same submodules in a DeltaTransformerLayer, plus two routers, and
  bias-dropout modules that return the addend v instead of adding it to a residual (layer.get_bias_dropout).
- `get_gpt_layer_with_delta_te_spec`: the Transformer Engine variant (input norms fused into
  linear_qkv / linear_fc1, so the routed input `u` is what enters the fused linear). Imported lazily.
- `decoder_block_spec`: the block-level spec (layers of this pipeline chunk + the final norm).
- `moe_decoder_block_spec`: `--num-experts`: Megatron's own MoE/dense block spec (`--moe-layer-freq`), as
  Megatron-LM's gpt_builders.py builds it; in a routed mode each layer spec is a DeltaTransformerLayer's.
- `mtp_block_spec`: Megatron's multi-token prediction block for `--mtp-num-layers` (baseline), built from
  the decoder's layer spec as Megatron-LM's gpt_builders.py builds it.
"""

from megatron.core.models.backends import LocalSpecProvider
from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_decoder_block_spec,
    get_gpt_layer_local_spec,
    get_gpt_mtp_block_spec,
    get_gpt_mtp_block_spec_for_backend,
)
from megatron.core.transformer.multi_latent_attention import MLASelfAttention
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

from megatron_delta.core.mla import LocalMLASelfAttention, MLADotProductAttention
from megatron_delta.core.norms import LocalNorm

# The attention's own norms: q/k of SelfAttention (--qk-layernorm), q/kv latents of MLASelfAttention
_ATTENTION_NORMS = ("q_layernorm", "k_layernorm", "kv_layernorm")


def _replace_norms(submodules, norm):
    """Swap the local spec's WrappedTorchNorm (no SP support) for `norm`; everything else stays Megatron's but
    MLA's attention and core attention (LocalMLASelfAttention, MLADotProductAttention). Under SP the MLA latent
    norms see sequence shards too (MLASelfAttention scatters the latents)."""
    submodules.input_layernorm = norm
    submodules.pre_mlp_layernorm = norm
    attn = submodules.self_attention.submodules
    for name in _ATTENTION_NORMS:
        module = getattr(attn, name, None)
        if module is not None and getattr(module, "__name__", "") != "IdentityOp":
            setattr(attn, name, norm)
    if submodules.self_attention.module is MLASelfAttention:  # what megatron-core 0.19 lacks locally (core/mla.py)
        submodules.self_attention.module = LocalMLASelfAttention
        attn.core_attention = MLADotProductAttention
    return submodules


def get_gpt_layer_local_spec_sp(qk_layernorm: bool = True, normalization: str = "RMSNorm",
                                **megatron_kwargs) -> ModuleSpec:
    """Megatron's local GPT layer spec, with sequence-parallel-capable norms (``megatron_kwargs``: the rest
    of get_gpt_layer_local_spec's, e.g. num_experts and moe_grouped_gemm)."""
    spec = get_gpt_layer_local_spec(qk_layernorm=qk_layernorm, normalization=normalization, **megatron_kwargs)
    _replace_norms(spec.submodules, LocalNorm)
    return spec


def _delta_layer_spec(spec: ModuleSpec) -> ModuleSpec:
    """Megatron's GPT layer spec as a DeltaTransformerLayer: its submodules, two routers, and bias-dropout
    modules that return the addend (the SourceBuffer adds it; Megatron's would add the residual)."""
    from megatron_delta.core.layer import DeltaTransformerLayer, DeltaTransformerLayerSubmodules, get_bias_dropout
    from megatron_delta.core.router import DepthRouter

    base = spec.submodules
    submodules = {k: getattr(base, k) for k in base.__dataclass_fields__}
    submodules.update(self_attn_bda=get_bias_dropout, mlp_bda=get_bias_dropout)
    return ModuleSpec(module=DeltaTransformerLayer, submodules=DeltaTransformerLayerSubmodules(
        **submodules, self_attention_router=DepthRouter, mlp_router=DepthRouter))


def get_gpt_layer_with_delta_spec(qk_layernorm: bool = True, normalization: str = "RMSNorm",
                                  multi_latent_attention: bool = False) -> ModuleSpec:
    """Local backend: Megatron's attention (MLASelfAttention with multi_latent_attention)/MLP/norm submodules
    inside a DeltaTransformerLayer."""
    return _delta_layer_spec(get_gpt_layer_local_spec_sp(qk_layernorm=qk_layernorm, normalization=normalization,
                                                         multi_latent_attention=multi_latent_attention))


def get_gpt_layer_with_delta_te_spec(qk_layernorm: bool = True, normalization: str = "RMSNorm",
                                     multi_latent_attention: bool = False,
                                     mla_down_proj_fusion: bool = False) -> ModuleSpec:
    """Transformer Engine backend (GPU only): Megatron's TE spec inside a DeltaTransformerLayer."""
    try:
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        spec = get_gpt_layer_with_transformer_engine_spec(qk_layernorm=qk_layernorm,
                                                          multi_latent_attention=multi_latent_attention,
                                                          mla_down_proj_fusion=mla_down_proj_fusion)
    except (ImportError, AssertionError) as e:
        raise RuntimeError("--transformer-impl transformer_engine: Transformer Engine is not importable "
                           f"({e}); install megatron-delta[te] on a GPU machine or use --transformer-impl local")
    return _delta_layer_spec(spec)


def decoder_block_spec(config, layer_spec: ModuleSpec, vp_stage=None, final_norm=LocalNorm):
    """The layers this (virtual) pipeline chunk builds, and the final norm."""
    n = get_num_layers_to_build(config, vp_stage=vp_stage)
    return TransformerBlockSubmodules(layer_specs=[layer_spec] * n, layer_norm=final_norm)


def moe_decoder_block_spec(config, vp_stage=None, transformer_impl: str = "local"):
    """--num-experts: Megatron's get_gpt_decoder_block_spec, as Megatron-LM's gpt_builders.py calls it (MoE
    layers where --moe-layer-freq puts them, dense ones elsewhere, this chunk's slice); on the local backend its
    norms are LocalNorm, as in get_gpt_layer_local_spec_sp. In a routed mode each layer's submodules (the
    MoELayer or dense MLP among them) go into a DeltaTransformerLayer, as for the dense model."""
    use_te = transformer_impl == "transformer_engine"
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=use_te, normalization=config.normalization,
                                      qk_l2_norm=config.qk_l2_norm, vp_stage=vp_stage)
    if not use_te:
        for layer_spec in spec.layer_specs:
            _replace_norms(layer_spec.submodules, LocalNorm)
        spec.layer_norm = LocalNorm
    if getattr(config, "routed", False):
        spec.layer_specs = [_delta_layer_spec(layer_spec) for layer_spec in spec.layer_specs]
    return spec


def check_moe_backend(transformer_impl: str, num_experts, moe_grouped_gemm: bool) -> None:
    """Megatron's local backend builds its experts as SequentialMLP whatever --moe-grouped-gemm says
    (LocalSpecProvider.grouped_mlp_modules): refuse the flag there rather than ignore it."""
    if num_experts and moe_grouped_gemm and transformer_impl != "transformer_engine":
        raise ValueError(f"--moe-grouped-gemm needs --transformer-impl transformer_engine: Megatron-Core's "
                         f"{transformer_impl} backend has no grouped GEMM and would build one MLP per expert "
                         f"(SequentialMLP). Drop --moe-grouped-gemm, or use Transformer Engine on a GPU")


class LocalNormSpecProvider(LocalSpecProvider):
    """Megatron's local backend with LocalNorm for the norms it chooses (the MTP layer's enorm, hnorm and
    final norm): the same function as its WrappedTorchNorm, which refuses sequence parallelism."""

    def layer_norm(self, rms_norm: bool = False, for_qk: bool = False, has_residual: bool = False):
        return LocalNorm


def mtp_block_spec(config, layer_spec: ModuleSpec, vp_stage=None, transformer_impl: str = "local"):
    """The MTP block this pipeline chunk builds (None without --mtp-num-layers, or off the chunk that holds
    it). Each MTP depth's transformer layer is the decoder's layer spec, as in Megatron-LM's gpt_builders.py.
    GPTModel computes the MTP loss whenever config.mtp_num_layers is set, so a model built with that
    config and no MTP block splits its decoder output in two and fails in the cross entropy."""
    if not config.mtp_num_layers:
        return None
    if transformer_impl == "transformer_engine":
        return get_gpt_mtp_block_spec(config, layer_spec, use_transformer_engine=True, vp_stage=vp_stage)
    return get_gpt_mtp_block_spec_for_backend(config, layer_spec, LocalNormSpecProvider(), vp_stage=vp_stage)
