"""DepthRouter: the softmax-over-depth router of Delta Attention Residuals (docs/design.md section 1).

Plain PyTorch, no Megatron import. For sources s_1..s_N (each [s, b, d]) and router parameters
w (query), g (key RMSNorm weight), optional z (null source) and a (scalar gate):

    logit_i = (s_i . q) * inv_rms_i       q = w * g,  inv_rms_i = rsqrt(mean_d(s_i^2) + eps)
    alpha   = softmax_i(logit)            per token
    r       = sum_i alpha_i * s_i         (values are the UNnormalised sources)

Cost model (CPU and GPU alike, the router is memory-bound): a source is read by many routers
(h0 by every sublayer), so everything that depends only on (source, router query) is done ONCE per
source, for all the routers that will read it, when the source is created (:func:`make_source`):
one GEMM [tokens, d] x [d, J] gives the J normalised logit columns, and its backward is one GEMM
for the source gradient and one for the J query gradients (``_ProjectSource``). The per-router
work (``_RouteFunction``) is then only the weighted sum (and, in backward, one dot product and one
scaled copy of the output gradient per source). A source with ONE reader (J = 1) skips that separate
pass: its router projects it inside its own pass, which reads the source anyway (a "local" source).
The additive modes fuse the residual: ``u = x + gated(r)`` is produced by the same pass (``base=x``).

Memory: sources are never stacked. Saved for backward: references to the source values (alive
anyway), the softmax weights [M, tokens] and the logits [J, tokens] (fp32, small), the router
vectors. All router math runs in fp32 (float64 for float64 inputs, for gradcheck) with autocast
disabled; the result is cast back once to the activation dtype.
"""
from __future__ import annotations

from contextlib import nullcontext
from typing import Mapping, NamedTuple, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

from megatron_delta.core import cpu_kernels, traffic
from megatron_delta.core.modes import KERNEL_CHOICES  # --delta-router-kernels' values (modes.py says which)
from megatron_delta.core.traffic import record

__all__ = ["KERNEL_CHOICES", "check_kernels", "check_kernel_placement",
           "Source", "GradSink", "PendingSum", "make_source", "DepthRouter", "route"]



def check_kernels(choice: str, *, on_cuda: bool = False, activation_dtype: Optional[str] = None) -> None:
    """Start-up check of `--delta-router-kernels`: `c` must build here, `fla` must import (fla_router.check),
    `triton` must import and find a CUDA device or the interpreter (triton_router.check) (raises ValueError
    if not). ``c`` must also be able to run the run's tensors: fp32 on CPU (``on_cuda``: the run trains on CUDA
    devices; ``activation_dtype``: 'bf16' or 'fp16' where --bf16 / --fp16 make the sources that), where the C
    kernels would otherwise leave every call to PyTorch ops without a word."""
    if choice not in KERNEL_CHOICES:
        raise ValueError(f"--delta-router-kernels {choice!r} is not one of {', '.join(KERNEL_CHOICES)}")
    if choice == "triton":
        from megatron_delta.core import triton_router

        triton_router.check(choice)
    if choice == "fla":
        from megatron_delta.core import fla_router

        fla_router.check(choice)
    if choice == "c":
        try:
            cpu_kernels.load()
        except cpu_kernels.KernelBuildError as e:
            raise ValueError(f"--delta-router-kernels c: the fused CPU kernels cannot be built: {e}. "
                             f"Install a C compiler or use --delta-router-kernels torch") from None
    check_kernel_placement(choice, on_cuda=on_cuda, activation_dtype=activation_dtype)


def check_kernel_placement(choice: str, *, on_cuda: bool = False, activation_dtype: Optional[str] = None) -> None:
    """`--delta-router-kernels c` where the C kernels cannot take the run's tensors (CUDA ones, or bf16 / fp16 ones):
    a ValueError naming the flag and what to use, instead of every call going to PyTorch ops without a word."""
    if choice != "c":
        return
    if on_cuda:
        raise ValueError("--delta-router-kernels c runs the fused C kernels on CPU tensors, and this run trains on "
                         "CUDA devices: use --delta-router-kernels auto (the Triton kernels on CUDA) or triton")
    if activation_dtype not in (None, "fp32"):
        raise ValueError(f"--delta-router-kernels c takes fp32 tensors, and --{activation_dtype} makes the sources "
                         f"{activation_dtype}: drop --{activation_dtype}, or use --delta-router-kernels auto or "
                         f"torch (PyTorch ops)")


class GradSink:
    """The gradient w.r.t. one projected source that its readers' routers accumulate in place.

    A router's backward adds ``w_i * grad`` here (one fused pass) instead of returning a fresh
    tensor that autograd would then add to the source's gradient (two more passes). The source's
    projection (_ProjectSource) consumes the sum in its backward, which autograd runs only after
    every router that read the source (they consume its logit columns), and returns it as part of
    the source's gradient.
    """

    __slots__ = ("grad",)

    def __init__(self) -> None:
        self.grad: Optional[Tensor] = None

    def add(self, grad: Tensor, weight: Tensor, dtype: torch.dtype) -> None:
        if self.grad is None:
            prod = torch.mul(grad, weight)
            self.grad = _as(prod, dtype)
            record("route", "backward", [grad], [prod])
            if self.grad is not prod:
                record("route", "backward", [prod], [self.grad])
        else:
            self.grad.addcmul_(grad, weight)
            record("route", "backward", [self.grad, grad], [self.grad])


