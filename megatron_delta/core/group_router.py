"""The group router of the fine-grained modes (delta, full_attnres): S consecutive routers share one pass
over the sources older than their group. Which routers group together, and the passes counted for them, is
core/group_plan.py (pure arithmetic, no torch); this module runs that plan.

Why: in the fine-grained modes router j reads every earlier sublayer output, so the per-router path reads
source i once per later router, forward and backward: traffic grows as (2L)^2. But a router's query
q_j = w_j * g_j is a parameter, not a function of the input, so when the group of routers [a, b) starts
(before sublayer a runs) everything it needs of the OLDER sources (those router a reads: h0, v0..v_{a-1})
already exists. One pass over them gives each router k of the group

    z_ki  = (s_i . q_k) inv_i                 inv_i = rsqrt(mean(s_i^2) + eps), the null source's logit too
    lse_k = logsumexp_i z_ki                  [T]
    r_k   = sum_i softmax_i(z_k)_i s_i        [T, d] in fp32 (compute dtype): the older sources' partial mix
    X     = sum_i s_i                         [T, d] in the sources' dtype (x_from_sources only: the older part of x)

and router a + k, when its turn comes, merges the k sources made inside the group (v_a..v_{a+k-1}) by an
online-softmax merge: the softmax over (lse_k, z_a, .., z_{a+k-1}) gives the old block's weight beta and
the in-group weights, and

    u = base + [X + sum_in v_i] + gate (beta r_k + sum_in alpha_i v_i)

which equals the per-router path's u in exact arithmetic (beta r_k is the old sources' share of r). The group's
first router (k = 0) has no in-group source, so beta = 1: without a gate and a held base its u = X + r_0 (or r_0)
is written by the old pass itself, in place of r_0, and no merge runs for it (forward: r_0 is not written, read
back with X and u written again; backward: no merge reads G_0 and r_0). In
backward each merge handles its in-group sources and the old block's logit (d lse), and leaves its output
gradient G_k with the per-token factor gate * beta in the group's stash (the GradSink pattern: no fp32
[T, d] gradient of r_k is written). On the C and Triton kernels a merge writes the gradient of its newest in-group
source only: its share of an older in-group source's gradient, w G_k + c q_k + e v (w, c, e per token), waits in
that source's sink (_Sink.pending) for the merge of the source's next router - the last of its in-group readers to
run in backward - which adds every deferred share as it writes the gradient, so each in-group gradient is written
once (merge k: 2 passes and s - 1 - k reads of later G_k, where one per in-group reader read and wrote 2 k). Then
ONE pass per group over the older sources gives every older
source's gradient (accumulated in place into its sink) and the group's query and null-source gradients. On the
kernels every other group from the scope's end (group_plan.deferring_groups) writes only the gradients of the sources
the previous group's pass does not read (the previous group's own): its share of the others waits in their sinks
(:class:`OldShare`: its G_k and, per token and source, their weights, query and norm terms) for the previous group's
pass, which adds it as it writes them, reading these G_k again - so those sinks are read and written once per two
groups, not once per group (-2 passes per source, + s per pair).
The projection of the older sources (their 1/rms and logits) is part of these passes, so no
_ProjectSource runs for a grouped router.

delta hands x out as the sum of its sources (x_from_sources; SourceBuffer.x). In a scope whose routers route in
groups that sum is :class:`_FinalSum`: one pass on the C / Triton kernels (each source read once, x written once;
PyTorch's chain of adds on the PyTorch path), and in backward x's gradient seeds the sink of every source the
groups read - by reference, no pass - so that each source keeps one autograd reader and autograd adds nothing; the
first group pass to reach a seeded sink reads the seed as it writes the sink (one row more than a fresh write,
instead of autograd's three; on the C and Triton kernels one row per pass for all the sinks it seeds: the seed is
the same tensor for every source). Where the scope's routers do not route in groups (S = 1, fla) x is summed as before.

Groups are consecutive sublayers of one SourceBuffer's scope (its pipeline chunk, or the layers of one
recompute chunk), anchored at the scope's first sublayer: they never cross a chunk or recompute boundary.
The final router of full_attnres routes as before (router.py). Group size: ``--delta-router-group-size``
(config ``delta_router_group_size``): ``auto``, or S >= 1 (1 = the per-router path). ``auto`` takes, for a scope of
n routers whose first reads n0 sources, the split of the n routers into consecutive groups with the fewest counted
passes (group_plan.passes, group_plan.auto_group_sizes), where the group runs on the C or Triton kernels: the groups
grow along the scope (24 over 1 source: 1, 1, 2, 3, 5, 6, 6, the deferring pairs chosen with them), because a later
group's old pass reads more older sources and so pays more for each group, while a larger group merges more in-group
sources per router, up to AUTO_MAX_GROUP routers a group; 1 where the routers
run on PyTorch ops (--delta-router-kernels torch, or tensors neither kernel takes: counted per op, the group router
moves more bytes than one router per pass) or on fla's kernel (one router per call).

Implementations: PyTorch ops (any device and dtype; the reference), the fused CPU kernels
(csrc/group_router_kernels.c, fp32 CPU tensors, --delta-router-kernels auto/c): each pass is one C loop
over the tokens that reads each [T, d] tensor once, and the Triton kernels (triton_group_kernels.py, CUDA
tensors in fp32 / bf16 / fp16, --delta-router-kernels triton, or auto where Triton imports): the same passes
on tiles of tokens. Every call records its traffic (core/traffic.py): a C loop or Triton kernel as one pass,
the PyTorch path each op it makes.
"""
from __future__ import annotations

import operator
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

from megatron_delta.core import traffic
from megatron_delta.core.group_plan import Sizes, deferring_starts, group_spans, resolve_sizes
from megatron_delta.core.router import (
    GradSink,
    _as,
    _compute_dtype,
    _inv_rms,
    _no_autocast,
    _outside_fp8,
    _record_cast,
    _rows,
    seed_sinks,
)

__all__ = ["GroupRouting", "sum_in_order"]


# --------------------------------------------------------------------------------------------- autograd
class _Collect(torch.autograd.Function):
    """An alias of a source value whose backward hands the gradient its group readers accumulated in its
    sink to the value (their backwards return None for it and add into the sink in place)."""

    @staticmethod
    def forward(ctx, value, sink):
        ctx.set_materialize_grads(False)
        ctx.sink, ctx.shape = sink, value.shape
        ctx.save_for_backward(value)
        return value.view_as(value)

    @staticmethod
    def backward(ctx, grad):
        sink = ctx.sink
        if sink.pending or sink.old is not None:  # shares no pass reached: a merge or old pass without a gradient
            value, = ctx.saved_tensors
            if sink.old is not None:
                _settle_old(sink, value, value.dtype)
            _settle_pending(sink, value, value.dtype)
        acc, seeded = (sink.grad, False) if sink.grad is not None else (sink.seed, True)
        sink.grad = sink.seed = None
        if acc is None:
            return grad, None
        acc = acc.view(ctx.shape)
        if grad is not None:  # a seed is shared with other sinks: never written in place
            acc = acc + grad if seeded else acc.add_(grad)
        return acc, None


