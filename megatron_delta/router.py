"""DepthRouter: the softmax-over-depth router of Delta Attention Residuals (DESIGN.md section 1).

Plain PyTorch, no Megatron import. For sources s_1..s_N (each [s, b, d]) and router parameters
w (query), g (key RMSNorm weight), optional z (null source) and a (scalar gate):

    logit_i = (s_i . (w * g)) * inv_rms_i          inv_rms_i = rsqrt(mean_d(s_i^2) + eps)
    alpha   = softmax_i(logit)                        per token
    r       = sum_i alpha_i * s_i                     (values are the UNnormalised sources)

Memory: the sources are never stacked. ``_RouteFunction`` saves only references to the source
values and their (shared) inv_rms tensors - which are alive anyway because they are the sources -
plus the per-token dot products [N, s*b] (fp32, small) and the few router vectors. ``inv_rms`` is
computed once per source by :func:`make_source` as a non-differentiable cache; the router's
backward differentiates through it analytically, so each (source, router) pair costs exactly one
[s, b, d] gradient tensor.

All router math runs in fp32 (float64 if the inputs are float64, for gradcheck) with autocast
disabled; the result is cast back to the sources' dtype.
"""
from __future__ import annotations

from contextlib import nullcontext
from typing import NamedTuple, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

__all__ = ["Source", "make_source", "DepthRouter", "route"]


class Source(NamedTuple):
    """One routing source: its value and the cached 1/rms of every token."""

    value: Tensor  # [s, b, d], activation dtype
    inv_rms: Tensor  # [s, b], fp32


def _compute_dtype(*dtypes: torch.dtype) -> torch.dtype:
    out = torch.float32
    for dt in dtypes:
        if dt is not None:
            out = torch.promote_types(out, dt)
    return out


def _flat(t: Tensor, rows: int, cols: int) -> Tensor:
    """[..., cols] -> [rows, cols] without a copy when possible."""
    return t.reshape(rows, cols)


def _as(t: Tensor, dtype: torch.dtype) -> Tensor:
    return t if t.dtype == dtype else t.to(dtype)


def _inv_rms(value: Tensor, eps: float) -> Tensor:
    cdt = _compute_dtype(value.dtype)
    # vector_norm accumulates in `cdt` without materialising an fp32 copy of a bf16 value.
    norm = torch.linalg.vector_norm(value, dim=-1, dtype=cdt)
    return norm.square_().div_(value.shape[-1]).add_(eps).rsqrt_()


def make_source(value: Tensor, eps: float) -> Source:
    """Wrap a [s, b, d] tensor as a routing source, computing its inv_rms once.

    ``inv_rms`` is a non-differentiable cache (fp32 [s, b], no autograd graph, nothing saved):
    the router differentiates through it analytically (d inv_rms / d v = -inv_rms^3 v / d), inside
    its own backward, so the gradient w.r.t. ``value`` is complete without one extra [s, b, d]
    gradient tensor per (source, router) pair. A Source must therefore always hold
    ``inv_rms == rsqrt(mean_d(value^2) + eps)`` of its own value - build it with this function.
    """
    with torch.no_grad(), torch.autocast(device_type=value.device.type, enabled=False):
        inv = _inv_rms(value, eps)
    return Source(value, inv)