def seed_sinks(sinks: Sequence, grad: Tensor) -> list:
    """The backward of x handed out as the sum of the sources (group_router._FinalSum,
    triton_group_kernels._SeededSum): x's gradient is each source's. A source with a sink (a group router's or a
    per-router kernel's) gets it by reference as the sink's seed, no pass: the sink's first writer adds it as it
    writes, so that the source keeps one autograd reader and autograd adds nothing. Where a writer reached the sink
    first (not in one backward of this graph) the sink adds it itself (``add_late``, its own pass). Returns each
    source's gradient for autograd: None where it has a sink, else x's gradient as is."""
    flat = grad.reshape(-1, grad.shape[-1])  # [T, d], as the kernels write the sinks
    if not flat.is_contiguous():  # the kernels read the seed as rows
        flat = flat.contiguous()
        record("x_sum", "backward", [grad], [flat])
    out = []
    for sink in sinks:
        if sink is None:
            out.append(grad)
            continue
        if sink.grad is None and sink.seed is None:
            sink.seed = flat
        else:
            sink.add_late(flat, "x_sum")
        out.append(None)
    return out


class PendingSum:
    """A source that is the sum ``base + addend`` (a partial sum P + v, p + f(u)), formed by the first of: the
    one router that reads it, in its kernel's pass (triton_router: it reads both parts, writes the sum once
    and routes it), or :meth:`form` (``base + addend``, the PyTorch add the mode would make)."""

    __slots__ = ("base", "addend", "value")

    def __init__(self, base: Tensor, addend: Tensor) -> None:
        self.base, self.addend = base, addend
        self.value: Optional[Tensor] = None

    def form(self) -> Tensor:
        if self.value is None:
            self.value = self.base + self.addend
            if traffic.active():  # the mode's partial sum as its own pass (formed in a kernel, it is that call's)
                record("partial_sum", "forward", [self.base, self.addend], [self.value])
                traffic.watch(self.value)
        return self.value


class Source(NamedTuple):
    """One routing source: its value, its 1/rms per token and its logit columns per reader.

    A router absent from ``logits`` projects the source itself inside its route (a "local" source:
    the right choice for a source with ONE reader, see _RouteFunction); SourceBuffer makes those with
    ``inv_rms=None``, ``logits={}``, ``sink=None``. With ``pending`` the source is ``pending.base +
    pending.addend``, not formed yet (``value`` is the base); its reader forms it (DepthRouter.forward)."""

    value: Tensor  # [s, b, d], activation dtype
    inv_rms: Optional[Tensor]  # [s, b], fp32, detached (the differentiable path goes through `logits`)
    logits: Mapping  # DepthRouter -> [s*b] fp32 logit (value . q) * inv_rms, differentiable
    eps: float
    sink: Optional[GradSink]  # where the readers' routers accumulate their gradient w.r.t. value
    pending: Optional[PendingSum] = None


_PROMOTE_TO_FP32 = (torch.float32, torch.bfloat16, torch.float16)  # promote_types(fp32, any of them) is fp32


def _compute_dtype(*dtypes: torch.dtype) -> torch.dtype:
    out = torch.float32
    for dt in dtypes:
        if dt is not None and dt not in _PROMOTE_TO_FP32:  # the common dtypes skip an aten call per source
            out = torch.promote_types(out, dt)
    return out


def _as(t: Tensor, dtype: torch.dtype) -> Tensor:
    return t if t.dtype == dtype else t.to(dtype)


def _inv_rms(value: Tensor, eps: float, cdt: torch.dtype) -> Tensor:
    # vector_norm accumulates in `cdt` without materialising an fp32 copy of a bf16 value.
    norm = torch.linalg.vector_norm(value, dim=-1, dtype=cdt)
    return norm.square_().div_(value.shape[-1]).add_(eps).rsqrt_()


def _rows(t: Tensor, index: Sequence[int]) -> Tensor:
    """``t[index]`` along dim 0 with no index tensor made on the host: on a GPU, indexing with a Python list
    copies the list to the device and waits for the copy (a synchronisation, and an illegal op under CUDA graph
    capture). ``t`` itself where the index is every row in order, a slice where it is a run, else one stack."""
    index = list(index)
    if not index:
        return t[:0]
    if index == list(range(index[0], index[-1] + 1)):  # a run of rows
        return t if len(index) == t.shape[0] else t[index[0]:index[-1] + 1]
    return torch.stack([t[k] for k in index])


def _projection_grad_coeffs(dz: Tensor, z: Tensor, inv: Tensor, d: int) -> Tuple[Tensor, Tensor]:
    """The backward of z_k = (v . q_k) * inv, inv = rsqrt(mean(v^2) + eps), for logit gradients dz
    [J, T]: dv = C Q + e v with C = dz * inv [J, T] and e = -(sum_k dz_k z_k) inv^2 / d [T]."""
    return dz * inv, (dz * z).sum(0).mul_(inv.square()).mul_(-1.0 / d)


