"""Hugging Face configuration for Delta Attention Residual models (remote code).

This file is copied next to converted checkpoints and loaded with ``trust_remote_code=True``, together
with ``modes.py`` (a copy of megatron_delta/core/modes.py: the mode names and the one check of the residual
options, shared with the command line); it imports nothing else from ``megatron_delta``.

One config class covers both backbones the project converts:
  * Qwen3 (``use_qk_norm=True``, the default): q_norm / k_norm on each head.
  * Llama (``use_qk_norm=False``, e.g. SmolLM2): no q/k norms. Everything else of Llama's
    decoder (RMSNorm pre-norms, SwiGLU MLP without bias, RoPE, GQA, optional attention bias,
    optional tied embeddings) is the same computation as Qwen3's; ``mlp_bias`` is not supported.

The extra fields follow docs/design.md section 1 (the Megatron flags ``--residual``, ``--delta-*``).
"""
from transformers import DeepseekV3Config, Qwen3Config

try:  # an exported model: the copy of core/modes.py next to this file (hf.write_remote_code_model)
    from .modes import (
        ATTNRES,
        AUTHORS_CODE,
        BASELINE,
        DELTA,
        DELTA_BLOCK,
        EXACT,
        FULL_ATTNRES,
        HF_FIELDS,
        REPLACEMENT_MODES,
        RoutedMode,
        check_delta_options,
        routed_mode_class,
    )
except ModuleNotFoundError:  # inside the megatron_delta package
    from megatron_delta.core.modes import (
        ATTNRES,
        AUTHORS_CODE,
        BASELINE,
        DELTA,
        DELTA_BLOCK,
        EXACT,
        FULL_ATTNRES,
        HF_FIELDS,
        REPLACEMENT_MODES,
        RoutedMode,
        check_delta_options,
        routed_mode_class,
    )


class DeltaFieldsMixin:
    """The residual-mode fields (``residual``, ``delta_*``) and their rules, for each backbone's config class
    (first base: DeltaQwen3Config, DeltaDeepseekV3Config)."""

    def set_delta_fields(self, residual=BASELINE, delta_num_blocks=None, delta_sources=EXACT, delta_null_source=False,
                         delta_gate="none", delta_router_eps=1e-6):
        self.residual = residual
        self.delta_num_blocks = delta_num_blocks
        self.delta_sources = delta_sources
        self.delta_null_source = delta_null_source
        self.delta_gate = delta_gate
        self.delta_router_eps = delta_router_eps

    # ------------------------------------------------------------------ validation
    def validate_delta(self):
        """Raise ValueError with a clear message for an inconsistent residual configuration: the field types
        here, the residual rules in modes.check_delta_options (those of the command line, naming the fields).
        A block mode without ``delta_num_blocks`` gets the command line's default K."""
        if not isinstance(self.delta_null_source, bool):
            raise ValueError(f"delta_null_source must be a bool, got {self.delta_null_source!r}")
        if not isinstance(self.delta_router_eps, (int, float)) or isinstance(self.delta_router_eps, bool) \
                or not self.delta_router_eps > 0:
            raise ValueError(f"delta_router_eps must be a positive float, got {self.delta_router_eps!r}")
        self.delta_num_blocks = check_delta_options(
            self.residual, self.num_hidden_layers, self.delta_num_blocks, self.delta_null_source, self.delta_gate,
            self.delta_sources, spell=HF_FIELDS)

    @property
    def has_routers(self) -> bool:
        return self.residual != BASELINE

    @property
    def has_final_router(self) -> bool:
        return self.residual in REPLACEMENT_MODES

    def residual_rules(self) -> RoutedMode | None:
        """The routed mode's rules (modes.py, those of the Megatron model): which sources each sublayer
        reads, how it forms its input and what its output adds to the sources; None for ``baseline``."""
        if not self.has_routers:
            return None
        L = self.num_hidden_layers
        return routed_mode_class(self.residual, self.delta_sources, HF_FIELDS)(L, self.delta_num_blocks or L)


