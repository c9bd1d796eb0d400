"""The router on GPUs: fla-core's fused AttnRes kernel (``fla.ops.attnres.fused_attnres``), with what it
does not do kept around it (docs/gpu.md).

``--delta-router-kernels fla`` routes through the kernel; ``auto`` does so for CUDA tensors when
``fla`` is importable (fp32 CPU tensors still take the C kernels of cpu_kernels.py, everything else
PyTorch ops). Imported lazily: nothing here, and nothing of fla, is imported unless a router on a
CUDA tensor asks for it (or the choice is ``fla``).

The mapping (fla-core 0.6.0, read from ``fla/ops/attnres/fused.py``). Per token the kernel computes,
in fp32 whatever the sources' dtype,

    logit_l = ((v_l * rsqrt(mean_d(v_l^2) + rms_eps)) * rms_weight) . query * scale
    p = softmax_l(logit_l),   o = sum_l p_l v_l         (o in the sources' dtype, p fp32 [L, T])

and in backward every source's gradient (the weighted sum's share and the key norm's), the query's and
the norm weight's. The router's ``alpha = softmax_i(w . (g * s_i / rms(s_i)))`` is that with
``query = w`` (``DepthRouter.query``), ``rms_weight = g`` (``DepthRouter.key_norm_weight``),
``rms_eps`` = the router's eps, ``scale = 1.0`` (the router's logits are unscaled),
``output_rms_weight = None`` (the sublayer's own input norm follows, in Megatron's module) and the
default ``checkpoint_level=1`` (the mix is recomputed in backward from the sources, which are alive
anyway: the kernel keeps no [T, d] tensor). ``r = o``.

Kept around the kernel (PyTorch ops, exact in fp32; see :func:`route`):

- the null source z: one more residual, LAST (the router's convention), ``z`` broadcast to every token
  in the sources' dtype (the kernel takes no broadcast source: one [T, d] tensor per router call, held
  until backward); its logit is the kernel's, which is the router's (z's key is normed like any
  source's). Its gradient, per token from the kernel, is summed over tokens in fp32.
- the scalar gate a, the residual add and the residual stream formed from the sources: ``u = B + a r``
  with B = x (``base``), the sum of the sources (``base=None, base_sums=True``) or 0, computed in fp32
  and rounded once to the output dtype (no gate, base x: one ``torch.add``). The kernel's r is rounded
  to the sources' dtype first: in bf16, u differs from the PyTorch path's (one rounding of x + a r in
  fp32) by at most about one bf16 unit of r. At a = 0, u = x bitwise, as on the PyTorch path.
- shared projections: none. The kernel computes every source's logit in the pass that reads it for the
  weighted sum, so a separate projection (router.make_source) would only add a pass; SourceBuffer asks
  :meth:`DepthRouter.routes_in_kernel` and makes such sources local. A source given with logit columns
  anyway is routed from its value (its columns get no gradient; its gradient reaches the value directly).
- With this backend the additive modes keep x as a running stream (``SourcePlan.from_config``): the
  kernel cannot fold x = sum_i s_i into its pass, and summing N sources per router would cost N reads.

Falls back to the PyTorch path (router.route), per call, where the kernel cannot express the case
(:func:`fallback_reason` says why): sources not all of one dtype among fp32 / bf16 / fp16 (float64 runs
the gradchecks: the kernel computes in fp32); an output dtype (``like`` / ``base``) other than the
sources'; rows not a multiple of 16 bytes (hidden size x element size; the kernel assumes 16-byte
aligned rows); devices the kernel does not take (the Triton kernel: CUDA only). Zero sources never
reach a kernel (DepthRouter._no_sources). A source whose storage is not 16-byte aligned is copied.

Testing on CPU: the Triton kernel refuses CPU tensors, so tests put fla's pure-PyTorch reference
``fla.ops.attnres.naive_attnres`` (same signature, CPU) in its place with :func:`use_kernel` - the one
documented injection point; everything else (this adapter, the router, the model) runs as in training.
"""
from __future__ import annotations

