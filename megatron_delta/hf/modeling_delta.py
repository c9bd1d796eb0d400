"""Hugging Face model for Delta Attention Residuals (remote code; eval and serving).

Copied verbatim next to converted checkpoints and loaded with ``trust_remote_code=True``:
it imports nothing from ``megatron_delta``; its config, and through it the mode rules of ``modes.py``
(a copy of megatron_delta/core/modes.py), by a relative import.

The backbone is transformers' Qwen3 (attention, SwiGLU MLP, RMSNorm, RoPE); with
``config.use_qk_norm=False`` the attention has no q/k norms, i.e. it is Llama's.
Every decoder layer has an ``attn_router`` and an ``mlp_router`` (modes other than
``baseline``), and the replacement modes have a ``model.final_router`` before the final norm.

The math is docs/design.md section 1. Sublayer j = 0..2L-1 (attention, MLP, attention, ...) computes
v_j = f_j(u_j), its input u_j routed over the sources S_j it reads:

  baseline       u = x;                    x <- x + v          (no routers)
  additive       u = x + G(r(S_j));        x <- x + v          (e.g. delta, delta_block)
  replacement    u = r(B + [p]);           p <- p + v          (e.g. attnres, full_attnres; a final router
                                                                 mixes B + [p] before the final norm)

with r(S) = sum_i alpha_i s_i (:class:`DeltaRouter`). Which sources S_j are (h0, v0, v1, ... for delta;
block sums for delta_block; B0 = h0, B1, ... for the replacement modes) and when a sublayer's output
becomes one is each mode's class in modes.py, the rules the Megatron model applies
(megatron_delta/core/sources.py); here :class:`DepthSources` holds them as a dict of named tensors,
stacked per call (readability over speed).

A receiver with no sources (``authors-code``: the first attention) uses u = x, or reads the null
source alone (r = z) when there is one - the convention of tests/helpers/reference_delta.py.
``output_routing=True`` keeps the routing weights of a call in ``model.model.last_routing``.

Sources are per token position, so with a KV cache the sources of the new tokens are
computed from the new tokens alone: ``generate()`` with the default DynamicCache works unchanged.
"""
import torch
from torch import nn
from transformers.cache_utils import Cache, DynamicCache
from transformers.generation import GenerationMixin
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.modeling_utils import PreTrainedModel
from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
    DeepseekV3Attention,
    DeepseekV3Experts,
    DeepseekV3MLP,
    DeepseekV3MoE,
    DeepseekV3RMSNorm,
    DeepseekV3RotaryEmbedding,
    DeepseekV3TopkRouter,
)
from transformers.models.qwen3.modeling_qwen3 import (
    Qwen3Attention,
    Qwen3MLP,
    Qwen3RMSNorm,
    Qwen3RotaryEmbedding,
)
from transformers.models.qwen3_moe.modeling_qwen3_moe import (
    Qwen3MoeExperts,
    Qwen3MoeSparseMoeBlock,
    Qwen3MoeTopKRouter,
)

from .configuration_delta import DeltaDeepseekV3Config, DeltaQwen3Config