class DeltaQwen3Config(DeltaFieldsMixin, Qwen3Config):
    """Qwen3Config plus the residual-mode fields.

    Args (in addition to Qwen3Config's):
        residual: ``baseline`` or a routed mode of modes.py (``--residual``'s choices: ``attnres``,
            ``full_attnres``, ``delta``, ``delta_block``, ...).
        delta_num_blocks: K, the number of blocks of consecutive layers (the block modes only,
            modes.BLOCK_MODES; must divide ``num_hidden_layers``).
        delta_sources: ``exact`` (paper definition) or ``authors-code`` (the public code's
            sources); for the modes that define it (modes.py: ``source_definitions``).
        delta_null_source: add a learnable zero-initialised null source z to every router.
        delta_gate: ``none`` or ``scalar`` (u = x + a*r, a zero-initialised; additive modes only).
        delta_router_eps: eps of the router's key RMS norm.
        use_qk_norm: True for Qwen3 (q_norm/k_norm), False for a Llama backbone.
        num_experts, num_experts_per_tok, moe_intermediate_size, norm_topk_prob, decoder_sparse_step,
            mlp_only_layers: a mixture-of-experts MLP, as Qwen3-MoE's (Qwen3MoeConfig's fields and meaning;
            its parameter layout): layer i has one when num_experts > 0, i is not in mlp_only_layers and
            (i + 1) % decoder_sparse_step == 0; num_experts 0 (the default) is the dense Qwen3 MLP everywhere.
    """

    model_type = "delta_qwen3"

    def __init__(
        self,
        residual: str = BASELINE,
        delta_num_blocks: int | None = None,
        delta_sources: str = EXACT,
        delta_null_source: bool = False,
        delta_gate: str = "none",
        delta_router_eps: float = 1e-6,
        use_qk_norm: bool = True,
        num_experts: int = 0,
        num_experts_per_tok: int = 2,
        moe_intermediate_size: int | None = None,
        norm_topk_prob: bool = False,
        decoder_sparse_step: int = 1,
        mlp_only_layers: list | None = None,
        **kwargs,
    ):
        self.num_experts = num_experts
        self.num_experts_per_tok = num_experts_per_tok
        self.moe_intermediate_size = moe_intermediate_size
        self.norm_topk_prob = norm_topk_prob
        self.decoder_sparse_step = decoder_sparse_step
        self.mlp_only_layers = list(mlp_only_layers or [])
        self.set_delta_fields(residual, delta_num_blocks, delta_sources, delta_null_source, delta_gate,
                              delta_router_eps)
        self.use_qk_norm = use_qk_norm
        super().__init__(**kwargs)
        self.validate_delta()

    def validate_delta(self):
        if not isinstance(self.use_qk_norm, bool):
            raise ValueError(f"use_qk_norm must be a bool, got {self.use_qk_norm!r}")
        super().validate_delta()

    def is_moe_layer(self, i: int) -> bool:
        """Whether layer i's MLP is the mixture of experts (Qwen3-MoE's rule)."""
        return (self.num_experts > 0 and i not in self.mlp_only_layers
                and (i + 1) % self.decoder_sparse_step == 0)


    # ------------------------------------------------------------------ construction
    @classmethod
    def from_backbone_config(cls, backbone_config, **delta_kwargs) -> "DeltaQwen3Config":
        """Build a DeltaQwen3Config from a stock ``Qwen3Config`` or ``LlamaConfig`` (same backbone weights)."""
        d = backbone_config.to_dict()
        mtype = d.get("model_type")
        if mtype not in ("qwen3", "qwen3_moe", "llama", cls.model_type):
            raise ValueError(f"unsupported backbone model_type {mtype!r} (qwen3, qwen3_moe or llama)")
        if d.get("mlp_bias"):
            raise ValueError("Llama backbones with mlp_bias=True are not supported")
        if mtype == "llama":
            delta_kwargs.setdefault("use_qk_norm", False)
            if d.get("head_dim") is None:
                d["head_dim"] = d["hidden_size"] // d["num_attention_heads"]
        if "num_local_experts" in d:  # Qwen3MoeConfig serialises num_experts under this name
            d["num_experts"] = d["num_local_experts"]
        keep = {k: v for k, v in d.items()
                if k not in ("model_type", "architectures", "transformers_version", "auto_map",
                             "mlp_bias", "pretraining_tp", "dtype", "torch_dtype", "num_local_experts",
                             "output_router_logits", "router_aux_loss_coef")}
        keep.update(delta_kwargs)
        return cls(**keep)




class DeltaDeepseekV3Config(DeltaFieldsMixin, DeepseekV3Config):
    """DeepseekV3Config (multi-latent attention, DeepSeek's MoE: DeepseekV3Config's fields and meaning, its
    parameter layout) plus the residual-mode fields (DeltaQwen3Config's)."""

    model_type = "delta_deepseek_v3"

    def __init__(self, residual: str = BASELINE, delta_num_blocks: int | None = None, delta_sources: str = EXACT,
                 delta_null_source: bool = False, delta_gate: str = "none", delta_router_eps: float = 1e-6, **kwargs):
        self.set_delta_fields(residual, delta_num_blocks, delta_sources, delta_null_source, delta_gate,
                              delta_router_eps)
        super().__init__(**kwargs)
        self.validate_delta()

    def is_moe_layer(self, i: int) -> bool:
        """Whether layer i's MLP is the mixture of experts (DeepSeek-V3's rule: after the first dense layers)."""
        return i >= self.first_k_dense_replace


__all__ = ["ATTNRES", "AUTHORS_CODE", "BASELINE", "DELTA", "DELTA_BLOCK", "DeltaDeepseekV3Config", "DeltaQwen3Config",
           "FULL_ATTNRES"]
