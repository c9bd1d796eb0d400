"""Checkpoint conversion between megatron-delta (torch_dist) and Hugging Face transformers.

    export: Megatron checkpoint -> HF directory
            baseline      -> stock Qwen3ForCausalLM (qk_layernorm) / LlamaForCausalLM (no qk norm),
                             loadable without remote code
            routed modes  -> DeltaQwen3ForCausalLM remote code (trust_remote_code=True)
            + the SentencePiece tokenizer named in run_config.json (tokenizer.json, tokenizer.model)
    import: HF Qwen3 / Llama directory -> Megatron checkpoint (iteration 0, model weights only) in any
            residual mode; router parameters get their initial values (zero query, unit key norm,
            zero null source / gate), so with `--delta-gate scalar` the imported model computes
            the HF model's function exactly.

Reading a checkpoint: the model is built in this process under TP1/PP1 and loaded with
`checkpointing.load_checkpoint`; dist_checkpointing reshards, so a checkpoint saved under any
TP/PP/VPP layout yields full tensors. Writing: torch_dist checkpoints are layout independent
(loading reshards), so saving under TP1/PP1 is enough for training under any TP/PP later; only the
vocabulary padding depends on TP (Megatron pads to a multiple of make-vocab-size-divisible-by x TP),
so `import` pads for the TP size it is given.

Megatron names (GPTModel local spec) <-> HF names: ONE rename table serves both directions (EMBEDDING,
FINAL_NORM, OUTPUT, LAYER_RENAMES, LAYER_FUSED, ROUTER_RENAMES below): q/k/v are fused per query group
into linear_qkv, gate/up into linear_fc1; the routers map decoder.layers.i.self_attention_router.* <->
model.layers.i.attn_router.*, ...mlp_router.*, decoder.final_router.* <-> model.final_router.*.
"""
import json
import os
import shutil
import tempfile

import torch

from megatron_delta.checkpointing import HF_TOKENIZER_FILES
from megatron_delta.core.modes import BASELINE, BLOCK_MODES, GATES, RESIDUAL_MODES, SOURCE_DEFINITIONS

ROUTER_FIELDS = ("query", "key_norm_weight", "null_source", "gate")
SUPPORTED_HF_ARCHS = ("Qwen3ForCausalLM", "LlamaForCausalLM")


class ConversionError(ValueError):
    """A checkpoint or model that cannot be converted; the message says why."""


