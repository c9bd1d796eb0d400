"""The run_config.json contract: what every checkpoint directory records, and how it is read back.

Every iter_NNNNNNN/ that Megatron-LM's trainer saves (or the import tool writes) carries run_config.json
beside upstream's files, readable without torch:

- the directory layout: :data:`TRACKER`, :func:`iteration_dir` (from layout.py), :func:`read_tracker`,
  :func:`resolve_checkpoint_dir` (a run directory or one iter_* directory), :func:`read_run_config`;
- the recorded keys: :data:`MODEL_FLAGS` (define the tensors), :data:`LAYOUT_FLAGS`,
  :data:`RECORDED_FLAGS`, the HF provenance (:data:`PROVENANCE_KEYS`, the hf_tokenizer/ copy);
- the writing side, on Megatron-LM's args: :func:`recorded_config` (two flags have other names there:
  --norm-epsilon is ``layernorm_epsilon``, --disable-bias-linear is ``add_bias_linear`` negated;
  num_query_groups is the heads' number without --group-query-attention) and :func:`write_run_config`
  (iter_NNNNNNN/run_config.json + iteration, consumed_samples, has_optimizer and the HF provenance the run
  carries), written by rank 0 after the checkpoint's data and BEFORE the tracker file names the
  iteration (trainer/hooks.py hooks it into upstream's save_checkpoint where the tracker filename is asked for);
- the reading side: :func:`check_load` / :func:`check_model_flags` (before upstream loads, the checkpoint's
  recorded model flags must equal the run's: CheckpointError naming the flags) and the HF provenance to
  carry on; :func:`run_config_fields` / :func:`model_fields` (the model fields of model_config.py),
  :func:`checkpoint_args` (what checkpoint/store.py reads of a run), :func:`model_flags` (pretrain_gpt.py
  flags of the model), :func:`true_vocab_size`.
"""
from __future__ import annotations

import json
import os
import shutil
import types
from typing import Mapping, Optional

from megatron_delta.checkpoint.errors import CheckpointError, ConversionError, read_json
from megatron_delta.checkpoint.layout import TRACKER, iteration_dir  # noqa: F401 (part of the contract)
from megatron_delta.checkpoint.model_config import ModelConfigError, resolve_model_fields
from megatron_delta.core.modes import BLOCK_MODES, GATES, SOURCE_DEFINITIONS

RUN_CONFIG = "run_config.json"


def read_tracker(root: str, tool: bool = False) -> int | None:
    """The iteration the tracker names (None: no tracker). An unreadable or garbled tracker is a CheckpointError
    naming it, with the complete checkpoints on disk (``tool``: the advice of a tool's --load)."""
    path = os.path.join(root, TRACKER)
    if not os.path.isfile(path):
        return None
    try:
        with open(path, "rb") as f:
            raw = f.read(4096)
        text = raw.decode("utf-8").strip()
        why = None if text.isdigit() else f"expected an iteration number, got {text[:40]!r}"
    except UnicodeDecodeError:
        why = f"not text: it starts with {raw[:16]!r}"
    except OSError as e:
        why = f"cannot be read: {e.strerror or e}"
    if why is None:
        return int(text)
    from megatron_delta.checkpoint.errors import resume_advice

    raise CheckpointError(f"--load: {path} is corrupt ({why}); it names the checkpoint to resume from. "
                          + resume_advice(root, None, tool=tool))


def resolve_checkpoint_dir(path: str) -> tuple[str, int]:
    """`--load` takes a run directory (its latest checkpoint) or one iter_* directory."""
    if not os.path.exists(path):
        raise CheckpointError(f"--load: {path} does not exist")
    iteration = read_tracker(path, tool=True)
    if iteration is not None:
        ckpt = iteration_dir(path, iteration)
        if not os.path.isdir(ckpt):
            from megatron_delta.checkpoint.errors import resume_advice

            raise CheckpointError(f"--load: {path}/{TRACKER} names iteration {iteration}, but {ckpt} is missing. "
                                  + resume_advice(path, iteration, tool=True))
        return ckpt, iteration
    if os.path.isfile(os.path.join(path, RUN_CONFIG)):
        rc = read_run_config(path)
        if not isinstance(rc.get("iteration"), int):
            raise CheckpointError(f"{os.path.join(path, RUN_CONFIG)} records no iteration: {path} is not a "
                                  f"checkpoint saved by megatron-delta; --load its run directory instead")
        return path, rc["iteration"]
    raise CheckpointError(f"--load: {path} holds no complete checkpoint (no {TRACKER} and no {RUN_CONFIG}); "
                          f"an interrupted save leaves only iter_*.partial, which is never loaded")