class DeltaRouter(nn.Module):
    """Softmax-over-depth router (docs/design.md section 1). Parameters are fp32; the math is fp32.

    logit_i = w . (g * s_i / rms(s_i)),  rms(x) = sqrt(mean_d(x^2) + eps)
    alpha   = softmax_i(logit);  r = sum_i alpha_i s_i  (unnormalised sources)

    Parameters: ``query`` w (zeros), ``key_norm_weight`` g (ones), optionally
    ``null_source`` z (zeros, an extra source broadcast to all tokens, placed LAST) and
    ``gate`` a (zeros, shape [1]).
    """

    def __init__(self, hidden_size: int, eps: float, null_source: bool = False, gate: bool = False):
        super().__init__()
        self.eps = float(eps)
        self.query = nn.Parameter(torch.zeros(hidden_size, dtype=torch.float32))
        self.key_norm_weight = nn.Parameter(torch.ones(hidden_size, dtype=torch.float32))
        if null_source:
            self.null_source = nn.Parameter(torch.zeros(hidden_size, dtype=torch.float32))
        else:
            self.register_parameter("null_source", None)
        if gate:
            self.gate = nn.Parameter(torch.zeros(1, dtype=torch.float32))
        else:
            self.register_parameter("gate", None)

    def reset_parameters(self):
        with torch.no_grad():
            self.query.zero_()
            self.key_norm_weight.fill_(1.0)
            if self.null_source is not None:
                self.null_source.zero_()
            if self.gate is not None:
                self.gate.zero_()

    def _stack(self, sources, like=None):
        if not sources:  # only the null source (authors-code, first receiver): it reads z alone
            return self.null_source.float().expand(1, *like.shape)
        s = torch.stack([t.float() for t in sources], dim=0)  # [N, b, t, d]
        if self.null_source is not None:
            z = self.null_source.float().expand(1, *s.shape[1:])
            s = torch.cat([s, z], dim=0)
        return s

    def weights(self, sources, like=None) -> torch.Tensor:
        """alpha, [N(+1), b, t] in fp32 (the null source, if any, is the last row)."""
        return self._weights_of(self._stack(sources, like))

    def _weights_of(self, s: torch.Tensor) -> torch.Tensor:
        inv_rms = torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + self.eps)
        keys = self.key_norm_weight.float() * (s * inv_rms)
        logits = keys @ self.query.float()  # [N, b, t]
        return torch.softmax(logits, dim=0)

    def forward(self, sources, like=None) -> torch.Tensor:
        """r = sum_i alpha_i s_i in fp32 (not gated, not cast). ``like``: shape donor when sources is empty."""
        s = self._stack(sources, like)
        alpha = self._weights_of(s)
        return (alpha.unsqueeze(-1) * s).sum(0)

    def _record(self, record, sources, like):
        if record is not None:
            with torch.no_grad():
                if sources or self.null_source is not None:
                    record.append(self.weights(sources, like).permute(1, 2, 0).contiguous())
                else:
                    record.append(like.new_zeros(*like.shape[:-1], 0, dtype=torch.float32))

    def additive(self, x: torch.Tensor, sources, record=None, apply_gate: bool = True) -> torch.Tensor:
        """u = x + G(r) for the additive modes; G = identity or a*r (scalar gate, unless not apply_gate).

        No sources (authors-code, first receiver): u = x, or u = x + G(z) with a null source."""
        self._record(record, sources, x)
        if len(sources) == 0 and self.null_source is None:
            return x
        r = self.forward(sources, like=x)
        if self.gate is not None and apply_gate:
            r = self.gate.float() * r
        return x + r.to(x.dtype)

    def replace(self, sources, dtype, record=None) -> torch.Tensor:
        """u = r for the replacement modes, cast to the activation dtype."""
        self._record(record, sources, sources[0])
        return self.forward(sources).to(dtype)


class DepthSources:
    """The sources of one call and the residual stream x (additive modes), by the names of modes.py.

    The mode object (``config.residual_rules()``) runs a call: ``start`` holds the embedding output,
    then per sublayer j ``u = routed_input(buf, j, router)`` and ``commit(buf, j, f_j(u))``, then
    ``output(buf, final_router)``. It acts through the methods below, the interface that
    megatron_delta/core/sources.py's SourceBuffer gives the Megatron model (which adds pipeline payloads
    and fused projections); here they are plain tensor operations.
    """

    def __init__(self, rules, dtype: torch.dtype, record=None):
        self.rules, self.dtype, self.record = rules, dtype, record
        self.sources = {}  # name -> tensor
        self.x = None  # the residual stream of the additive modes

    @property
    def held_x(self):
        return self.x

    def hold(self, name: str, value: torch.Tensor):
        if name == "x":
            self.x = value
        else:
            self.sources[name] = value

    def hold_sum(self, name: str, partial, addend: torch.Tensor):
        self.hold(name, addend if partial is None else partial + addend)

    def hold_difference(self, name: str, minuend: torch.Tensor, subtrahend: torch.Tensor):
        self.hold(name, minuend - subtrahend)

    def take(self, name: str):
        return self.sources.pop(name, None)

    def value(self, name: str) -> torch.Tensor:
        return self.x if name == "x" else self.sources[name]

    def rename(self, old: str, new: str):
        self.sources[new] = self.sources.pop(old)

    def add_to_x(self, v: torch.Tensor):
        self.x = self.x + v

    def route(self, j, router: DeltaRouter, *, base, apply_gate: bool, base_sums: bool) -> torch.Tensor:
        """Receiver j (a sublayer, or "final") over the sources it reads: base + G(r), or r without a base.
        ``base_sums`` (the base is the sum of those sources) only tells the Megatron router that it may
        rebuild one from the other; the math is the same."""
        names = self.rules.final_reads() if j == "final" else self.rules.reads(j)
        sources = [self.sources[name] for name in names]
        if base is None:
            return router.replace(sources, self.dtype, self.record)
        return router.additive(base, sources, self.record, apply_gate=apply_gate)