class _RouteFunction(torch.autograd.Function):
    """r = a * sum_i softmax_i((v_i . q) * inv_i) v_i  (+ the null source), without stacking.

    Inputs: n (number of real sources), q [d], gate ([1] or None: the scale a, fused), null_logit
    (0-dim or None), null_value ([d] or None), then n values [.., d] and n inv_rms [..].
    Outputs: r (in the first value's dtype) and alpha [M, T] (non-differentiable; M = n + null,
    the null source last; T = tokens).

    Saved for backward: q, gate, null tensors, the logits [M, T] (compute dtype) and REFERENCES to
    the values and inv_rms. Every [T, d] tensor is touched one source at a time, so the transient
    memory is O(1) tensors of [T, d] (an fp32 copy of one bf16 source at a time), never O(N).

    ``inv_rms`` is treated as the cache of ``rsqrt(mean(v^2) + eps)`` it is (see make_source): no
    gradient is returned for it; its derivative is folded into each value's gradient:

        d logit_i / d v_i = inv_i q - logit_i inv_i^2 v_i / d
    """

    @staticmethod
    def forward(ctx, n, out_dtype, q, gate, null_logit, null_value, *tensors):
        values = tensors[:n]
        invs = tensors[n:]
        v0 = values[0]
        shape = v0.shape
        d = shape[-1]
        rows = v0.numel() // d
        cdt = _compute_dtype(q.dtype, *(v.dtype for v in values))
        qc = _as(q, cdt)
        has_null = null_logit is not None
        m = n + int(has_null)
        flat = [v.reshape(rows, d) for v in values]

        logits = torch.empty(m, rows, dtype=cdt, device=v0.device)
        dots = logits[:n]
        for vf, dot in zip(flat, dots.unbind(0)):
            torch.mv(vf if vf.dtype == cdt else vf.to(cdt), qc, out=dot)
        dots.mul_(_stack_inv(invs, rows, cdt))
        if has_null:
            logits[n].copy_(null_logit)
        alpha = torch.softmax(logits, dim=0)
        w = alpha if gate is None else alpha * _as(gate, cdt)
        wcols = w.unsqueeze(2).unbind(0)

        # Accumulate on a fresh compute-dtype buffer; mixed-dtype ops upcast on the fly.
        out = torch.mul(flat[0], wcols[0])
        if out.dtype != cdt:
            out = out.to(cdt)
        for i in range(1, n):
            out.addcmul_(flat[i], wcols[i])
        if has_null:
            out.addr_(w[n], _as(null_value, cdt))
        result = _as(out, out_dtype or v0.dtype).view(shape)

        ctx.n = n
        ctx.shape = shape
        ctx.cdt = cdt
        ctx.save_for_backward(q, gate, null_logit, null_value, logits, *values, *invs)
        ctx.mark_non_differentiable(alpha)
        return result, alpha

    @staticmethod
    def backward(ctx, grad_out, _grad_alpha):
        n = ctx.n
        cdt = ctx.cdt
        saved = ctx.saved_tensors
        q, gate, null_logit, null_value, logits = saved[:5]
        values = saved[5 : 5 + n]
        invs = saved[5 + n :]
        d = ctx.shape[-1]
        m, rows = logits.shape
        has_null = null_logit is not None
        qc = _as(q, cdt)
        needs = ctx.needs_input_grad[1:]  # (out_dtype, q, gate, null_logit, null_value, *v, *inv)
        flat = [v.reshape(rows, d) for v in values]

        alpha = torch.softmax(logits, dim=0)  # bitwise the forward's
        g = None if gate is None else _as(gate, cdt)
        w = alpha if g is None else alpha * g

        grad = _as(grad_out.reshape(rows, d), cdt)
        # dL/dw_i per token: <grad, v_i>
        dw = torch.empty(m, rows, dtype=cdt, device=logits.device)
        for vf, dwi in zip(flat, dw[:n].unbind(0)):
            torch.linalg.vecdot(grad, vf if vf.dtype == cdt else vf.to(cdt), out=dwi)
        if has_null:
            torch.mv(grad, _as(null_value, cdt), out=dw[n])

        grad_gate = None
        if g is not None and needs[2]:
            grad_gate = (alpha * dw).sum().reshape(gate.shape).to(gate.dtype)
        dalpha = dw if g is None else dw.mul_(g)
        dlogit = dalpha.sub_((alpha * dalpha).sum(0, keepdim=True)).mul_(alpha)

        inv = _stack_inv(invs, rows, cdt)
        c = dlogit[:n] * inv  # dL/d(v_i . q) per token
        e = dlogit[:n] * logits[:n]  # dL/dv_i through inv_i: e_i v_i
        e.mul_(inv.square_()).mul_(-1.0 / d)
        cs = c.unbind(0)
        ecols = e.unsqueeze(2).unbind(0)
        wcols = w.unsqueeze(2).unbind(0)

        grad_q = torch.zeros_like(qc) if needs[1] else None
        grad_values = []
        for i in range(n):
            vf = flat[i]
            if needs[5 + i]:
                gv = torch.mul(grad, wcols[i])
                gv.addr_(cs[i], qc)
                gv.addcmul_(vf, ecols[i])
                grad_values.append(_as(gv, vf.dtype).view(values[i].shape))
            else:
                grad_values.append(None)
            if grad_q is not None:
                grad_q.addmv_((vf if vf.dtype == cdt else vf.to(cdt)).t(), cs[i])
        grad_null_logit = None
        grad_null_value = None
        if has_null:
            if needs[3]:
                grad_null_logit = dlogit[n].sum().to(null_logit.dtype)
            if needs[4]:
                grad_null_value = torch.mv(grad.t(), w[n]).to(null_value.dtype)
        if grad_q is not None:
            grad_q = grad_q.to(q.dtype)
        return (None, None, grad_q, grad_gate, grad_null_logit, grad_null_value, *grad_values,
                *([None] * n))