class _ProjectSource(torch.autograd.Function):
    """inv = rsqrt(mean(v^2) + eps) and z_k = (v . q_k) * inv for J queries, in ONE pass over v.

    Inputs: value [.., d], eps, the GradSink of the routers reading it, then J queries [d].
    Outputs: inv [T] (non-differentiable) and the J logit columns z_k [T] (T = tokens). Backward,
    with c_k = dz_k * inv:

        dv = sink + C Q - (sum_k dz_k z_k) inv^2 v / d  (in place on the sink: one GEMM + one pass)
        dq_k = c_k . v                                   (one GEMM for all k)
    """

    @staticmethod
    def forward(ctx, value, eps, sink, *queries):
        ctx.set_materialize_grads(False)
        d = value.shape[-1]
        rows = value.numel() // d
        cdt = _compute_dtype(value.dtype, *(q.dtype for q in queries))
        vf = _as(value.reshape(rows, d), cdt)
        inv = _inv_rms(vf, eps, cdt)
        zt = torch.stack([_as(q, cdt) for q in queries]) @ vf.t() if len(queries) else vf.new_empty(0, rows)
        zt.mul_(inv)  # [J, T]
        if traffic.active():
            _record_cast("project", "forward", value, vf)
            record("project", "forward", [vf], [inv])  # the norm
            record("project", "forward", [vf], [zt])  # the GEMM
        ctx.cdt = cdt
        ctx.sink = sink
        ctx.save_for_backward(value, inv, zt, *queries)
        ctx.mark_non_differentiable(inv)
        return (inv, *zt.unbind(0))

    @staticmethod
    def backward(ctx, _grad_inv, *grad_z):
        value, inv, zt, *queries = ctx.saved_tensors
        acc, ctx.sink.grad = ctx.sink.grad, None  # the routers' share of dv (see GradSink)
        used = [k for k, g in enumerate(grad_z) if g is not None]
        grad_q = [None] * len(queries)
        if not used:
            return (None if acc is None else acc.view(value.shape), None, None, *grad_q)
        cdt = ctx.cdt
        d = value.shape[-1]
        rows = inv.numel()
        dz = torch.stack([_as(grad_z[k], cdt) for k in used])  # [J', T]
        c, e = _projection_grad_coeffs(dz, _rows(zt, used), inv, d)  # [J', T], [T]
        vf = _as(value.reshape(rows, d), cdt)
        _record_cast("project", "backward", value, vf)
        q = torch.stack([_as(queries[k], cdt) for k in used])  # [J', d]
        grad_value = None
        if ctx.needs_input_grad[0]:
            if acc is None or acc.dtype != cdt:
                gv = torch.mm(c.t(), q)
                gv.addcmul_(vf, e.unsqueeze(1))
                record("project", "backward", [], [gv])
                record("project", "backward", [gv, vf], [gv])
                if acc is None:
                    cast = _as(gv, value.dtype)
                    _record_cast("project", "backward", gv, cast)
                    gv = cast
                else:
                    record("project", "backward", [acc, gv], [acc])
                    gv = acc.add_(gv)
            else:
                gv = acc.addmm_(c.t(), q).addcmul_(vf, e.unsqueeze(1))
                record("project", "backward", [acc], [acc])
                record("project", "backward", [acc, vf], [acc])
            grad_value = gv.view(value.shape)
        if any(ctx.needs_input_grad[3:]):
            dq = torch.mm(c, vf)
            record("project", "backward", [vf], [dq])
            for row, k in zip(dq.unbind(0), used):
                grad_q[k] = _as(row, queries[k].dtype)
        return (grad_value, None, None, *grad_q)


def make_source(value: Tensor, eps: float, readers: Sequence["DepthRouter"] = (),
                queries: Optional[Mapping] = None) -> Source:
    """Wrap a [s, b, d] tensor as a routing source for the routers ``readers`` (in any order).

    Computes 1/rms per token and the logit column of every reader in one pass over ``value``
    (see _ProjectSource); a router that is not among ``readers`` projects the source itself when
    it reads it (correct, one extra pass). The logits are differentiable w.r.t. ``value`` and the
    readers' parameters; ``inv_rms`` is a detached copy for diagnostics. ``queries`` (router ->
    its ``query_vector()``) lets many sources share one q tensor per router: each projection saves
    its queries for backward, and shared ones are saved once, not once per source.
    """
    readers = list(dict.fromkeys(readers))  # unique, order kept
    queries = queries if queries is not None else {}
    outside = any(r.outside_fp8 for r in readers)
    with _no_autocast(value.device.type), _outside_fp8(outside):
        if not readers:
            with torch.no_grad():
                inv = _inv_rms(value.reshape(-1, value.shape[-1]), eps, _compute_dtype(value.dtype))
            record("project", "forward", [value], [inv])
            return Source(value, inv.view(value.shape[:-1]), {}, eps, None)
        qs = [queries[r] if r in queries else r.query_vector() for r in readers]
        sink = GradSink()
        inv, *cols = _ProjectSource.apply(value, eps, sink, *qs)
    return Source(value, inv.view(value.shape[:-1]), dict(zip(readers, cols)), eps, sink)


def _record_cast(kernel: str, phase: str, src: Tensor, dst: Tensor) -> None:
    """A dtype conversion (``_as``) reads ``src`` and writes ``dst``; nothing where the dtypes agree (``_as``
    returned its input, or a view of it)."""
    if dst.dtype != src.dtype and traffic.active():
        record(kernel, phase, [src], [dst])


def _local_pairs(proj: Tensor, local: Sequence[int], n: int) -> list:
    """Per source: (1/rms, logit) rows of ``proj`` [2 * len(local), T] for a local source, else None."""
    pairs = [None] * n
    for k, i in enumerate(local):
        pairs[i] = (proj[2 * k], proj[2 * k + 1])
    return pairs


def _value_weights(w: Tensor, n: int, unit: bool) -> Tensor:
    """The weight of each value in the output: w = gate * alpha, plus 1 for the n real sources when the
    base is their sum (the null source, row n, is not part of the residual stream)."""
    if not unit:
        return w
    out = w.clone()
    out[:n] += 1.0
    return out


