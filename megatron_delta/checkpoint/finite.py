"""No non-finite state is ever saved: before each save the trainer checks that every parameter of the model is
finite, and a NaN or inf stops the run with one line (the iteration, the first offending tensor, the last good
checkpoint, which the tracker still names) instead of writing that state and moving the tracker to it.

The check reads every parameter once: the smallest and largest value of each tensor (``torch.aminmax``: a NaN or
inf makes them non-finite, a large finite value never overflows them, unlike a norm), one flag all-reduced over
the ranks, and only when it fails the name of the first offending tensor of each rank. The optimizer state is not
read: a NaN or inf in an Adam moment reaches the parameters at the step before the save. Its cost is in
docs/performance.md (tools/finite_cost.py).
"""
from __future__ import annotations

import os
from typing import Iterable, List, Optional, Tuple

from megatron_delta.checkpoint.errors import CheckpointError
from megatron_delta.checkpoint.layout import TRACKER, iteration_dir


class NonFiniteState(CheckpointError):
    """The model holds a NaN or inf: the run stops before saving it; the message says where and what to do."""


def _name(name: str) -> str:
    while name.startswith("module."):  # DDP / Float16Module wrappers
        name = name[len("module."):]
    return name


def named_parameters(model_chunks) -> List[Tuple[str, object]]:
    """(name, parameter) of every model chunk; with several chunks (virtual pipeline) the name says which."""
    chunks = list(model_chunks)
    out = []
    for i, chunk in enumerate(chunks):
        prefix = f"model chunk {i}: " if len(chunks) > 1 else ""
        out += [(prefix + _name(n), p) for n, p in chunk.named_parameters()]
    return out


def first_non_finite(named: Iterable[Tuple[str, object]]) -> Optional[str]:
    """The name of the first tensor holding a NaN or inf, None when all are finite."""
    import torch

    named = [(n, p) for n, p in named if p is not None and p.numel()]
    if not named:
        return None
    with torch.no_grad():
        # aminmax propagates NaN and inf and never overflows; one reduction per tensor, one host sync in all
        ends = torch.stack([torch.stack(torch.aminmax(p.detach().reshape(-1))).float() for _, p in named])
        finite = torch.isfinite(ends).all(dim=1)
        if bool(finite.all()):
            return None
        return named[int((~finite).nonzero()[0])][0]


def last_complete(save_dir: Optional[str]) -> Optional[Tuple[int, str, str]]:
    """(iteration, its directory, the tracker) that the tracker of save_dir names; None when it names none."""
    if not save_dir:
        return None
    path = os.path.join(save_dir, TRACKER)
    try:
        with open(path) as f:
            iteration = int(f.read().strip())
    except (OSError, ValueError):
        return None
    return iteration, iteration_dir(save_dir, iteration), path


def check_before_save(iteration: int, model_chunks, save_dir: Optional[str]) -> None:
    """Every rank calls it before a save: raises NonFiniteState on every rank when a parameter of any rank is
    not finite."""
    import torch

    named = named_parameters(model_chunks)
    bad = first_non_finite(named)
    dist = torch.distributed.is_available() and torch.distributed.is_initialized()
    if dist and torch.distributed.get_world_size() > 1:
        device = named[0][1].device if named else torch.device("cpu")
        if device.type != "cuda" and torch.distributed.get_backend() == "nccl":
            device = torch.device("cuda", torch.cuda.current_device())
        flag = torch.tensor([0 if bad is None else 1], dtype=torch.int32, device=device)
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        if int(flag.item()) == 0:
            return
        names = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(names, bad)
        rank, bad = next((r, n) for r, n in enumerate(names) if n is not None)
        where = f"{bad} (rank {rank})"
    elif bad is None:
        return
    else:
        where = bad
    line = f"iteration {iteration}: {where} holds NaN or inf values, so this state is not saved; "
    good = last_complete(save_dir)
    if good is None:
        line += f"no checkpoint was saved in {save_dir} before it" if save_dir else "nothing was saved"
    else:
        line += (f"the last good checkpoint is iteration {good[0]} ({good[1]}), which {good[2]} still names: resume "
                 f"from it with --load {save_dir} (with a lower --lr, or --clip-grad, if the loss diverged)")
    raise NonFiniteState(line)


__all__ = ["NonFiniteState", "named_parameters", "first_non_finite", "check_before_save"]