class DeferredShare(NamedTuple):
    """One later merge's share of an in-group source's gradient, w G + c q + e v, waiting in the source's sink
    (:class:`_Sink`'s pending) for the merge that writes that gradient. ``coef``: the later merge's [3, k, T] w, c, e
    of its k in-group sources, of which this source is ``index``; ``grad``: its output gradient G [T, d];
    ``q``: its query [d]. The kernels read w, c, e by address (:meth:`address`: no view op per share)."""

    coef: Tensor
    index: int
    grad: Tensor
    q: Tensor

    def row(self, j: int) -> Tensor:
        """w (j = 0), c (1) or e (2) [T]."""
        return self.coef[j, self.index]

    def address(self, j: int) -> int:
        """The address of :meth:`row` ``j``."""
        _, k, T = self.coef.shape
        return self.coef.data_ptr() + (j * k + self.index) * T * self.coef.element_size()


class OldShare(NamedTuple):
    """A group's share of the gradients of the sources its previous group's old pass also reads, deferred to that
    pass (group_plan.deferring_groups), which adds it as it writes their sinks - so each of those sinks is written once
    per two groups, not once per group. For source i: E[i] v_i + sum_k A[k, i] G_k + sum_k C[k, i] Q_k, where
    ``grads`` are the group's output gradients G_k (those that came), A [len(grads), n, T] their per-token weights
    (gate beta_k p_ki, + 1 where x is the sum of the sources), C [S, n, T] dz_ki inv_i, Q [S, d] the group's
    queries and E [n, T] the norm's term; n = the previous group's older sources."""

    grads: Tuple[Tensor, ...]
    A: Tensor
    C: Tensor
    Q: Tensor
    E: Tensor


class _Sink(GradSink):
    """The gradient sink of a source the scope's groups read. ``seed``: the gradient of x handed out as the sum
    of the sources (:class:`_FinalSum`), held by reference - the same tensor for every source, never written -
    until the first pass to reach the sink in backward adds it to its own contribution as it writes the sink
    (the kernels' mode 2: read the seed, write the sink), or _Collect hands it on where no pass wrote one."""

    __slots__ = ("seed", "pending", "old")

    def __init__(self) -> None:
        super().__init__()
        self.seed: Optional[Tensor] = None
        self.old: Optional[Tuple[OldShare, int]] = None  # the next group's deferred share and this source's index
        # the in-group merges' deferred shares of this source's gradient (:class:`_Merge`), added by the merge of
        # the source's next router (its earliest in-group reader)
        self.pending: List[DeferredShare] = []

    def add_late(self, grad: Tensor, kernel: str) -> None:
        """x's gradient where a pass wrote the sink first (router.seed_sinks): added in place, its own pass."""
        _sink_add(self, grad, self.grad.dtype if self.grad is not None else self.seed.dtype, kernel)


def _target(sink: Optional[_Sink], needed: bool) -> Tuple[Optional[Tensor], bool, Optional[Tensor]]:
    """A kernel's gradient target for one source: (the sink's gradient, assigned fresh, seed); (None, False,
    None) where no gradient is needed."""
    if not needed or sink is None:
        return None, False, None
    return sink.grad, sink.grad is None and sink.seed is None, sink.seed if sink.grad is None else None


def _allocate(sink: _Sink, target: Tuple[Optional[Tensor], bool, Optional[Tensor]], like: Tensor,
              T: int, d: int) -> Tuple[Optional[Tensor], bool, Optional[Tensor]]:
    """The kernels' target: a new sink gradient where the sink had none (written fresh, or seed + gradient)."""
    t, fresh, seed = target
    if t is None and (fresh or seed is not None):
        t = sink.grad = torch.empty(T, d, dtype=like.dtype, device=like.device)
        sink.seed = None
    return t, fresh, seed


class _Stash:
    """What the group's merges leave for the group's backward: router k's output gradient G_k and the
    per-token factor gate * beta_k of its older sources' share (absent: the merge had no gradient)."""

    __slots__ = ("grads", "defer_n")

    def __init__(self, defer_n: int = 0) -> None:
        self.grads: Dict[int, Tuple[Tensor, Tensor]] = {}
        # the first defer_n older sources are the previous group's: on the kernels, their gradient shares wait for
        # its old pass (OldShare) instead of being written here
        self.defer_n = defer_n


def _sink_add(sink: _Sink, grad: Tensor, dtype: torch.dtype, kernel: str) -> None:
    if sink.grad is None and sink.seed is not None:  # seed + gradient into a new sink (the seed is shared)
        sink.grad = torch.add(sink.seed, grad, out=torch.empty_like(sink.seed, dtype=dtype))
        traffic.record(kernel, "backward", [sink.seed, grad], [sink.grad])
        sink.seed = None
    elif sink.grad is None:
        sink.grad = _as(grad, dtype) if grad.dtype != dtype else grad
        _record_cast(kernel, "backward", grad, sink.grad)
    else:
        sink.grad.add_(grad)
        traffic.record(kernel, "backward", [sink.grad, grad], [sink.grad])


def _settle_pending(sink: _Sink, value: Tensor, dtype: torch.dtype) -> None:
    """The deferred in-group shares of a source's gradient (``sink.pending``) on PyTorch ops, into the sink: where
    the merge that adds them in its pass did not run or ran on PyTorch ops. ``value``: the source, [T, d] or in its
    own shape (as the Triton kernels leave it: no view op per call); the shares' output gradients likewise."""
    pending, sink.pending = sink.pending, []
    if not pending:
        return
    cdt = pending[0].coef.dtype
    vf = _as(value.reshape(-1, value.shape[-1]), cdt)
    _record_cast("group_merge", "backward", value, vf)
    gv = torch.mul(vf, sum(x.row(2) for x in pending).unsqueeze(1))
    traffic.record("group_merge", "backward", [vf], [gv])
    for x in pending:
        gv.addcmul_(_as(x.grad.reshape(gv.shape), cdt), x.row(0).unsqueeze(1)).addr_(x.row(1), x.q)
        traffic.record("group_merge", "backward", [gv, x.grad], [gv])
        traffic.record("group_merge", "backward", [gv], [gv])
    _sink_add(sink, gv, dtype, "group_merge")


