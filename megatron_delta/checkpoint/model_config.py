"""A GPT model described by a dict of model fields, built without any command line.

The fields are Megatron-LM's argument names - the keys of the ``run_config.json`` every checkpoint carries
(checkpoint/run_config.py) - so conversion rebuilds a checkpoint's model from that file, and the tools and tests
describe theirs the same way:

    fields = resolve_model_fields({"num_layers": 4, "residual": "delta_block", "vocab_size": 256})
    config, options = model_config(fields)
    chunks = build_model_chunks(config, fields["padded_vocab_size"], **options)   # megatron_delta.core.model

A field left out (or None, as run_config.json records a flag that was not given) takes its value from
:data:`SMALL_CPU_MODEL`, the tiny Qwen3-style model (RMSNorm, SwiGLU, RoPE, qk-layernorm, GQA, no biases)
the tools and tests build on a CPU, or is derived (ffn_hidden_size, kv_channels, max_position_embeddings,
delta_num_blocks, delta_router_eps, padded_vocab_size). A missing required field, an unknown one or a bad
value raises :class:`ModelConfigError` naming the field (and its pretrain_gpt.py flag).

The mapping to DeltaTransformerConfig is the one of Megatron-LM's core_transformer_config_from_args, which
the trainer uses (trainer/provider.py), on every field that defines the model's function
(tests/integration/test_conversion.py compares the two on the trainer's own arguments); it differs only where this
process is a CPU build of one model: no CUDA fusions, CPU initialisation, no dropout by default.
"""
from __future__ import annotations

from typing import Iterable, Mapping

from megatron_delta.core.modes import BASELINE, check_delta_options


class ModelConfigError(ValueError):
    """A missing, unknown or bad model field; the message names it and its pretrain_gpt.py flag."""


# Every field this module knows, with its value when not given (None: derived, or off).
SMALL_CPU_MODEL = dict(
    # shape (run_config.MODEL_FLAGS)
    num_layers=4, hidden_size=128, ffn_hidden_size=None, num_attention_heads=4, num_query_groups=2,
    kv_channels=None, normalization="RMSNorm", norm_epsilon=1e-6, swiglu=True, qk_layernorm=True,
    disable_bias_linear=True, untie_embeddings_and_output_weights=False, position_embedding_type="rope",
    rotary_base=1000000, max_position_embeddings=None, seq_length=128,
    vocab_size=None, padded_vocab_size=None, make_vocab_size_divisible_by=128,
    # residual routing
    residual=BASELINE, delta_num_blocks=None, delta_null_source=False, delta_gate="none", delta_sources="exact",
    delta_router_eps=None, delta_router_kernels="auto",
    # mixture of experts (Megatron-LM's defaults; num_experts None: dense) and multi-token prediction
    num_experts=None, moe_ffn_hidden_size=None, moe_router_topk=2, moe_router_pre_softmax=False, moe_layer_freq=1,
    moe_router_score_function="softmax",
    moe_shared_expert_intermediate_size=None, moe_router_enable_expert_bias=False, moe_router_num_groups=None,
    moe_router_group_topk=None, moe_router_topk_scaling_factor=None, moe_shared_expert_gate=False,
    mtp_num_layers=None,
    # multi-latent attention (Megatron-LM's parser defaults; rope_type None: MLATransformerConfig's, yarn)
    multi_latent_attention=False, q_lora_rank=None, kv_lora_rank=32, qk_head_dim=128, qk_pos_emb_head_dim=64,
    v_head_dim=128, rope_type=None, rotary_scaling_factor=1.0, mscale=1.0, mscale_all_dim=0.0,
    # initialisation and regularisation (a CPU test model: no dropout)
    init_method_std=0.02, hidden_dropout=0.0, attention_dropout=0.0,
    # Megatron-LM's default (--attention-softmax-in-fp32 off): BF16 models take the softmax in BF16, as trained
    attention_softmax_in_fp32=False,
    # layout
    tensor_model_parallel_size=1, pipeline_model_parallel_size=1, virtual_pipeline_model_parallel_size=None,
    sequence_parallel=False,
    # precision and backend
    transformer_impl="local", bf16=False, fp8_format=None, fp8_recipe="delayed", fp8_amax_history_len=1,
    fp8_amax_compute_algo="most_recent",
    # activation recomputation
    recompute_granularity=None, recompute_method=None, recompute_num_layers=None,
)

