"""The model: DeltaGPTModel, the layer spec of each mode and one GPT model per pipeline chunk.

`baseline` is Megatron-Core's own GPTModel with its own local (or TE) layer spec. The routed modes use
`DeltaGPTModel` with `get_gpt_layer_with_delta_spec`, which build on the same Megatron submodules; the
routers consume no random numbers, so one `--seed` gives the same backbone weights in every mode.
"""

import torch
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.heterogeneous.heterogeneous_layer_specs import get_gpt_heterogeneous_layer_spec
from megatron.core.pipeline_parallel.utils import (
    is_pp_first_stage,
    is_pp_last_stage,
    is_vp_first_stage,
    is_vp_last_stage,
)
from megatron.core.process_groups_config import ProcessGroupCollection

from megatron_delta.core.block import DeltaTransformerBlock
from megatron_delta.core.config import DeltaTransformerConfig
from megatron_delta.core.layer import DeltaTransformerLayer
from megatron_delta.core.mtp import MTPRouting, megatron_layer_of, routed_mtp_block_spec, routes_mtp
from megatron_delta.core.norms import LocalNorm
from megatron_delta.core.source_cache import link_chunks
from megatron_delta.core.specs import (
    decoder_block_spec,
    get_gpt_layer_local_spec_sp,
    get_gpt_layer_with_delta_spec,
    get_gpt_layer_with_delta_te_spec,
    moe_decoder_block_spec,
    mtp_block_spec,
)


def megatron_layer_spec(config: DeltaTransformerConfig, transformer_impl: str = "local"):
    """Megatron's GPT layer spec (an MoE layer with --num-experts), local or TE backend: baseline's layers."""
    moe = dict(num_experts=config.num_moe_experts, moe_grouped_gemm=config.moe_grouped_gemm)
    mla = config.multi_latent_attention  # Megatron's MLA spec (DeltaMLATransformerConfig), as gpt_builders.py
    if transformer_impl == "transformer_engine":
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        return get_gpt_layer_with_transformer_engine_spec(
            qk_layernorm=config.qk_layernorm, multi_latent_attention=mla,
            mla_down_proj_fusion=getattr(config, "mla_down_proj_fusion", False), **moe)
    return get_gpt_layer_local_spec_sp(qk_layernorm=config.qk_layernorm, normalization=config.normalization,
                                       multi_latent_attention=mla, **moe)


def layer_spec_for(config: DeltaTransformerConfig, transformer_impl: str = "local"):
    """Megatron's GPT layer spec for `baseline` (an MoE layer with --num-experts), the Delta layer spec
    otherwise (local or TE backend)."""
    if not config.routed:
        return megatron_layer_spec(config, transformer_impl)
    kw = dict(qk_layernorm=config.qk_layernorm, normalization=config.normalization,
              multi_latent_attention=config.multi_latent_attention)
    if transformer_impl == "transformer_engine":
        return get_gpt_layer_with_delta_te_spec(**kw, mla_down_proj_fusion=getattr(config, "mla_down_proj_fusion",
                                                                                    False))
    return get_gpt_layer_with_delta_spec(**kw)


def megatron_mtp_layer_spec(config: DeltaTransformerConfig, vp_stage=None, transformer_impl: str = "local"):
    """The layer spec Megatron-LM's gpt_builders.py gives the MTP block: the decoder's (baseline's) layer spec;
    with --num-experts the MoE block spec (MTP reads its last layer's spec), or the MoE layer spec on a
    chunk with no decoder layers."""
    if config.num_moe_experts:
        block_spec = moe_decoder_block_spec(config, vp_stage, transformer_impl)
        if block_spec.layer_specs:
            return megatron_layer_of(block_spec)  # its last layer, as Megatron's own (routed modes' specs too)
    return megatron_layer_spec(config, transformer_impl)


def mtp_spec_for(config: DeltaTransformerConfig, vp_stage=None, transformer_impl: str = "local"):
    """The MTP block this chunk builds (None without --mtp-num-layers or off its chunk): Megatron's, built
    from baseline's layer spec (baseline and the additive modes), or with routed depths (the replacement
    modes; core/mtp.py and docs/design.md section 1.7)."""
    if not config.mtp_num_layers:
        return None
    block_spec = mtp_block_spec(config, megatron_mtp_layer_spec(config, vp_stage, transformer_impl), vp_stage,
                                transformer_impl)
    if routes_mtp(config):
        routed = layer_spec_for(config, transformer_impl)
        if config.num_moe_experts:  # the decoder's last layer, MoE or dense (--moe-layer-freq), as it is routed
            last = moe_decoder_block_spec(config, vp_stage, transformer_impl).layer_specs[-1:]
            if last and issubclass(last[0].module, DeltaTransformerLayer):
                routed = last[0]
        block_spec = routed_mtp_block_spec(block_spec, routed)
    return block_spec


def final_norm_for(transformer_impl: str):
    if transformer_impl == "transformer_engine":
        from megatron.core.extensions.transformer_engine import TENorm

        return TENorm
    return LocalNorm