# =============================================================================================== names
# ONE rename table serves both directions (export reads it left to right, import right to left).
# Whole-model tensors: (Megatron name, HF name). The vocabulary rows of the embedding / output layer are
# stripped on export and zero-padded on import; output_layer <-> lm_head only for untied embeddings.
EMBEDDING = ("embedding.word_embeddings.weight", "model.embed_tokens.weight")
FINAL_NORM = ("decoder.final_layernorm.weight", "model.norm.weight")
OUTPUT = ("output_layer.weight", "lm_head.weight")
# Per layer i (under decoder.layers.i. / model.layers.i.): (Megatron, HF, present only with qk-layernorm)
LAYER_RENAMES = (
    ("self_attention.linear_proj.weight", "self_attn.o_proj.weight", False),
    ("self_attention.q_layernorm.weight", "self_attn.q_norm.weight", True),
    ("self_attention.k_layernorm.weight", "self_attn.k_norm.weight", True),
    ("input_layernorm.weight", "input_layernorm.weight", False),
    ("pre_mlp_layernorm.weight", "post_attention_layernorm.weight", False),
    ("mlp.linear_fc2.weight", "mlp.down_proj.weight", False),
)
# Per layer, one fused Megatron tensor <-> several HF tensors (split on export, concatenated on import):
# linear_qkv is [q heads of group g; k_g; v_g] for each query group g, linear_fc1 is [gate; up].
LAYER_FUSED = (
    ("self_attention.linear_qkv.weight", ("self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                          "self_attn.v_proj.weight")),
    ("mlp.linear_fc1.weight", ("mlp.gate_proj.weight", "mlp.up_proj.weight")),
)
# Router tensors keep their field names; these prefix / module renames apply in order (reversed for import).
ROUTER_RENAMES = (("decoder.", "model."), ("self_attention_router", "attn_router"))


def _layer_prefixes(i):
    return f"decoder.layers.{i}.", f"model.layers.{i}."


def _layer_renames(num_layers, qk_layernorm):
    """(Megatron name, HF name) of every one-to-one per-layer tensor."""
    for i in range(num_layers):
        p, q = _layer_prefixes(i)
        for meg, hf, qk_only in LAYER_RENAMES:
            if qk_layernorm or not qk_only:
                yield p + meg, q + hf


def _router_name(name, to_hf):
    for meg, hf in (ROUTER_RENAMES if to_hf else ROUTER_RENAMES[::-1]):
        name = name.replace(meg, hf, 1) if to_hf else name.replace(hf, meg, 1)
    return name


def _split_fused(meg, w, per, num_query_groups, hn, d):
    """A fused Megatron tensor -> its HF tensors (in LAYER_FUSED order)."""
    if meg.endswith("linear_qkv.weight"):
        qkv = w.view(num_query_groups, per + 2, hn, d)
        return [qkv[:, :per].reshape(-1, d), qkv[:, per].reshape(-1, d), qkv[:, per + 1].reshape(-1, d)]
    return list(w.chunk(2, dim=0))


def _fuse(meg, parts, per, num_query_groups, hn, d):
    """HF tensors (in LAYER_FUSED order) -> the fused Megatron tensor."""
    if meg.endswith("linear_qkv.weight"):
        q, k, v = parts
        return torch.cat([q.view(num_query_groups, per, hn, d), k.view(num_query_groups, 1, hn, d),
                          v.view(num_query_groups, 1, hn, d)], dim=1).reshape(-1, d)
    return torch.cat(parts, dim=0)


def megatron_to_hf_state_dict(sd, *, num_layers, num_attention_heads, num_query_groups, kv_channels,
                              hidden_size, qk_layernorm, tied, vocab_size):
    """Megatron (TP1, full tensors) state dict -> HF (Qwen3/Llama/DeltaQwen3) state dict."""
    sd = {k: v for k, v in sd.items() if not k.endswith("_extra_state")}
    geom = (num_attention_heads // num_query_groups, num_query_groups, kv_channels, hidden_size)
    emb = sd.pop(EMBEDDING[0])
    if emb.shape[0] < vocab_size:
        raise ConversionError(f"embedding has {emb.shape[0]} rows, fewer than the vocabulary ({vocab_size})")
    out = {EMBEDDING[1]: emb[:vocab_size], FINAL_NORM[1]: sd.pop(FINAL_NORM[0])}
    if OUTPUT[0] in sd:
        w = sd.pop(OUTPUT[0])
        if not tied:
            out[OUTPUT[1]] = w[:vocab_size]
    for meg, hf in _layer_renames(num_layers, qk_layernorm):
        out[hf] = sd.pop(meg)
    for i in range(num_layers):
        p, q = _layer_prefixes(i)
        for meg, hfs in LAYER_FUSED:
            out.update(zip((q + h for h in hfs), _split_fused(meg, sd.pop(p + meg), *geom)))
    for name in list(sd):
        if "_router." in name:
            out[_router_name(name, to_hf=True)] = sd.pop(name)
    if sd:
        raise ConversionError(f"Megatron tensors with no HF counterpart: {sorted(sd)[:8]}")
    return {k: v.contiguous() for k, v in out.items()}


def hf_to_megatron_state_dict(hf, *, num_layers, num_attention_heads, num_query_groups, kv_channels,
                              hidden_size, qk_layernorm, tied, padded_vocab_size):
    """HF backbone state dict -> Megatron (TP1) names; vocabulary padded with zero rows."""
    hf = dict(hf)
    geom = (num_attention_heads // num_query_groups, num_query_groups, kv_channels, hidden_size)

    def pad(w):
        if w.shape[0] > padded_vocab_size:
            raise ConversionError(f"vocabulary {w.shape[0]} exceeds the padded size {padded_vocab_size}")
        return torch.cat([w, w.new_zeros(padded_vocab_size - w.shape[0], w.shape[1])]) \
            if w.shape[0] < padded_vocab_size else w

    out = {EMBEDDING[0]: pad(hf.pop(EMBEDDING[1])), FINAL_NORM[0]: hf.pop(FINAL_NORM[1])}
    head = hf.pop(OUTPUT[1], None)
    if tied:
        # Megatron keeps a (tied) output_layer.weight in its state dict on the last stage
        out[OUTPUT[0]] = out[EMBEDDING[0]]
    else:
        if head is None:
            raise ConversionError(f"untied embeddings but the HF model has no {OUTPUT[1]}")
        out[OUTPUT[0]] = pad(head)
    for meg, name in _layer_renames(num_layers, qk_layernorm):
        out[meg] = hf.pop(name)
    for i in range(num_layers):
        p, q = _layer_prefixes(i)
        for meg, hfs in LAYER_FUSED:
            out[p + meg] = _fuse(meg, [hf.pop(q + h) for h in hfs], *geom)
    for name in list(hf):
        if "_router." in name:
            out[_router_name(name, to_hf=False)] = hf.pop(name)
        elif name.endswith("rotary_emb.inv_freq"):
            hf.pop(name)
    if hf:
        raise ConversionError(f"HF tensors with no Megatron counterpart (unsupported architecture "
                              f"feature?): {sorted(hf)[:8]}")
    return {k: v.contiguous() for k, v in out.items()}


# =============================================================================================== Megatron side
def model_flags(c: dict) -> list:
    """pretrain_gpt flags of the model a run_config-like dict describes (no data / tokenizer / layout flags).
    For an imported checkpoint, fine-tune with these + `--tokenizer-type NullTokenizer --vocab-size
    <run_config vocab_size> --finetune --load CKPT`."""
    argv = ["--num-layers", c["num_layers"], "--hidden-size", c["hidden_size"],
            "--ffn-hidden-size", c["ffn_hidden_size"], "--num-attention-heads", c["num_attention_heads"],
            "--num-query-groups", c["num_query_groups"], "--kv-channels", c["kv_channels"],
            "--norm-epsilon", c["norm_epsilon"], "--rotary-base", c["rotary_base"],
            "--max-position-embeddings", c["max_position_embeddings"],
            "--normalization", c.get("normalization") or "RMSNorm",
            "--position-embedding-type", c.get("position_embedding_type") or "rope",
            "--residual", c["residual"], "--delta-gate", c.get("delta_gate") or GATES[0],
            "--delta-sources", c.get("delta_sources") or SOURCE_DEFINITIONS[0]]
    # Megatron-LM's flags state what differs from its defaults (LayerNorm, GeLU, biases, MHA, no qk norm)
    argv += ["--swiglu"] if c.get("swiglu", True) else []
    argv += ["--disable-bias-linear"] if c.get("disable_bias_linear", True) else []
    argv += ["--group-query-attention"] if c["num_query_groups"] != c["num_attention_heads"] else []
    argv += ["--qk-layernorm"] if c["qk_layernorm"] else []
    if c.get("untie_embeddings_and_output_weights"):
        argv.append("--untie-embeddings-and-output-weights")
    if c.get("delta_num_blocks") is not None and c["residual"] in BLOCK_MODES:
        argv += ["--delta-num-blocks", c["delta_num_blocks"]]
    if c.get("delta_null_source"):
        argv.append("--delta-null-source")
    if c.get("delta_router_eps") is not None:
        argv += ["--delta-router-eps", c["delta_router_eps"]]
    return [str(a) for a in argv]


def model_fields(rc: dict, where: str = "run_config.json", **overrides) -> dict:
    """The model fields (megatron_delta.model_config.run_config_fields) of a run_config-like dict; a missing or
    bad key is a ConversionError that says where it was read."""
    from megatron_delta.model_config import ModelConfigError, run_config_fields

    try:
        return run_config_fields(rc, **overrides)
    except ModelConfigError as e:
        raise ConversionError(f"{where}: {e}") from None


def checkpoint_args(fields: dict, **run):
    """What checkpointing.load_checkpoint / save_checkpoint read of a run (getattr on RECORDED_FLAGS):
    the model fields, one data-parallel replica without a distributed optimizer, and ``run``
    (tokenizer, vocabulary, seed)."""
    import types

    record = dict(data_parallel_size=1, use_distributed_optimizer=False, tokenizer_type=None, tokenizer_model=None,
                  seed=1234)
    record.update(fields)
    record.update(run)
    return types.SimpleNamespace(**record)


def _check_supported_run_config(rc: dict, where: str):
    bad = []
    if rc.get("normalization", "RMSNorm") != "RMSNorm":
        bad.append(f"normalization={rc.get('normalization')}")
    if rc.get("swiglu") is False:
        bad.append("swiglu=False")
    if rc.get("disable_bias_linear") is False:
        bad.append("linear biases (--add-bias-linear)")
    if rc.get("position_embedding_type", "rope") != "rope":
        bad.append(f"position_embedding_type={rc.get('position_embedding_type')}")
    if bad:
        raise ConversionError(f"{where}: cannot convert a model with {', '.join(bad)}; "
                              f"the HF export supports RMSNorm + SwiGLU + RoPE without biases (Qwen3/Llama)")


# How the tools compute with a checkpoint (--dtype): "auto" is the precision it was trained in (run_config.json
# "bf16"), so evaluation reproduces training's numbers; "fp32" computes with the (possibly bf16) weights in fp32.
EVAL_DTYPES = ("auto", "fp32", "bf16")


def eval_in_bf16(rc: dict, dtype: str, flag: str = "--dtype") -> bool:
    """Whether a tool computes in bf16 for ``dtype`` (one of EVAL_DTYPES) on a checkpoint of run_config ``rc``."""
    if dtype not in EVAL_DTYPES:
        raise ConversionError(f"{flag} must be one of {', '.join(EVAL_DTYPES)}, got {dtype!r}")
    return bool(rc.get("bf16")) if dtype == "auto" else dtype == "bf16"


def as_trained(chunks, config, bf16: bool) -> list:
    """The chunks as ``--bf16`` training holds them: each in Megatron-Core's Float16Module (bf16 model copy,
    fp32 logits out; the routers still compute in fp32, docs/design.md 2.5), else as built (fp32)."""
    if not bf16:
        return chunks
    from megatron.core.transformer.module import Float16Module

    return [Float16Module(config, c) for c in chunks]


def build_megatron_model(run_config: dict, padded_vocab_size: int, where: str = "run_config.json",
                         bf16: bool = False):
    """One GPT model (TP1/PP1, this process; fp32, or bf16 in Float16Module) for the model keys of a
    run_config-like dict. Returns (model, args): args as checkpointing's load / save read them (see
    checkpoint_args)."""
    from megatron_delta.cpu_platform import activate_cpu_platform, initialize_distributed
    from megatron_delta.core.model import build_model_chunks
    from megatron_delta.model_config import model_config

    fields = model_fields(run_config, where, padded_vocab_size=padded_vocab_size, bf16=bf16)
    args = checkpoint_args(fields)
    activate_cpu_platform()
    initialize_distributed(1, 1, seed=args.seed)
    config, options = model_config(fields)
    (model,) = as_trained(build_model_chunks(config, padded_vocab_size, **options), config, bf16)
    return model, args


def true_vocab_size(rc: dict) -> int:
    """The tokenizer's vocabulary (the HF vocab_size): the Megatron embedding minus its padding."""
    if rc.get("hf_vocab_size"):
        return int(rc["hf_vocab_size"])
    ttype = rc.get("tokenizer_type")
    if ttype == "NullTokenizer":
        return int(rc["vocab_size"])  # Megatron's NullTokenizer (0.17+): N tokens, eod = N - 1
    spm = rc.get("tokenizer_model")
    if not spm or not os.path.isfile(spm):
        raise ConversionError(f"the checkpoint's tokenizer model {spm!r} (run_config.json tokenizer_model) does "
                              f"not exist: it is needed for the vocabulary size and the exported tokenizer; "
                              f"restore it at that path (or retrain it with tools/train_tokenizer.py)")
    import sentencepiece

    return sentencepiece.SentencePieceProcessor(model_file=spm).get_piece_size()


def load_megatron(load: str, dtype: str = "fp32"):
    """Load a checkpoint (any TP/PP/VPP layout) as one TP1/PP1 model computing in ``dtype`` (EVAL_DTYPES;
    the export reads weights in fp32). Returns (model, args, run_config)."""
    from megatron_delta.checkpointing import load_checkpoint, read_run_config, resolve_checkpoint_dir

    ckpt_dir, _ = resolve_checkpoint_dir(load)
    rc = read_run_config(ckpt_dir)
    _check_supported_run_config(rc, f"--load {ckpt_dir}")
    bf16 = eval_in_bf16(rc, dtype)
    model, args = build_megatron_model(rc, rc["padded_vocab_size"], f"--load {ckpt_dir}", bf16=bf16)
    load_checkpoint(ckpt_dir, [model], None, None, args, load_optim=False, load_rng=False)
    model.eval()
    return model, args, rc


def load_megatron_parallel(load: str, tensor_model_parallel_size: int = 1, pipeline_model_parallel_size: int = 1,
                           dtype: str = "fp32"):
    """Load a checkpoint (saved under any layout) split over TP x PP ranks of this torch.distributed world
    (torchrun's WORLD_SIZE; the remaining factor is data parallel), as training would hold it, computing in
    ``dtype`` (EVAL_DTYPES). Returns (model chunks of this rank, args, run_config)."""
    from megatron_delta.checkpointing import load_checkpoint, read_run_config, resolve_checkpoint_dir
    from megatron_delta.cpu_platform import activate_cpu_platform, initialize_distributed
    from megatron_delta.core.model import build_model_chunks
    from megatron_delta.model_config import model_config

    tp, pp = int(tensor_model_parallel_size), int(pipeline_model_parallel_size)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if tp < 1 or pp < 1 or world % (tp * pp):
        raise ConversionError(f"--tensor-model-parallel-size {tp} x --pipeline-model-parallel-size {pp} needs "
                              f"{tp * pp} ranks per model, but the world size is {world}: launch with "
                              f"`torchrun --nproc-per-node {tp * pp}` (or a multiple of it)")
    ckpt_dir, _ = resolve_checkpoint_dir(load)
    rc = read_run_config(ckpt_dir)
    _check_supported_run_config(rc, f"--load {ckpt_dir}")
    bf16 = eval_in_bf16(rc, dtype)
    padded = rc["padded_vocab_size"]
    if padded % tp:
        raise ConversionError(f"--tensor-model-parallel-size {tp} does not divide the checkpoint's padded "
                              f"vocabulary ({padded})")
    # routed modes send a payload whose length differs by stage boundary (model_config sets
    # variable_seq_lengths for them under PP > 1, as training does)
    fields = model_fields(rc, f"--load {ckpt_dir}", tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                          bf16=bf16)
    args = checkpoint_args(fields, data_parallel_size=world // (tp * pp))
    activate_cpu_platform()
    initialize_distributed(tp, pp, seed=args.seed)
    config, options = model_config(fields)
    chunks = as_trained(build_model_chunks(config, padded, **options), config, bf16)
    load_checkpoint(ckpt_dir, chunks, None, None, args, load_optim=False, load_rng=False)
    for c in chunks:
        c.eval()
    return chunks, args, rc


def megatron_logits_parallel(chunks, ids) -> torch.Tensor | None:
    """One sequence through Megatron's pipeline schedule (forward only) on this rank's model chunks:
    [len(ids), padded_vocab] fp32 logits (gathered over TP) on the last pipeline stage, None elsewhere."""
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.utils import get_model_config

    from megatron_delta.core.payload import schedule_communication_kwargs

    tokens = torch.tensor([list(ids)], dtype=torch.long)
    pos = torch.arange(tokens.shape[1]).unsqueeze(0)

    def step(data_iterator, model):
        next(data_iterator)
        return model(tokens, pos, None), None  # no loss function: the schedule returns the logits

    its = [iter([None]) for _ in chunks]
    with torch.no_grad():
        out = get_forward_backward_func()(
            forward_step_func=step, data_iterator=its if len(chunks) > 1 else its[0],
            model=chunks if len(chunks) > 1 else chunks[0], num_microbatches=1, seq_length=tokens.shape[1],
            micro_batch_size=1, forward_only=True, **schedule_communication_kwargs(get_model_config(chunks[0])))
        if not parallel_state.is_pipeline_last_stage():
            return None
        return tensor_parallel.gather_from_tensor_model_parallel_region(out[0])[0].float()


def megatron_logits(model, tokens: torch.Tensor) -> torch.Tensor:
    """[b, s] token ids -> [b, s, padded_vocab] fp32 logits of a TP1/PP1 model."""
    b, s = tokens.shape
    pos = torch.arange(s).unsqueeze(0).expand(b, s)
    with torch.no_grad():
        return model(tokens, pos, None).float()


# =============================================================================================== HF configs
def hf_config_from_run_config(rc: dict, vocab_size: int):
    """transformers config for the checkpoint: Qwen3Config / LlamaConfig (baseline) or DeltaQwen3Config."""
    from transformers import LlamaConfig, Qwen3Config

    kw = dict(vocab_size=vocab_size, hidden_size=rc["hidden_size"], intermediate_size=rc["ffn_hidden_size"],
              num_hidden_layers=rc["num_layers"], num_attention_heads=rc["num_attention_heads"],
              num_key_value_heads=rc["num_query_groups"], head_dim=rc["kv_channels"],
              max_position_embeddings=rc["max_position_embeddings"], rms_norm_eps=rc["norm_epsilon"],
              rope_theta=float(rc["rotary_base"]), tie_word_embeddings=not rc["untie_embeddings_and_output_weights"],
              hidden_act="silu", attention_bias=False, attention_dropout=0.0)
    if rc.get("bos_token_id") is not None:
        kw["bos_token_id"] = rc["bos_token_id"]
    if rc.get("eos_token_id") is not None:
        kw["eos_token_id"] = rc["eos_token_id"]
    if rc["residual"] == BASELINE:
        if rc["qk_layernorm"]:
            cfg = Qwen3Config(**kw)
            cfg.architectures = ["Qwen3ForCausalLM"]
        else:
            cfg = LlamaConfig(mlp_bias=False, **kw)
            cfg.architectures = ["LlamaForCausalLM"]
        return cfg
    from megatron_delta.hf import DeltaQwen3Config

    return DeltaQwen3Config(
        residual=rc["residual"],
        delta_num_blocks=rc.get("delta_num_blocks") if rc["residual"] in BLOCK_MODES else None,
        delta_sources=rc.get("delta_sources") or SOURCE_DEFINITIONS[0], delta_null_source=bool(rc.get("delta_null_source")),
        delta_gate=rc.get("delta_gate") or GATES[0], delta_router_eps=float(rc.get("delta_router_eps") or rc["norm_epsilon"]),
        use_qk_norm=bool(rc["qk_layernorm"]), **kw)


def model_config_from_hf(cfg, residual, delta_num_blocks=None, delta_null_source=False, delta_gate=GATES[0],
                         delta_sources=SOURCE_DEFINITIONS[0], delta_router_eps=None) -> dict:
    """A run_config-like dict (Megatron model flags) for a stock Qwen3 / Llama config."""
    archs = list(getattr(cfg, "architectures", None) or [])
    mtype = getattr(cfg, "model_type", None)
    if mtype not in ("qwen3", "llama") or (archs and archs[0] not in SUPPORTED_HF_ARCHS):
        raise ConversionError(f"unsupported architecture {archs or mtype!r} (model_type {mtype!r}): import "
                              f"supports {', '.join(SUPPORTED_HF_ARCHS)}")
    if getattr(cfg, "mlp_bias", False) or getattr(cfg, "attention_bias", False):
        raise ConversionError("linear biases (attention_bias / mlp_bias) are not supported by the import")
    if getattr(cfg, "hidden_act", "silu") != "silu":
        raise ConversionError(f"hidden_act={cfg.hidden_act!r}: only SwiGLU (silu) MLPs are supported")
    rope = getattr(cfg, "rope_parameters", None) or {}
    if rope.get("rope_type", "default") != "default":
        raise ConversionError(f"rope scaling {rope.get('rope_type')!r} is not supported (plain RoPE only)")
    theta = rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0))
    if float(theta) != int(theta):
        raise ConversionError(f"rope_theta {theta} is not an integer (Megatron's --rotary-base is an int)")
    if getattr(cfg, "use_sliding_window", False):
        raise ConversionError("sliding-window attention is not supported")
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return dict(num_layers=cfg.num_hidden_layers, hidden_size=cfg.hidden_size, ffn_hidden_size=cfg.intermediate_size,
                num_attention_heads=cfg.num_attention_heads,
                num_query_groups=getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads,
                kv_channels=head_dim, norm_epsilon=cfg.rms_norm_eps, qk_layernorm=(mtype == "qwen3"),
                untie_embeddings_and_output_weights=not cfg.tie_word_embeddings, rotary_base=int(theta),
                max_position_embeddings=cfg.max_position_embeddings, residual=residual,
                delta_num_blocks=delta_num_blocks, delta_null_source=delta_null_source, delta_gate=delta_gate,
                delta_sources=delta_sources, delta_router_eps=delta_router_eps)


# =============================================================================================== export / import
def _tmp_sibling(path):
    parent = os.path.dirname(os.path.abspath(path)) or "."
    os.makedirs(parent, exist_ok=True)
    return tempfile.mkdtemp(prefix=os.path.basename(os.path.abspath(path)) + ".tmp-", dir=parent)


def _finish(tmp, final):
    if os.path.exists(final):
        shutil.rmtree(final)
    os.replace(tmp, final)


def export_checkpoint(load: str, output: str, dtype: str = "fp32", log=print) -> str:
    """Megatron checkpoint -> HF directory (written to a temporary sibling, renamed at the end)."""
    if dtype not in ("fp32", "bf16"):
        raise ConversionError(f"--dtype must be fp32 or bf16, got {dtype!r}")
    from megatron_delta.checkpointing import hf_tokenizer_dir, read_run_config, resolve_checkpoint_dir

    ckpt_dir, _ = resolve_checkpoint_dir(load)
    rc = read_run_config(ckpt_dir)
    vocab = true_vocab_size(rc)  # fails early on a missing tokenizer
    hf_tok = hf_tokenizer_dir(ckpt_dir, rc)
    if hf_tok is not None and not os.path.isdir(hf_tok):
        raise ConversionError(f"--load {ckpt_dir}: the HF tokenizer directory {hf_tok} (run_config.json "
                              f"hf_tokenizer_dir) is missing; restore it or re-import the model")
    model, _, rc = load_megatron(load)
    sd = {k: v.detach().float().clone() for k, v in model.state_dict().items()
          if isinstance(v, torch.Tensor) and not k.endswith("_extra_state")}
    tied = not rc["untie_embeddings_and_output_weights"]
    hf_sd = megatron_to_hf_state_dict(
        sd, num_layers=rc["num_layers"], num_attention_heads=rc["num_attention_heads"],
        num_query_groups=rc["num_query_groups"], kv_channels=rc["kv_channels"], hidden_size=rc["hidden_size"],
        qk_layernorm=rc["qk_layernorm"], tied=tied, vocab_size=vocab)
    spm = rc.get("tokenizer_model") if rc.get("tokenizer_type") != "NullTokenizer" else None
    if spm:
        import sentencepiece

        sp = sentencepiece.SentencePieceProcessor(model_file=spm)
        rc = dict(rc, bos_token_id=sp.bos_id() if sp.bos_id() >= 0 else None,
                  eos_token_id=sp.eos_id() if sp.eos_id() >= 0 else None)
    cfg = hf_config_from_run_config(rc, vocab)
    torch_dtype = torch.bfloat16 if dtype == "bf16" else torch.float32
    tmp = _tmp_sibling(output)
    try:
        if rc["residual"] == BASELINE:
            from transformers import LlamaForCausalLM, Qwen3ForCausalLM

            cls = Qwen3ForCausalLM if rc["qk_layernorm"] else LlamaForCausalLM
            hf = cls(cfg)
            missing, unexpected = hf.load_state_dict(hf_sd, strict=False)
            missing = [m for m in missing if not (tied and m == "lm_head.weight")]
            if missing or unexpected:
                raise ConversionError(f"export: missing {missing}, unexpected {unexpected}")
            if tied:
                hf.tie_weights()
            hf.to(torch_dtype).save_pretrained(tmp)
        else:
            from megatron_delta.hf import write_remote_code_model

            write_remote_code_model(hf_sd, cfg, tmp, dtype=torch_dtype if dtype == "bf16" else None)
        if spm:
            from megatron_delta.hf import export_sentencepiece_tokenizer

            export_sentencepiece_tokenizer(spm, tmp)
        elif hf_tok:
            for f in HF_TOKENIZER_FILES:
                src = os.path.join(hf_tok, f)
                if os.path.isfile(src) and f != "generation_config.json":
                    shutil.copyfile(src, os.path.join(tmp, f))
        else:
            log(f"[export] no tokenizer exported (tokenizer_type {rc.get('tokenizer_type')}: token ids only)")
        with open(os.path.join(tmp, "megatron_run_config.json"), "w") as f:
            json.dump(rc, f, indent=1)
        _finish(tmp, output)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log(f"[export] {ckpt_dir} ({rc['residual']}) -> {output} ({type(cfg).__name__}, {dtype}, vocab {vocab})")
    return output


def load_hf_model(hf_dir: str):
    """A stock Qwen3/Llama HF model (fp32) from a directory, with a clear error for anything else."""
    from transformers import AutoConfig

    if not os.path.isfile(os.path.join(hf_dir, "config.json")):
        raise ConversionError(f"--hf {hf_dir}: no config.json (not a transformers model directory)")
    try:
        cfg = AutoConfig.from_pretrained(hf_dir)
    except (ValueError, KeyError) as e:
        raise ConversionError(f"--hf {hf_dir}: unsupported architecture ({e}); import supports "
                              f"{', '.join(SUPPORTED_HF_ARCHS)}") from None
    model_config_from_hf(cfg, BASELINE)  # raises on unsupported architectures
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()


def import_checkpoint(hf_dir_or_model, save: str, residual: str = RESIDUAL_MODES[0], delta_num_blocks=None,
                      delta_null_source=False, delta_gate=GATES[0], delta_sources=SOURCE_DEFINITIONS[0],
                      tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
                      make_vocab_size_divisible_by=128, log=print) -> str:
    """HF Qwen3/Llama -> Megatron checkpoint `save/iter_0000000` (model only; use `--finetune --load`)."""
    from megatron_delta.checkpointing import save_checkpoint
    from megatron_delta.model_config import padded_vocab_size

    if isinstance(hf_dir_or_model, str):
        hf_dir, hf = hf_dir_or_model, load_hf_model(hf_dir_or_model)
    else:
        hf_dir, hf = None, hf_dir_or_model
    mc = model_config_from_hf(hf.config, residual, delta_num_blocks, delta_null_source, delta_gate, delta_sources)
    if mc["num_layers"] % pipeline_model_parallel_size:
        raise ConversionError(f"--pipeline-model-parallel-size {pipeline_model_parallel_size} does not divide "
                              f"the {mc['num_layers']} layers")
    for name, n in (("num_attention_heads", mc["num_attention_heads"]), ("num_query_groups", mc["num_query_groups"])):
        if n % tensor_model_parallel_size:
            raise ConversionError(f"--tensor-model-parallel-size {tensor_model_parallel_size} does not divide "
                                  f"{name}={n}")
    vocab = hf.config.vocab_size
    emb_rows = hf.get_input_embeddings().weight.shape[0]
    if emb_rows != vocab:
        raise ConversionError(f"config vocab_size {vocab} != embedding rows {emb_rows}")
    padded = padded_vocab_size(vocab, make_vocab_size_divisible_by, tensor_model_parallel_size)
    model, args = build_megatron_model(mc, padded, f"--hf {hf_dir or type(hf).__name__}")
    tied = not mc["untie_embeddings_and_output_weights"]
    meg_sd = hf_to_megatron_state_dict(
        {k: v.detach().float() for k, v in hf.state_dict().items()}, num_layers=mc["num_layers"],
        num_attention_heads=mc["num_attention_heads"], num_query_groups=mc["num_query_groups"],
        kv_channels=mc["kv_channels"], hidden_size=mc["hidden_size"], qk_layernorm=mc["qk_layernorm"],
        tied=tied, padded_vocab_size=padded)
    target = model.state_dict()
    new = {}
    for k, v in target.items():
        if k.endswith("_extra_state") or not isinstance(v, torch.Tensor):
            new[k] = v
        elif k in meg_sd:
            if tuple(meg_sd[k].shape) != tuple(v.shape):
                raise ConversionError(f"{k}: HF gives shape {tuple(meg_sd[k].shape)}, Megatron expects {tuple(v.shape)}")
            new[k] = meg_sd.pop(k).to(v.dtype)
        elif "_router." in k:
            new[k] = v  # initial router values (zero query, unit key norm, zero null source / gate)
        else:
            raise ConversionError(f"Megatron parameter {k} has no HF counterpart")
    meg_sd.pop("output_layer.weight", None) if tied else None
    if meg_sd:
        raise ConversionError(f"HF tensors left over: {sorted(meg_sd)[:8]}")
    model.load_state_dict(new)
    # record the requested layout's vocabulary padding and the HF vocabulary / tokenizer
    args.vocab_size = vocab  # NullTokenizer semantics (Megatron-Core 0.17+): --vocab-size N gives N tokens
    args.tokenizer_type, args.tokenizer_model = "NullTokenizer", None
    args.make_vocab_size_divisible_by = make_vocab_size_divisible_by
    # the HF tokenizer files are copied into the checkpoint (CKPT/iter_*/hf_tokenizer): fine-tuning runs that
    # load it carry them on, and export writes them next to the model
    extra = dict(hf_vocab_size=vocab, imported_from=hf_dir, hf_tokenizer_source=hf_dir,
                 imported_for_layout=dict(tensor_model_parallel_size=tensor_model_parallel_size,
                                          pipeline_model_parallel_size=pipeline_model_parallel_size))
    tmp = _tmp_sibling(save)
    try:
        save_checkpoint(tmp, 0, [model], None, None, 0, args, save_optim=False, extra=extra)
        _finish(tmp, save)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log(f"[import] {hf_dir or type(hf).__name__} -> {save} (residual {residual}, vocab {vocab} padded to {padded} "
        f"for TP{tensor_model_parallel_size}; torch_dist checkpoints load under any TP/PP layout)")
    return save