def _rebuild_source(flat: Sequence[Tensor], r: int, w: Tensor, null_value: Optional[Tensor]) -> Tensor:
    """Source r from the router's output u (held at ``flat[r]``) when base = sum of the sources:
    v_r = (u - sum_{i != r} (1 + w_i) v_i - w_null z) / (1 + w_r), w [M, T] (PyTorch ops; the C
    kernel does the same per token)."""
    out = flat[r].clone()
    record("route", "backward", [flat[r]], [out])
    for i, vi in enumerate(flat):
        if i != r:
            out.addcmul_(vi, (1.0 + w[i]).unsqueeze(1), value=-1.0)
            record("route", "backward", [out, vi], [out])
    if null_value is not None:
        out.addr_(w[len(flat)], null_value.to(out.dtype), alpha=-1.0)
        record("route", "backward", [out], [out])
    record("route", "backward", [out], [out])
    return out.div_((1.0 + w[r]).unsqueeze(1))


class _RouteFunction(torch.autograd.Function):
    """out = base + a * sum_i softmax_i(z_i) v_i  (+ the null source), without stacking.

    Inputs: n (number of real sources), out_dtype, lib (the fused CPU kernels of cpu_kernels.py, or
    None for PyTorch ops), sinks (the GradSink of each source: its gradient goes there, not to the
    value input), base_sums (the caller's promise that base == sum of the values in exact arithmetic,
    see below; with base None: the base IS the sum of the values, formed in this pass, out = sum_i
    (1 + a alpha_i) v_i + ..., the residual stream of the additive modes kept as its sources), eps,
    base ([.., d] or None), gate ([1] or None), null_logit (0-dim or None),
    null_value ([d] or None), query (q = w * g, [d]; needed for local sources), then n values [.., d]
    and their n logit columns z_i [T]. A column given as None marks a LOCAL source: one that only this
    router reads (the partial block sum of delta_block, attnres' partial p): it is projected here, in
    the same pass that reads it for the weighted sum, and its whole gradient (weighted sum's and
    projection's shares) is returned as the value's gradient - no _ProjectSource, no sink. Outputs:
    out (``out_dtype``) and alpha [M, T] (non-differentiable; M = n + null, the null source last).

    Saved for backward: gate, null tensors, query, alpha [M, T], the local sources' 1/rms and logits
    [2, T] each (compute dtype) and REFERENCES to the values - except, on the C path with ``base_sums``
    (delta_block: x = h0 + sum Delta + P), the last local source (the partial block sum, which nothing
    else keeps): its backward rebuilds it per token from the output u, which the next norm saves anyway,
    P = (u - sum_{i != P} (1 + w_i) v_i - w_null z) / (1 + w_P), w = gate * alpha. Equal in exact
    arithmetic; in fp32 the rebuilt P differs by the round-off of x (about 1e-7 |x|). Only where
    1 + w_P >= 1/2 (no gate, or gate >= -1/2), so the division cannot amplify the round-off more than
    twice; bf16 outputs would round u far more, so the PyTorch path always keeps P. Every [T, d]
    tensor is touched one source at a time: the transient memory is O(1) tensors of [T, d] (an fp32
    copy of one bf16 source at a time), never O(N). With ``lib`` and fp32 CPU tensors each direction is one C loop over
    the tokens (logits of the local sources, softmax over depth, weighted sum; dot products, softmax derivative,
    every source's gradient); otherwise PyTorch ops compute the same function.
    """

    @staticmethod
    def forward(ctx, n, out_dtype, lib, sinks, base_sums, eps, base, gate, null_logit, null_value, query,
                *tensors):
        values, cols = tensors[:n], tensors[n:]
        v0 = values[0]
        shape = v0.shape
        d = shape[-1]
        rows = v0.numel() // d
        local = [i for i in range(n) if cols[i] is None]
        cdt = _compute_dtype(*(v.dtype for v in values), *(c.dtype for c in cols if c is not None),
                             None if query is None or not local else query.dtype)
        has_null = null_logit is not None
        m = n + int(has_null)
        flat = [v.reshape(rows, d) for v in values]
        flat_base = None if base is None else base.reshape(rows, d)
        unit = base_sums and base is None  # out = sum_i (1 + w_i) v_i: the base is the sum of the values
        out_dtype = out_dtype or v0.dtype
        if not (cdt == out_dtype == torch.float32 and cpu_kernels.eligible(
                *flat, flat_base, null_value, *cols, query if local else None)):
            lib = None  # the C kernels take fp32 CPU tensors only

        proj = torch.empty(2 * len(local), rows, dtype=cdt, device=v0.device)  # local (inv, z) rows
        pairs = _local_pairs(proj, local, n)
        recover = None
        if lib is not None:
            gate_f = 1.0 if gate is None else float(gate)
            if base_sums and local and gate_f >= -0.5:
                recover = local[-1]
            alpha = torch.empty(m, rows, dtype=cdt, device=v0.device)
            out = cpu_kernels.route_forward(lib, flat, cols, query, eps, null_logit, null_value, gate_f,
                                            flat_base, alpha, pairs, v0.new_empty(rows, d), unit)
            # one pass over the token rows: each source (a local one's norm and logit included) and the
            # base read once, u written once
            record("route", "forward", [*flat, flat_base, null_value, *cols, alpha], [out, alpha, proj])
        else:
            logits = torch.empty(m, rows, dtype=cdt, device=v0.device)
            for i, (col, row) in enumerate(zip(cols, logits.unbind(0))):
                if col is None:  # local: 1/rms and (v . q) * inv in compute dtype, as _ProjectSource
                    vf = _as(flat[i], cdt)
                    inv, z = pairs[i]
                    inv.copy_(_inv_rms(vf, eps, cdt))
                    torch.mv(vf, _as(query, cdt), out=z).mul_(inv)
                    if traffic.active():
                        _record_cast("route", "forward", flat[i], vf)
                        record("route", "forward", [vf], [inv])
                        record("route", "forward", [vf], [z])
                    col = z
                row.copy_(col)
            if has_null:
                logits[n].copy_(null_logit)
            alpha = torch.softmax(logits, dim=0)
            w = alpha if gate is None else alpha * _as(gate, cdt)
            # One fresh compute-dtype accumulator; mixed-dtype ops upcast on the fly.
            wcols = _value_weights(w, n, unit).unsqueeze(2).unbind(0)
            if base is None:
                out = torch.mul(flat[0], wcols[0])
                record("route", "forward", [flat[0]], [out])
            else:
                base_c = _as(flat_base, cdt)
                _record_cast("route", "forward", flat_base, base_c)
                out = torch.addcmul(base_c, flat[0], wcols[0])
                record("route", "forward", [base_c, flat[0]], [out])
            out_c = _as(out, cdt)
            _record_cast("route", "forward", out, out_c)
            out = out_c
            for i in range(1, n):
                out.addcmul_(flat[i], wcols[i])
                record("route", "forward", [out, flat[i]], [out])
            if has_null:
                out.addr_(w[n], _as(null_value, cdt))
                record("route", "forward", [out], [out])
        result = _as(out, out_dtype)
        _record_cast("route", "forward", out, result)
        result = result.view(shape)

        ctx.n = n
        ctx.cdt = cdt
        ctx.lib = lib
        ctx.sinks = sinks
        ctx.local = local
        ctx.base_dtype = None if base is None else base.dtype
        ctx.recover = recover
        ctx.unit = unit
        kept = list(values)
        if recover is not None:
            kept[recover] = result  # the backward rebuilds that source from u (see above)
        ctx.save_for_backward(gate, null_logit, null_value, query if local else None, alpha, proj, *kept)
        ctx.mark_non_differentiable(alpha)
        return result, alpha

    @staticmethod
    def backward(ctx, grad_out, _grad_alpha):
        n = ctx.n
        cdt = ctx.cdt
        local = ctx.local
        gate, null_logit, null_value, query, alpha, proj, *values = ctx.saved_tensors
        m, rows = alpha.shape
        d = grad_out.shape[-1]
        has_null = null_logit is not None
        # needs: (lib, sinks, base_sums, eps, base, gate, null_logit, null_value, query, *values, *cols)
        needs = ctx.needs_input_grad[2:]
        nv = 9  # index of the first value in `needs`
        flat = [v.reshape(rows, d) for v in values]
        pairs = _local_pairs(proj, local, n)
        g = None if gate is None else _as(gate, cdt)
        w = alpha if g is None else alpha * g

        grad = _as(grad_out.reshape(rows, d), cdt)
        _record_cast("route", "backward", grad_out, grad)
        used = [i for i in range(n) if needs[nv + i] and i not in local]  # sources with a sink
        grad_values = [None] * n
        c = [None] * n  # dlogit * inv of each local source (its query gradient is c . v)
        dq = None  # the local sources' share of the query's gradient, from the C kernel
        dw = torch.empty(m, rows, dtype=cdt, device=alpha.device)  # dL/dw_i per token: <grad, v_i>
        lib = ctx.lib
        if lib is not None and not (cpu_kernels.eligible(grad) and all(
                ctx.sinks[i].grad is None or (cpu_kernels.eligible(ctx.sinks[i].grad)
                                              and ctx.sinks[i].grad.shape == grad.shape) for i in used)):
            lib = None
        recover = ctx.recover
        if recover is not None and lib is None:  # this grad or a sink does not suit the kernel
            flat[recover], recover = _rebuild_source(flat, recover, w, null_value), None
        if lib is not None:
            dlogit = torch.empty_like(dw)
            targets = [(None, False)] * n
            for i in used:  # the first reader to reach a sink creates it (fresh: assigned, not added)
                fresh = ctx.sinks[i].grad is None
                if fresh:
                    ctx.sinks[i].grad = torch.empty_like(grad)
                targets[i] = (ctx.sinks[i].grad, fresh)
            for i in local:
                if needs[nv + i]:
                    grad_values[i] = torch.empty_like(grad)
                    targets[i] = (grad_values[i], True)
            if local and needs[8]:
                dq = grad.new_empty(d)
            cpu_kernels.route_backward(lib, grad, flat, alpha, 1.0 if g is None else float(g), null_value,
                                       query, pairs, targets, dw, dlogit, dq, recover, ctx.unit)
            # one pass: grad and each source (or u, for the rebuilt one) read once; each gradient target
            # written, and read first where it accumulates (not fresh)
            record("route", "backward", [grad, *flat, alpha, proj, *(t for t, fresh in targets if not fresh)],
                   [t for t, _ in targets] + [dw, dlogit])
        else:
            # each source's a_i * grad goes to its sink (see GradSink)
            prod = torch.empty_like(grad)  # one product buffer, reused (and cache-warm) for every source
            for vf, dwi in zip(flat, dw[:n].unbind(0)):
                torch.sum(torch.mul(grad, vf, out=prod), dim=-1, out=dwi)
                record("route", "backward", [grad, vf], [prod])
                record("route", "backward", [prod], [dwi])
            if has_null:
                torch.mv(grad, _as(null_value, cdt), out=dw[n])
                record("route", "backward", [grad], [])
            dalpha = dw if g is None else dw * g
            dlogit = alpha * (dalpha - (alpha * dalpha).sum(0, keepdim=True))
            wcols = _value_weights(w, n, ctx.unit).unsqueeze(2).unbind(0)
            for i in used:
                ctx.sinks[i].add(grad, wcols[i], values[i].dtype)
            for i in local:  # the weighted sum's share w_i grad, plus the projection's c q + e v
                inv, z = pairs[i]
                ci, e = _projection_grad_coeffs(dlogit[i:i + 1], z.unsqueeze(0), inv, d)
                c[i] = ci[0]
                if needs[nv + i]:
                    gv = torch.mul(grad, wcols[i])
                    vf = _as(flat[i], cdt)
                    gv.addr_(c[i], _as(query, cdt)).addcmul_(vf, e.unsqueeze(1))
                    grad_values[i] = _as(gv, values[i].dtype)
                    if traffic.active():
                        record("route", "backward", [grad], [gv])
                        record("route", "backward", [gv], [gv])  # + c q^T
                        _record_cast("route", "backward", flat[i], vf)
                        record("route", "backward", [gv, vf], [gv])  # + e v
                        _record_cast("route", "backward", gv, grad_values[i])

        grad_gate = None
        if g is not None and needs[5]:
            grad_gate = (alpha * dw).sum().reshape(gate.shape).to(gate.dtype)
        grad_query = None
        if local and needs[8]:
            if dq is None:
                dq = 0
                for i in local:
                    vf = _as(flat[i], cdt)
                    dq = dq + torch.mv(vf.t(), c[i])
                    _record_cast("route", "backward", flat[i], vf)
                    record("route", "backward", [vf], [])
            grad_query = _as(dq, query.dtype)
        grad_cols = [dlogit[i] if i not in local and needs[nv + n + i] else None for i in range(n)]
        grad_values = [None if gv is None else gv.view(values[i].shape) for i, gv in enumerate(grad_values)]
        grad_base = None
        if ctx.base_dtype is not None and needs[4]:
            grad_base = _as(grad_out, ctx.base_dtype)
            _record_cast("route", "backward", grad_out, grad_base)
        grad_null_logit = grad_null_value = None
        if has_null:
            if needs[6]:
                grad_null_logit = dlogit[n].sum().to(null_logit.dtype)
            if needs[7]:
                grad_null_value = torch.mv(grad.t(), w[n]).to(null_value.dtype)
                record("route", "backward", [grad], [])
        return (None, None, None, None, None, None, grad_base, grad_gate, grad_null_logit, grad_null_value, grad_query,
                *grad_values, *grad_cols)