# Flags that define the model's tensors: a checkpoint only loads into a model with the same values.
MODEL_FLAGS = (
    "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
    "kv_channels", "normalization", "norm_epsilon", "swiglu", "qk_layernorm", "disable_bias_linear",
    "untie_embeddings_and_output_weights", "position_embedding_type", "rotary_base",
    "max_position_embeddings", "padded_vocab_size", "residual", "delta_num_blocks",
    "delta_null_source", "delta_gate", "delta_sources", "delta_router_eps",
    # mixture of experts (the fields that define its tensors and function) and multi-token prediction
    "num_experts", "moe_ffn_hidden_size", "moe_router_topk", "moe_router_pre_softmax", "moe_layer_freq",
    "moe_router_score_function",
    "mtp_num_layers",
    # multi-latent attention (--multi-latent-attention and the flags of its shapes and rotary embedding)
    "multi_latent_attention", "q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim",
    "rope_type", "rotary_scaling_factor", "mscale", "mscale_all_dim",
    # DeepSeek's MoE routing: shared experts, the expert bias, group-limited top-k, the top-k scale
    "moe_shared_expert_intermediate_size", "moe_router_enable_expert_bias", "moe_router_num_groups",
    "moe_router_group_topk", "moe_router_topk_scaling_factor", "moe_shared_expert_gate",
)
LAYOUT_FLAGS = ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                "virtual_pipeline_model_parallel_size", "data_parallel_size", "use_distributed_optimizer")
# A per-layer configuration (--heterogeneous-layers-config-path) is a file, not flags: recorded so that the tools,
# which rebuild a model from the flags alone, refuse such a checkpoint (checkpoint/reader.py) instead of building a
# uniform model.
PER_LAYER_CONFIG = "heterogeneous_layers_config_path"
RECORDED_FLAGS = MODEL_FLAGS + LAYOUT_FLAGS + ("seq_length", "tokenizer_type", "tokenizer_model", "vocab_size",
                                               "transformer_impl", "bf16", "seed", PER_LAYER_CONFIG)
# What a checkpoint imported from Hugging Face (tools/convert_checkpoint.py import) records about its origin;
# a run that loads it (`--finetune --load`, or a resume) with the same NullTokenizer vocabulary keeps it in
# every checkpoint it saves, so exporting the fine-tuned model writes the HF tokenizer again.
PROVENANCE_KEYS = ("hf_vocab_size", "imported_from", "imported_for_layout")
HF_TOKENIZER_SUBDIR = "hf_tokenizer"  # the HF tokenizer files, copied into the checkpoint directory


def read_run_config(ckpt_dir: str) -> dict:
    """The checkpoint's run_config.json; a missing, unreadable or garbled file is a CheckpointError naming it."""
    path = os.path.join(ckpt_dir, RUN_CONFIG)
    if not os.path.isfile(path):
        raise CheckpointError(f"{path} is missing: {ckpt_dir} is not a megatron-delta checkpoint")
    rc, why = read_json(path, lambda v: None if isinstance(v, dict) else f"a JSON {type(v).__name__}, not an object")
    if why is not None:
        raise CheckpointError(f"{path} is corrupt ({why}); it records the checkpoint's model flags. Restore it "
                              f"from a copy of the checkpoint, or load another checkpoint of "
                              f"{os.path.dirname(os.path.abspath(ckpt_dir))}")
    return rc


def hf_tokenizer_dir(ckpt_dir: str, rc: dict) -> str | None:
    """The HF tokenizer directory a checkpoint carries (run_config `hf_tokenizer_dir`, relative to the
    checkpoint directory, or absolute in older checkpoints); None when it records none."""
    path = rc.get("hf_tokenizer_dir")
    if not path:
        return None
    return path if os.path.isabs(path) else os.path.join(ckpt_dir, path)


