"""Fixes of the distributed optimizer over torch's own Adam (no Apex / Transformer Engine), on every device:
the implementations of the ``distopt_*`` entries of megatron_delta.platform.patches (which says which failure each
answers and for which Megatron-Core versions).

Without Apex and Transformer Engine (megatron.core.optimizer.distrib_optimizer.HAVE_APEX_OR_TE is False: any
CPU, and GPUs without them) the DistributedOptimizer wraps torch.optim.Adam, whose per-parameter state
holds its own 0-dim ``step`` tensor; distrib_optimizer.py (0.19.2) mishandles that tensor in four places.
Each fix does nothing when the optimizer is Apex's / TE's fused Adam.
"""
from __future__ import annotations

import functools

import torch

from megatron_delta.platform.patches.install import replace


def _torch_adam_without_fused(opt) -> bool:
    from megatron.core.optimizer import distrib_optimizer

    inner = getattr(opt, "optimizer", None)
    return not distrib_optimizer.HAVE_APEX_OR_TE and isinstance(inner, torch.optim.Adam)


def _init_adam_state(adam: torch.optim.Adam) -> None:
    """The state torch.optim.Adam's first step gives a parameter (Adam._init_group): step 0, zero moments."""
    for group in adam.param_groups:
        for p in group["params"]:
            state = adam.state[p]
            if len(state) == 0:
                state["step"] = torch.tensor(0.0, dtype=torch.float32)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                if group.get("amsgrad"):
                    state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)


# distopt_fresh_state_dict (0.19.2; core/optimizer/distrib_optimizer.py:839): DistributedOptimizer.state_dict
# asserts that the torch Adam states hold exactly one step value; a fresh optimizer (a resume's
# sharded_state_dict(is_loading=True), or `--train-iters 0 --save` with --use-distributed-optimizer)
# holds none -> AssertionError. -> state_dict first gives the parameters without state the state
# torch's first Adam step would (step 0, zero moments: the same optimizer).
def fix_distopt_fresh_state_dict() -> None:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    original = DistributedOptimizer.__dict__["state_dict"]

    @functools.wraps(original)
    def state_dict(self):
        if _torch_adam_without_fused(self):
            _init_adam_state(self.optimizer)
        return original(self)

    replace(DistributedOptimizer, "state_dict", state_dict)


# distopt_step_per_param (0.19.2; core/optimizer/distrib_optimizer.py:1026-1032 and :1225):
# DistributedOptimizer.load_state_dict gives every parameter ONE shared step tensor (torch Adam then
# adds 1 per parameter per iteration to it: wrong bias correction), and load_parameter_state_from_*
# then copies into it the dummy step captured when the load's sharded state dict was built (0): a
# resumed run restarts Adam at step 0 instead of the saved step, its loss drifts from the second
# resumed iteration on. -> after load_state_dict, each parameter gets its own step tensor holding the
# checkpoint's step (its param_groups' "step", which state_dict wrote).
def fix_distopt_step_per_param() -> None:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    original = DistributedOptimizer.__dict__["load_state_dict"]

    @functools.wraps(original)
    def load_state_dict(self, state_dict):
        out = original(self, state_dict)
        if _torch_adam_without_fused(self) and isinstance(state_dict.get("optimizer"), dict):
            steps = {g["step"] for g in state_dict["optimizer"].get("param_groups", []) if g.get("step") is not None}
            if len(steps) > 1:
                raise RuntimeError(f"the optimizer checkpoint holds several Adam steps {sorted(steps)}")
            if steps:
                step = float(steps.pop())
                for state in self.optimizer.state.values():
                    if isinstance(state.get("step"), torch.Tensor):
                        state["step"] = torch.tensor(step, dtype=state["step"].dtype, device=state["step"].device)
        return out

    replace(DistributedOptimizer, "load_state_dict", load_state_dict)