def _settle_old(sink: _Sink, value: Tensor, dtype: torch.dtype) -> None:
    """A deferred old-pass share of a source's gradient (``sink.old``, :class:`OldShare`) on PyTorch ops, into the
    sink: where the old pass that adds it in its kernel did not run or runs on PyTorch ops. ``value``: the source,
    [T, d] or in its own shape, and the share's output gradients likewise (as :func:`_settle_pending`)."""
    share, i = sink.old
    sink.old = None
    cdt = share.E.dtype
    vf = _as(value.reshape(-1, value.shape[-1]), cdt)
    _record_cast("group_old_pass", "backward", value, vf)
    gv = torch.mul(vf, share.E[i].unsqueeze(1))
    traffic.record("group_old_pass", "backward", [vf], [gv])
    gv.addmm_(share.C[:, i].t(), share.Q)
    traffic.record("group_old_pass", "backward", [gv], [gv])
    for k, Gk in enumerate(share.grads):
        gv.addcmul_(_as(Gk.reshape(gv.shape), cdt), share.A[k, i].unsqueeze(1))
        traffic.record("group_old_pass", "backward", [gv, Gk], [gv])
    _sink_add(sink, gv, dtype, "group_old_pass")


def _received(sinks: Sequence[Optional[_Sink]], needs: Sequence[bool], flat: Sequence[Tensor],
              dtypes: Sequence[torch.dtype], kernel_reads) -> Optional[OldShare]:
    """The next group's share every needed sink of an old pass holds, for its kernel to add (taken off the sinks),
    where ``kernel_reads(share)`` says the kernel can read it; else None, each share settled on PyTorch ops."""
    held = [(i, sinks[i].old) for i in range(len(flat)) if needs[i] and sinks[i].old is not None]
    if not held:
        return None
    share = held[0][1][0]
    if (kernel_reads is not None and len(held) == sum(needs) and share.E.shape[0] == len(flat)
            and all(o[0] is share and o[1] == i for i, o in held) and kernel_reads(share)):
        for i, _ in held:
            sinks[i].old = None
        return share
    for i, _ in held:
        _settle_old(sinks[i], flat[i], dtypes[i])
    return None


def _once(tensors: Sequence[Optional[Tensor]]) -> List[Optional[Tensor]]:
    """The tensors a kernel call reads, each once: the final sum's seed (x's gradient, the same tensor for every
    source it seeds) is read by the call for all the sinks it seeds - per token (C) or per tile (Triton) one row,
    the first from memory and the others from cache."""
    seen, out = set(), []
    for t in tensors:
        if t is None or id(t) not in seen:
            out.append(t)
            if t is not None:
                seen.add(id(t))
    return out


TRITON = "triton"  # _kernel_lib's answer for the Triton kernels (triton_group_kernels.py)


def _kernel_rows(tensors: Sequence[Tensor], T: int, d: int) -> List[Tensor]:
    """What the Triton kernels read of [.., d] tensors (triton_router.kernel_rows: a contiguous tensor as it is,
    whatever its shape - no view op per tensor and call); only where a pass runs on them (a lazy import)."""
    from megatron_delta.core.triton_router import kernel_rows

    return kernel_rows(tensors, T, d)


def _kernel_lib(kernels: str, tensors: Sequence[Optional[Tensor]], others: Sequence[Optional[Tensor]] = ()):
    """The group kernels for a router's ``kernels`` choice: TRITON (triton_group_kernels.py) under ``triton``, or
    ``auto`` on CUDA tensors, where Triton imports and the sources ``tensors`` suit it; the C kernels' library
    for fp32 CPU tensors under auto / c; else None (PyTorch ops). ``others``: further tensors (r, X, x) the C
    kernels also need in fp32 and the Triton kernels on the same device."""
    if kernels == "triton" or (kernels == "auto" and tensors and tensors[0].device.type == "cuda"):
        from megatron_delta.core import triton_group_kernels

        return TRITON if triton_group_kernels.eligible(kernels, list(tensors), others) else None
    if kernels not in ("auto", "c"):
        return None
    from megatron_delta.core import cpu_kernels

    if not cpu_kernels.eligible(*tensors, *others):
        return None
    from megatron_delta.core import group_kernels

    return group_kernels.library(kernels)