import contextlib
import importlib
import threading
import warnings
from typing import Callable, NamedTuple, Optional, Sequence, Tuple

import torch
from torch import Tensor

from megatron_delta.core import traffic
from megatron_delta.core.traffic import record

__all__ = ["Kernel", "FlaUnavailable", "set_kernel", "use_kernel", "load", "available", "kernel_for", "check",
           "describe", "plan_keeps_x", "fallback_reason", "route"]

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
ALIGN = 16  # bytes: the kernel's loads assume 16-byte aligned sources and rows
CHOICES = ("auto", "fla")  # the --delta-router-kernels choices that may route through the kernel


class Kernel(NamedTuple):
    """A fused_attnres-compatible function, the device types it takes and a name for the log."""

    fn: Callable
    devices: Tuple[str, ...]
    name: str


class FlaUnavailable(RuntimeError):
    """fla's fused_attnres cannot be imported here; the message says why."""


_lock = threading.Lock()
_injected: Optional[Kernel] = None
_fla: Optional[Kernel] = None
_error: Optional[str] = None
_warned = False


# ---------------------------------------------------------------------------------------- the kernel
def set_kernel(fn: Optional[Callable], devices: Sequence[str] = ("cpu", "cuda"), name: Optional[str] = None
               ) -> Optional[Kernel]:
    """THE injection point: route through ``fn`` (fused_attnres's signature: ``fn(query, residuals,
    rms_weight, output_rms_weight=None, rms_eps=..., scale=..., return_weights=...)``) for tensors on
    ``devices``, instead of fla's Triton kernel; ``None`` restores the kernel. Returns the previous one.
    Used by the tests and ``tools/gpu_check.py --dry-run`` with ``fla.ops.attnres.naive_attnres``."""
    global _injected
    prev = _injected
    _injected = None if fn is None else Kernel(fn, tuple(devices), name or getattr(fn, "__name__", "kernel"))
    return prev


@contextlib.contextmanager
def use_kernel(fn: Callable, devices: Sequence[str] = ("cpu", "cuda"), name: Optional[str] = None):
    """``set_kernel`` for the duration of a ``with`` block."""
    global _injected
    prev = set_kernel(fn, devices, name)
    try:
        yield _injected
    finally:
        _injected = prev


def load() -> Kernel:
    """fla's ``fused_attnres`` (Triton; CUDA tensors only), imported on first use. Raises FlaUnavailable."""
    global _fla, _error
    with _lock:
        if _fla is None and _error is None:
            try:
                with warnings.catch_warnings():  # fla warns at import on machines without a GPU
                    warnings.simplefilter("ignore")
                    mod = importlib.import_module("fla.ops.attnres")
                    version = getattr(importlib.import_module("fla"), "__version__", "?")
                _fla = Kernel(mod.fused_attnres, ("cuda",), f"fla {version} fused_attnres")
            except Exception as e:  # noqa: BLE001  (ImportError, or a broken Triton install)
                _error = f"{type(e).__name__}: {e}"
        if _fla is None:
            raise FlaUnavailable(f"fla.ops.attnres.fused_attnres cannot be imported ({_error}); "
                                 f"pip install 'megatron-delta[gpu]' (fla-core==0.6.0)")
        return _fla


def available() -> bool:
    """True when fla's fused_attnres imports here."""
    try:
        load()
        return True
    except FlaUnavailable:
        return False


def kernel_for(choice: str, device_type: str) -> Optional[Kernel]:
    """The kernel a router with ``--delta-router-kernels choice`` uses for tensors on ``device_type``, or
    None (C kernels / PyTorch ops). ``fla``: the injected kernel where it takes the device, else fla's on
    CUDA. ``auto``: the same, CUDA tensors only; if fla does not import, one warning and PyTorch ops."""
    global _warned
    if choice not in CHOICES or (choice == "auto" and device_type != "cuda"):
        return None
    if _injected is not None and device_type in _injected.devices:
        return _injected
    if device_type != "cuda":
        return None
    try:
        return load()
    except FlaUnavailable as e:
        if choice == "fla":
            raise
        if not _warned:
            _warned = True
            warnings.warn(f"megatron-delta: {e}. The routers on CUDA tensors run on PyTorch ops; pass "
                          f"--delta-router-kernels torch to choose them knowingly.", RuntimeWarning, stacklevel=2)
        return None


