"""The group router's toy configurations (tests/unit/test_group_router.py, tests/helpers/triton_cases.py): a
toy stack of L layers of width D per (mode, null source, gate, x_from_sources), its input, its pipeline or recompute
cuts, one forward and backward through them, and the same stream on the independent float64 reference's router
(reference, against_reference)."""
import torch
from torch.utils.checkpoint import checkpoint

from megatron_delta.core.sources import SourceBuffer, SourcePlan
from tests.helpers import reference_delta as R
from tests.helpers.toy_stack import EPS, Toy, sublayer

L, D, SEQ, BATCH = 3, 8, 3, 2
# (mode, null source, gate, x_from_sources): x kept as the sources (delta without a gate), x held (with the gate)
CONFIGS = [("delta", False, False, True), ("delta", True, False, True), ("delta", True, True, False),
           ("full_attnres", False, False, False), ("full_attnres", True, False, False)]
CUTS = {"none": (), "chunks": (1, 2), "chunk": (2,), "recompute": "recompute"}  # layer boundaries


def config_id(c):
    mode, null, gate, xs = c
    return f"{mode}{'-null' if null else ''}{'-gate' if gate else ''}{'-xsum' if xs else ''}"


def make_toy(mode, null, gate, xs, size, dtype=torch.float64, kernels="torch"):
    plan = SourcePlan(mode, L, L, x_from_sources=xs, router_group_size=size)
    toy = Toy(plan, D, null=null, gate=gate, seed=5, kernels=kernels)
    toy.weights = [w.detach().to(dtype).requires_grad_() for w in toy.weights]
    for r in toy.routers + ([toy.final] if toy.final else []):
        r.to(dtype)
    return toy


def make_h0(dtype, seq=SEQ, batch=BATCH):
    h0 = torch.randn(seq, batch, D, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    return h0.to(dtype).requires_grad_()


def run_recompute(toy, h0, per):
    """Full recompute of ``per`` layers at a time (as DeltaTransformerBlock._checkpointed_layers): each
    checkpointed chunk rebuilds its buffer from explicit tensors, scoped to its layers' routers."""
    plan = toy.plan
    bounds = tuple(range(per, L, per))
    tensors = [h0]
    for first in range(0, L, per):
        def fn(*ts, first=first):
            buf = SourceBuffer.from_tensors(plan, first, ts, EPS, readers=toy.readers(first, bounds))
            for j in range(2 * first, 2 * min(first + per, L)):
                buf.commit(j, sublayer(buf.routed_input(j, toy.routers[j]), toy.weights[j]))
            return tuple(buf.to_tensors())
        tensors = checkpoint(fn, *tensors, use_reentrant=False)
    return SourceBuffer.from_tensors(plan, L, tensors, EPS, readers=toy.readers(L, bounds)).output(toy.final)


def forward_backward(toy, h0, cut):
    out = run_recompute(toy, h0, 2) if cut == "recompute" else toy.run(h0, cut)[0]
    leaves = toy.params() + [h0]
    go = torch.linspace(-1, 1, out.numel(), dtype=out.dtype, device=out.device).reshape(out.shape)
    return out, torch.autograd.grad(out, leaves, go, allow_unused=True)


def run_capturing_sources(toy, h0, cut):
    """The toy's output over ``cut`` (run_recompute for "recompute"), and each sublayer's output v_j as
    SourceBuffer.commit received it."""
    vs = []
    commit = SourceBuffer.commit

    def capture(buf, j, out):
        vs.append(out)
        return commit(buf, j, out)
    try:
        SourceBuffer.commit = capture
        out = run_recompute(toy, h0, 2) if cut == "recompute" else toy.run(h0, cut)[0]
    finally:
        SourceBuffer.commit = commit
    return out, vs


def scope_runs(cut):
    """The sublayer runs of the buffers' scopes (chunks, or recompute chunks of 2 layers)."""
    bounds = [0] + (list(range(2, L, 2)) if cut == "recompute" else list(cut)) + [L]
    return [2 * (b - a) for a, b in zip(bounds, bounds[1:])]


def reference(toy, h0):
    """The toy's stream on the independent float64 reference's router (tests/helpers/reference_delta.route: every source
    stacked, the null source last, softmax over depth), with the toy's sublayers: receiver j reads
    [h0, v_0 .. v_{j-1}]; delta u_j = x + a r_j (x = h0 + the v's, the output), full_attnres u_j = r_j (the output
    the final router's). Float64 copies of the toy's parameters and of h0 are its leaves (toy.params() order, h0
    last). Returns (the output, the leaves, the sources v_0 .., each router's alpha)."""
    leaves = [p.detach().double().requires_grad_() for p in toy.params()] + [h0.detach().double().requires_grad_()]
    it = iter(leaves)
    weights = [next(it) for _ in toy.weights]
    routers = [{name: next(it) for name, _ in r.named_parameters()}
               for r in toy.routers + ([toy.final] if toy.final else [])]
    x = leaves[-1]
    srcs, alphas = [x], []
    for j, w in enumerate(weights):
        p = routers[j]
        r, alpha = R.route(srcs, p["query"], p["key_norm_weight"], p.get("null_source"), eps=EPS)
        alphas.append(alpha)
        u = x + (p["gate"] * r if "gate" in p else r) if toy.plan.additive else r
        srcs.append(sublayer(u, w))
        x = x + srcs[-1]
    if not toy.plan.additive:
        p = routers[-1]
        x, alpha = R.route(srcs, p["query"], p["key_norm_weight"], p.get("null_source"), eps=EPS)
        alphas.append(alpha)
    return x, leaves, srcs[1:], alphas


def against_reference(toy, h0, cut, tol, gtol=None):
    """The toy's output and the gradients of ``go . output`` with respect to every parameter (sublayer weights, each
    router's query, key-norm weight, null source and gate), h0 and - but under recompute, whose recomputed sources
    are not these tensors - every source v_j (captured as SourceBuffer.commit receives it): the output within
    ``tol``, each gradient within ``gtol`` (default ``tol``) of the float64 reference's (:func:`reference`),
    relative to the largest entry (1e-3 at least for a gradient)."""
    out, vs = run_capturing_sources(toy, h0, cut)
    ref_out, ref_leaves, ref_vs, _ = reference(toy, h0)
    assert len(vs) == len(ref_vs) == 2 * L and out.shape == ref_out.shape
    wrt, ref_wrt = toy.params() + [h0], list(ref_leaves)
    if cut != "recompute":
        wrt, ref_wrt = wrt + vs, ref_wrt + ref_vs
    go = torch.linspace(-1, 1, out.numel(), dtype=torch.float64).reshape(out.shape)
    grads = torch.autograd.grad(out, wrt, go.to(out.dtype), allow_unused=True)
    ref_grads = torch.autograd.grad(ref_out, ref_wrt, go, allow_unused=True)
    err = (out.double() - ref_out).abs().max().item() / ref_out.abs().max().item()
    assert err <= tol, err
    for i, (g, r) in enumerate(zip(grads, ref_grads, strict=True)):
        assert (g is None) == (r is None), i
        if r is not None:
            e = (g.double() - r).abs().max().item() / max(r.abs().max().item(), 1e-3)
            assert e <= (tol if gtol is None else gtol), (i, e)