_INT = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups", "kv_channels",
        "rotary_base", "max_position_embeddings", "seq_length", "vocab_size", "padded_vocab_size",
        "make_vocab_size_divisible_by", "delta_num_blocks", "tensor_model_parallel_size",
        "pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size", "fp8_amax_history_len",
        "recompute_num_layers", "num_experts", "moe_ffn_hidden_size", "moe_router_topk", "mtp_num_layers",
        "q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim",
        "moe_shared_expert_intermediate_size", "moe_router_num_groups", "moe_router_group_topk")
_FLOAT = ("norm_epsilon", "delta_router_eps", "init_method_std", "hidden_dropout", "attention_dropout",
          "rotary_scaling_factor", "mscale", "mscale_all_dim", "moe_router_topk_scaling_factor")
_BOOL = ("swiglu", "qk_layernorm", "disable_bias_linear", "untie_embeddings_and_output_weights", "delta_null_source",
         "sequence_parallel", "bf16", "attention_softmax_in_fp32", "moe_router_pre_softmax", "multi_latent_attention",
         "moe_router_enable_expert_bias", "moe_shared_expert_gate")
# Choices of the fields the modes module does not check (residual, delta_gate, delta_sources: modes.py;
# delta_router_kernels: the config).
_CHOICES = dict(normalization=("RMSNorm", "LayerNorm"), position_embedding_type=("rope", "learned_absolute", "none"),
                transformer_impl=("local", "transformer_engine"), fp8_format=("e4m3", "hybrid"),
                fp8_recipe=("delayed", "tensorwise", "mxfp8", "blockwise"),
                fp8_amax_compute_algo=("max", "most_recent"), recompute_granularity=("full", "selective"),
                recompute_method=("uniform", "block"), moe_router_score_function=("softmax", "sigmoid"),
                rope_type=("rope", "yarn"))


def _name(field: str) -> str:
    return f"{field} (--{field.replace('_', '-')})"


def _fail(field: str, what: str):
    raise ModelConfigError(f"model field {_name(field)} {what}")


def _check_type(field: str, value) -> None:
    if field in _INT and (isinstance(value, bool) or not isinstance(value, int)):
        _fail(field, f"must be an integer, got {value!r}")
    if field in _FLOAT and (isinstance(value, bool) or not isinstance(value, (int, float))):
        _fail(field, f"must be a number, got {value!r}")
    if field in _BOOL and not isinstance(value, bool):
        _fail(field, f"must be true or false, got {value!r}")
    if field == "moe_layer_freq" and not (isinstance(value, int) and not isinstance(value, bool) and value > 0
                                          or isinstance(value, list) and all(v in (0, 1) for v in value)):
        _fail(field, f"must be a positive integer or a list of 0 / 1 per layer, got {value!r}")
    if field in _CHOICES and value not in _CHOICES[field]:
        _fail(field, f"must be one of {', '.join(_CHOICES[field])}, got {value!r}")


