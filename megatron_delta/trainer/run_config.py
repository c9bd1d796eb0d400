"""``run_config.json`` in every checkpoint directory Megatron-LM's trainer saves, and the model-flag
check of ``--load``: the project's checkpoint contract (megatron_delta/checkpointing.py) on upstream's
checkpoints.

- :func:`recorded_config` - megatron_delta.checkpointing.RECORDED_FLAGS read from Megatron-LM's args
  (two flags have other names there: --norm-epsilon is ``layernorm_epsilon``, --disable-bias-linear is
  ``add_bias_linear`` negated; num_query_groups is the heads' number without --group-query-attention).
- :func:`write_run_config` - iter_NNNNNNN/run_config.json (+ iteration, consumed_samples,
  has_optimizer and the HF provenance the run carries), written by rank 0 after the checkpoint's
  data and BEFORE the tracker file names the iteration (main.py hooks it into upstream's
  save_checkpoint where the tracker filename is asked for).
- :func:`check_load` - before upstream loads: the checkpoint's recorded model flags must equal the
  run's (CheckpointError naming the flags, as the old loop), and the HF provenance to carry on.
"""
from __future__ import annotations

import json
import os
import types
from typing import Optional

from megatron_delta.checkpointing import (HF_TOKENIZER_SUBDIR, RECORDED_FLAGS, RUN_CONFIG, CheckpointError,
                                          carried_provenance, check_model_flags, copy_hf_tokenizer, iteration_dir,
                                          read_run_config, read_tracker)

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
    """RECORDED_FLAGS with the old loop's names and meanings, from Megatron-LM's args."""
    return {k: (_ALIASES[k](args) if k in _ALIASES else getattr(args, k, None)) for k in RECORDED_FLAGS}


def flags_view(args):
    """Megatron-LM's args seen with the old loop's flag names (for checkpointing's helpers)."""
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
