"""Multi-token prediction (--mtp-num-layers) in the routed modes (docs/design.md section 1.7).

Megatron's MTP depth k (megatron/core/transformer/multi_token_prediction.py) reads the previous hidden state
h_{k-1} (h_0: the decoder's output after its final norm) and the embedding of the tokens shifted by k, forms
z = eh_proj([enorm(e); hnorm(h_{k-1})]), runs one transformer layer on z and applies its own final norm. What
the layer is depends on the mode:

- additive modes (delta, delta_block): the decoder's output is the residual stream x_L, normed, which is what
  Megatron's MTP reads; each depth is Megatron's own residual layer (the layer baseline would build), so the
  MTP block is Megatron's, unchanged (``megatron_mtp_layer_spec``).
- replacement modes (attnres, full_attnres), following Megatron-LM PR #6840: each depth reads the decoder's
  sources at its end (the ones its final router reads, before the final router and norm: the trunk tuple T,
  the same for every depth) plus its own, which start from z and follow the mode's rule: attnres keeps one
  partial p (z, then z + v_attn, then z + v_attn + v_mlp), full_attnres keeps each output as a source
  (z, v_attn, v_mlp). Its two sublayers route over T + its own sources, and a final router of the depth mixes
  T + its own sources before the depth's final norm. The depth's output feeds the next depth's hnorm, never
  T. ``MTPDeltaTransformerLayer`` is the depth's layer and ``DeltaMultiTokenPredictionLayer`` the depth (its
  final router); DeltaGPTModel hands T from the decoder to the depths.
"""

from __future__ import annotations

from dataclasses import fields as dataclass_fields
from dataclasses import replace
from typing import List, Optional

from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.transformer.multi_token_prediction import MultiTokenPredictionLayer
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules
from megatron.core.utils import deprecate_inference_params

from megatron_delta.core.layer import DeltaTransformerLayer, build_router
from megatron_delta.core.modes import FULL_ATTNRES, REPLACEMENT_MODES
from megatron_delta.core.router import DepthRouter, Source


def routes_mtp(config) -> bool:
    """Whether this config's MTP depths route over the decoder's sources (replacement modes with MTP)."""
    return bool(config.mtp_num_layers) and config.residual in REPLACEMENT_MODES


# Megatron MTP options the replacement modes' routed depths do not implement: config field -> (flag, why)
ROUTED_MTP_REFUSED = {
    "mtp_use_repeated_layer": ("--mtp-use-repeated-layer", "each depth has its own routers over the decoder's "
                               "sources; one layer shared by every depth is not built or tested for them"),
    "mtp_detach_heads": ("--mtp-detach-heads", "it detaches the depths' hidden-state input only, while the routed "
                         "depths also read the decoder's sources, so the MTP loss would still train the decoder"),
    "mtp_standalone": ("--mtp-standalone", "it puts the MTP block on a pipeline stage of its own, while the routed "
                       "depths read the decoder's sources, which stay on the stage of the decoder's last layer"),
}


def check_mtp_options(residual: str, mtp_num_layers, recompute_granularity, **options) -> None:
    """What the routed MTP depths cannot do (ValueError naming the flags). Megatron's MTP recompute
    (--recompute-granularity full) re-runs a depth from its hidden-state input alone, but a replacement
    mode's depth also reads the decoder's sources, which would then get no gradient from the recomputed pass.
    ``options``: the ROUTED_MTP_REFUSED fields that are set."""
    if mtp_num_layers and residual in REPLACEMENT_MODES:
        for field, (flag, why) in ROUTED_MTP_REFUSED.items():
            if options.get(field):
                raise ValueError(f"{flag} cannot be used with --mtp-num-layers and --residual {residual}: {why}. "
                                 f"Drop {flag}")
    if mtp_num_layers and residual in REPLACEMENT_MODES and recompute_granularity == "full":
        raise ValueError(f"--recompute-granularity full cannot be used with --mtp-num-layers and --residual "
                         f"{residual}: each MTP depth reads the decoder's sources, which Megatron's MTP "
                         f"recompute does not take as inputs. Use --recompute-granularity selective, or no "
                         f"recompute")


class MTPDepthSources:
    """The sources one MTP depth's routers read: the trunk tuple T, then the depth's own (see module
    docstring). Protocol as SourceBuffer's: ``routed_input(router)`` then ``commit(v)`` per sublayer, then
    ``output(final_router)``. Every source is projected by the router that reads it (a local Source)."""

    def __init__(self, trunk: List, z, eps: float, every_output_is_source: bool,
                 recording: Optional["MTPRouting"] = None, depth: int = 0):
        self.trunk = list(trunk)
        self.own: list = []  # full_attnres: the depth's completed sources (z, v_attn)
        self.partial = z  # attnres: z + the outputs so far; full_attnres: the latest one
        self.eps = eps
        self.every_output_is_source = every_output_is_source
        self.recording, self.depth = recording, depth
        self._sublayers = iter(("attn", "mlp"))

    def values(self) -> list:
        return self.trunk + self.own + [self.partial]

    def _route(self, router: DepthRouter, receiver: str):
        sources = [Source(v, None, {}, self.eps, None) for v in self.values()]
        if self.recording is None:
            return router(sources)
        u, alpha = router(sources, True)
        self.recording.routing[mtp_receiver(self.depth, receiver)] = alpha.detach()
        return u

    def routed_input(self, router: DepthRouter):
        u = self._route(router, next(self._sublayers))
        if self.every_output_is_source:  # the partial becomes a source; the next output starts a new one
            self.own.append(self.partial)
            self.partial = None
        return u

    def commit(self, v) -> None:
        self.partial = v if self.partial is None else self.partial + v

    def output(self, final_router: DepthRouter):
        return self._route(final_router, "final")


