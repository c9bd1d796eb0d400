"""Distributed start-up: torch.distributed (gloo on CPU, nccl on GPU), Megatron's model-parallel groups, the RNG.

Public API
----------
initialize_distributed(...)        torch.distributed (gloo on CPU / nccl on GPU) + Megatron model
                                   parallel groups + model-parallel RNG seeding; activates the CPU
                                   platform (platform/cpu.py) first
release_model_parallel()          Megatron's model-parallel state and every process group but the
                                   default one, threads included (before a rebuild, after a run)
destroy_distributed()
free_port() -> int
"""
from __future__ import annotations

import datetime
import gc
import os
import random
import socket
from typing import Optional

import torch

from megatron_delta.platform.cpu import activate_cpu_platform, is_cpu_platform

__all__ = ["initialize_distributed", "release_model_parallel", "destroy_distributed", "free_port"]


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

    release_model_parallel()
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


def release_model_parallel() -> None:
    """Drop Megatron's model-parallel state and destroy every process group but the default one.

    Megatron-Core's ``destroy_model_parallel`` only sets its globals to None (and destroys one gloo
    group): torch.distributed keeps every group registered, and with gloo each keeps its threads (a
    TCP loop and two workers), ~60 threads per rebuild of the groups.  A process that changes
    layouts or runs the trainer again therefore grows by thousands of threads.  Destroying a group
    is local to this rank (no collective), so a rank may release while its peers still finish.
    The models built on the released groups cannot communicate any more: their DDP hook cycles are
    cut (_cut_ddp_hook_cycles) so that they, their optimizers and the groups they hold are freed.
    """
    from megatron.core import parallel_state
    from torch.distributed import distributed_c10d

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    # (patches.REGISTRY model_parallel_release) two globals upstream's teardown forgets
    parallel_state._INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP = None
    parallel_state._INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP_GLOO = None
    if not torch.distributed.is_initialized():
        return
    default = distributed_c10d.GroupMember.WORLD
    # torch lists its groups only in _world (as Megatron's destroy_model_parallel reads it too)
    for group in list(distributed_c10d._world.pg_map):
        if group is not default:
            torch.distributed.destroy_process_group(group)
    _cut_ddp_hook_cycles()
    _clear_rotary_caches()
    gc.collect()  # a finished run's models and optimizers hold the groups in reference cycles


def _cut_ddp_hook_cycles() -> None:
    """Megatron-Core's DistributedDataParallel registers its backward hook on each parameter's
    grad-accumulator node, and the hook refers to DDP.  The node is kept alive by DDP (``grad_accs``)
    and, with the distributed optimizer, by the optimizer's parameter shards (views with a grad_fn),
    which DDP reaches through ``config.grad_scale_func`` (the optimizer's scale_loss): cycles through
    autograd's C++ nodes that the garbage collector cannot see.  Without the cut every DDP, its
    module, optimizer and process groups (gloo threads included) outlive their run."""
    from megatron.core.distributed import DistributedDataParallel

    for obj in gc.get_objects():
        if issubclass(type(obj), DistributedDataParallel):  # (type(): no proxy object is asked)
            obj.grad_accs.clear()  # each node then dies with its hook (a parameter holds it weakly)
            obj.config.grad_scale_func = None  # DDP -> optimizer -> shard views -> nodes -> hook -> DDP


def _clear_rotary_caches() -> None:
    """Megatron-Core's rotary embeddings cache ``forward`` in a class-level lru_cache keyed by the module
    (32 entries): each entry keeps a finished model's rotary module and its context-parallel group."""
    from megatron.core.models.common.embeddings import rotary_pos_embedding, yarn_rotary_pos_embedding

    rotary_pos_embedding.RotaryEmbedding.forward.cache_clear()
    yarn_rotary_pos_embedding.YarnRotaryEmbedding.forward.cache_clear()


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
