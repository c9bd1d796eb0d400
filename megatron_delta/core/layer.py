"""DeltaTransformerLayer: Megatron's TransformerLayer whose two sublayers read routed inputs.

For each sublayer j (2 per layer: attention, then MLP) the SourceBuffer of the micro-batch supplies
the routed input `u` (additive modes: x + G(r_j); replacement modes: r_j over B + [p]), the sublayer
computes its addend `v_j = dropout(f_j(u))` (f_j includes the sublayer's own input norm; with TE the
norm is fused into linear_qkv / linear_fc1, so `u` is what enters the fused linear), and the buffer
commits it. The attention, MLP and norm modules are Megatron's own, built from the spec.
"""

from dataclasses import dataclass
from typing import Union

import torch

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
    router.outside_fp8 = bool(config.fp8)  # DESIGN.md 2: router math fp32, outside FP8 autocast
    return router


class DeltaTransformerLayer(TransformerLayer):
    def __init__(self, config, submodules: DeltaTransformerLayerSubmodules, *args, **kwargs):
        super().__init__(config, submodules, *args, **kwargs)
        self.self_attention_router = build_router(submodules.self_attention_router, config)
        self.mlp_router = build_router(submodules.mlp_router, config)

    @property
    def first_sublayer(self) -> int:
        """Global index j of this layer's attention sublayer (layer_number is global and 1-based)."""
        return 2 * (self.layer_number - 1)

    # Replaces TransformerLayer.forward: the layer threads a SourceBuffer, not one hidden-states tensor.
    def forward(self, source_buffer, attention_mask=None, rotary_pos_emb=None, rotary_pos_cos=None,
                rotary_pos_sin=None, attention_bias=None, packed_seq_params=None, sequence_len_offset=None,
                inference_context=None, **unused):
        j = self.first_sublayer
        u = source_buffer.routed_input(j, self.self_attention_router)
        out, bias = self.self_attention(
            self.input_layernorm(u), attention_mask=attention_mask, inference_context=inference_context,
            rotary_pos_emb=rotary_pos_emb, rotary_pos_cos=rotary_pos_cos, rotary_pos_sin=rotary_pos_sin,
            attention_bias=attention_bias, packed_seq_params=packed_seq_params,
            sequence_len_offset=sequence_len_offset)
        source_buffer.commit(j, self._addend(out, bias))

        u = source_buffer.routed_input(j + 1, self.mlp_router)
        out, bias = self.mlp(self.pre_mlp_layernorm(u))
        source_buffer.commit(j + 1, self._addend(out, bias))
        return source_buffer

    def _addend(self, out, bias):
        """What Megatron's bias-dropout-add would add to the residual: dropout(out + bias)."""
        if bias is not None:
            out = out + bias
        return torch.nn.functional.dropout(out, p=self.hidden_dropout, training=self.training)