class _OldPass(torch.autograd.Function):
    """One pass over the n older sources for the S routers of a group (module docstring).

    Inputs: n, S, eps, unit (also return X = sum of the sources), first_u, lib, sinks (one per source), stash,
    then the n values, the S queries, and (null source) the S null logits (0-dim) and S null values [d].
    Outputs: S partial mixes r_k [T, d], S log-sum-exps [T] (compute dtype), X [T, d] (the sources' dtype, or
    None) and the softmax weights p [S, M, T] (non-differentiable; M = n + null, the null source last).
    ``first_u`` (the group's first router has no gate and no base): that router's merge would merge no in-group
    source, so its u, X + r_0 (unit) or r_0, is this pass's first output in place of r_0 (in the sources' dtype)
    and no merge runs for it; in backward u's gradient is its G_0, with gate * beta = 1.
    """

    @staticmethod
    def forward(ctx, n, S, eps, unit, first_u, lib, sinks, stash, *tensors):
        ctx.set_materialize_grads(False)
        values, queries = tensors[:n], tensors[n:n + S]
        rest = tensors[n + S:]
        has_null = len(rest) > 0
        null_logits, null_values = (rest[:S], rest[S:]) if has_null else ((), ())
        v0 = values[0]
        d = v0.shape[-1]
        T = v0.numel() // d
        cdt = _compute_dtype(*(v.dtype for v in values), *(q.dtype for q in queries))
        m = n + int(has_null)
        triton = lib == TRITON and cdt == torch.float32
        # the Triton kernels read addresses: a contiguous source as it is, no view op per source and call
        flat = _kernel_rows(values, T, d) if triton else [v.reshape(T, d) for v in values]
        Q = torch.stack([_as(q, cdt) for q in queries])  # [S, d]
        nv = torch.stack([_as(z, cdt) for z in null_values]) if has_null else None  # [S, d]
        nl = torch.stack([_as(z, cdt).reshape(()) for z in null_logits]) if has_null else None  # [S]
        inv = torch.empty(n, T, dtype=cdt, device=v0.device)
        z = torch.empty(S, m, T, dtype=cdt, device=v0.device)
        r = torch.empty(S - int(first_u), T, d, dtype=cdt, device=v0.device)  # r_k, without r_0 under first_u
        # X in the sources' dtype: the merges add it to u in fp32 and nothing differentiates through it (x's gradient
        # reaches the sources through the old pass's unit term), so a bf16 X moves half the bytes of an fp32 one
        x = torch.empty(T, d, dtype=v0.dtype, device=v0.device) if unit else None
        u0 = (torch.empty(v0.shape if triton else (T, d), dtype=v0.dtype, device=v0.device)
              if first_u and lib is not None else None)  # on Triton in the sources' shape: route() then needs no view
        if triton:
            from megatron_delta.core import triton_group_kernels

            p, lse = torch.empty_like(z), torch.empty(S, T, dtype=cdt, device=v0.device)
            triton_group_kernels.old_forward(flat, Q, eps, nl, nv, inv, z, p, lse, r, x, u0)
        elif lib is not None and cdt == torch.float32 and v0.dtype == torch.float32:
            from megatron_delta.core import group_kernels

            p, lse = torch.empty_like(z), torch.empty(S, T, dtype=cdt, device=v0.device)
            group_kernels.old_forward(lib, flat, Q, eps, nl, nv, inv, z, p, lse, r, x, u0)
        else:
            lib = None
            r0 = torch.empty(T, d, dtype=cdt, device=v0.device) if first_u else None
            for i, vf in enumerate(flat):
                vf = _as(vf, cdt)
                inv[i] = _inv_rms(vf, eps, cdt)
                z[:, i] = torch.mm(Q, vf.t()).mul_(inv[i])
                _record_cast("group_old_pass", "forward", flat[i], vf)
                traffic.record("group_old_pass", "forward", [vf], [])  # the norm (its [T] output is not a row)
                traffic.record("group_old_pass", "forward", [vf], [])  # the GEMM ([S, T] logits)
            if has_null:
                z[:, n] = nl.unsqueeze(1)
            lse = torch.logsumexp(z, dim=1)  # [S, T]
            p = torch.exp(z - lse.unsqueeze(1))
            for k in range(S):
                rk = r0 if (first_u and k == 0) else r[k - int(first_u)]
                torch.mul(flat[0], p[k, 0].unsqueeze(1), out=rk)
                traffic.record("group_old_pass", "forward", [flat[0]], [rk])
                for i in range(1, n):
                    rk.addcmul_(flat[i], p[k, i].unsqueeze(1))
                    traffic.record("group_old_pass", "forward", [rk, flat[i]], [rk])
                if has_null:
                    rk.addr_(p[k, n], nv[k])
                    traffic.record("group_old_pass", "forward", [rk], [rk])
            if unit:
                x.copy_(flat[0])
                traffic.record("group_old_pass", "forward", [flat[0]], [x])
                for vf in flat[1:]:
                    x.add_(vf)
                    traffic.record("group_old_pass", "forward", [x, vf], [x])
            if first_u:  # as the merge would: r_0 (times beta = 1) + X, in the sources' dtype
                if unit:
                    out = torch.add(r0, x)
                    traffic.record("group_old_pass", "forward", [r0, x], [out])
                    r0 = out
                u0 = _as(r0, v0.dtype)
                _record_cast("group_old_pass", "forward", r0, u0)
        if lib is not None:  # the C loop reads each tensor once (the PyTorch ops above record their own passes)
            traffic.record("group_old_pass", "forward", reads=flat, writes=[u0, *r.unbind(0), x])
        ctx.n, ctx.S, ctx.unit, ctx.lib, ctx.sinks, ctx.stash, ctx.cdt = n, S, unit, lib, sinks, stash, cdt
        ctx.first_u = first_u
        ctx.null_dtypes = [(a.dtype, b.dtype) for a, b in zip(null_logits, null_values)]
        ctx.save_for_backward(inv, z, p, Q, nv, *values)
        ctx.query_dtypes = [q.dtype for q in queries]
        ctx.mark_non_differentiable(p)
        return (*([u0] if first_u else []), *r.unbind(0), *lse.unbind(0), x, p)

    @staticmethod
    def backward(ctx, *grads):
        n, S, unit, cdt = ctx.n, ctx.S, ctx.unit, ctx.cdt
        inv, z, p, Q, nv, *values = ctx.saved_tensors
        grad_lse = grads[S:2 * S]
        stash, ctx.stash.grads = ctx.stash.grads, {}  # consumed (a retained graph's next backward refills it)
        if ctx.first_u and grads[0] is not None:  # u_0 came from this pass: its gradient is G_0, gate * beta_0 = 1
            stash[0] = (grads[0], torch.ones(inv.shape[1], dtype=cdt, device=inv.device))
        m = p.shape[1]
        has_null = nv is not None
        d = values[0].shape[-1]
        T = inv.shape[1]
        ks = sorted(stash)
        if all(g is None or g.dtype == cdt for g in grad_lse) and any(g is not None for g in grad_lse):
            # one op where every router's lse has a gradient (the usual case), two where some have none (a group's
            # first router under first_u: no merge reads its lse): one zero row stands for them all
            zero = None if all(g is not None for g in grad_lse) else torch.zeros(T, dtype=cdt, device=inv.device)
            dlse = torch.stack([zero if g is None else g for g in grad_lse])
        else:
            dlse = torch.zeros(S, T, dtype=cdt, device=inv.device)
            for k, g in enumerate(grad_lse):
                if g is not None:
                    dlse[k] = g
        lib = ctx.lib
        if lib == TRITON and len({stash[k][0].dtype for k in ks}) <= 1:  # the kernel reads G in its own dtype
            G = _kernel_rows([stash[k][0] for k in ks], T, d)
        else:
            lib = None if lib == TRITON else lib
            G = [_as(stash[k][0].reshape(T, d), cdt) for k in ks]  # each router's output gradient
        if ks == list(range(S)) and all(stash[k][1].dtype == cdt for k in ks):
            w = torch.stack([stash[k][1] for k in ks])  # gate * beta_k, one op where every router has a gradient
        else:
            w = torch.zeros(S, T, dtype=cdt, device=inv.device)  # (0 where no gradient came)
            for k in ks:
                w[k] = stash[k][1]
        needs_v = [ctx.needs_input_grad[8 + i] and ctx.sinks[i] is not None for i in range(n)]
        if lib is not None and lib != TRITON and not all(t.dtype == torch.float32 and t.is_contiguous() for t in G):
            lib = None
        flat = _kernel_rows(values, T, d) if lib == TRITON else [v.reshape(T, d) for v in values]
        # the next group's deferred share of these sources' gradients: added by the kernel as it writes the sinks
        g_dtype = G[0].dtype if G else values[0].dtype
        kernel_reads = None if lib is None else (
            lambda sh: all(g.dtype == g_dtype and g.is_contiguous() for g in sh.grads) and sh.E.dtype == cdt)
        received = _received(ctx.sinks, needs_v, flat, [v.dtype for v in values], kernel_reads)
        defer_n = ctx.stash.defer_n if lib is not None else 0
        # the first reader to reach a sink creates it; a deferred source's share waits for the previous group's pass
        targets = [_target(ctx.sinks[i], needs_v[i] and i >= defer_n) for i in range(n)]
        dq = None if lib == TRITON else torch.zeros(S, d, dtype=cdt, device=inv.device)  # Triton: its partials' sum
        dnull = None
        if lib is not None:
            from megatron_delta.core import group_kernels

            outs = [_allocate(ctx.sinks[i], tg, values[i], T, d) for i, tg in enumerate(targets)]
            dz = torch.empty_like(z)
            if lib == TRITON:
                from megatron_delta.core import triton_group_kernels

                dq, dnull = triton_group_kernels.old_backward(G, ks, w, dlse, flat, inv, z, p, Q, nv, outs, unit, dz,
                                                              received)
            else:
                group_kernels.old_backward(lib, G, ks, w, dlse, flat, inv, z, p, Q, nv, outs, unit, dz, dq, received)
            reads = ([*flat, *G] + ([] if received is None else list(received.grads))
                     + _once([t if sd is None else sd for t, f, sd in outs if t is not None and not f]))
            traffic.record("group_old_pass", "backward", reads=reads, writes=[t for t, _, _ in outs if t is not None])
            if defer_n and any(needs_v[:defer_n]):
                _defer(ctx.sinks, needs_v, defer_n, G, ks, w, p, z, dz, inv, Q, unit)
        else:
            for k, Gk in zip(ks, G):
                _record_cast("group_old_pass", "backward", stash[k][0], Gk)
            # dp_ki = gate beta_k <G_k, s_i>: the gradient of the old softmax weights
            dp = torch.zeros(S, m, T, dtype=cdt, device=inv.device)
            prod = None
            for i, vf in enumerate(flat):
                vf = _as(vf, cdt)
                _record_cast("group_old_pass", "backward", flat[i], vf)
                for k, Gk in zip(ks, G):
                    prod = torch.mul(Gk, vf, out=prod)
                    dp[k, i] = prod.sum(-1)
                    traffic.record("group_old_pass", "backward", [Gk, vf], [prod])
                    traffic.record("group_old_pass", "backward", [prod], [])
            if has_null:
                for k, Gk in zip(ks, G):
                    dp[k, n] = torch.mv(Gk, nv[k])
                    traffic.record("group_old_pass", "backward", [Gk], [])
            dp.mul_(w.unsqueeze(1))
            dz = p * (dp - (p * dp).sum(1, keepdim=True)) + p * dlse.unsqueeze(1)
            gsum = None
            if unit and G:
                gsum = G[0].clone()
                traffic.record("group_old_pass", "backward", [G[0]], [gsum])
                for Gk in G[1:]:
                    gsum.add_(Gk)
                    traffic.record("group_old_pass", "backward", [gsum, Gk], [gsum])
            for i, vf in enumerate(flat):
                vf = _as(vf, cdt)
                _record_cast("group_old_pass", "backward", flat[i], vf)
                c = dz[:, i] * inv[i]  # [S, T]
                dq.addmm_(c, vf)
                traffic.record("group_old_pass", "backward", [vf], [])
                if not needs_v[i]:
                    continue
                e = -(dz[:, i] * z[:, i]).sum(0) * inv[i].square() / d  # [T]
                gv = torch.mm(c.t(), Q).addcmul_(vf, e.unsqueeze(1))
                traffic.record("group_old_pass", "backward", [], [gv])
                traffic.record("group_old_pass", "backward", [gv, vf], [gv])
                for k, Gk in zip(ks, G):
                    gv.addcmul_(Gk, (w[k] * p[k, i]).unsqueeze(1))
                    traffic.record("group_old_pass", "backward", [gv, Gk], [gv])
                if gsum is not None:
                    gv.add_(gsum)
                    traffic.record("group_old_pass", "backward", [gv, gsum], [gv])
                _sink_add(ctx.sinks[i], gv, values[i].dtype, "group_old_pass")
        grad_q = [_as(g, dt) for g, dt in zip(dq.unbind(0), ctx.query_dtypes)]  # one op for the S rows
        grad_nl, grad_nv = [], []
        if has_null:
            for k, (ldt, vdt) in enumerate(ctx.null_dtypes):
                grad_nl.append(dz[k, n].sum().to(ldt))
                if dnull is not None:  # the Triton kernel's per-program sums
                    grad_nv.append(dnull[k].to(vdt))
                elif k in stash:
                    Gk = G[ks.index(k)]
                    grad_nv.append(torch.mv(Gk.t(), w[k] * p[k, n]).to(vdt))
                    traffic.record("group_old_pass", "backward", [Gk], [])
                else:
                    grad_nv.append(torch.zeros(d, dtype=vdt, device=inv.device))
        return (None,) * 8 + (None,) * n + (*grad_q, *grad_nl, *grad_nv)