def carried_provenance(ckpt_dir: str, saved: dict, args) -> dict:
    """The HF provenance of a loaded checkpoint that the run's own checkpoints keep: only when the run
    uses the same token ids (NullTokenizer with the imported vocabulary). {} otherwise."""
    if not saved.get("hf_vocab_size"):
        return {}
    same_ids = (getattr(args, "tokenizer_type", None) == "NullTokenizer"
                and getattr(args, "vocab_size", None) is not None and args.vocab_size == saved["hf_vocab_size"])
    if not same_ids:
        return {}
    carried = {k: saved[k] for k in PROVENANCE_KEYS if k in saved}
    tok = hf_tokenizer_dir(ckpt_dir, saved)
    if tok is not None:
        if not os.path.isdir(tok):
            raise CheckpointError(f"--load {ckpt_dir}: its run_config.json names the HF tokenizer directory {tok}, "
                                  f"which is missing; restore it or re-import the model")
        carried["hf_tokenizer_source"] = os.path.abspath(tok)
    return carried


def copy_hf_tokenizer(src: str, ckpt_dir: str) -> str | None:
    """Copy the tokenizer files of `src` into CKPT/hf_tokenizer; returns the relative name to record
    (None when `src` holds no tokenizer file, e.g. a model built from a config alone)."""
    names = [n for n in HF_TOKENIZER_FILES if os.path.isfile(os.path.join(src, n))]
    if not any(n not in ("generation_config.json", "tokenizer_config.json") for n in names):
        return None
    dst = os.path.join(ckpt_dir, HF_TOKENIZER_SUBDIR)
    os.makedirs(dst, exist_ok=True)
    for name in names:
        shutil.copyfile(os.path.join(src, name), os.path.join(dst, name))
    return HF_TOKENIZER_SUBDIR


HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                      "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja", "generation_config.json")


def check_model_flags(saved: dict, args, ckpt_dir: str) -> None:
    """Refuse a checkpoint whose tensors do not fit the model the flags describe."""
    diffs = [(k, saved.get(k), getattr(args, k, None)) for k in MODEL_FLAGS
             if k in saved and saved.get(k) != getattr(args, k, None)]
    if diffs:
        lines = "; ".join(f"--{k.replace('_', '-')}: checkpoint {s!r}, flags {a!r}" for k, s, a in diffs)
        raise CheckpointError(f"--load {ckpt_dir} was saved with a different model: {lines}. "
                              f"Pass the checkpoint's values (see {RUN_CONFIG}).")


# The run_config.json keys a checkpoint must record for its model to be rebuilt. Its other model keys
# (MODEL_FLAGS) fall back to SMALL_CPU_MODEL's (RMSNorm, SwiGLU, RoPE, no biases), as in the
# record of a Hugging Face import (convert/hf_checkpoint.py model_config_from_hf).
REQUIRED_RUN_CONFIG_KEYS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
                            "num_query_groups", "kv_channels", "norm_epsilon", "qk_layernorm", "rotary_base",
                            "max_position_embeddings", "padded_vocab_size", "residual")


def run_config_fields(run_config: Mapping, **overrides) -> dict:
    """The resolved model fields of a checkpoint's run_config.json (or a dict like it): its model keys
    (MODEL_FLAGS) in a one-process fp32 local build (TP1/PP1) reading sequences of up to
    max_position_embeddings tokens; ``overrides`` (layout, seq_length, ...) replace any of them."""
    fields = {k: run_config[k] for k in MODEL_FLAGS if k in run_config}
    fields["seq_length"] = run_config.get("max_position_embeddings")
    fields.update(overrides)
    return resolve_model_fields(fields, require=REQUIRED_RUN_CONFIG_KEYS)


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
    if c.get("num_experts"):
        freq = c.get("moe_layer_freq") or 1
        argv += ["--num-experts", c["num_experts"], "--moe-router-topk", c.get("moe_router_topk") or 2,
                 "--moe-layer-freq", str(freq).replace(" ", "")]
        argv += ["--moe-ffn-hidden-size", c["moe_ffn_hidden_size"]] if c.get("moe_ffn_hidden_size") else []
        argv += ["--moe-router-pre-softmax"] if c.get("moe_router_pre_softmax") else []
        if (c.get("moe_router_score_function") or "softmax") != "softmax":
            argv += ["--moe-router-score-function", c["moe_router_score_function"]]
        argv += ["--moe-router-enable-expert-bias"] if c.get("moe_router_enable_expert_bias") else []
        argv += ["--moe-shared-expert-gate"] if c.get("moe_shared_expert_gate") else []
        for key in ("moe_shared_expert_intermediate_size", "moe_router_num_groups", "moe_router_group_topk",
                    "moe_router_topk_scaling_factor"):
            argv += [f"--{key.replace('_', '-')}", c[key]] if c.get(key) else []
    if c.get("multi_latent_attention"):
        argv.append("--multi-latent-attention")
        for key in ("q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim", "rope_type",
                    "rotary_scaling_factor", "mscale", "mscale_all_dim"):
            argv += [f"--{key.replace('_', '-')}", c[key]] if c.get(key) is not None else []
    if c.get("mtp_num_layers"):
        argv += ["--mtp-num-layers", c["mtp_num_layers"]]
    return [str(a) for a in argv]


