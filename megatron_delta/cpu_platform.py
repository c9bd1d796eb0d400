"""Megatron-Core on CPU + gloo: activation of the CPU adaptation, distributed initialisation, the CPU allocator.

The adaptation itself (what is changed in Megatron-Core and megatron.training, and which upstream failure
each change answers, for which versions) is the CPU-only part of the registry megatron_delta.patches;
:func:`activate_cpu_platform` applies it when CUDA is not available, after the registry's fixes of every
device.

Public API
----------
activate_cpu_platform() -> bool   idempotent; the registry's every-device fixes; False (no CPU patching) with CUDA
is_cpu_platform() -> bool          True once the CPU adaptation is active
initialize_distributed(...)        torch.distributed (gloo on CPU / nccl on GPU) + Megatron model
                                   parallel groups + model-parallel RNG seeding
destroy_distributed()
set_cpu_allocator(choice) -> str   "cache": glibc keeps freed memory, as the CUDA caching allocator
free_port() -> int
"""
from __future__ import annotations

import datetime
import os
import random
import socket
from typing import Optional

import torch

__all__ = [
    "activate_cpu_platform",
    "is_cpu_platform",
    "initialize_distributed",
    "destroy_distributed",
    "free_port",
    "CPU_ALLOCATOR_CHOICES",
    "set_cpu_allocator",
]

_ACTIVE = False


def is_cpu_platform() -> bool:
    """True once :func:`activate_cpu_platform` has adapted Megatron-Core to CPU."""
    return _ACTIVE


def activate_cpu_platform() -> bool:
    """Adapt Megatron-Core to CPU + gloo.  Idempotent.

    Applies the registry's every-device entries first (megatron_delta.patches, EVERY_DEVICE). Returns False
    and applies no CPU entry when CUDA is available; otherwise applies the CPU-only entries (also when
    megatron.core was imported before) and returns True.
    """
    global _ACTIVE
    from megatron_delta import patches

    patches.import_megatron()  # their import-time notices quieted (patches.KNOWN_WARNINGS)
    patches.apply_patches(patches.EVERY_DEVICE)
    if torch.cuda.is_available():
        return False
    if not _ACTIVE:
        patches.apply_patches(patches.CPU_ONLY)
        _ACTIVE = True
    return True


# --------------------------------------------------------------------------------------------
# The CPU allocator
# --------------------------------------------------------------------------------------------
CPU_ALLOCATOR_CHOICES = ("cache", "system")
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc <malloc.h>
_MMAP_THRESHOLD = 32 << 20  # glibc's ceiling on 64-bit (HEAP_MAX_SIZE / 2); bigger blocks stay mmapped
_TRIM_THRESHOLD = 1 << 30
_ALLOCATOR_USER_CHOICES = ("jemalloc", "tcmalloc", "mimalloc")


def set_cpu_allocator(choice: str = "cache") -> str:
    """``--delta-cpu-allocator``: how freed CPU tensor memory is handled; returns a line for the log.

    PyTorch's CPU allocator is plain malloc/free. With glibc's defaults a freed multi-MiB activation
    or gradient is given back to the OS (unmapped, or trimmed off the heap top) and the next one of
    that size faults its pages in afresh, zeroed by the kernel: measured here, 20-240 thousand page
    faults per training step, 2-3 % of the step's CPU time (README, Performance). ``cache`` makes glibc
    keep freed memory for reuse, as PyTorch's CUDA caching allocator does on GPU (blocks up to 32 MiB
    come from the heap, the heap is not trimmed below 1 GiB free): the process keeps its peak RSS.
    ``system`` leaves malloc as configured. Left alone as well: non-glibc systems, and processes whose
    user chose a malloc (MALLOC_* / GLIBC_TUNABLES malloc settings, or jemalloc / tcmalloc / mimalloc
    in LD_PRELOAD). Process-wide; call it once at start-up (pretrain_gpt.py and tools/benchmark.py do).
    """
    import ctypes
    import ctypes.util

    if choice not in CPU_ALLOCATOR_CHOICES:
        raise ValueError(f"--delta-cpu-allocator {choice!r} is not one of {', '.join(CPU_ALLOCATOR_CHOICES)}")
    if choice == "system":
        return "CPU allocator: malloc as configured (--delta-cpu-allocator system)"
    preload = os.environ.get("LD_PRELOAD", "")
    chosen = sorted(k for k in os.environ if k.startswith("MALLOC_"))
    if "glibc.malloc" in os.environ.get("GLIBC_TUNABLES", ""):
        chosen.append("GLIBC_TUNABLES")
    chosen += [lib for lib in _ALLOCATOR_USER_CHOICES if lib in preload]
    if chosen:
        return f"CPU allocator: malloc as configured by {', '.join(chosen)} (--delta-cpu-allocator cache not applied)"
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return "CPU allocator: malloc as configured (no glibc mallopt here)"
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    if not (mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD) and mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD)):
        return "CPU allocator: malloc as configured (glibc refused mallopt)"
    return "CPU allocator: glibc keeps freed memory for reuse (--delta-cpu-allocator cache)"


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