def route(
    values: Sequence[Tensor],
    logits: Sequence[Optional[Tensor]],
    sinks: Sequence[Optional[GradSink]],
    *,
    eps: float = 1e-6,
    query: Optional[Tensor] = None,
    base: Optional[Tensor] = None,
    gate: Optional[Tensor] = None,
    null_logit: Optional[Tensor] = None,
    null_value: Optional[Tensor] = None,
    out_dtype: Optional[torch.dtype] = None,
    kernels: str = "auto",
    base_sums: bool = False,
) -> Tuple[Tensor, Tensor]:
    """Functional router over >= 1 sources given their logit columns [T] and gradient sinks (see
    make_source; a value's gradient from here reaches it through its sink's projection). A logit
    given as None (sink None) marks a local source, projected here with ``query`` and ``eps``; its
    gradient is returned to its value directly.
    Returns (out [s, b, d] = base + gate * r, in ``out_dtype`` (default: the first value's dtype),
    alpha [M, s*b] with M = N (+1 for the null source, last)). ``kernels``: auto / c / torch, see
    cpu_kernels.py (the C kernels apply to fp32 CPU tensors only). ``base_sums``: the caller states
    that ``base`` equals the sum of ``values`` in exact arithmetic (delta_block's sources sum to x),
    which lets the C path keep the last local source out of memory (see _RouteFunction); with
    ``base=None`` the base is that sum, formed in the same pass: out = sum_i (1 + gate alpha_i) v_i
    (+ the null source's share), i.e. x + gate * r with x never materialised."""
    n = len(values)
    if n == 0 or len(logits) != n or len(sinks) != n:
        raise ValueError("route() needs at least one source, and one logit column and sink per source")
    if query is None and any(col is None for col in logits):
        raise ValueError("route(): sources without a logit column are projected here and need query=")
    lib = cpu_kernels.library(kernels) if values[0].device.type == "cpu" else None
    return _RouteFunction.apply(n, out_dtype, lib, list(sinks), bool(base_sums), float(eps), base, gate, null_logit,
                                null_value, query, *values, *logits)


