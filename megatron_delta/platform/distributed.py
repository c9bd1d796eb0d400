"""Distributed start-up: torch.distributed (gloo on CPU, nccl on GPU), Megatron's model-parallel groups, the RNG.

Public API
----------
initialize_distributed(...)        torch.distributed (gloo on CPU / nccl on GPU) + Megatron model
                                   parallel groups + model-parallel RNG seeding; activates the CPU
                                   platform (platform/cpu.py) first
destroy_distributed()
free_port() -> int
"""
from __future__ import annotations

import datetime
import os
import random
import socket
from typing import Optional

import torch

from megatron_delta.platform.cpu import activate_cpu_platform, is_cpu_platform

__all__ = ["initialize_distributed", "destroy_distributed", "free_port"]


# --------------------------------------------------------------------------------------------
# Distributed initialisation
# --------------------------------------------------------------------------------------------
def free_port() -> int:
    """A free TCP port on localhost."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def initialize_distributed(
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    virtual_pipeline_model_parallel_size: Optional[int] = None,
    context_parallel_size: int = 1,
    seed: int = 1234,
    timeout_minutes: int = 10,
    **model_parallel_kwargs,
) -> None:
    """Initialise torch.distributed, Megatron's model-parallel groups and the RNG.

    torch.distributed: env:// when torchrun's RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT are set,
    otherwise a one-process world on a free localhost port; gloo on CPU (after
    :func:`activate_cpu_platform`), nccl on GPU.  Already-initialised torch.distributed is reused
    and an existing model-parallel state is replaced.  Then
    ``parallel_state.initialize_model_parallel`` (extra keyword arguments are passed to it) and the
    seeding of Megatron-LM's ``_set_random_seed``: seed + 100 * pipeline rank for python, numpy and
    torch, and ``model_parallel_cuda_manual_seed`` (on CPU an RNG tracker forking the CPU
    generator).
    """
    from megatron.core import parallel_state, tensor_parallel

    cpu = activate_cpu_platform() or is_cpu_platform()
    tp, pp, cp = tensor_model_parallel_size, pipeline_model_parallel_size, context_parallel_size
    for flag, value in (
        ("--tensor-model-parallel-size", tp),
        ("--pipeline-model-parallel-size", pp),
        ("--context-parallel-size", cp),
    ):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{flag} must be a positive integer, got {value!r}")
    if virtual_pipeline_model_parallel_size is not None:
        if virtual_pipeline_model_parallel_size < 1:
            raise ValueError("the virtual pipeline size must be a positive integer")
        if pp < 2 and virtual_pipeline_model_parallel_size > 1:
            raise ValueError(
                "virtual pipeline parallelism needs --pipeline-model-parallel-size >= 2, "
                f"got {pp}"
            )

    if not torch.distributed.is_initialized():
        backend = "gloo" if cpu else "nccl"
        timeout = datetime.timedelta(minutes=timeout_minutes)
        if all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")):
            world_size = int(os.environ["WORLD_SIZE"])
            _check_divisible(world_size, tp, pp, cp)
            if not cpu:
                torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
            torch.distributed.init_process_group(
                backend=backend,
                init_method="env://",
                rank=int(os.environ["RANK"]),
                world_size=world_size,
                timeout=timeout,
            )
        else:
            _check_divisible(1, tp, pp, cp)
            if not cpu:
                torch.cuda.set_device(0)
            torch.distributed.init_process_group(
                backend=backend,
                init_method=f"tcp://127.0.0.1:{free_port()}",
                rank=0,
                world_size=1,
                timeout=timeout,
            )
    world_size = torch.distributed.get_world_size()
    _check_divisible(world_size, tp, pp, cp)

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=virtual_pipeline_model_parallel_size,
        context_parallel_size=cp,
        distributed_timeout_minutes=timeout_minutes,
        **model_parallel_kwargs,
    )

    # Megatron-LM's _set_random_seed: different pipeline stages get different seeds.
    seed = seed + 100 * parallel_state.get_pipeline_model_parallel_rank()
    random.seed(seed)
    try:
        import numpy as np

        np.random.seed(seed)
    except ImportError:  # pragma: no cover
        pass
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed, force_reset_rng=True)


def _check_divisible(world_size: int, tp: int, pp: int, cp: int) -> None:
    if world_size % (tp * pp * cp) != 0:
        raise ValueError(
            f"world size {world_size} is not divisible by --tensor-model-parallel-size ({tp}) x "
            f"--pipeline-model-parallel-size ({pp}) x --context-parallel-size ({cp}) = "
            f"{tp * pp * cp}; launch with a multiple of it (e.g. torchrun --nproc-per-node "
            f"{tp * pp * cp}) or reduce the parallel sizes"
        )


def destroy_distributed() -> None:
    """Tear down Megatron's model-parallel state, the RNG tracker and torch.distributed.

    Call it once, at the end of the process: a new env:// world after it on the same
    MASTER_PORT can hang.  To change parallel layouts within one process, call
    :func:`initialize_distributed` again instead (it keeps torch.distributed and replaces the
    model-parallel state).
    """
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import random as mp_random

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    mp_random.initialize_rng_tracker(force_reset=True)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