def check(choice: str) -> None:
    """Start-up check of ``--delta-router-kernels fla`` (raises ValueError naming the flag): fla must import,
    and there must be a CUDA device (or an injected kernel that runs on CPU)."""
    if choice != "fla":
        return
    if _injected is not None and "cpu" in _injected.devices:
        return
    try:
        load()
    except FlaUnavailable as e:
        raise ValueError(f"--delta-router-kernels fla: {e}; or use --delta-router-kernels auto") from None
    if not torch.cuda.is_available():
        raise ValueError("--delta-router-kernels fla: no CUDA device here, and fla's Triton kernel runs on CUDA "
                         "tensors only; use --delta-router-kernels auto (C kernels on CPU)")


def describe(choice: str, cuda: Optional[bool] = None) -> str:
    """The start-up line saying which kernels the routers use (``cuda``: whether the model runs on CUDA;
    default torch.cuda.is_available()). Tries the imports/builds it names, as the first route would."""
    from megatron_delta.core import cpu_kernels

    cuda = torch.cuda.is_available() if cuda is None else cuda
    flag = f"(--delta-router-kernels {choice})"
    if choice == "torch":
        return f"router kernels: PyTorch ops {flag}"
    if choice == "triton" or (choice == "auto" and cuda):
        from megatron_delta.core import triton_router

        if choice == "triton" or triton_router.available():
            where = "CUDA tensors" if cuda else "CPU tensors under TRITON_INTERPRET=1"
            return (f"router kernels: the project's Triton kernels (triton_router.py) for {where}, PyTorch ops "
                    f"where they cannot run{', C kernels for fp32 CPU tensors' if choice == 'auto' else ''} {flag}")
    if choice == "c" or not cuda:
        if choice == "fla":
            k = _injected.name if _injected is not None else "none"
            return f"router kernels: {k} (injected) for CPU tensors, PyTorch ops where it cannot run {flag}"
        try:
            cpu_kernels.load()
            c = "fused C kernels for fp32 CPU tensors"
        except cpu_kernels.KernelBuildError:
            c = "fused C kernels cannot be built here: PyTorch ops for fp32 CPU tensors"
        return f"router kernels: {c}, PyTorch ops otherwise {flag}"
    k = _injected if _injected is not None and "cuda" in _injected.devices else None
    if k is None:
        try:
            k = load()
        except FlaUnavailable as e:
            return f"router kernels: PyTorch ops for CUDA tensors ({e}) {flag}"
    return (f"router kernels: {k.name} for CUDA tensors, PyTorch ops where it cannot run (docs/gpu.md)"
            f"{', C kernels for fp32 CPU tensors' if choice == 'auto' else ''} {flag}")


def plan_keeps_x(choice: str) -> bool:
    """Whether routers with this choice route through a kernel here, so the additive modes keep x as a
    running stream (SourcePlan.from_config): ``fla``, or ``auto`` on a machine with CUDA and a kernel."""
    if choice == "fla":
        return True
    if choice != "auto" or not torch.cuda.is_available():
        return False
    return kernel_for("auto", "cuda") is not None


# ---------------------------------------------------------------------------------------- routing
def fallback_reason(values: Sequence[Tensor], out_dtype: Optional[torch.dtype]) -> Optional[str]:
    """Why the kernel cannot route these sources (the PyTorch path does), or None."""
    dtype = values[0].dtype
    if dtype not in SUPPORTED_DTYPES:
        return f"sources in {dtype} (the kernel computes in fp32; float64 keeps the PyTorch path)"
    if any(v.dtype != dtype for v in values):
        return "sources of mixed dtypes (the kernel takes one dtype)"
    if out_dtype is not None and out_dtype != dtype:
        return f"output in {out_dtype}, sources in {dtype} (the kernel's output is in the sources' dtype)"
    if (values[0].shape[-1] * values[0].element_size()) % ALIGN:
        return f"rows of {values[0].shape[-1]} x {values[0].element_size()} bytes, not a multiple of {ALIGN}"
    if any(v.device != values[0].device for v in values):
        return "sources on several devices"
    return None


