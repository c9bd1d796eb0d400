"""The router's fused CPU kernels (csrc/router_kernels.c): built with the system C compiler on first
use, cached, loaded with ctypes.

Why C and not PyTorch ops: on CPU the router is memory-bound and every eager operator is a pass over
memory; the kernels make each pass the method needs once (docs/performance.md). They take fp32,
contiguous CPU tensors; anything else (GPU, bf16, float64) runs router.py's PyTorch path, which
computes the same function. No torch headers are involved, so the build takes well under a second
and does not depend on the PyTorch version.

`--delta-router-kernels` (config `delta_router_kernels`) chooses: `auto` (default) uses them for
fp32 CPU tensors and, if they cannot be built, warns once and uses PyTorch ops; `c` makes a failed
build an error at start-up; `torch` never uses them. `triton` (and `auto` for CUDA tensors, when Triton
imports) routes through the project's Triton kernels instead (triton_router.py), `fla` through fla-core's
fused GPU kernel (fla_router.py, docs/gpu.md).
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
import threading
import warnings
from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc", "router_kernels.c")
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c11")
LIBS = ("-lm",)  # after the source: linkers with --as-needed drop libraries named before their user
KERNEL_TOKEN_BLOCK = 64  # TB in router_kernels.c: tokens per block of the query gradient's partial sums

_warned = False


class KernelBuildError(RuntimeError):
    """The C kernels cannot be built or loaded here; the message says why and what to do."""


def cache_dir() -> str:
    """Where built kernels are kept: $MEGATRON_DELTA_CACHE, else $XDG_CACHE_HOME/megatron_delta,
    else ~/.cache/megatron_delta."""
    if os.environ.get("MEGATRON_DELTA_CACHE"):
        return os.environ["MEGATRON_DELTA_CACHE"]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "megatron_delta")


def _machine() -> bytes:
    # -march=native: a library built on one CPU model must not be loaded on another.
    flags = b""
    try:
        with open("/proc/cpuinfo", "rb") as f:
            flags = next((line for line in f if line.startswith(b"flags")), b"")
    except OSError:
        pass
    return platform.machine().encode() + flags


def compile_library(source: str, stem: str) -> ctypes.CDLL:
    """Build (once per source, compiler and machine; cached) and load the C file ``source``; KernelBuildError
    says why not. Shared by the router's kernels and the group router's (group_kernels.py)."""
    cc_text = os.environ.get("CC") or "cc"
    cc = shlex.split(cc_text)  # CC may carry a wrapper or flags ("ccache gcc")
    if not cc or shutil.which(cc[0]) is None:
        raise KernelBuildError(f"no C compiler {cc_text!r} on PATH (set CC, or install gcc)")
    with open(source, "rb") as f:
        src = f.read()
    version = subprocess.run([*cc, "--version"], capture_output=True).stdout
    key = hashlib.sha256(b"\0".join([src, cc_text.encode(), " ".join(FLAGS + LIBS).encode(), version,
                                     _machine()])).hexdigest()[:16]
    out_dir = cache_dir()
    lib_path = os.path.join(out_dir, f"{stem}-{key}.so")
    if not os.path.exists(lib_path):
        try:
            os.makedirs(out_dir, exist_ok=True)
        except OSError as e:
            raise KernelBuildError(f"cannot create the kernel cache {out_dir} ({e}); set MEGATRON_DELTA_CACHE")
        # Build under a temporary name and rename: ranks building at once never load a partial file.
        fd, tmp = tempfile.mkstemp(dir=out_dir, suffix=".so.tmp")
        os.close(fd)
        try:
            p = subprocess.run([*cc, *FLAGS, source, "-o", tmp, *LIBS], capture_output=True, text=True)
            if p.returncode != 0:
                raise KernelBuildError(f"{cc_text} {' '.join(FLAGS)} {source} failed (exit {p.returncode}):\n"
                                       f"{p.stderr.strip()[-2000:]}")
            os.replace(tmp, lib_path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    try:
        lib = ctypes.CDLL(lib_path)
    except OSError as e:
        raise KernelBuildError(f"cannot load {lib_path}: {e}") from None
    return lib


def _build() -> ctypes.CDLL:
    lib = compile_library(SOURCE, "router_kernels")
    P, I64, INT, F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
    lib.delta_route_forward.argtypes = [I64, I64, INT, P, P, P, F, INT, F, P, F, P, INT, P, P, P, P, INT]
    lib.delta_route_forward.restype = None
    lib.delta_route_backward.argtypes = [I64, I64, INT, P, P, P, F, INT, P, P, P, P, P, P, INT, P, P, INT, P, P,
                                         INT]
    lib.delta_route_backward.restype = None
    return lib


class BuildOnce:
    """Kernels built on first use and tried once per process: :meth:`load` returns them, or raises ``fail(the
    exception of that one attempt)``. The C libraries (here, group_kernels.py) and the Triton kernels
    (triton_router.py, triton_group_kernels.py) are all loaded this way."""

    def __init__(self, build: Callable[[], Any], catch=KernelBuildError,
                 fail: Callable[[BaseException], Exception] = lambda e: KernelBuildError(str(e))) -> None:
        self._build, self._catch, self._fail, self._lock = build, catch, fail, threading.Lock()
        self._built: Any = None
        self._error: Optional[BaseException] = None

    def load(self) -> Any:
        built = self._built  # built once: every later call (one per kernel launch) returns it without the lock
        if built is not None:
            return built
        with self._lock:
            if self._built is None and self._error is None:
                try:
                    self._built = self._build()
                except self._catch as e:
                    self._error = e
            if self._built is None:
                raise self._fail(self._error)
            return self._built


_library = BuildOnce(_build)


def load() -> ctypes.CDLL:
    """The kernel library, built on first use; raises KernelBuildError (once per process it is tried)."""
    return _library.load()



def library(choice: str) -> Optional[ctypes.CDLL]:
    """The library for a router's `kernels` choice, or None for PyTorch ops (`torch`, or `auto` where
    the kernels cannot be built: then one warning per process says so; `fla` / `triton`: what their kernels
    cannot route takes PyTorch ops)."""
    global _warned
    if choice in ("torch", "fla", "triton"):
        return None
    try:
        return load()
    except KernelBuildError as e:
        if choice == "c":
            raise
        if not _warned:
            _warned = True
            warnings.warn(f"megatron-delta: the fused CPU router kernels cannot be built ({e}); the routers run on "
                          f"PyTorch ops, slower on CPU. Install a C compiler, or pass --delta-router-kernels torch "
                          f"to choose PyTorch ops knowingly.", RuntimeWarning, stacklevel=2)
        return None


def eligible(*tensors: Optional[Tensor]) -> bool:
    """True when every given tensor is an fp32, contiguous CPU tensor (None entries are skipped)."""
    return all(t is None or (t.device.type == "cpu" and t.dtype == torch.float32 and t.is_contiguous())
               for t in tensors)


def _ptrs(tensors: Sequence[Optional[Tensor]]):
    return (ctypes.c_void_p * len(tensors))(*[None if t is None else t.data_ptr() for t in tensors])


def _ptr(t: Optional[Tensor]):
    return None if t is None else t.data_ptr()


def route_forward(lib, values: Sequence[Tensor], cols: Sequence[Optional[Tensor]], query: Optional[Tensor],
                  eps: float, null_logit: Optional[float], null_value: Optional[Tensor], gate: float,
                  base: Optional[Tensor], alpha: Tensor, proj: Sequence[Optional[Tuple[Tensor, Tensor]]],
                  out: Tensor, unit: bool = False) -> Tensor:
    """out = base + gate * (sum_i alpha_i values[i] + alpha_null null_value), alpha = softmax over the
    logit columns ``cols`` [T] (None: a local source, projected here with ``query``; its 1/rms and
    logit go to ``proj[i]`` = (inv [T], z [T])). values/base/out [T, d], alpha [M, T] (written).
    ``unit`` (base None): the base is the sum of the values, each value's weight is 1 + gate alpha_i."""
    rows, d = out.shape
    n = len(values)
    has_null = null_value is not None
    if unit and base is not None:
        raise ValueError("route_forward: unit=True forms the base from the values; pass base=None")
    lib.delta_route_forward(rows, d, n, _ptrs(values), _ptrs(cols), _ptr(query), eps, int(has_null),
                            float(null_logit) if has_null else 0.0, _ptr(null_value), gate, _ptr(base),
                            int(unit), alpha.data_ptr(), _ptrs([p and p[0] for p in proj]),
                            _ptrs([p and p[1] for p in proj]), out.data_ptr(), torch.get_num_threads())
    return out