def _defer(sinks: Sequence[Optional[_Sink]], needs: Sequence[bool], n: int, G: Sequence[Tensor], ks: Sequence[int],
           w: Tensor, p: Tensor, z: Tensor, dz: Tensor, inv: Tensor, Q: Tensor, unit: bool) -> None:
    """An old pass's share of the gradients of its first ``n`` sources (the previous group's older sources), as
    :class:`OldShare` on their sinks, from the kernel's dz: the previous group's old pass adds it."""
    d = Q.shape[1]
    iv = inv[:n]
    C = (dz[:, :n] * iv).contiguous()  # [S, n, T]
    E = (dz[:, :n] * z[:, :n]).sum(0).mul_(iv.square()).mul_(-1.0 / d)  # [n, T]
    A = _rows(w, ks).unsqueeze(1) * _rows(p, ks)[:, :n]  # [len(G), n, T]
    if unit:
        A += 1.0
    share = OldShare(tuple(G), A.contiguous(), C, Q.contiguous(), E.contiguous())
    for i in range(n):
        if needs[i]:
            sinks[i].old = (share, i)


class _Merge(torch.autograd.Function):
    """Router k of a group: the online-softmax merge of its older sources' (r_k, lse_k) with the k sources
    made inside the group (projected here), and u (module docstring).

    Inputs: k, out_dtype, eps, unit, lib, sinks (of the in-group sources), stash, slot (k), r [T, d], lse [T],
    x (X or None), base (or None), gate ([1] or None), query [d], then the k in-group values.
    Outputs: u and the weights [1 + k, T] (beta, then the in-group alphas; non-differentiable).
    """

    @staticmethod
    def forward(ctx, k, out_dtype, eps, unit, lib, sinks, stash, slot, r, lse, x, base, gate, query, *values):
        ctx.set_materialize_grads(False)
        T, d = r.shape
        cdt = r.dtype
        triton = lib == TRITON and cdt == torch.float32
        if triton:  # the Triton kernel reads addresses: a contiguous tensor as it is, no view op per source and call
            flat = _kernel_rows(values, T, d)
            flat_base = None if base is None else _kernel_rows([base], T, d)[0]
        else:
            flat = [v.reshape(T, d) for v in values]
            flat_base = None if base is None else base.reshape(T, d)
        g = None if gate is None else _as(gate, cdt)
        inv = torch.empty(k, T, dtype=cdt, device=r.device)
        zin = torch.empty(k, T, dtype=cdt, device=r.device)
        a = torch.empty(1 + k, T, dtype=cdt, device=r.device)
        if triton:
            from megatron_delta.core import triton_group_kernels

            like = base if base is not None else values[0] if values else None
            # u in the sources' shape where one is at hand: route() then needs no view
            out = torch.empty(like.shape if like is not None else (T, d), dtype=out_dtype, device=r.device)
            triton_group_kernels.merge_forward(r, lse, x, flat_base, gate, _as(query, cdt), flat, eps, unit, inv,
                                               zin, a, out)
        elif lib is not None and lib != TRITON and cdt == torch.float32 and out_dtype == torch.float32:
            from megatron_delta.core import group_kernels

            out = torch.empty(T, d, dtype=cdt, device=r.device)
            group_kernels.merge_forward(lib, r, lse, x, flat_base, 1.0 if g is None else float(g), _as(query, cdt),
                                        flat, eps, unit, inv, zin, a, out)
        else:
            lib = None
            q = _as(query, cdt)
            for i, vf in enumerate(flat):
                vf = _as(vf, cdt)
                inv[i] = _inv_rms(vf, eps, cdt)
                torch.mv(vf, q, out=zin[i]).mul_(inv[i])
                _record_cast("group_merge", "forward", flat[i], vf)
                traffic.record("group_merge", "forward", [vf], [])  # the norm (its [T] output is not a row)
                traffic.record("group_merge", "forward", [vf], [])  # the logit
            torch.softmax(torch.cat([lse.unsqueeze(0), zin]), dim=0, out=a)
            wa = a if g is None else a * g
            out = torch.mul(r, wa[0].unsqueeze(1))
            traffic.record("group_merge", "forward", [r], [out])
            if flat_base is not None:
                out.add_(flat_base)
                traffic.record("group_merge", "forward", [out, flat_base], [out])
            if x is not None:
                out.add_(x)
                traffic.record("group_merge", "forward", [out, x], [out])
            for i, vf in enumerate(flat):
                out.addcmul_(vf, (wa[1 + i] + float(unit)).unsqueeze(1))
                traffic.record("group_merge", "forward", [out, vf], [out])
        if lib is not None:  # the C loop reads each tensor once (the PyTorch ops above record their own passes)
            traffic.record("group_merge", "forward", reads=[r, x, flat_base, *flat], writes=[out])
        ctx.k, ctx.unit, ctx.lib, ctx.sinks, ctx.stash, ctx.slot, ctx.cdt = k, unit, lib, sinks, stash, slot, cdt
        ctx.base_dtype = None if base is None else base.dtype
        ctx.base_shape = None if base is None else base.shape
        ctx.save_for_backward(r, gate, query, inv, zin, a, *values)
        ctx.mark_non_differentiable(a)
        u = _as(out, out_dtype)
        _record_cast("group_merge", "forward", out, u)
        return u, a

    @staticmethod
    def backward(ctx, grad_out, _grad_a):
        if grad_out is None:
            return (None,) * (14 + ctx.k)
        k, unit, cdt = ctx.k, ctx.unit, ctx.cdt
        r, gate, query, inv, zin, a, *values = ctx.saved_tensors
        T, d = r.shape
        lib = ctx.lib
        if lib == TRITON:  # the kernel reads addresses: a contiguous tensor as it is, no view op per source and call
            flat = _kernel_rows(values, T, d)
            grad = _kernel_rows([grad_out], T, d)[0]
        else:
            flat = [v.reshape(T, d) for v in values]
            grad = grad_out.reshape(T, d)
        g = None if gate is None else _as(gate, cdt)
        gf = 1.0 if g is None else g
        needs = ctx.needs_input_grad
        q = _as(query, cdt)
        if lib is not None and lib != TRITON and not (grad.dtype == torch.float32 and grad.is_contiguous()):
            lib = None
        targets = [_target(ctx.sinks[i], needs[14 + i]) for i in range(k)]
        needed = [i for i, (t, fresh, seed) in enumerate(targets) if t is not None or fresh or seed is not None]
        dq = None if lib == TRITON else torch.zeros(d, dtype=cdt, device=r.device)  # Triton: its partials' sum
        newest = ctx.sinks[k - 1] if k and (k - 1) in needed else None  # the one sink the kernels write
        if lib is not None and newest is not None and newest.pending and any(
                x.grad.dtype != grad.dtype or x.grad.device != grad.device for x in newest.pending):
            _settle_pending(newest, flat[k - 1], values[k - 1].dtype)  # shares the kernel cannot read as one dtype
            targets[k - 1] = _target(newest, True)
        if lib is not None:
            from megatron_delta.core import group_kernels

            # the kernels defer each in-group source's share of its gradient (w G + c q + e v) to the merge of the
            # source's next router, the last of its in-group readers to run, and write only the newest source's:
            # each in-group gradient is written once, not once per in-group reader
            later, target = [], (None, False, None)
            if newest is not None:
                later, newest.pending = newest.pending, []
                target = _allocate(newest, targets[k - 1], values[k - 1], T, d)
            coef = torch.empty(3, k, T, dtype=cdt, device=r.device)  # w, c, e of each in-group source
            da = torch.empty_like(a)  # <G, r>, <G, v_i> (without the gate)
            dlog = torch.empty_like(a)
            if lib == TRITON:
                from megatron_delta.core import triton_group_kernels

                dq = triton_group_kernels.merge_backward(grad, r, gate, q, flat, inv, zin,
                                                         a, unit, target, later, coef, da, dlog)
            else:
                group_kernels.merge_backward(lib, grad, r, 1.0 if g is None else float(g), q, flat, inv, zin, a,
                                             unit, target, later, coef, da, dlog, dq)
            qc = q.contiguous()
            for i in needed[:-1] if newest is not None else needed:
                ctx.sinks[i].pending.append(DeferredShare(coef, i, grad, qc))
            t, fresh, seed = target  # the sink read where it is added to (in place, or the final sum's seed)
            acc = [] if t is None or fresh else [t if seed is None else seed]
            traffic.record("group_merge", "backward", reads=[grad, r, *flat, *[x.grad for x in later], *acc],
                           writes=[] if t is None else [t])
        else:
            gr = _as(grad, cdt)
            _record_cast("group_merge", "backward", grad, gr)
            da = torch.empty(1 + k, T, dtype=cdt, device=r.device)
            prod = torch.mul(gr, r)
            torch.sum(prod, -1, out=da[0])
            traffic.record("group_merge", "backward", [gr, r], [prod])
            traffic.record("group_merge", "backward", [prod], [])
            for i, vf in enumerate(flat):
                torch.sum(torch.mul(gr, vf, out=prod), -1, out=da[1 + i])
                traffic.record("group_merge", "backward", [gr, vf], [prod])
                traffic.record("group_merge", "backward", [prod], [])
            dag = da * gf
            dlog = a * (dag - (a * dag).sum(0, keepdim=True))
            for i, vf in enumerate(flat):
                vf = _as(vf, cdt)
                _record_cast("group_merge", "backward", flat[i], vf)
                c = dlog[1 + i] * inv[i]
                dq.add_(torch.mv(vf.t(), c))
                traffic.record("group_merge", "backward", [vf], [])
                if i not in needed:
                    continue
                e = -(dlog[1 + i] * zin[i]) * inv[i].square() / d
                gv = torch.mul(gr, (a[1 + i] * gf + float(unit)).unsqueeze(1))
                gv.addr_(c, q).addcmul_(vf, e.unsqueeze(1))
                traffic.record("group_merge", "backward", [gr], [gv])
                traffic.record("group_merge", "backward", [gv], [gv])
                traffic.record("group_merge", "backward", [gv, vf], [gv])
                _sink_add(ctx.sinks[i], gv, values[i].dtype, "group_merge")
            if newest is not None:  # shares a merge on the kernels deferred to this one
                _settle_pending(newest, flat[k - 1], values[k - 1].dtype)
        ctx.stash.grads[ctx.slot] = (grad_out, a[0] if g is None else a[0] * g)  # the group's backward: G, gate * beta
        grad_gate = None
        if g is not None and needs[12]:
            grad_gate = (a * da).sum().reshape(gate.shape).to(gate.dtype)
        grad_query = _as(dq, query.dtype) if needs[13] else None
        grad_base = None
        if ctx.base_dtype is not None and needs[11]:
            grad_base = _as(grad_out, ctx.base_dtype).view(ctx.base_shape)
        return (None,) * 9 + (dlog[0], None, grad_base, grad_gate, grad_query) + (None,) * k


