"""Distributed (torch_dist) checkpoints: atomic saves, resumable loads, any TP/PP/VPP layout.

Layout of `--save DIR`:
    DIR/iter_0000020/                     one dist_checkpointing checkpoint (model, optimizer, RNG)
    DIR/iter_0000020/run_config.json      the model flags, readable without torch (tools use it)
    DIR/latest_checkpointed_iteration.txt written last, by atomic rename: `--load` only ever sees
                                          complete checkpoints (a save interrupted midway stays
                                          under `iter_*.partial` and is ignored, then replaced).
"""

import json
import os
import random
import shutil

import numpy as np
import torch

from megatron.core import dist_checkpointing, parallel_state, tensor_parallel
from megatron.core.dist_checkpointing.mapping import ShardedObject
from megatron.core.dist_checkpointing.serialization import StrictHandling

TRACKER = "latest_checkpointed_iteration.txt"
RUN_CONFIG = "run_config.json"

# Flags that define the model's tensors: a checkpoint only loads into a model with the same values.
MODEL_FLAGS = (
    "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
    "kv_channels", "normalization", "norm_epsilon", "swiglu", "qk_layernorm", "disable_bias_linear",
    "untie_embeddings_and_output_weights", "position_embedding_type", "rotary_base",
    "max_position_embeddings", "padded_vocab_size", "residual", "delta_num_blocks",
    "delta_null_source", "delta_gate", "delta_sources", "delta_router_eps",
)
LAYOUT_FLAGS = ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                "virtual_pipeline_model_parallel_size", "data_parallel_size", "use_distributed_optimizer")
RECORDED_FLAGS = MODEL_FLAGS + LAYOUT_FLAGS + ("seq_length", "tokenizer_type", "tokenizer_model", "vocab_size",
                                               "transformer_impl", "bf16", "seed")
# What a checkpoint imported from Hugging Face (tools/convert_checkpoint.py import) records about its origin;
# a run that loads it (`--finetune --load`, or a resume) with the same NullTokenizer vocabulary keeps it in
# every checkpoint it saves, so exporting the fine-tuned model writes the HF tokenizer again.
PROVENANCE_KEYS = ("hf_vocab_size", "imported_from", "imported_for_layout")
HF_TOKENIZER_SUBDIR = "hf_tokenizer"  # the HF tokenizer files, copied into the checkpoint directory


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used with these flags; the message says why and what to do."""


def _rank0() -> bool:
    return torch.distributed.get_rank() == 0


def iteration_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def read_tracker(root: str) -> int | None:
    path = os.path.join(root, TRACKER)
    if not os.path.isfile(path):
        return None
    text = open(path).read().strip()
    if not text.isdigit():
        raise CheckpointError(f"--load: {path} is corrupt (expected an iteration number, got {text!r})")
    return int(text)


def resolve_checkpoint_dir(path: str) -> tuple[str, int]:
    """`--load` takes a run directory (its latest checkpoint) or one iter_* directory."""
    if not os.path.exists(path):
        raise CheckpointError(f"--load: {path} does not exist")
    iteration = read_tracker(path)
    if iteration is not None:
        ckpt = iteration_dir(path, iteration)
        if not os.path.isdir(ckpt):
            raise CheckpointError(f"--load: {path}/{TRACKER} names iteration {iteration}, but {ckpt} is missing")
        return ckpt, iteration
    if os.path.isfile(os.path.join(path, RUN_CONFIG)):
        return path, json.load(open(os.path.join(path, RUN_CONFIG)))["iteration"]
    raise CheckpointError(f"--load: {path} holds no complete checkpoint (no {TRACKER} and no {RUN_CONFIG}); "
                          f"an interrupted save leaves only iter_*.partial, which is never loaded")


def read_run_config(ckpt_dir: str) -> dict:
    path = os.path.join(ckpt_dir, RUN_CONFIG)
    if not os.path.isfile(path):
        raise CheckpointError(f"{path} is missing: {ckpt_dir} is not a megatron-delta checkpoint")
    return json.load(open(path))


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


def _rng_state():
    return {
        "random": random.getstate(),
        "np": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "tracker": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }


def _set_rng_state(state):
    random.setstate(state["random"])
    np.random.set_state(state["np"])
    torch.set_rng_state(state["torch"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


def _rng_sharded_object(state=None):
    """Each rank's RNG state, keyed by its (pp, tp, dp) coordinates: only loadable into the same layout."""
    pp, tp, dp = (parallel_state.get_pipeline_model_parallel_rank(), parallel_state.get_tensor_model_parallel_rank(),
                  parallel_state.get_data_parallel_rank())
    shape = (parallel_state.get_pipeline_model_parallel_world_size(),
             parallel_state.get_tensor_model_parallel_world_size(), parallel_state.get_data_parallel_world_size())
    return ShardedObject("rng_state", state, shape, (pp, tp, dp), replica_id=0)