def route_backward(lib, grad: Tensor, values: Sequence[Tensor], alpha: Tensor, gate: float,
                   null_value: Optional[Tensor], query: Optional[Tensor],
                   proj: Sequence[Optional[Tuple[Tensor, Tensor]]],
                   targets: List[Tuple[Optional[Tensor], bool]], dw: Tensor, dlogit: Tensor,
                   dq: Optional[Tensor] = None, recover: Optional[int] = None, unit: bool = False) -> None:
    """The backward of route_forward: dw [M, T] (row-wise <grad, value>), dlogit [M, T]; each target
    (or None) gets its source's gradient (assigned when fresh, else added): gate alpha_i grad, plus for a
    local source (proj[i] given) its projection's share; ``dq`` [d] (when given) gets the local sources'
    share of the query's gradient. ``recover``: index of a source whose entry in ``values`` is the
    forward's output u, rebuilt from it (the sources sum to the base; see the kernel's comment).
    ``unit``: as in route_forward (the weighted sum's share is (1 + gate alpha_i) grad)."""
    rows, d = grad.shape
    n = len(values)
    fresh = (ctypes.c_int * n)(*[int(f) for _, f in targets])
    part = None if dq is None else grad.new_empty(-(-rows // KERNEL_TOKEN_BLOCK), d)
    lib.delta_route_backward(rows, d, n, grad.data_ptr(), _ptrs(values), alpha.data_ptr(), gate,
                             int(null_value is not None), _ptr(null_value), _ptr(query),
                             _ptrs([p and p[0] for p in proj]), _ptrs([p and p[1] for p in proj]),
                             _ptrs([t for t, _ in targets]), fresh, int(unit), dw.data_ptr(), dlogit.data_ptr(),
                             -1 if recover is None else recover, _ptr(part), _ptr(dq), torch.get_num_threads())