def sum_in_order(values: Sequence[Tensor]) -> Tensor:
    """v0 + v1 + ... in order on PyTorch ops, each add recorded: the additive modes' x from their sources
    (SourceBuffer.x) where no group kernel sums them in one pass (_FinalSum)."""
    x = values[0]
    if len(values) > 1:
        x = values[0] + values[1]
        traffic.record("x_sum", "forward", values[:2], [x])
    for v in values[2:]:
        old = x
        x = x.add_(v) if x.dtype == v.dtype else x + v  # x is a fresh sum nobody saved
        traffic.record("x_sum", "forward", [old, v], [x])
    return x


class _FinalSum(torch.autograd.Function):
    """x handed out as the sum of the sources (delta, x_from_sources; SourceBuffer.x) in a scope whose routers
    route in groups.

    Inputs: lib, sinks (one per source: the source's group sink, or None), ``older`` (the scope's last group's X,
    the sum of the first ``n_older`` values, or None), n_older, then the values (a source with a sink is passed as
    its _Collect alias). Forward: x = X + the later values (or the sum of all values), one pass on the C or Triton
    kernels (each tensor read once, x written once), else PyTorch's chain of adds (each add its own pass, as
    SourceBuffer.x without groups). X is a sum the old pass has made already: the values it covers are not read
    again (at the 1B shape, 3 rows of [tokens, hidden] instead of 58).
    Backward: x's gradient is each source's gradient. Where a source has a sink it seeds it by reference (no pass)
    and the source's first group pass in backward adds it as it writes the sink, so that the source keeps one
    autograd reader (its _Collect alias) and autograd adds nothing; the other sources get it as is."""

    @staticmethod
    def forward(ctx, lib, sinks, older, n_older, *values):
        ctx.set_materialize_grads(False)
        ctx.sinks = sinks
        shape = values[0].shape
        terms = list(values) if older is None else [older.view(shape), *values[n_older:]]
        if lib is not None:
            from megatron_delta.core import group_kernels, triton_group_kernels

            d = shape[-1]
            flat = [v.reshape(-1, d).contiguous() for v in terms]
            x = torch.empty_like(flat[0])
            if lib == TRITON:
                triton_group_kernels.final_sum(flat, x)
            else:
                group_kernels.final_sum(lib, flat, x)
            traffic.record("x_sum", "forward", flat, [x])
            return x.view(shape)
        return sum_in_order(terms)

    @staticmethod
    def backward(ctx, grad):
        if grad is None:
            return (None,) * (2 + len(ctx.sinks))
        return (None, None, None, None, *seed_sinks(ctx.sinks, grad))


