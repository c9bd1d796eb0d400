"""The group router's fused CPU kernels (csrc/group_router_kernels.c): built with the system C compiler on
first use, cached, loaded with ctypes, as the per-router kernels (cpu_kernels.py, whose build and
``--delta-router-kernels`` rules they follow: `auto` warns once and takes PyTorch ops where they cannot be
built, `c` raises). fp32, contiguous CPU tensors only; group_router.py runs PyTorch ops otherwise.
"""
from __future__ import annotations

import ctypes
import os
import warnings
from typing import List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from megatron_delta.core import cpu_kernels
from megatron_delta.core.cpu_kernels import KERNEL_TOKEN_BLOCK, KernelBuildError

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc", "group_router_kernels.c")

_warned = False


def _build() -> ctypes.CDLL:
    lib = cpu_kernels.compile_library(SOURCE, "group_router_kernels")
    P, I64, INT, F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
    lib.group_old_forward.argtypes = [I64, I64, INT, INT, P, P, F, INT, P, P, P, P, P, P, P, P, INT, INT]
    lib.group_old_backward.argtypes = [I64, I64, INT, INT, P, P, P, P, P, P, P, P, INT, P, P, P, P, INT, INT, P, P,
                                       INT, P, P, P, P, P, P, INT]
    lib.group_merge_forward.argtypes = [I64, I64, INT, P, P, P, P, F, P, P, F, INT, P, P, P, P, INT]
    lib.group_merge_backward.argtypes = [I64, I64, INT, P, P, F, P, P, P, P, P, INT, P, INT, P, INT, P, P, P, P, P,
                                         P, P, P, P, P, INT]
    lib.group_final_sum.argtypes = [I64, I64, INT, P, P, INT]
    for f in (lib.group_old_forward, lib.group_old_backward, lib.group_merge_forward, lib.group_merge_backward,
              lib.group_final_sum):
        f.restype = None
    return lib


_library = cpu_kernels.BuildOnce(_build)


def load() -> ctypes.CDLL:
    """The kernel library, built on first use; raises KernelBuildError (tried once per process)."""
    return _library.load()


def library(choice: str) -> Optional[ctypes.CDLL]:
    """The library for a router's ``kernels`` choice (auto / c), or None for PyTorch ops (see module docstring)."""
    global _warned
    if choice not in ("auto", "c"):
        return None
    try:
        return load()
    except KernelBuildError as e:
        if choice == "c":
            raise
        if cpu_kernels.library(choice) is not None and not _warned:  # the per-router kernels built, these did not
            _warned = True
            warnings.warn(f"megatron-delta: the group router's CPU kernels cannot be built ({e}); it runs on PyTorch "
                          f"ops, slower on CPU. Pass --delta-router-group-size 1 to route one router per pass on the "
                          f"fused kernels.", RuntimeWarning, stacklevel=2)
        return None  # else cpu_kernels.library said once that the fused CPU kernels cannot be built


def _ptrs(tensors: Sequence[Optional[Tensor]]):
    return (ctypes.c_void_p * len(tensors))(*[None if t is None else t.data_ptr() for t in tensors])


def _addresses(addresses: Sequence[int]):
    return (ctypes.c_void_p * len(addresses))(*addresses)


def _ptr(t: Optional[Tensor]):
    return None if t is None else t.data_ptr()


def _threads() -> int:
    return torch.get_num_threads()


def old_forward(lib, values: Sequence[Tensor], Q: Tensor, eps: float, null_logits: Optional[Tensor],
                null_values: Optional[Tensor], inv: Tensor, z: Tensor, p: Tensor, lse: Tensor, r: Tensor,
                x: Optional[Tensor], u0: Optional[Tensor] = None) -> None:
    """The old pass (csrc: group_old_forward): values n x [T, d], Q [S, d], null [S] and [S, d] (or None);
    writes inv [n, T], z and p [S, M, T], lse [S, T], r [S, T, d] and x [T, d] (when given); with ``u0`` (the
    first router's u, group_router._OldPass's first_u) r holds r_1 .. r_{S-1} and u0 = r_0 (+ x)."""
    T, d = values[0].shape
    S = Q.shape[0]
    has_null = null_values is not None
    nl = null_logits.contiguous() if has_null else None
    nv = null_values.contiguous() if has_null else None
    lib.group_old_forward(T, d, len(values), S, _ptrs(values), Q.contiguous().data_ptr(), eps, int(has_null),
                          _ptr(nl), _ptr(nv), inv.data_ptr(), z.data_ptr(), p.data_ptr(), lse.data_ptr(),
                          _ptrs(([u0] if u0 is not None else []) + list(r.unbind(0))), _ptr(x), int(u0 is not None),
                          _threads())