class DeltaQwen3Attention(Qwen3Attention):
    """Qwen3 attention; with ``use_qk_norm=False`` the q/k norms are dropped (Llama attention)."""

    def __init__(self, config: DeltaQwen3Config, layer_idx: int):
        super().__init__(config, layer_idx)
        if not config.use_qk_norm:
            self.q_norm = nn.Identity()
            self.k_norm = nn.Identity()


class DeltaQwen3DecoderLayer(nn.Module):
    """One transformer layer = two sublayers f_j (each including its own input norm) + their routers."""

    def __init__(self, config: DeltaQwen3Config, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.self_attn = DeltaQwen3Attention(config=config, layer_idx=layer_idx)
        # the mixture of experts where Qwen3-MoE has it (its router `gate` and stacked `experts`), else SwiGLU
        self.mlp = Qwen3MoeSparseMoeBlock(config) if config.is_moe_layer(layer_idx) else Qwen3MLP(config)
        self.input_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.add_routers(config)

    def add_routers(self, config):
        if config.has_routers:
            kw = dict(eps=config.delta_router_eps, null_source=config.delta_null_source,
                      gate=config.delta_gate == "scalar")
            self.attn_router = DeltaRouter(config.hidden_size, **kw)
            self.mlp_router = DeltaRouter(config.hidden_size, **kw)

    def attn_sublayer(self, u, attention_mask, position_embeddings, position_ids, cache, **kwargs):
        out, _ = self.self_attn(
            hidden_states=self.input_layernorm(u),
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            position_embeddings=position_embeddings,
            **kwargs,
        )
        return out

    def mlp_sublayer(self, u):
        return self.mlp(self.post_attention_layernorm(u))


class DeltaDeepseekV3DecoderLayer(DeltaQwen3DecoderLayer):
    """DeepSeek-V3's layer (multi-latent attention; its MoE after the first dense layers) as two routed sublayers."""

    def __init__(self, config: DeltaDeepseekV3Config, layer_idx: int):
        nn.Module.__init__(self)  # replaces DeltaQwen3DecoderLayer.__init__: DeepSeek-V3's submodules, same names
        self.layer_idx = layer_idx
        self.self_attn = DeepseekV3Attention(config=config, layer_idx=layer_idx)
        self.mlp = DeepseekV3MoE(config) if config.is_moe_layer(layer_idx) else DeepseekV3MLP(config)
        self.input_layernorm = DeepseekV3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = DeepseekV3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.add_routers(config)


class DeltaQwen3PreTrainedModel(PreTrainedModel):
    config_class = DeltaQwen3Config
    config: DeltaQwen3Config
    base_model_prefix = "model"
    supports_gradient_checkpointing = False
    _no_split_modules = ["DeltaQwen3DecoderLayer"]
    _supports_flash_attn = True
    _supports_sdpa = True
    _supports_flex_attn = True
    _supports_attention_backend = True
    # router parameters and math stay in fp32 whatever dtype the model is loaded in
    _keep_in_fp32_modules_strict = ["attn_router", "mlp_router", "final_router"]

    def _init_weights(self, module):
        super()._init_weights(module)
        if isinstance(module, DeltaRouter):
            module.reset_parameters()
        elif isinstance(module, Qwen3MoeExperts):  # as Qwen3MoePreTrainedModel initialises them
            nn.init.normal_(module.gate_up_proj, std=self.config.initializer_range)
            nn.init.normal_(module.down_proj, std=self.config.initializer_range)
        elif isinstance(module, Qwen3MoeTopKRouter):
            nn.init.normal_(module.weight, std=self.config.initializer_range)


class DeltaQwen3Model(DeltaQwen3PreTrainedModel):
    # the backbone's modules (DeltaDeepseekV3Model: DeepSeek-V3's)
    decoder_layer_class, norm_class, rotary_class = DeltaQwen3DecoderLayer, Qwen3RMSNorm, Qwen3RotaryEmbedding

    def __init__(self, config: DeltaQwen3Config):
        super().__init__(config)
        self.padding_idx = config.pad_token_id
        self.vocab_size = config.vocab_size
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, self.padding_idx)
        self.layers = nn.ModuleList(
            [self.decoder_layer_class(config, i) for i in range(config.num_hidden_layers)]
        )
        self.norm = self.norm_class(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = self.rotary_class(config=config)
        if config.has_final_router:
            self.final_router = DeltaRouter(config.hidden_size, eps=config.delta_router_eps,
                                            null_source=config.delta_null_source, gate=False)
        self.layer_types = getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
        self.has_sliding_layers = "sliding_attention" in self.layer_types
        self.last_routing = None
        self.post_init()

    def get_input_embeddings(self):
        return self.embed_tokens

    def set_input_embeddings(self, value):
        self.embed_tokens = value

    def _sublayers(self):
        """Yield (layer, is_attention) for j = 0..2L-1."""
        for layer in self.layers[: self.config.num_hidden_layers]:
            yield layer, True
            yield layer, False

    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        position_ids=None,
        cache: Cache | None = None,
        inputs_embeds=None,
        use_cache=None,
        past_key_values: Cache | None = None,
        output_routing: bool = False,
        **kwargs,
    ) -> BaseModelOutputWithPast:
        """``output_routing=True`` stores the routing weights of this call in ``self.last_routing``: one fp32
        tensor [b, t, N(+1)] per receiver, in order j = 0..2L-1 then the final router (null source last)."""
        record = [] if output_routing else None
        self.last_routing = record
        if cache is None:
            cache = past_key_values
        if (input_ids is None) ^ (inputs_embeds is not None):
            raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
        use_cache = use_cache if use_cache is not None else self.config.use_cache
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        if use_cache and cache is None:
            cache = DynamicCache(config=self.config)
        if position_ids is None:
            past_seen = cache.get_seq_length() if cache is not None else 0
            position_ids = (torch.arange(inputs_embeds.shape[1], device=inputs_embeds.device) + past_seen).unsqueeze(0)

        if not isinstance(mask_mapping := attention_mask, dict):
            mask_kwargs = dict(config=self.config, inputs_embeds=inputs_embeds, attention_mask=attention_mask,
                               cache=cache, position_ids=position_ids)
            mask_mapping = {"full_attention": create_causal_mask(**mask_kwargs)}
            if self.has_sliding_layers:
                mask_mapping["sliding_attention"] = create_sliding_window_causal_mask(**mask_kwargs)

        h0 = inputs_embeds
        position_embeddings = self.rotary_emb(h0, position_ids)
        layer_types = self.layer_types

        def f(layer, is_attn, u):
            if is_attn:
                return layer.attn_sublayer(u, mask_mapping[layer_types[layer.layer_idx]], position_embeddings,
                                           position_ids, cache if use_cache else None, **kwargs)
            return layer.mlp_sublayer(u)

        def router(layer, is_attn):
            return layer.attn_router if is_attn else layer.mlp_router

        rules = self.config.residual_rules()  # the mode's class in modes.py; None for baseline
        if rules is None:
            x = h0
            for layer, is_attn in self._sublayers():
                x = x + f(layer, is_attn, x)
            out = x
        else:
            sources = DepthSources(rules, h0.dtype, record)
            rules.start(sources, h0)
            for j, (layer, is_attn) in enumerate(self._sublayers()):
                u = rules.routed_input(sources, j, router(layer, is_attn))
                rules.commit(sources, j, f(layer, is_attn, u))
            out = rules.output(sources, getattr(self, "final_router", None))

        return BaseModelOutputWithPast(last_hidden_state=self.norm(out), cache=cache if use_cache else None)