def gpt_model(config: DeltaTransformerConfig, vocab_size: int, *, pre_process: bool, post_process: bool,
              vp_stage=None, transformer_impl: str = "local", **gpt_kwargs) -> GPTModel:
    """One pipeline chunk: Megatron-Core's GPTModel (baseline) or DeltaGPTModel (routed modes).
    ``gpt_kwargs`` are GPTModel's own (max_sequence_length, position_embedding_type, rotary_base, ...).
    With config.mtp_num_layers the chunk that holds the MTP block (the last) gets it (mtp_spec_for)."""
    if config.num_moe_experts:
        # Megatron-LM's gpt_builders.py: the MoE block spec (dense and MoE layers, --moe-layer-freq; routed:
        # each layer in a DeltaTransformerLayer)
        block_spec = moe_decoder_block_spec(config, vp_stage, transformer_impl)
    elif config.heterogeneous_block_specs:
        # Megatron-LM's gpt_builders.py for HeterogeneousTransformerConfig (baseline only: core/config.py
        # HETEROGENEOUS_REFUSED): its per-layer block spec, this chunk's layers, as upstream builds it
        block_spec = get_gpt_heterogeneous_layer_spec(config, transformer_impl == "transformer_engine",
                                                      vp_stage=vp_stage)
    else:
        block_spec = decoder_block_spec(config, layer_spec_for(config, transformer_impl), vp_stage,
                                        final_norm_for(transformer_impl))
    model_cls = DeltaGPTModel if config.routed else GPTModel
    return model_cls(config=config, transformer_layer_spec=block_spec, vocab_size=vocab_size,
                     pre_process=pre_process, post_process=post_process, vp_stage=vp_stage,
                     mtp_block_spec=mtp_spec_for(config, vp_stage, transformer_impl),
                     parallel_output=True, **gpt_kwargs)


def build_model_chunks(config: DeltaTransformerConfig, vocab_size: int, pg_collection=None,
                       **options) -> list[torch.nn.Module]:
    """One GPT model per (virtual) pipeline chunk held by this rank, as megatron.training's get_model builds
    them (``options``: those of gpt_model). ``pg_collection``: the process groups (default: Megatron-Core's
    global ones, ProcessGroupCollection.use_mpu_process_groups)."""
    if pg_collection is None:
        pg_collection = ProcessGroupCollection.use_mpu_process_groups()
    vp_size = config.virtual_pipeline_model_parallel_size
    chunks = []
    for vp_stage in range(vp_size or 1):
        stage = vp_stage if vp_size else None
        chunks.append(gpt_model(
            config, vocab_size, vp_stage=stage,
            pre_process=is_pp_first_stage(pg_collection.pp) and is_vp_first_stage(stage, vp_size),
            post_process=is_pp_last_stage(pg_collection.pp) and is_vp_last_stage(stage, vp_size),
            pg_collection=pg_collection, **options))
    link_chunks(chunks, pg_collection)  # one source cache per rank under the interleaved schedule
    return chunks


class DeltaGPTModel(GPTModel):
    """GPTModel whose decoder is a DeltaTransformerBlock.

    GPTModel.__init__ hard-codes TransformerBlock; we let Megatron build it (so parameters, init order
    and random numbers are exactly the baseline's) and then re-class the built block, which only adds
    routing parameters that consume no random numbers.
    """

    def __init__(self, config, transformer_layer_spec, *args, **kwargs):
        super().__init__(config, transformer_layer_spec, *args, **kwargs)
        self.decoder.__class__ = DeltaTransformerBlock
        self.decoder.init_delta()
        self.mtp_reads_sources = self.mtp_process and routes_mtp(config)
        if self.mtp_reads_sources and not self.decoder.post_process:
            raise ValueError(f"--residual {config.residual} with --mtp-num-layers: the MTP block must be on the "
                             f"pipeline stage of the decoder's last layer (its depths read the decoder's sources); "
                             f"drop --pipeline-model-parallel-layout's standalone MTP stage")
        self.decoder.keep_final_sources = self.mtp_reads_sources

    # GPTModel.forward runs the decoder, then _postprocess (MTP, output layer, loss) in the same call: the
    # decoder's final sources (the trunk tuple, core/mtp.py) go to the MTP depths for that call only.
    def _postprocess(self, *args, **kwargs):
        if not self.mtp_process:
            return super()._postprocess(*args, **kwargs)
        rotary = kwargs.get("rotary_pos_emb")
        if isinstance(rotary, torch.Tensor) and not self.pre_process:
            # GPTModel sized the rotary table from the stage payload (several tensors x seq), as the decoder
            # found it (DeltaTransformerBlock.forward): the MTP layers need the positions of one sequence.
            hidden = kwargs["hidden_states"]
            kwargs["rotary_pos_emb"] = rotary[:hidden.size(0) * (self.config.tensor_model_parallel_size
                                                                 if self.config.sequence_parallel else 1)]
        if not self.mtp_reads_sources:
            return super()._postprocess(*args, **kwargs)
        trunk, self.decoder.final_sources = self.decoder.final_sources, None
        if self.config.mtp_detach_heads:  # as for the hidden state: no MTP gradient into the decoder
            trunk = [t.detach() for t in trunk]
        inner = [layer.mtp_model_layer for layer in self.mtp.layers]
        recording = MTPRouting() if self.decoder.record_routing else None
        for depth, layer in enumerate(inner, 1):
            layer.trunk_sources, layer.routing_recording, layer.depth = trunk, recording, depth
        try:
            out = super()._postprocess(*args, **kwargs)
        finally:
            for layer in inner:
                layer.trunk_sources, layer.routing_recording = None, None
        if recording is not None and recording.routing:
            self.decoder.routing_records.append(recording)
        return out