def _aligned(t: Tensor) -> Tensor:
    src = t
    if not t.is_contiguous():
        t = t.contiguous()
    if t.data_ptr() % ALIGN:
        t = t.clone()
    if t is not src and t.data_ptr() != src.data_ptr():
        record("fla", "forward", [src], [t])
    return t


class _Broadcast(torch.autograd.Function):
    """z [d] -> z in ``dtype`` on every one of ``rows`` tokens [rows, d]; backward sums over tokens in fp32."""

    @staticmethod
    def forward(ctx, z, rows, dtype):
        ctx.z_dtype = z.dtype
        out = z.detach().to(dtype).expand(rows, z.shape[-1]).contiguous()
        record("fla_null", "forward", [z], [out])
        return out

    @staticmethod
    def backward(ctx, grad):
        record("fla_null", "backward", [grad], [])
        return grad.sum(0, dtype=torch.float32).to(ctx.z_dtype), None, None


class _Combine(torch.autograd.Function):
    """out = B + a * r in fp32, rounded once to r's dtype; B = base and/or the sum of ``summed`` (or 0),
    a = gate (or 1). Saves r only when the gate needs its gradient."""

    @staticmethod
    def forward(ctx, r, gate, base, *summed):
        acc = torch.mul(r, gate) if gate is not None else r.to(torch.float32, copy=True)
        record("fla_combine", "forward", [r], [acc])
        if acc.dtype != torch.float32:
            record("fla_combine", "forward", [acc], [acc.float()])
            acc = acc.float()
        if base is not None:
            acc.add_(base)
            record("fla_combine", "forward", [acc, base], [acc])
        for v in summed:
            acc.add_(v)
            record("fla_combine", "forward", [acc, v], [acc])
        ctx.r_dtype = r.dtype
        ctx.base_dtype = None if base is None else base.dtype
        ctx.summed_dtypes = [v.dtype for v in summed]
        keep_r = gate is not None and ctx.needs_input_grad[1]
        ctx.save_for_backward(gate, r if keep_r else None)
        out = acc.to(r.dtype)
        if out.dtype != acc.dtype:
            record("fla_combine", "forward", [acc], [out])
        return out

    @staticmethod
    def backward(ctx, grad):
        gate, r = ctx.saved_tensors
        g32 = grad.float()
        if g32.dtype != grad.dtype:
            record("fla_combine", "backward", [grad], [g32])
        if gate is not None:
            scaled = g32 * gate
            grad_r = scaled.to(ctx.r_dtype)
            record("fla_combine", "backward", [g32], [scaled])
            if grad_r.dtype != scaled.dtype:
                record("fla_combine", "backward", [scaled], [grad_r])
        else:
            grad_r = grad.to(ctx.r_dtype)
            if grad_r.dtype != grad.dtype:
                record("fla_combine", "backward", [grad], [grad_r])
        grad_gate = None
        if r is not None:
            r32 = r.reshape(-1).float()
            if r32.dtype != r.dtype:
                record("fla_combine", "backward", [r], [r32])
            grad_gate = torch.linalg.vecdot(g32.reshape(-1), r32).reshape(gate.shape).to(gate.dtype)
            record("fla_combine", "backward", [g32, r32], [])
        grad_base = None if ctx.base_dtype is None else grad.to(ctx.base_dtype)
        return (grad_r, grad_gate, grad_base, *[grad.to(dt) for dt in ctx.summed_dtypes])