def _no_autocast(device_type: str):
    """torch.autocast switched OFF around the routers' fp32 math; no context at all where it is off already
    (Megatron's bf16 training runs without it): one fewer context per router call for the host to enter."""
    if not torch.is_autocast_enabled(device_type):
        return nullcontext()
    return torch.autocast(device_type=device_type, enabled=False)


def _outside_fp8(enabled: bool):
    """A context that switches Transformer Engine's FP8 autocast OFF (router math stays fp32 under
    FP8 training); a no-op unless ``enabled``. TE is imported only then (never on CPU machines).
    Nested ``enabled=False`` does not trigger TE's amax reduction (only the outermost enabled exit does)."""
    if not enabled:
        return nullcontext()
    import transformer_engine.pytorch as te

    autocast = getattr(te, "autocast", None) or te.fp8_autocast  # TE >= 2.8 renamed fp8_autocast
    return autocast(enabled=False)


def _mark_router_param(p: torch.nn.Parameter, sequence_parallel: bool) -> None:
    # Megatron's finalize-grads step all-reduces, over the TP group, the grads of parameters marked
    # `sequence_parallel` (as for LayerNorm weights); the router is per token, so under SP each TP
    # rank only sees its sequence shard and its grads are partial sums.
    p.sequence_parallel = sequence_parallel
    p.tensor_model_parallel = False
    p.partition_dim = -1
    p.partition_stride = 1
    p.is_delta_router = True