# distopt_load_no_grad (0.19.2; core/optimizer/distrib_optimizer.py:1225 via :2061/:2140/:2254):
# _set_main_param_and_optimizer_states copy_()s the loaded values into the main params, which without
# fp16/bf16 main copies are views of the model's parameters (leaves that require grad), and the dp_reshardable
# (default) and dp_zero loaders call it with autograd on -> "a view of a leaf Variable that requires grad
# is being used in an in-place operation". -> those loaders run under torch.no_grad(), as upstream's
# fully_reshardable and fs_model_space loaders already do.
def fix_distopt_load_no_grad() -> None:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    for name in ("load_parameter_state_from_dp_reshardable", "load_parameter_state_from_dp_zero",
                 "load_parameter_state_from_dp_zero_legacy"):
        fn = DistributedOptimizer.__dict__.get(name)
        if fn is not None:
            replace(DistributedOptimizer, name, torch.no_grad()(fn))


# distopt_missing_state_key (0.19.2; core/optimizer/distrib_optimizer.py:1223 via :2390): with
# --dist-ckpt-optim-fully-reshardable the loader leaves torch Adam's "step" out of the tensors it hands
# to _set_main_param_and_optimizer_states, which looks up every state key -> KeyError: 'step' on
# resume (and training/checkpointing.py:2251's hint names a flag, --ckpt-fully-parallel-save, that
# does not choose this format). -> a state the checkpoint's tensors lack is left as it is
# (distopt_step_per_param sets the step).
def fix_distopt_missing_state_key() -> None:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    original = DistributedOptimizer.__dict__["_set_main_param_and_optimizer_states"]

    @functools.wraps(original)
    def _set_main_param_and_optimizer_states(self, model_param, tensors):
        if not self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
            group_index, group_order = self.model_param_group_index_map[model_param]
            main_param = self.optimizer.param_groups[group_index]["params"][group_order]
            missing = [k for k in self.optimizer.state[main_param] if k not in tensors]
            if missing:
                tensors = {**tensors, **{k: None for k in missing}}  # None: upstream skips the key
        return original(self, model_param, tensors)

    replace(DistributedOptimizer, "_set_main_param_and_optimizer_states", _set_main_param_and_optimizer_states)


# expert_parallel_optimizer_reshard (0.19.2; core/optimizer/optimizer.py:1574): with expert parallelism the
# optimizer is a ChainedOptimizer of two DistributedOptimizers (dense parameters; expert parameters, reduced
# over the expert data-parallel group), without it one. A fully reshardable checkpoint stores each one's
# common state (param_groups, sharding type) under its index and the parameter state by parameter name, so an
# EP > 1 checkpoint loaded under EP1 hands the one optimizer {0: ..., 1: ..., "param_state": ...}, and
# DistributedOptimizer.load_state_dict fails on state_dict["optimizer"] -> the entries are merged into one: the
# param_groups of all (each current group finds its saved counterpart by its identifier, lr and step included),
# the rest of the first. The parameter state is already the current optimizer's, loaded by name.
def fix_expert_parallel_optimizer_reshard() -> None:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    from megatron.core.optimizer.optimizer import ChainedOptimizer

    original = ChainedOptimizer.__dict__["load_state_dict"]

    @functools.wraps(original)
    def load_state_dict(self, state_dict):
        entries = sorted(k for k in state_dict if isinstance(k, int)) if isinstance(state_dict, dict) else []
        if (len(self.chained_optimizers) == 1 and len(entries) > 1
                and isinstance(self.chained_optimizers[0], DistributedOptimizer)):
            merged = {k: v for k, v in state_dict.items() if not isinstance(k, int)}
            for key, value in state_dict[entries[0]].items():
                merged.setdefault(key, value)
            merged["optimizer"] = dict(state_dict[entries[0]]["optimizer"])
            merged["optimizer"]["param_groups"] = [
                group for k in entries for group in state_dict[k]["optimizer"]["param_groups"]]
            state_dict = merged
        return original(self, state_dict)

    replace(ChainedOptimizer, "load_state_dict", load_state_dict)