def _unwrap(m):
    """The GPT model inside Megatron's DDP wrapper: keys as in Megatron-LM checkpoints (no `module.`)."""
    return m.module if hasattr(m, "module") else m


def _model_sharded_state_dict(model):
    if len(model) == 1:
        return {"model": _unwrap(model[0]).sharded_state_dict()}
    return {f"model{i}": _unwrap(m).sharded_state_dict() for i, m in enumerate(model)}


def save_checkpoint(root, iteration, model, optimizer, scheduler, consumed_samples, args,
                    save_optim=True, extra=None):
    """Write iter_<N> atomically (partial dir, rename, then tracker) from every rank."""
    final_dir = iteration_dir(root, iteration)
    partial = final_dir + ".partial"
    if _rank0():
        os.makedirs(root, exist_ok=True)
        shutil.rmtree(partial, ignore_errors=True)
        os.makedirs(partial)
    torch.distributed.barrier()

    state = _model_sharded_state_dict(model)
    if save_optim and optimizer is not None:
        state["optimizer"] = optimizer.sharded_state_dict(dict(state))
        state["opt_param_scheduler"] = scheduler.state_dict()
        state["rng_state"] = _rng_sharded_object(_rng_state())
    state["iteration"] = iteration
    state["consumed_samples"] = consumed_samples
    dist_checkpointing.save(state, partial)
    torch.distributed.barrier()

    if _rank0():
        config = {k: getattr(args, k, None) for k in RECORDED_FLAGS}
        config.update(iteration=iteration, consumed_samples=consumed_samples, has_optimizer=bool(save_optim))
        carried = dict(getattr(args, "carried_provenance", None) or {})
        carried.update(extra or {})
        tok_src = carried.pop("hf_tokenizer_source", None)
        if tok_src and copy_hf_tokenizer(tok_src, partial):
            carried["hf_tokenizer_dir"] = HF_TOKENIZER_SUBDIR
        config.update(carried)
        with open(os.path.join(partial, RUN_CONFIG), "w") as f:
            json.dump(config, f, indent=1)
        if os.path.isdir(final_dir):  # re-saving an iteration (e.g. --train-iters 0 twice)
            shutil.rmtree(final_dir)
        os.replace(partial, final_dir)
        tmp = os.path.join(root, TRACKER + ".tmp")
        with open(tmp, "w") as f:
            f.write(str(iteration))
        os.replace(tmp, os.path.join(root, TRACKER))
    torch.distributed.barrier()
    return final_dir


def load_checkpoint(path, model, optimizer, scheduler, args, load_optim=True, load_rng=True):
    """Load into the current layout. Returns (iteration, consumed_samples, ckpt_dir)."""
    ckpt_dir, iteration = resolve_checkpoint_dir(path)
    saved = read_run_config(ckpt_dir)
    check_model_flags(saved, args, ckpt_dir)
    same_layout = all(saved.get(k) == getattr(args, k, None) for k in LAYOUT_FLAGS)
    load_optim = load_optim and optimizer is not None and saved.get("has_optimizer", False)
    if load_optim and not same_layout and not (saved.get("use_distributed_optimizer") == args.use_distributed_optimizer):
        raise CheckpointError(f"--load {ckpt_dir}: the optimizer state was saved with --use-distributed-optimizer="
                              f"{saved.get('use_distributed_optimizer')}; pass the same, or --no-load-optim")

    state = _model_sharded_state_dict(model)
    if load_optim:
        state["optimizer"] = optimizer.sharded_state_dict(dict(state), is_loading=True)
    load_rng = load_rng and load_optim and same_layout
    if load_rng:
        state["rng_state"] = _rng_sharded_object()
    loaded = dist_checkpointing.load(state, ckpt_dir, strict=StrictHandling.ASSUME_OK_UNEXPECTED)

    if len(model) == 1:
        _unwrap(model[0]).load_state_dict(loaded["model"])
    else:
        for i, m in enumerate(model):
            _unwrap(m).load_state_dict(loaded[f"model{i}"])
    if load_optim:
        # upstream re-matches the saved param groups by every per-group setting (max_lr, min_lr, wd_mult, ...
        # in megatron-core 0.19.2; 0.16 left max_lr out and needed a patch): tests/test_patches.py round trip
        optimizer.load_state_dict(loaded["optimizer"])
        scheduler.load_state_dict(loaded["opt_param_scheduler"])
    if load_rng:
        _set_rng_state(loaded["rng_state"])
    return iteration, loaded.get("consumed_samples", saved.get("consumed_samples", 0)), ckpt_dir
