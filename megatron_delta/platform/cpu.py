"""Megatron-Core on CPU + gloo: activation of the CPU adaptation, and the CPU allocator.

The adaptation itself (what is changed in Megatron-Core and megatron.training, and which upstream failure
each change answers, for which versions) is the CPU-only part of the registry megatron_delta.platform.patches;
:func:`activate_cpu_platform` applies it when CUDA is not available, after the registry's fixes of every
device.

Public API
----------
activate_cpu_platform() -> bool   idempotent; the registry's every-device fixes; False (no CPU patching) with CUDA
is_cpu_platform() -> bool          True once the CPU adaptation is active
set_cpu_allocator(choice) -> str   "cache": glibc keeps freed memory, as the CUDA caching allocator
"""
from __future__ import annotations

import os

import torch

__all__ = ["activate_cpu_platform", "is_cpu_platform", "CPU_ALLOCATOR_CHOICES", "set_cpu_allocator"]

_ACTIVE = False


def is_cpu_platform() -> bool:
    """True once :func:`activate_cpu_platform` has adapted Megatron-Core to CPU."""
    return _ACTIVE


def activate_cpu_platform() -> bool:
    """Adapt Megatron-Core to CPU + gloo.  Idempotent.

    Applies the registry's every-device entries first (megatron_delta.platform.patches, EVERY_DEVICE). Returns False
    and applies no CPU entry when CUDA is available; otherwise applies the CPU-only entries (also when
    megatron.core was imported before) and returns True.
    """
    global _ACTIVE
    from megatron_delta.platform import patches

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