def mtp_receiver(depth: int, receiver: str) -> str:
    """The routing statistics' key of MTP depth ``depth``'s (1-based) router ``receiver`` (attn, mlp, final)."""
    return f"mtp{depth}.{receiver}"


def mtp_source_names(depth: int, receiver: str, trunk: List[str], every_output_is_source: bool) -> List[str]:
    """Names of the sources MTP depth ``depth``'s router ``receiver`` reads, in order (the null source excluded):
    the trunk tuple's (``trunk``: the decoder's final router's), then the depth's own (MTPDepthSources):
    full_attnres its input z and each output so far, attnres its one partial sum."""
    done = {"attn": [], "mlp": ["attn"], "final": ["attn", "mlp"]}[receiver]
    if every_output_is_source:
        own = ["z"] + done
    else:
        own = ["+".join(["z"] + done)]
    return list(trunk) + [f"mtp{depth}:{name}" for name in own]


class MTPRouting:
    """The MTP depths' routing weights of one forward pass (``routing``: mtp_receiver key -> alpha [s, b, N(+1)]),
    recorded beside the decoder's SourceBuffers (DeltaTransformerBlock.routing_records) while it records."""

    def __init__(self) -> None:
        self.routing: dict = {}


class MTPDeltaTransformerLayer(DeltaTransformerLayer):
    """The transformer layer of one MTP depth in a replacement mode: its sublayers read routed inputs over the
    trunk tuple (``trunk_sources``, set by DeltaGPTModel for the duration of the MTP block) and the depth's
    own sources, started from its input z. Returns the depth's MTPDepthSources (in place of the hidden
    state); DeltaMultiTokenPredictionLayer._postprocess applies its final router."""

    trunk_sources: Optional[list] = None
    routing_recording: Optional[MTPRouting] = None  # set with trunk_sources while the decoder records routing
    depth: int = 0  # 1-based, set with trunk_sources

    # Replaces TransformerLayer.forward as Megatron's MultiTokenPredictionLayer calls it (keyword arguments,
    # ``inference_params`` under its old name); every argument is handed on as upstream's forward does.
    def forward(self, hidden_states, **kwargs):
        if self.trunk_sources is None:
            raise RuntimeError("MTPDeltaTransformerLayer: no decoder sources were handed to this MTP depth; "
                               "build the model with megatron_delta.core.model.gpt_model (DeltaGPTModel)")
        kwargs["inference_context"] = deprecate_inference_params(kwargs.get("inference_context"),
                                                                 kwargs.pop("inference_params", None))
        sources = MTPDepthSources(self.trunk_sources, hidden_states, self.config.delta_router_eps,
                                  every_output_is_source=self.config.residual == FULL_ATTNRES,
                                  recording=self.routing_recording, depth=self.depth)
        v, _ = self._forward_attention(sources.routed_input(self.self_attention_router), **kwargs)
        sources.commit(v)
        v = self._forward_mlp(sources.routed_input(self.mlp_router), kwargs.get("inference_context"),
                              padding_mask=kwargs.get("padding_mask"),
                              packed_seq_params=kwargs.get("packed_seq_params"))
        sources.commit(v)
        return sources, None


class DeltaMultiTokenPredictionLayer(MultiTokenPredictionLayer):
    """Megatron's MTP depth with a final router: the depth's output is final_router(T + its sources), then
    Megatron's final norm of the depth (PR #6840's per-depth aggregation before the final norm)."""

    def __init__(self, config, submodules, *args, **kwargs):
        super().__init__(config, submodules, *args, **kwargs)
        self.final_router = build_router(DepthRouter, config)

    def _postprocess(self, hidden_states):
        if isinstance(hidden_states, MTPDepthSources):
            hidden_states = hidden_states.output(self.final_router)
        return super()._postprocess(hidden_states)


def megatron_layer_of(spec):
    """Megatron's own TransformerLayer spec with ``spec``'s submodules: a DeltaTransformerLayer spec (or a block
    spec whose last layer is one, as MTP reads it) back to the residual layer, Megatron's bias-dropout-add
    included; any other spec as given. The additive modes' MTP depths are Megatron's layers (module docstring)."""
    if isinstance(spec, TransformerBlockSubmodules):
        spec = spec.layer_specs[-1]
    if not (isinstance(spec, ModuleSpec) and isinstance(spec.module, type)
            and issubclass(spec.module, DeltaTransformerLayer)):
        return spec
    fields = {f.name: getattr(spec.submodules, f.name) for f in dataclass_fields(TransformerLayerSubmodules)}
    fields.update(self_attn_bda=get_bias_dropout_add, mlp_bda=get_bias_dropout_add)
    return ModuleSpec(module=TransformerLayer, params=dict(spec.params),
                      submodules=TransformerLayerSubmodules(**fields))


def routed_mtp_block_spec(block_spec, routed_layer_spec: ModuleSpec):
    """Megatron's MTP block spec (built from the plain layer spec) with each depth a
    DeltaMultiTokenPredictionLayer whose transformer layer is ``routed_layer_spec``'s submodules in an
    MTPDeltaTransformerLayer."""
    if block_spec is None:
        return None
    inner = ModuleSpec(module=MTPDeltaTransformerLayer, params=dict(routed_layer_spec.params),
                       submodules=routed_layer_spec.submodules)
    block_spec.layer_specs = [
        ModuleSpec(module=DeltaMultiTokenPredictionLayer, params=dict(spec.params),
                   submodules=replace(spec.submodules, mtp_model_layer=inner))
        for spec in block_spec.layer_specs]
    return block_spec