class DepthRouter(torch.nn.Module):
    """The router of one receiving sublayer (or the final router of the replacement modes).

    Parameters (fp32, initialised deterministically without consuming random numbers):
    ``query`` (zeros [d]), ``key_norm_weight`` (ones [d]), optionally ``null_source`` (zeros [d])
    and ``gate`` (zeros [1]).
    """

    def __init__(
        self,
        hidden_size: int,
        *,
        null_source: bool,
        gate: bool,
        eps: float,
        sequence_parallel: bool = False,
        kernels: str = "auto",
    ) -> None:
        super().__init__()
        if kernels not in KERNEL_CHOICES:
            raise ValueError(f"DepthRouter: kernels={kernels!r} is not one of {', '.join(KERNEL_CHOICES)}")
        self.kernels = kernels  # C kernels for fp32 CPU tensors (cpu_kernels.py) unless "torch"; GPU: Triton / fla
        self.hidden_size = int(hidden_size)
        self.eps = float(eps)
        self.sequence_parallel = bool(sequence_parallel)
        self.outside_fp8 = False  # set by build_router when config.fp8: run outside TE's FP8 autocast
        self.query = torch.nn.Parameter(torch.zeros(hidden_size, dtype=torch.float32))
        self.key_norm_weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=torch.float32))
        if null_source:
            self.null_source = torch.nn.Parameter(torch.zeros(hidden_size, dtype=torch.float32))
        else:
            self.register_parameter("null_source", None)
        if gate:
            self.gate = torch.nn.Parameter(torch.zeros(1, dtype=torch.float32))
        else:
            self.register_parameter("gate", None)
        for p in self.parameters():
            _mark_router_param(p, self.sequence_parallel)

    @property
    def has_null_source(self) -> bool:
        return self.null_source is not None

    @property
    def has_gate(self) -> bool:
        return self.gate is not None

    def extra_repr(self) -> str:
        return (
            f"{self.hidden_size}, null_source={self.has_null_source}, gate={self.has_gate}, "
            f"eps={self.eps}, sequence_parallel={self.sequence_parallel}, kernels={self.kernels}"
        )

    def query_vector(self) -> Tensor:
        """q = w * g: the logit of a source is (s . q) * inv_rms(s). In fp32 (at least) even where
        Float16Module made the parameters bf16 (--bf16): the routers' math is fp32 (design.md 2.5)."""
        cdt = _compute_dtype(self.query.dtype)
        return _as(self.query, cdt) * _as(self.key_norm_weight, cdt)

    def _null(self, q: Tensor) -> Tuple[Tensor, Tensor]:
        z = _as(self.null_source, q.dtype)  # fp32 (query_vector) even when the parameter is bf16
        inv = torch.rsqrt(z.pow(2).mean() + self.eps)
        return torch.dot(z, q) * inv, z

    def _logit(self, src: Source) -> Tuple[Optional[Tensor], Optional[GradSink]]:
        col = src.logits.get(self)
        if col is not None:
            return col, src.sink
        return None, None  # a source made without this router among its readers: route() projects it

    def forward(
        self,
        sources: Sequence[Source],
        return_weights: bool = False,
        *,
        like: Optional[Tensor] = None,
        apply_gate: bool = False,
        base: Optional[Tensor] = None,
        base_sums: bool = False,
    ) -> Union[Tensor, Tuple[Tensor, Tensor]]:
        """Route over ``sources`` (made by :func:`make_source`). Returns r [s, b, d] and, with
        ``return_weights``, alpha [s, b, N(+1)] fp32 (detached; the null source is LAST).

        ``base=x`` returns ``x + gated(r)`` in x's dtype, fused (the additive modes' input u);
        ``apply_gate=True`` applies the gate inside the fp32 math before the single cast;
        ``base_sums=True`` states that x is the sum of the sources (see route); without ``base`` it
        makes x that sum and returns ``x + gated(r)`` (x is not materialised). Without
        ``base`` the result is in the sources' dtype (``like.dtype`` when ``like`` is given).
        With zero sources ``like`` (or ``base``) gives shape/dtype/device: r is zeros (or the null
        source broadcast to every token, when present), still connected to every parameter (zero
        gradients) so no parameter is left without a grad.
        """
        like = base if base is not None else like
        ref = sources[0].value if len(sources) else like
        device_type = ref.device.type if ref is not None else "cpu"
        with _no_autocast(device_type), _outside_fp8(self.outside_fp8):
            backend = self._gpu_backend(ref) if sources else None
            if backend == "triton":  # the project's Triton kernels (triton_router.py), where they apply
                from megatron_delta.core import triton_router

                routed = triton_router.route_router(
                    self, sources, base=base, gate=self.gate if apply_gate else None, base_sums=base_sums,
                    out_dtype=None if like is None else like.dtype)
                if routed is not None:
                    out, alpha = routed
                    if return_weights:
                        alpha = alpha.t().reshape(*sources[0].value.shape[:-1], alpha.shape[0])
                    return (out, alpha) if return_weights else out
            if any(s.pending is not None for s in sources):  # the other paths route formed sums
                sources = [s if s.pending is None else s._replace(value=s.pending.form(), pending=None)
                           for s in sources]
            if backend == "fla":  # fla's fused kernel (fla_router.py), where it applies
                from megatron_delta.core import fla_router

                routed = fla_router.route_router(
                    self, sources, base=base, gate=self.gate if apply_gate else None, base_sums=base_sums,
                    out_dtype=None if like is None else like.dtype, return_weights=return_weights)
                if routed is not None:
                    out, alpha = routed
                    if return_weights:
                        alpha = alpha.t().reshape(*sources[0].value.shape[:-1], alpha.shape[0])
                    return (out, alpha) if return_weights else out
            # q = w * g only when needed here: the sources' projections already hold their logits
            need_q = not sources or self.null_source is not None or any(self not in s.logits for s in sources)
            q = self.query_vector() if need_q else None
            gate = self.gate if (apply_gate and self.gate is not None) else None
            null_logit = null_value = None
            if self.null_source is not None:
                null_logit, null_value = self._null(q)
            if len(sources) == 0:
                if base_sums and base is None:
                    raise ValueError("DepthRouter: base_sums without base makes x the sum of the sources; "
                                     "it needs at least one source")
                out, alpha = self._no_sources(q, gate, null_logit, null_value, like)
                if base is not None:
                    summed = out.requires_grad  # backward sums u's gradient over the tokens into the vector
                    out = base + out
                    if traffic.active():  # x + the vector broadcast to every token: reads x, writes u
                        record("route", "forward", [base], [out])
                        if summed:
                            out.register_hook(lambda grad: record("route", "backward", [grad], []))
            else:
                cols, sinks = zip(*(self._logit(s) for s in sources))
                eps = {s.eps for s, col in zip(sources, cols) if col is None}
                if len(eps) > 1:
                    raise ValueError(f"DepthRouter: sources it projects itself must share one eps, got {sorted(eps)}")
                out, alpha = route([s.value for s in sources], cols, sinks, eps=eps.pop() if eps else self.eps,
                                   query=q, base=base, gate=gate,
                                   null_logit=null_logit, null_value=null_value,
                                   out_dtype=None if like is None else like.dtype, kernels=self.kernels,
                                   base_sums=base_sums)
                alpha = alpha.t().reshape(*sources[0].value.shape[:-1], alpha.shape[0])
        return (out, alpha) if return_weights else out

    def _gpu_backend(self, value: Tensor) -> Optional[str]:
        """'triton', 'fla' or None: the fused GPU kernels this router may route tensors like ``value`` through.
        `auto` on CUDA tensors takes the Triton kernels when Triton imports, else fla's. Cheap test first:
        triton_router / fla_router (and Triton, fla) are imported only when they may apply."""
        if self.kernels in ("triton", "fla"):
            return self.kernels
        if self.kernels != "auto" or value.device.type != "cuda":
            return None
        from megatron_delta.core import triton_router

        return "triton" if triton_router.available() else "fla"

    def routes_in_kernel(self, value: Tensor) -> bool:
        """True when this router routes sources like ``value`` through a fused GPU kernel (Triton's or fla's),
        which computes every logit in its own pass: a shared projection (make_source with readers) would be
        wasted, so SourceBuffer makes such sources local."""
        backend = self._gpu_backend(value)
        if backend == "triton":
            from megatron_delta.core import triton_router

            return triton_router.fallback_reason([value]) is None and triton_router.available()
        if backend != "fla":
            return False
        from megatron_delta.core import fla_router

        return (fla_router.kernel_for(self.kernels, value.device.type) is not None
                and fla_router.fallback_reason([value], value.dtype) is None)

    def gpu_kernel(self, value: Tensor) -> Optional[str]:
        """'triton' or 'fla' where this router routes sources like ``value`` through that fused GPU kernel
        (routes_in_kernel), else None."""
        return self._gpu_backend(value) if self.routes_in_kernel(value) else None

    def forms_sums_in_kernel(self, value: Tensor) -> bool:
        """True when this router's kernel forms a partial sum it alone reads (Source.pending) in its own pass."""
        return self._gpu_backend(value) == "triton" and self.routes_in_kernel(value)

    def kernel_sink(self, value: Tensor):
        """A gradient buffer for a source like ``value`` that several routers read, which this router's kernel
        accumulates into in place (triton_router.KernelSink), or None (fla's kernel returns fresh gradients)."""
        if self._gpu_backend(value) != "triton":
            return None
        from megatron_delta.core import triton_router

        return triton_router.make_sink(value)

    def _no_sources(self, q, gate, null_logit, null_value, like):
        if like is None:
            raise ValueError("DepthRouter: zero sources need `like=` (a tensor giving shape/dtype)")
        zero = q.sum() * 0.0
        if null_value is not None:
            vec = null_value + (zero + null_logit * 0.0)  # alpha = 1 on the null source
        else:
            vec = zero.expand(like.shape[-1])
        if gate is not None:
            vec = vec * gate
        out = vec.to(like.dtype).expand(like.shape)
        m = 1 if null_value is not None else 0
        alpha = torch.ones(*like.shape[:-1], m, dtype=torch.float32, device=like.device)
        return out, alpha

    def gated(self, r: Tensor) -> Tensor:
        """a * r with the scalar gate (computed in fp32, cast back to r's dtype), else r."""
        if self.gate is None:
            return r
        with _no_autocast(r.device.type):
            return _as(torch.mul(r, self.gate), r.dtype)