def _record_fused_attnres(residuals: Sequence[Tensor], r: Tensor) -> None:
    """What fla-core 0.6.0's fused_attnres moves per call (fla/ops/attnres/fused.py, checkpoint_level=1, no
    output norm), whichever kernel ran (on CPU the tests' naive_attnres stands in for it). Forward,
    attnres_fwd_kernel: each residual read once (norm, logit and weighted sum from one tile load), o written.
    Backward, attnres_bwd_kernel_dv: do read, every residual read twice (the mix recomputed from the
    residuals, then the dv loop), a fresh dv written per residual (``torch.empty_like(r)``: autograd then adds
    it into the source's gradient, counted by traffic.watch) and dqw [N, D] fp32 written, which
    attnres_bwd_kernel_dqdw reads back to reduce it over the tokens. dv and dqw are fla's own tensors, not
    reachable from here: equal-sized stand-ins (the residuals, a meta tensor) give their sizes."""
    record("fla", "forward", residuals, [r])
    if not r.requires_grad:
        return
    kept = list(residuals)

    def backward_traffic(do: Tensor) -> None:
        dqw = torch.empty(do.shape, dtype=torch.float32, device="meta")
        record("fla", "backward", [do, *kept, *kept], [*kept, dqw])  # attnres_bwd_kernel_dv
        record("fla", "backward", [dqw], [])  # attnres_bwd_kernel_dqdw

    r.register_hook(backward_traffic)


def route(kernel: Kernel, values: Sequence[Tensor], *, query: Tensor, key_norm_weight: Tensor, eps: float,
          null_source: Optional[Tensor] = None, gate: Optional[Tensor] = None, base: Optional[Tensor] = None,
          base_sums: bool = False, return_weights: bool = False) -> Tuple[Tensor, Optional[Tensor]]:
    """``B + gate * r`` over ``values`` ([.., d] each, one dtype; see fallback_reason) with ``kernel``
    (B: ``base``; with ``base=None, base_sums=True`` the sum of the values; else 0), and alpha [M, T]
    fp32 (null source last) when ``return_weights`` (else None). Differentiable in every input."""
    shape = values[0].shape
    d = shape[-1]
    rows = values[0].numel() // d
    dtype = values[0].dtype
    residuals = [_aligned(v.reshape(rows, d)) for v in values]
    if null_source is not None:
        residuals.append(_Broadcast.apply(null_source, rows, dtype))
    res = kernel.fn(query, residuals, key_norm_weight, None, rms_eps=float(eps), scale=1.0,
                    return_weights=return_weights)
    r, alpha = res if return_weights else (res, None)
    if traffic.active():
        _record_fused_attnres(residuals, r)
    unit = base is None and base_sums
    flat_base = None if base is None else base.reshape(rows, d)
    if gate is None and not unit:
        out = r if flat_base is None else torch.add(flat_base, r)
        if flat_base is not None:
            record("fla_combine", "forward", [flat_base, r], [out])
    else:
        out = _Combine.apply(r, gate, flat_base, *([v.reshape(rows, d) for v in values] if unit else []))
    if alpha is not None:
        alpha = alpha.reshape(len(residuals), rows).detach()
    return out.view(shape), alpha


def route_router(router, sources, *, base: Optional[Tensor], gate: Optional[Tensor], base_sums: bool,
                 out_dtype: Optional[torch.dtype], return_weights: bool):
    """DepthRouter.forward's entry (``sources``: router.Source tuples): (out, alpha or None), or None when
    this call falls back to the PyTorch path (no kernel for the device, fallback_reason, or sources made
    with different key-norm eps - the kernel takes one; the null source's key uses the router's eps)."""
    values = [s.value for s in sources]
    kern = kernel_for(router.kernels, values[0].device.type)
    if kern is None or fallback_reason(values, out_dtype) is not None:
        return None
    eps = {float(s.eps) for s in sources}
    if len(eps) > 1 or (router.null_source is not None and eps != {router.eps}):
        return None
    return route(kern, values, query=router.query, key_norm_weight=router.key_norm_weight, eps=eps.pop(),
                 null_source=router.null_source, gate=gate, base=base, base_sums=base_sums,
                 return_weights=return_weights)