def _stack_inv(invs, rows: int, cdt: torch.dtype) -> Tensor:
    """[N, T] copy of the N inv_rms (N * T scalars: negligible next to one [T, d] pass)."""
    return torch.stack([_as(t.reshape(rows), cdt) for t in invs])


def route(
    sources: Sequence[Source],
    q: Tensor,
    *,
    gate: Optional[Tensor] = None,
    null_logit: Optional[Tensor] = None,
    null_value: Optional[Tensor] = None,
    out_dtype: Optional[torch.dtype] = None,
) -> Tuple[Tensor, Tensor]:
    """Functional router over >= 1 sources. Returns (r [s, b, d] in ``out_dtype`` (default: the
    first source's dtype), alpha [M, s*b] with M = N (+1 for the null source, last)).
    ``gate`` scales r (fused into the fp32 math)."""
    n = len(sources)
    if n == 0:
        raise ValueError("route() needs at least one source")
    values = [src.value for src in sources]
    invs = [src.inv_rms for src in sources]
    return _RouteFunction.apply(n, out_dtype, q, gate, null_logit, null_value, *values, *invs)


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
    ) -> None:
        super().__init__()
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
            f"eps={self.eps}, sequence_parallel={self.sequence_parallel}"
        )

    def _null(self, q: Tensor) -> Tuple[Tensor, Tensor]:
        z = self.null_source
        inv = torch.rsqrt(z.pow(2).mean() + self.eps)
        return torch.dot(z, q) * inv, z

    def forward(
        self,
        sources: Sequence[Source],
        return_weights: bool = False,
        *,
        like: Optional[Tensor] = None,
        apply_gate: bool = False,
    ) -> Union[Tensor, Tuple[Tensor, Tensor]]:
        """Route over ``sources``. Returns r [s, b, d] in the sources' dtype (``like.dtype`` when
        ``like`` is given: the activation dtype of the residual stream) and, with
        ``return_weights``, alpha [s, b, N(+1)] fp32 (detached; the null source is LAST).

        ``apply_gate=True`` returns ``gated(r)`` computed in fp32 before the single cast (fused, no
        extra pass); the default keeps the documented ``u = x + router.gated(router(S))`` form.
        With zero sources ``like`` gives shape/dtype/device: the result is zeros (or the null
        source broadcast to every token, when present) as a broadcast (expanded) view, still
        connected to every parameter (zero gradients) so no parameter is left without a grad.
        """
        ref = sources[0].value if len(sources) else like
        device_type = ref.device.type if ref is not None else "cpu"
        with torch.autocast(device_type=device_type, enabled=False), _outside_fp8(self.outside_fp8):
            q = self.query * self.key_norm_weight
            gate = self.gate if (apply_gate and self.gate is not None) else None
            null_logit = null_value = None
            if self.null_source is not None:
                null_logit, null_value = self._null(q)
            if len(sources) == 0:
                return self._no_sources(q, gate, null_logit, null_value, like, return_weights)
            out, alpha = route(sources, q, gate=gate, null_logit=null_logit, null_value=null_value,
                               out_dtype=None if like is None else like.dtype)
        if return_weights:
            shape = sources[0].value.shape[:-1]
            return out, alpha.t().reshape(*shape, alpha.shape[0])
        return out

    def _no_sources(self, q, gate, null_logit, null_value, like, return_weights):
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
        if return_weights:
            m = 1 if null_value is not None else 0
            alpha = torch.ones(*like.shape[:-1], m, dtype=torch.float32, device=like.device)
            return out, alpha
        return out

    def gated(self, r: Tensor) -> Tensor:
        """a * r with the scalar gate (computed in fp32, cast back to r's dtype), else r."""
        if self.gate is None:
            return r
        with torch.autocast(device_type=r.device.type, enabled=False):
            return _as(torch.mul(r, self.gate), r.dtype)