# --------------------------------------------------------------------------------------------- the buffer's side
class _Group:
    """The live state of one group in a SourceBuffer: its old pass's outputs and stash."""

    __slots__ = ("start", "end", "n_old", "old_values", "u0", "r", "lse", "x", "p", "stash")


class GroupRouting:
    """A SourceBuffer's group router: the groups of its scope's sublayers and the collected sources.

    ``size``: S >= 2, or ``auto`` (resolved at the scope's first route from its size and the sources its
    first router reads). Built by SourceBuffer when the plan's router_group_size is not 1."""

    def __init__(self, size: Union[int, str], sublayers: Sequence[int]) -> None:
        self.size = size
        self.sublayers = sorted(sublayers)
        self.spans: Optional[Dict[int, Tuple[int, int]]] = None
        self.resolved: Optional[Sizes] = None  # 1 (one router per pass), S, or the groups' sizes (auto)
        self.kernels: Optional[str] = None  # the routers' --delta-router-kernels choice, once resolved
        self._group: Optional[_Group] = None
        self._last: Optional[_Group] = None  # the latest group started: its X can start the final sum
        self._n_older = 0  # the sources the scope's first router reads
        self._defers: Optional[Dict[int, bool]] = None  # group start -> it defers to the previous group (OldShare)
        self._collected: Dict[int, Tuple[Tensor, Tensor, GradSink]] = {}  # id(value) -> (value, alias, sink)

    def resolve(self, routers: Sequence, value: Tensor, n_older: int, first_u: bool = True) -> Sizes:
        """The scope's group sizes, resolved once (``first_u``: each group's first router takes its u from the old
        pass, as group_plan.passes counts)."""
        if self.spans is None:
            size = resolve_sizes(self.size, len(self.sublayers), n_older, first_u=first_u,
                                 one_router_per_call=any(r.gpu_kernel(value) == "fla" for r in routers),
                                 fused_passes=_kernel_lib(routers[0].kernels, [value]) is not None)
            self.spans = group_spans(self.sublayers, size)
            self.resolved = size
            self.kernels = routers[0].kernels
            self._n_older = n_older
        return self.resolved

    def _deferring(self, a: int, unit: bool) -> bool:
        """Whether the group starting at sublayer ``a`` defers to the previous one (group_plan.deferring_groups)."""
        if self._defers is None:
            self._defers = deferring_starts(self.spans, self._n_older, unit)
        return self._defers.get(a, False)

    def _collect(self, value: Tensor) -> Tuple[Tensor, Optional[GradSink]]:
        hit = self._collected.get(id(value))
        if hit is not None and hit[0] is value:
            return hit[1], hit[2]
        if not value.requires_grad:
            self._collected[id(value)] = (value, value, None)
            return value, None
        sink = _Sink()
        alias = _Collect.apply(value, sink)
        self._collected[id(value)] = (value, alias, sink)
        return alias, sink

    def final_sum(self, values: Sequence[Tensor]) -> Optional[Tensor]:
        """x = the sum of ``values`` (the held sources, in order) when the scope's routers route in groups
        (:class:`_FinalSum`: one pass on the C / Triton kernels, from the last group's X where it covers the first
        values, and x's gradient seeds the sources' sinks); None where they do not (S = 1, or no router of the
        scope routed): SourceBuffer.x sums them itself."""
        if self.resolved in (None, 1) or len(values) < 2:
            return None
        collected = [self._collected.get(id(v)) for v in values]
        inputs = [v if hit is None or hit[0] is not v else hit[1] for v, hit in zip(values, collected)]
        sinks = [None if hit is None or hit[0] is not v else hit[2] for v, hit in zip(values, collected)]
        last, older, n_older = self._last, None, 0
        if (last is not None and last.x is not None and last.n_old < len(values)
                and all(a is b for a, b in zip(values, last.old_values))):
            older, n_older = last.x.detach(), last.n_old  # X = the sum of the values the last group's old pass read
        terms = values if older is None else [older, *values[n_older:]]
        lib = _kernel_lib(self.kernels, terms) if len({v.dtype for v in terms}) == 1 else None
        if lib is not None and lib != TRITON and not all(v.is_contiguous() for v in terms):
            lib = None
        with _no_autocast(values[0].device.type):
            return _FinalSum.apply(lib, sinks, older, n_older, *inputs)

    def route(self, buf, key: int, router, *, base: Optional[Tensor], apply_gate: bool, base_sums: bool,
              record: bool) -> Optional[Tuple[Tensor, Optional[Tensor]]]:
        """u of receiver ``key`` (as SourceBuffer.route) and, with ``record``, alpha [s, b, N(+1)]; None for a
        receiver this router does not route (the final router, or groups of one: the per-router path)."""
        if not isinstance(key, int) or key not in self.sublayers:
            return None
        values = buf.values_read(key)
        gate = router.gate if (apply_gate and router.gate is not None) else None
        first_u = gate is None and base is None  # a group's first router: u from its old pass (_OldPass)
        if self.spans is None:
            self.resolve([buf.readers[j] for j in self.sublayers], values[0], len(values), first_u)
        if self.resolved == 1:
            return None
        a, b = self.spans[key]
        unit = bool(base_sums and base is None)
        dev = values[0].device.type
        with _no_autocast(dev), _outside_fp8(router.outside_fp8):
            if key == a:
                self._start(buf, a, b, values, unit, first_u)
            grp = self._group
            if grp is None or grp.start != a or not all(map(operator.is_, values, grp.old_values)):
                raise RuntimeError(f"group router: sublayer {key} routes out of its group [{a}, {b}) (the older "
                                   f"sources changed, or the group's first router did not route)")
            k = key - a
            if k == 0 and grp.u0 is not None:
                u, w = grp.u0, None
            else:
                inside = [self._collect(v) for v in values[grp.n_old:]]
                like = base if base is not None else values[0]
                lib = _kernel_lib(router.kernels, values, [grp.r[k], base])
                u, w = _Merge.apply(k, like.dtype, buf.eps, unit, lib, [s for _, s in inside], grp.stash, k,
                                    grp.r[k], grp.lse[k], grp.x if unit else None, base, gate, buf.query(router),
                                    *[v for v, _ in inside])
        if u.shape != values[0].shape:
            u = u.view(values[0].shape)
        if key == b - 1:
            self._group = None
        alpha = None
        if record:
            with torch.no_grad():
                p = grp.p[k]
                n = grp.n_old
                if w is None:  # u from the old pass: beta = 1, no in-group source
                    w = torch.ones(1, p.shape[1], dtype=p.dtype, device=p.device)
                parts = [p[:n] * w[0], w[1:]] + ([p[n:] * w[0]] if p.shape[0] > n else [])
                alpha = torch.cat(parts).t().reshape(*values[0].shape[:-1], -1)
        return u, alpha

    def _start(self, buf, a: int, b: int, values: List[Tensor], unit: bool, first_u: bool) -> None:
        routers = [buf.readers[j] for j in range(a, b)]
        collected = [self._collect(v) for v in values]
        queries = [buf.query(r) for r in routers]
        null = []
        if routers[0].null_source is not None:
            pairs = [r._null(q) for r, q in zip(routers, queries)]
            null = [z for z, _ in pairs] + [v for _, v in pairs]
        lib = _kernel_lib(routers[0].kernels, values)
        grp = _Group()
        grp.start, grp.end, grp.n_old, grp.old_values = a, b, len(values), values
        prev = self._last  # the group this one defers to: the one just before it, whose older sources lead its own
        defer = (prev is not None and prev.end == a and self._deferring(a, unit) and prev.n_old < len(values)
                 and all(x is y for x, y in zip(prev.old_values, values)))
        grp.stash = _Stash(prev.n_old if defer else 0)
        S = b - a
        out = _OldPass.apply(len(values), S, buf.eps, unit, first_u, lib, [s for _, s in collected], grp.stash,
                             *[v for v, _ in collected], *queries, *null)
        grp.u0, grp.r = (out[0], (None, *out[1:S])) if first_u else (None, out[:S])
        grp.lse, grp.x, grp.p = out[S:2 * S], out[2 * S], out[2 * S + 1]
        self._group = self._last = grp
