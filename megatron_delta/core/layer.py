"""DeltaTransformerLayer: Megatron's TransformerLayer whose two sublayers read routed inputs.

For each sublayer j (2 per layer: attention, then MLP) the SourceBuffer of the micro-batch supplies
the routed input `u` (additive modes: x + G(r_j); replacement modes: r_j over B + [p]), the sublayer
computes its addend `v_j = dropout(f_j(u))` (f_j includes the sublayer's own input norm; with TE the
norm is fused into linear_qkv / linear_fc1, so `u` is what enters the fused linear), and the buffer
commits it. The sublayers run through TransformerLayer's own `_forward_attention` / `_forward_mlp`
(selective recompute, MLP chunking, padding_mask and the rest as upstream); the spec's bias-dropout
modules (:func:`get_bias_dropout`) return v instead of adding it to a residual.
"""

from dataclasses import dataclass
from typing import Union

import torch
from megatron.core.transformer.identity_op import IdentityFuncOp, IdentityOp
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules


@dataclass
class DeltaTransformerLayerSubmodules(TransformerLayerSubmodules):
    self_attention_router: Union[ModuleSpec, type] = None
    mlp_router: Union[ModuleSpec, type] = None


def build_router(spec, config):
    """A DepthRouter from the config's delta_* fields (no random numbers are consumed)."""
    router = build_module(spec, config.hidden_size, null_source=config.delta_null_source,
                          gate=config.delta_gate == "scalar", eps=config.delta_router_eps,
                          sequence_parallel=config.sequence_parallel, kernels=config.delta_router_kernels)
    router.outside_fp8 = bool(config.fp8)  # docs/design.md section 2: router math fp32, outside FP8 autocast
    return router


def get_bias_dropout(training: bool, fused: bool):
    """The routed layer's `self_attn_bda` / `mlp_bda` (in place of Megatron's get_bias_dropout_add): the addend
    v = dropout(out + bias), without the residual, which the SourceBuffer adds (x <- x + v). `fused` is
    ignored: the same two ops either way, so --bias-dropout-fusion changes no number."""
    def bias_dropout(x_with_bias, residual, prob):
        out, bias = x_with_bias
        if bias is not None:
            out = out + bias
        return torch.nn.functional.dropout(out, p=prob, training=training)
    return bias_dropout


# Cross-attention's three submodules and what a GPT layer has there instead.
_NO_CROSS_ATTENTION = {"cross_attention": IdentityOp, "pre_cross_attn_layernorm": IdentityOp,
                       "cross_attn_bda": IdentityFuncOp}


def check_no_cross_attention(submodules, residual: str) -> None:
    """A routed layer has two sublayers (self-attention, MLP), each with its router; refuse a spec with a
    cross-attention sublayer (which would have no router, and whose norm would get the addend v)."""
    for name, identity in _NO_CROSS_ATTENTION.items():
        spec = getattr(submodules, name)
        module = spec.module if isinstance(spec, ModuleSpec) else spec
        if module not in (IdentityOp, IdentityFuncOp):
            raise ValueError(f"cross-attention is not supported with --residual {residual}: the layer spec's "
                             f"{name} is {getattr(module, '__name__', module)}, but a routed layer routes two "
                             f"sublayers (self-attention, MLP). Use a GPT layer spec with {name}="
                             f"{identity.__name__}, or --residual baseline (Megatron's TransformerLayer)")


class DeltaTransformerLayer(TransformerLayer):
    def __init__(self, config, submodules: DeltaTransformerLayerSubmodules, *args, **kwargs):
        check_no_cross_attention(submodules, config.residual)
        super().__init__(config, submodules, *args, **kwargs)
        self.self_attention_router = build_router(submodules.self_attention_router, config)
        self.mlp_router = build_router(submodules.mlp_router, config)

    @property
    def first_sublayer(self) -> int:
        """Global index j of this layer's attention sublayer (layer_number is global and 1-based)."""
        return 2 * (self.layer_number - 1)

    # Replaces TransformerLayer.forward: the layer threads a SourceBuffer, not one hidden-states tensor.
    # ``kwargs`` are TransformerLayer.forward's own (attention_mask, rotary_pos_emb, ..., padding_mask),
    # handed on as upstream's forward does: all to _forward_attention, three of them to _forward_mlp.
    def forward(self, source_buffer, **kwargs):
        j = self.first_sublayer
        v, _ = self._forward_attention(source_buffer.routed_input(j, self.self_attention_router), **kwargs)
        source_buffer.commit(j, v)
        v = self._forward_mlp(source_buffer.routed_input(j + 1, self.mlp_router), kwargs.get("inference_context"),
                              padding_mask=kwargs.get("padding_mask"),
                              packed_seq_params=kwargs.get("packed_seq_params"))
        source_buffer.commit(j + 1, v)
        return source_buffer