class DeltaQwen3ForCausalLM(DeltaQwen3PreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    model_class = DeltaQwen3Model  # DeltaDeepseekV3ForCausalLM: DeltaDeepseekV3Model

    def __init__(self, config: DeltaQwen3Config):
        super().__init__(config)
        self.model = self.model_class(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def set_input_embeddings(self, value):
        self.model.embed_tokens = value

    def get_output_embeddings(self):
        return self.lm_head

    def set_output_embeddings(self, value):
        self.lm_head = value

    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        position_ids=None,
        cache: Cache | None = None,
        inputs_embeds=None,
        labels=None,
        use_cache=None,
        logits_to_keep: int | torch.Tensor = 0,
        past_key_values: Cache | None = None,
        output_routing: bool = False,
        **kwargs,
    ) -> CausalLMOutputWithPast:
        """``output_routing=True``: routing weights of this call in ``self.model.last_routing``."""
        outputs = self.model(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
            cache=cache if cache is not None else past_key_values, inputs_embeds=inputs_embeds,
            use_cache=use_cache, output_routing=output_routing, **kwargs,
        )
        hidden = outputs.last_hidden_state
        if isinstance(logits_to_keep, int):
            hidden = hidden[:, -logits_to_keep:, :] if logits_to_keep > 0 else hidden
        else:
            hidden = hidden[:, logits_to_keep, :]
        logits = self.lm_head(hidden)
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
        return CausalLMOutputWithPast(loss=loss, logits=logits, cache=outputs.cache)

    @classmethod
    def from_backbone(cls, backbone, **delta_kwargs) -> "DeltaQwen3ForCausalLM":
        """A Delta model holding the weights of a stock ``Qwen3ForCausalLM`` / ``LlamaForCausalLM``.

        Router parameters get their initial values (zero query, unit key norm, zero null source/gate).
        """
        config = DeltaQwen3Config.from_backbone_config(backbone.config, **delta_kwargs)
        model = cls(config).to(dtype=next(backbone.parameters()).dtype)
        missing, unexpected = model.load_state_dict(backbone.state_dict(), strict=False)
        bad_missing = [k for k in missing if "_router." not in k and k != "lm_head.weight"]
        if bad_missing or unexpected:
            raise ValueError(f"backbone weights do not fit: missing {bad_missing}, unexpected {unexpected}")
        for m in model.modules():
            if isinstance(m, DeltaRouter):
                m.float().reset_parameters()
        if config.tie_word_embeddings:
            model.tie_weights()
        return model


class DeltaDeepseekV3PreTrainedModel(DeltaQwen3PreTrainedModel):
    config_class = DeltaDeepseekV3Config
    config: DeltaDeepseekV3Config
    _no_split_modules = ["DeltaDeepseekV3DecoderLayer"]
    # DeepSeek-V3's router and its correction bias stay fp32, as in DeepseekV3PreTrainedModel
    _keep_in_fp32_modules_strict = DeltaQwen3PreTrainedModel._keep_in_fp32_modules_strict + [
        "e_score_correction_bias", "gate.weight"]

    def _init_weights(self, module):
        super()._init_weights(module)
        if isinstance(module, DeepseekV3TopkRouter):  # as DeepseekV3PreTrainedModel initialises them
            nn.init.normal_(module.weight, std=self.config.initializer_range)
            nn.init.zeros_(module.e_score_correction_bias)
        elif isinstance(module, DeepseekV3Experts):
            nn.init.normal_(module.gate_up_proj, std=self.config.initializer_range)
            nn.init.normal_(module.down_proj, std=self.config.initializer_range)


class DeltaDeepseekV3Model(DeltaDeepseekV3PreTrainedModel, DeltaQwen3Model):
    decoder_layer_class, norm_class, rotary_class = (DeltaDeepseekV3DecoderLayer, DeepseekV3RMSNorm,
                                                     DeepseekV3RotaryEmbedding)


class DeltaDeepseekV3ForCausalLM(DeltaDeepseekV3PreTrainedModel, DeltaQwen3ForCausalLM):
    model_class = DeltaDeepseekV3Model


__all__ = ["DeltaDeepseekV3ForCausalLM", "DeltaDeepseekV3Model", "DeltaQwen3ForCausalLM", "DeltaQwen3Model",
           "DeltaQwen3PreTrainedModel", "DeltaRouter"]