def _modes(targets: Sequence[Tuple[Optional[Tensor], bool, Optional[Tensor]]]):
    """The kernels' per-target mode (csrc: fresh_i) from (target, fresh, seed): 1 assign, 2 assign seed + the
    gradient (a sink the final sum seeded), 0 add in place (or no target)."""
    return [1 if f else (2 if s is not None else 0) for _, f, s in targets]


def old_backward(lib, G: Sequence[Tensor], ks: Sequence[int], w: Tensor, dlse: Tensor, values: Sequence[Tensor],
                 inv: Tensor, z: Tensor, p: Tensor, Q: Tensor, null_values: Optional[Tensor],
                 targets: List[Tuple[Optional[Tensor], bool, Optional[Tensor]]], unit: bool, dz: Tensor,
                 dq: Tensor, received=None) -> None:
    """The old pass's backward (csrc: group_old_backward): G[j] is router ks[j]'s output gradient; targets:
    (sink gradient, assigned, seed) per source; ``received``: the next group's deferred share of every source's
    gradient (group_router.OldShare), added as the targets are written."""
    T, d = values[0].shape
    S = Q.shape[0]
    grads: List[Optional[Tensor]] = [None] * S
    for k, g in zip(ks, G):
        grads[k] = g
    fresh = (ctypes.c_int * len(values))(*_modes(targets))
    nblk = -(-T // KERNEL_TOKEN_BLOCK)
    part = values[0].new_empty(nblk, S, d)
    nv = null_values.contiguous() if null_values is not None else None
    lib.group_old_backward(T, d, len(values), S, _ptrs(grads), w.data_ptr(), dlse.data_ptr(), _ptrs(values),
                           inv.data_ptr(), z.data_ptr(), p.data_ptr(), Q.contiguous().data_ptr(), int(nv is not None),
                           _ptr(nv), _ptrs([t for t, _, _ in targets]), fresh,
                           _ptrs([sd for _, _, sd in targets]), int(unit),
                           *((0, None, None, 0, None, None, None) if received is None else
                             (len(received.grads), _ptrs(received.grads), received.A.data_ptr(), received.C.shape[0],
                              received.C.data_ptr(), received.Q.data_ptr(), received.E.data_ptr())),
                           dz.data_ptr(), part.data_ptr(),
                           dq.data_ptr(), _threads())


def merge_forward(lib, r: Tensor, lse: Tensor, x: Optional[Tensor], base: Optional[Tensor], gate: float, q: Tensor,
                  values: Sequence[Tensor], eps: float, unit: bool, inv: Tensor, z: Tensor, a: Tensor,
                  out: Tensor) -> None:
    """The merge of one router (csrc: group_merge_forward)."""
    T, d = r.shape
    lib.group_merge_forward(T, d, len(values), r.data_ptr(), lse.contiguous().data_ptr(), _ptr(x), _ptr(base),
                            gate, q.contiguous().data_ptr(), _ptrs(values), eps, int(unit), inv.data_ptr(),
                            z.data_ptr(), a.data_ptr(), out.data_ptr(), _threads())


def merge_backward(lib, grad: Tensor, r: Tensor, gate: float, q: Tensor, values: Sequence[Tensor], inv: Tensor,
                   z: Tensor, a: Tensor, unit: bool, target: Tuple[Optional[Tensor], bool, Optional[Tensor]],
                   later: Sequence[tuple], coef: Tensor, da: Tensor,
                   dlog: Tensor, dq: Tensor) -> None:
    """The merge's backward (csrc: group_merge_backward): ``target`` (sink gradient, assigned, seed) of the newest
    in-group source, ``later`` the later merges' deferred shares of it (group_router.DeferredShare);
    writes each in-group source's w, c, e into ``coef`` [3, k, T]."""
    T, d = r.shape
    part = r.new_empty(-(-T // KERNEL_TOKEN_BLOCK), d)
    t, _, seed = target
    mode = _modes([target])[0]
    lib.group_merge_backward(T, d, len(values), grad.data_ptr(), r.data_ptr(), gate, q.contiguous().data_ptr(),
                             _ptrs(values), inv.data_ptr(), z.data_ptr(), a.data_ptr(), int(unit), _ptr(t), mode,
                             _ptr(seed), len(later), _ptrs([x.grad for x in later]), _ptrs([x.q for x in later]),
                             *[_addresses([x.address(j) for x in later]) for j in range(3)],
                             coef.data_ptr(), da.data_ptr(), dlog.data_ptr(), part.data_ptr(), dq.data_ptr(),
                             _threads())


def final_sum(lib, values: Sequence[Tensor], x: Tensor) -> None:
    """x = the sum of the sources, in order (csrc: group_final_sum): each source read once, x written once."""
    T, d = x.shape
    lib.group_final_sum(T, d, len(values), _ptrs(values), x.data_ptr(), _threads())
