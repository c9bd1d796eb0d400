"""The tools' loader and saver of distributed (torch_dist) checkpoints: atomic saves, resumable loads, any
TP/PP/VPP layout (the trainer saves and loads through Megatron-LM's own checkpointing).

Layout of `--save DIR`:
    DIR/iter_0000020/                     one dist_checkpointing checkpoint (model, optimizer, RNG)
    DIR/iter_0000020/run_config.json      the model flags, readable without torch (tools use it)
    DIR/iter_0000020/integrity.json       the SHA-256 of every file above (checkpoint/integrity.py)
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

from megatron_delta.checkpoint.errors import CheckpointError, describe_load_failure
from megatron_delta.checkpoint.integrity import add_to_manifest
from megatron_delta.checkpoint.run_config import (
    HF_TOKENIZER_SUBDIR,
    LAYOUT_FLAGS,
    RECORDED_FLAGS,
    RUN_CONFIG,
    TRACKER,
    check_model_flags,
    copy_hf_tokenizer,
    iteration_dir,
)


def _rank0() -> bool:
    return torch.distributed.get_rank() == 0


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
    dist_checkpointing.save(state, partial, verify_integrity=True)  # integrity.json, as the trainer's saves
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
        add_to_manifest(partial, RUN_CONFIG)  # run_config.json is verified with the checkpoint's files
        if os.path.isdir(final_dir):  # re-saving an iteration (e.g. --train-iters 0 twice)
            shutil.rmtree(final_dir)
        os.replace(partial, final_dir)
        tmp = os.path.join(root, TRACKER + ".tmp")
        with open(tmp, "w") as f:
            f.write(str(iteration))
        os.replace(tmp, os.path.join(root, TRACKER))
    torch.distributed.barrier()
    return final_dir


def load_checkpoint(path, model, optimizer, scheduler, args, load_optim=True, load_rng=True, verify_integrity=True):
    """Load into the current layout. Returns (iteration, consumed_samples, ckpt_dir). The checkpoint is opened by
    checkpoint/reader.py (its files verified against integrity.json unless not ``verify_integrity``); a damaged
    file found while reading it is a CheckpointError naming the file (errors.describe_load_failure)."""
    from megatron_delta.checkpoint.reader import open_checkpoint

    opened = open_checkpoint(path, verify_integrity)
    ckpt_dir, iteration, saved = opened.ckpt_dir, opened.iteration, opened.run_config
    check_model_flags(saved, args, ckpt_dir)
    same_layout = all(saved.get(k) == getattr(args, k, None) for k in LAYOUT_FLAGS)
    load_optim = load_optim and optimizer is not None and saved.get("has_optimizer", False)
    if (load_optim and not same_layout
            and not (saved.get("use_distributed_optimizer") == args.use_distributed_optimizer)):
        raise CheckpointError(f"--load {ckpt_dir}: the optimizer state was saved with --use-distributed-optimizer="
                              f"{saved.get('use_distributed_optimizer')}; pass the same, or --no-load-optim")

    state = _model_sharded_state_dict(model)
    if load_optim:
        state["optimizer"] = optimizer.sharded_state_dict(dict(state), is_loading=True)
    load_rng = load_rng and load_optim and same_layout
    if load_rng:
        state["rng_state"] = _rng_sharded_object()
    try:
        loaded = dist_checkpointing.load(state, ckpt_dir, strict=StrictHandling.ASSUME_OK_UNEXPECTED)
    except BaseException as e:  # torch.distributed.checkpoint's CheckpointException is a BaseException
        message = describe_load_failure(e, opened.root, opened.step, tool=True)
        if message is None:
            raise
        raise CheckpointError(message) from None

    if len(model) == 1:
        _unwrap(model[0]).load_state_dict(loaded["model"])
    else:
        for i, m in enumerate(model):
            _unwrap(m).load_state_dict(loaded[f"model{i}"])
    if load_optim:
        # upstream re-matches the saved param groups by every per-group setting (max_lr, min_lr, wd_mult, ...
        # in megatron-core 0.19.2; 0.16 left max_lr out and needed a patch): tests/integration/test_patches.py round
        # trip
        optimizer.load_state_dict(loaded["optimizer"])
        scheduler.load_state_dict(loaded["opt_param_scheduler"])
    if load_rng:
        _set_rng_state(loaded["rng_state"])
    return iteration, loaded.get("consumed_samples", saved.get("consumed_samples", 0)), ckpt_dir