def model_fields(rc: dict, where: str = "run_config.json", **overrides) -> dict:
    """The model fields (megatron_delta.checkpoint.run_config.run_config_fields) of a run_config-like dict; a missing or
    bad key is a ConversionError that says where it was read."""
    try:
        return run_config_fields(rc, **overrides)
    except ModelConfigError as e:
        raise ConversionError(f"{where}: {e}") from None


def checkpoint_args(fields: dict, **run):
    """What store.load_checkpoint / save_checkpoint read of a run (getattr on RECORDED_FLAGS):
    the model fields, one data-parallel replica without a distributed optimizer, and ``run``
    (tokenizer, vocabulary, seed)."""
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
_ALIASES = {
    "norm_epsilon": lambda a: getattr(a, "layernorm_epsilon", getattr(a, "norm_epsilon", None)),
    "disable_bias_linear": lambda a: (not a.add_bias_linear) if hasattr(a, "add_bias_linear")
    else getattr(a, "disable_bias_linear", None),
    # Without --group-query-attention Megatron-LM keeps args.num_query_groups = 1 but builds one group per
    # head (core_transformer_config_from_args passes no num_query_groups): record what the model has.
    "num_query_groups": lambda a: getattr(a, "num_query_groups", None) if getattr(a, "group_query_attention", True)
    else a.num_attention_heads,
}


def recorded_config(args) -> dict:
    """RECORDED_FLAGS, named and meant as pretrain_gpt.py's flags, from Megatron-LM's args (_ALIASES)."""
    return {k: (_ALIASES[k](args) if k in _ALIASES else getattr(args, k, None)) for k in RECORDED_FLAGS}


def flags_view(args):
    """Megatron-LM's args seen with the RECORDED_FLAGS names (for check_model_flags / carried_provenance)."""
    view = types.SimpleNamespace(**vars(args))
    for k, v in recorded_config(args).items():
        setattr(view, k, v)
    return view


def write_run_config(save_dir: str, iteration: int, args, has_optimizer: bool, carried: Optional[dict]) -> str:
    ckpt = iteration_dir(save_dir, iteration)
    os.makedirs(ckpt, exist_ok=True)
    config = recorded_config(args)
    config.update(iteration=int(iteration), consumed_samples=int(getattr(args, "consumed_train_samples", 0) or 0),
                  has_optimizer=bool(has_optimizer))
    carried = dict(carried or {})
    tok_src = carried.pop("hf_tokenizer_source", None)
    if tok_src and copy_hf_tokenizer(tok_src, ckpt):
        carried["hf_tokenizer_dir"] = HF_TOKENIZER_SUBDIR
    config.update(carried)
    tmp = os.path.join(ckpt, RUN_CONFIG + ".tmp")
    with open(tmp, "w") as f:
        json.dump(config, f, indent=1)
    os.replace(tmp, os.path.join(ckpt, RUN_CONFIG))
    return ckpt


def load_dir(args) -> Optional[str]:
    """The iteration directory upstream's load_checkpoint will read (None: nothing to load / not ours)."""
    if not args.load or not os.path.isdir(args.load):
        return None
    if getattr(args, "ckpt_step", None) is not None:
        ckpt = iteration_dir(args.load, args.ckpt_step)
    elif os.path.isfile(os.path.join(args.load, RUN_CONFIG)):
        ckpt = args.load
    else:
        iteration = read_tracker(args.load)
        if iteration is None:
            return None
        ckpt = iteration_dir(args.load, iteration)
    return ckpt if os.path.isfile(os.path.join(ckpt, RUN_CONFIG)) else None


def check_load(args) -> dict:
    """Refuse a --load whose run_config.json records other model flags; returns the HF provenance
    that this run's checkpoints carry on ({} when none, or when the checkpoint has no run_config.json)."""
    ckpt = load_dir(args)
    if ckpt is None:
        return {}
    saved = read_run_config(ckpt)
    view = flags_view(args)
    check_model_flags(saved, view, ckpt)
    return carried_provenance(ckpt, saved, view)


__all__ = ["recorded_config", "flags_view", "write_run_config", "check_load", "load_dir", "CheckpointError"]