def padded_vocab_size(vocab_size: int, make_vocab_size_divisible_by: int = 128,
                      tensor_model_parallel_size: int = 1) -> int:
    """Megatron-LM's padding: a multiple of make_vocab_size_divisible_by x TP."""
    multiple = make_vocab_size_divisible_by * tensor_model_parallel_size
    return ((vocab_size + multiple - 1) // multiple) * multiple


def resolve_model_fields(fields: Mapping, require: Iterable[str] = ()) -> dict:
    """Every field of :data:`SMALL_CPU_MODEL`, from ``fields`` (None = not given) or its default, derived values
    filled in and every combination checked. ``require``: fields that must be given (not None)."""
    unknown = sorted(set(fields) - set(SMALL_CPU_MODEL))
    if unknown:
        raise ModelConfigError(f"unknown model field(s) {', '.join(unknown)}; known: {', '.join(SMALL_CPU_MODEL)}")
    for field in require:
        if fields.get(field) is None:
            raise ModelConfigError(f"model field {_name(field)} is missing")
    f = dict(SMALL_CPU_MODEL)
    f.update({k: v for k, v in fields.items() if v is not None})
    for field, value in f.items():
        if value is not None:
            _check_type(field, value)

    L, d, heads = f["num_layers"], f["hidden_size"], f["num_attention_heads"]
    for field in ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "seq_length",
                  "tensor_model_parallel_size", "pipeline_model_parallel_size", "make_vocab_size_divisible_by"):
        if f[field] <= 0:
            _fail(field, f"must be a positive integer, got {f[field]}")
    if f["kv_channels"] is None:
        if d % heads:
            _fail("hidden_size", f"{d} is not divisible by num_attention_heads {heads}; give kv_channels")
        f["kv_channels"] = d // heads
    if f["ffn_hidden_size"] is None:
        f["ffn_hidden_size"] = 3 * d if f["swiglu"] else 4 * d
    if heads % f["num_query_groups"]:
        _fail("num_attention_heads", f"{heads} is not divisible by num_query_groups {f['num_query_groups']}")
    if f["max_position_embeddings"] is None:
        f["max_position_embeddings"] = f["seq_length"]
    if f["seq_length"] > f["max_position_embeddings"]:
        _fail("seq_length", f"{f['seq_length']} exceeds max_position_embeddings {f['max_position_embeddings']}")
    if f["vocab_size"] is not None and f["vocab_size"] <= 0:
        _fail("vocab_size", f"must be a positive integer, got {f['vocab_size']}")

    tp, pp = f["tensor_model_parallel_size"], f["pipeline_model_parallel_size"]
    if heads % tp:
        _fail("tensor_model_parallel_size", f"{tp} does not divide num_attention_heads {heads}")
    if f["num_query_groups"] % tp:
        _fail("tensor_model_parallel_size", f"{tp} does not divide num_query_groups {f['num_query_groups']}")
    if tp == 1:
        f["sequence_parallel"] = False  # Megatron-LM does the same: SP is a no-op without TP
    if f["sequence_parallel"] and f["seq_length"] % tp:
        _fail("sequence_parallel", f"needs seq_length {f['seq_length']} divisible by tensor_model_parallel_size {tp}")
    if L % pp:
        _fail("pipeline_model_parallel_size", f"{pp} does not divide num_layers {L}")
    vpp = f["virtual_pipeline_model_parallel_size"]
    if vpp is not None:
        if pp < 2:
            _fail("virtual_pipeline_model_parallel_size", "needs pipeline_model_parallel_size > 1")
        if vpp < 1 or (L // pp) % vpp:
            _fail("virtual_pipeline_model_parallel_size", f"{vpp} does not divide the {L // pp} layers of each "
                                                          f"pipeline stage")
        if vpp == 1:
            f["virtual_pipeline_model_parallel_size"] = None
    if f["padded_vocab_size"] is None and f["vocab_size"] is not None:
        f["padded_vocab_size"] = padded_vocab_size(f["vocab_size"], f["make_vocab_size_divisible_by"], tp)
    if f["padded_vocab_size"] is not None:
        if f["padded_vocab_size"] % tp:
            _fail("padded_vocab_size", f"{f['padded_vocab_size']} is not divisible by tensor_model_parallel_size {tp}")
        if f["vocab_size"] is not None and f["padded_vocab_size"] < f["vocab_size"]:
            _fail("padded_vocab_size", f"{f['padded_vocab_size']} is below vocab_size {f['vocab_size']}")

    if isinstance(f["moe_layer_freq"], list) and len(f["moe_layer_freq"]) != L:
        _fail("moe_layer_freq", f"lists {len(f['moe_layer_freq'])} layers, the model has num_layers {L}")
    if f["recompute_granularity"] == "full" and f["recompute_method"] is None:
        _fail("recompute_granularity", "full needs recompute_method uniform or block")
    if f["recompute_method"] is not None and f["recompute_granularity"] != "full":
        _fail("recompute_method", "is only used with recompute_granularity full")
    if f["recompute_granularity"] == "full" and f["recompute_num_layers"] is None:
        f["recompute_num_layers"] = 1
    if f["transformer_impl"] == "transformer_engine":
        import importlib.util

        import torch

        if not torch.cuda.is_available() or importlib.util.find_spec("transformer_engine") is None:
            _fail("transformer_impl", "transformer_engine needs a GPU and Transformer Engine; use local")
    if f["fp8_format"] is not None:
        if f["transformer_impl"] != "transformer_engine":
            _fail("fp8_format", f"{f['fp8_format']} needs transformer_impl transformer_engine (FP8 GEMMs are "
                                f"Transformer Engine kernels; the local backend has none)")
        if not f["bf16"]:
            _fail("fp8_format", f"{f['fp8_format']} needs bf16 (FP8 GEMMs with BF16 weights and activations, as "
                                f"in Megatron-LM)")
        if f["fp8_amax_history_len"] < 1:
            _fail("fp8_amax_history_len", f"must be >= 1, got {f['fp8_amax_history_len']}")

    try:  # the residual options: one check, in core/modes.py (its messages name the flags)
        f["delta_num_blocks"] = check_delta_options(
            f["residual"], L, f["delta_num_blocks"], f["delta_null_source"], f["delta_gate"], f["delta_sources"],
            router_kernels=f["delta_router_kernels"])
        if f["residual"] != BASELINE:
            from megatron_delta.core.router import check_kernels

            check_kernels(f["delta_router_kernels"])  # `c` must build, `fla` import: fail now, not at step 1
    except ValueError as e:
        raise ModelConfigError(str(e)) from None
    if f["delta_router_eps"] is None:
        f["delta_router_eps"] = f["norm_epsilon"]
    return f


def model_config(fields: Mapping, **config_overrides):
    """(DeltaTransformerConfig, GPTModel options of megatron_delta.core.model.gpt_model / build_model_chunks)
    for the model ``fields`` describe (resolved by :func:`resolve_model_fields` first); ``config_overrides``
    set DeltaTransformerConfig fields directly."""
    import torch
    import torch.nn.functional as F

    from megatron_delta.core.config import DeltaMLATransformerConfig, DeltaTransformerConfig
    from megatron_delta.platform import patches

    f = resolve_model_fields(fields)
    dtype = torch.bfloat16 if f["bf16"] else torch.float32
    kw = dict(
        num_layers=f["num_layers"], hidden_size=f["hidden_size"], ffn_hidden_size=f["ffn_hidden_size"],
        num_attention_heads=f["num_attention_heads"], num_query_groups=f["num_query_groups"],
        kv_channels=f["kv_channels"], normalization=f["normalization"], layernorm_epsilon=f["norm_epsilon"],
        gated_linear_unit=f["swiglu"], activation_func=F.silu if f["swiglu"] else F.gelu,
        add_bias_linear=not f["disable_bias_linear"], add_qkv_bias=not f["disable_bias_linear"],
        qk_layernorm=f["qk_layernorm"], init_method_std=f["init_method_std"], hidden_dropout=f["hidden_dropout"],
        attention_dropout=f["attention_dropout"], attention_softmax_in_fp32=f["attention_softmax_in_fp32"],
        tensor_model_parallel_size=f["tensor_model_parallel_size"],
        pipeline_model_parallel_size=f["pipeline_model_parallel_size"],
        virtual_pipeline_model_parallel_size=f["virtual_pipeline_model_parallel_size"],
        sequence_parallel=f["sequence_parallel"], params_dtype=dtype, pipeline_dtype=dtype, bf16=f["bf16"],
        fp8=f["fp8_format"], fp8_recipe=f["fp8_recipe"], fp8_amax_history_len=f["fp8_amax_history_len"],
        fp8_amax_compute_algo=f["fp8_amax_compute_algo"],
        recompute_granularity=f["recompute_granularity"], recompute_method=f["recompute_method"],
        recompute_num_layers=f["recompute_num_layers"], transformer_impl=f["transformer_impl"],
        # Fused kernels are CUDA-only; Megatron falls back to them only when asked.
        bias_activation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False, apply_rope_fusion=False,
        persist_layer_norm=False, gradient_accumulation_fusion=False, cross_entropy_loss_fusion=False,
        use_cpu_initialization=True,
        # Upstream workaround, in the registry (patches.REGISTRY vpp_pp2_batched_p2p, Megatron-LM #750): VPP with
        # PP=2 and batched p2p mixes send-next/send-prev to the same peer, so p2p is batched only without VPP.
        batch_p2p_comm=patches.batch_p2p_comm(f["virtual_pipeline_model_parallel_size"]),
        residual=f["residual"], delta_num_blocks=f["delta_num_blocks"], delta_null_source=f["delta_null_source"],
        delta_gate=f["delta_gate"], delta_sources=f["delta_sources"], delta_router_eps=f["delta_router_eps"],
        delta_router_kernels=f["delta_router_kernels"],
        num_moe_experts=f["num_experts"], moe_ffn_hidden_size=f["moe_ffn_hidden_size"],
        moe_router_topk=f["moe_router_topk"], moe_router_pre_softmax=f["moe_router_pre_softmax"],
        moe_layer_freq=f["moe_layer_freq"], moe_router_score_function=f["moe_router_score_function"],
        moe_shared_expert_intermediate_size=f["moe_shared_expert_intermediate_size"],
        moe_router_enable_expert_bias=f["moe_router_enable_expert_bias"],
        moe_router_num_groups=f["moe_router_num_groups"], moe_router_group_topk=f["moe_router_group_topk"],
        moe_router_topk_scaling_factor=f["moe_router_topk_scaling_factor"],
        moe_shared_expert_gate=f["moe_shared_expert_gate"],
        mtp_num_layers=f["mtp_num_layers"],
    )
    if f["multi_latent_attention"]:  # MLATransformerConfig's fields, as core_transformer_config_from_args maps them
        kw.update(multi_latent_attention=True, num_query_groups=None, rotary_base=f["rotary_base"],
                  **{k: f[k] for k in ("q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim",
                                       "v_head_dim", "rotary_scaling_factor", "mscale", "mscale_all_dim")},
                  **({"rope_type": f["rope_type"]} if f["rope_type"] else {}))
    kw.update(config_overrides)
    options = dict(transformer_impl=f["transformer_impl"], max_sequence_length=f["max_position_embeddings"],
                   share_embeddings_and_output_weights=not f["untie_embeddings_and_output_weights"],
                   position_embedding_type=f["position_embedding_type"], rotary_base=f["rotary_base"])
    config = (DeltaMLATransformerConfig if f["multi_latent_attention"] else DeltaTransformerConfig)(**kw)
    if f["residual"] != BASELINE and f["pipeline_model_parallel_size"] > 1:
        # As the trainer (trainer/provider.transformer_config), after __post_init__ (whose MoE check refuses it
        # with the default token dispatcher): routed payloads differ in length from stage boundary to boundary,
        # so p2p sends shapes first where a rank holds several chunks (core/payload.py)
        from megatron_delta.core.payload import payload_shapes_travel

        config.variable_seq_lengths = payload_shapes_travel(config)
    return config, options
