"""DeltaTransformerBlock: one micro-batch's sources, from embedding to output, in one pipeline chunk.

The decoder of one (virtual) pipeline chunk holds the SourceBuffer of the micro-batch it is running:
it starts it from the embedding output (first chunk) or unpacks it from the one tensor the previous
stage sent (under the interleaved schedule, plus the sources its rank already holds: the pipeline
source cache, core/source_cache.py), runs its layers, and either packs what the next stage needs into one tensor or
(last chunk) applies the final router of the replacement modes and the final norm. Activation recompute
checkpoints groups of layers whose inputs are the buffer's tensors, passed explicitly.
"""

from contextlib import nullcontext

import torch
from megatron.core import tensor_parallel
from megatron.core.transformer.transformer_block import TransformerBlock
from megatron.core.utils import WrappedTensor, deprecate_inference_params, make_viewless_tensor

from megatron_delta.core.layer import build_router
from megatron_delta.core.modes import REPLACEMENT_MODES
from megatron_delta.core.payload import pack_stage_payload, payload_padding, unpack_stage_payload
from megatron_delta.core.router import DepthRouter
from megatron_delta.core.source_cache import cache_applies
from megatron_delta.core.sources import SourceBuffer, SourcePlan


class DeltaTransformerBlock(TransformerBlock):
    """TransformerBlock whose layers thread a SourceBuffer (see module docstring)."""

    def init_delta(self):
        """Called once by DeltaGPTModel after Megatron built the block: adds what routing needs."""
        self.plan = SourcePlan.from_config(self.config)
        self.payload_padding = payload_padding(self.config)  # None, or every payload's tensor count (graphs)
        self.record_routing = False
        self.source_cache = None  # the rank's SourceCache under the interleaved schedule (source_cache.link_chunks)
        self.routing_records = []  # SourceBuffers (and core.mtp.MTPRouting) of the micro-batches run while recording
        self.keep_final_sources = False  # set by DeltaGPTModel when MTP depths read the sources (core/mtp.py)
        self.final_sources = None  # the last forward's sources at the end of the decoder, when kept
        if self.config.residual in REPLACEMENT_MODES and self.post_process:
            self.final_router = build_router(DepthRouter, self.config)
        else:
            self.final_router = None

    def readers(self, layers, final: bool = False) -> dict:
        """Receiver -> router for a SourceBuffer whose scope is ``layers`` (+ the final router)."""
        out = {}
        for layer in layers:
            out[layer.first_sublayer] = layer.self_attention_router
            out[layer.first_sublayer + 1] = layer.mlp_router
        if final and self.final_router is not None:
            out["final"] = self.final_router
        return out

    @property
    def first_layer(self) -> int:
        """0-based global index of this chunk's first layer."""
        return self.layers[0].layer_number - 1

    @property
    def end_layer(self) -> int:
        return self.layers[-1].layer_number

    # Replaces TransformerBlock.forward: a SourceBuffer, not one hidden-states tensor, runs through the layers
    # (upstream's arguments, all handed on or refused by name); the output is the stage payload or final-normed.
    def forward(self, hidden_states, attention_mask, context=None, context_mask=None, rotary_pos_emb=None,
                rotary_pos_cos=None, rotary_pos_sin=None, rotary_pos_cos_sin=None, attention_bias=None,
                inference_context=None, packed_seq_params=None, sequence_len_offset=None, padding_mask=None,
                extract_layer_indices=None, *, inference_params=None, dynamic_inference_decode_only=None):
        inference_context = deprecate_inference_params(inference_context, inference_params)
        self._refuse_unsupported(context=context, context_mask=context_mask, inference_context=inference_context,
                                 extract_layer_indices=extract_layer_indices)
        if isinstance(hidden_states, WrappedTensor):
            hidden_states = hidden_states.unwrap()
        if not self.pre_process:
            hidden_states = self.input_tensor  # the previous stage's payload (see set_input_tensor)
        eps = self.config.delta_router_eps
        scope = self.readers(self.layers, final=self.post_process)  # the routers of this chunk
        cache = self._linked_source_cache()
        if cache is not None:
            micro_batch, k = cache.begin(self.vp_stage), cache.chunk(self.vp_stage)  # k: the global chunk index
        if self.pre_process:
            h0 = make_viewless_tensor(inp=hidden_states, requires_grad=True, keep_graph=True)
            buffer = SourceBuffer.start(self.plan, h0, eps, record_routing=self.record_routing, readers=scope)
            tensors = None
        else:
            names = self.plan.payload_names(self.first_layer)
            if cache is None:
                tensors = unpack_stage_payload(hidden_states, len(names), self.payload_padding)
            else:  # the payload holds what this rank lacks; the rest comes from its cache
                sent = cache.plan.sent_names(k)
                by_name = dict(zip(sent, unpack_stage_payload(hidden_states, len(sent), self.payload_padding)))
                by_name.update(cache.take(micro_batch, cache.plan.taken_names(k)))
                tensors = [by_name[n] for n in names]
            buffer = None
            # GPTModel sizes the rotary table from input_tensor, which is the packed payload
            # (len(names) x seq): keep the positions of one sequence.
            if isinstance(rotary_pos_emb, torch.Tensor):
                full = tensors[0].size(0) * (self.config.tensor_model_parallel_size
                                             if self.config.sequence_parallel else 1)
                rotary_pos_emb = rotary_pos_emb[:full]
        # TransformerLayer.forward's arguments, as upstream's layer loop passes them (context and
        # context_mask are None: cross-attention is refused)
        layer_kwargs = dict(attention_mask=attention_mask, rotary_pos_emb=rotary_pos_emb,
                            rotary_pos_cos=rotary_pos_cos, rotary_pos_sin=rotary_pos_sin,
                            rotary_pos_cos_sin=rotary_pos_cos_sin, attention_bias=attention_bias,
                            inference_context=inference_context, packed_seq_params=packed_seq_params,
                            sequence_len_offset=sequence_len_offset, padding_mask=padding_mask)

        rng = tensor_parallel.get_cuda_rng_tracker().fork() if self.config.sequence_parallel else nullcontext()
        with rng, self._outer_fp8_context():
            if self.config.recompute_granularity == "full" and self.training:
                if buffer is not None:
                    tensors = buffer.to_tensors()
                tensors = self._checkpointed_layers(tensors, layer_kwargs)
                buffer = SourceBuffer.from_tensors(self.plan, self.end_layer, tensors, eps,
                                                   readers=self.readers([], final=self.post_process))
            else:
                if buffer is None:
                    buffer = SourceBuffer.from_tensors(self.plan, self.first_layer, tensors, eps,
                                                       record_routing=self.record_routing, readers=scope)
                for layer in self.layers:
                    with self._inner_fp8_context(layer):
                        layer(buffer, **layer_kwargs)
                if self.record_routing:
                    self.routing_records.append(buffer)

        if self.post_process:
            if self.keep_final_sources:  # what the final router reads: the MTP depths read it too
                self.final_sources = [buffer.value(n) for n in self.plan.final_reads()]
            out = buffer.output(self.final_router)
            if self.final_layernorm is not None:
                out = self.final_layernorm(out)
        elif cache is None:
            out = pack_stage_payload(buffer.to_tensors(), self.payload_padding)
        else:
            tensors = dict(zip(self.plan.payload_names(self.end_layer), buffer.to_tensors()))
            out = pack_stage_payload([tensors[n] for n in cache.plan.sent_names(k + 1)], self.payload_padding)
            out = cache.keep(micro_batch, self.vp_stage, out, {n: tensors[n] for n in cache.plan.kept_names(k)})
        if cache is not None:
            cache.finish_forward(micro_batch, self.vp_stage)
        return make_viewless_tensor(inp=out, requires_grad=True, keep_graph=True)

    def _linked_source_cache(self):
        """The rank's SourceCache, or None; refuses to run interleaved chunks that were never linked (the
        neighbouring ranks' chunks would send a cached payload this one cannot read)."""
        if self.source_cache is None and cache_applies(self.config):
            raise RuntimeError("--delta-pp-source-cache on: this rank's model chunks were never linked to one "
                               "source cache; build them with megatron_delta.core.model.build_model_chunks, or call "
                               "megatron_delta.core.source_cache.link_chunks(model_chunks) after Megatron's get_model")
        return self.source_cache

    def _refuse_unsupported(self, **arguments):
        """TransformerBlock.forward's arguments that the routed block cannot honour: an error naming the
        argument, not a silent skip (the config-level refusals are in config.UNSUPPORTED_FEATURES)."""
        why = {"context": "cross-attention (the routed layer has no cross-attention sublayer)",
               "context_mask": "cross-attention (the routed layer has no cross-attention sublayer)",
               "inference_context": "Megatron-Core inference (KV cache); generate with the model exported to "
                                    "Hugging Face (megatron_delta.hf)",
               "extract_layer_indices": "intermediate hidden states: a routed layer's output is the SourceBuffer's "
                                        "sources, not one hidden state"}
        for name, value in arguments.items():
            if value is not None and (not isinstance(value, (set, list, tuple)) or value):
                raise ValueError(f"DeltaTransformerBlock.forward: {name} is not supported with --residual "
                                 f"{self.config.residual}: {why[name]}")

    # FP8 contexts as in TransformerBlock.forward: the delayed recipe wraps the whole layer loop once
    # (one amax reduction per pass), the other recipes wrap each layer (get_fp8_context may leave
    # first/last layers in BF16). The routers inside switch FP8 off again (router._outside_fp8), and
    # the final router / final norm run after the outer context, as Megatron's final norm does.
    def _outer_fp8_context(self):
        if not self.config.fp8 or self.config.fp8_recipe != "delayed":
            return nullcontext()
        from megatron.core.fp8_utils import get_fp8_context

        return get_fp8_context(self.config)

    def _inner_fp8_context(self, layer):
        if not self.config.fp8 or self.config.fp8_recipe == "delayed":
            return nullcontext()
        from megatron.core.fp8_utils import get_fp8_context

        return get_fp8_context(self.config, layer.layer_number - 1)

    # Replaces megatron.core.recompute.checkpointed_forward (full recompute): the sources go in as explicit
    # tensor arguments, since recompute re-runs the function in backward; upstream's rules otherwise kept.
    def _checkpointed_layers(self, tensors, layer_kwargs):
        eps = self.config.delta_router_eps
        n, step = len(self.layers), self.config.recompute_num_layers

        def run(start, end):
            def fn(*ts):
                first = self.layers[start].layer_number - 1
                buffer = SourceBuffer.from_tensors(self.plan, first, list(ts), eps,
                                                   readers=self.readers(self.layers[start:end]))
                for layer in self.layers[start:end]:
                    with self._inner_fp8_context(layer):
                        layer(buffer, **layer_kwargs)
                return tuple(buffer.to_tensors())
            return fn

        def checkpointed(start, end, ts):
            if self.config.fp8:  # TE's checkpoint restores the FP8 state on recompute
                from megatron.core.extensions.transformer_engine import te_checkpoint

                return list(te_checkpoint(run(start, end), self.config.distribute_saved_activations,
                                          tensor_parallel.random.get_cuda_rng_tracker, self.pg_collection.tp, *ts))
            return list(tensor_parallel.checkpoint(run(start, end), self.config.distribute_saved_activations, *ts))

        if self.config.recompute_method == "uniform":
            for start in range(0, n, step):
                tensors = checkpointed(start, min(start + step, n), tensors)
        elif self.config.recompute_method == "block":
            skipped = 0  # under FP8, TE's re-entrant checkpoint needs an input that needs a gradient
            for i in range(n):
                if self.config.fp8 and not any(t.requires_grad for t in tensors):
                    skipped += 1
                if skipped <= i < step + skipped:
                    tensors = checkpointed(i, i + 1, tensors)
                else:
                    tensors = list(run(i, i + 1)(*tensors))
        else:
            raise ValueError(f"--recompute-method {self.config.recompute_method!r} is not uniform or block")
        return tensors
