"""The interpreter cases of tests/test_triton_router.py: the router on the project's Triton kernels
(megatron_delta/core/triton_router.py), on CPU. Run by that test in a fresh process with TRITON_INTERPRET=1:
Triton reads the variable when its own functions are jitted, at its import, so it must be set before anything
imports Triton (in a whole-suite pytest process fla's tests import it first). fp32 only (the interpreter's bf16
is not trustworthy). Yardsticks: the float64 reference router (tests/reference_delta.route, written from
docs/design.md alone) and the routers' PyTorch path (kernels='torch'). That the kernels ran is proven by their
calls in the traffic count (core/traffic.py), which is also checked against triton_router.call_rows.
"""
import itertools

import pytest
import torch

from megatron_delta.core import group_router, traffic, triton_router
from megatron_delta.core.router import DepthRouter, make_source
from megatron_delta.core.sources import SourcePlan
from tests import kernel_models as K
from tests import reference_delta as R
from tests import test_group_router as G

EPS = 1e-6


@pytest.fixture(scope="module")
def interpreter():
    if not triton_router.interpreting():
        pytest.fail("run through tests/test_triton_router.py (it sets TRITON_INTERPRET=1 before Triton is imported)")


def _calls(count):
    return [c for c in count.calls if c.kernel == triton_router.KERNEL]


def _routers(kind, n, d, null, gate, seed):
    g = torch.Generator().manual_seed(seed)
    rs = [DepthRouter(d, null_source=null, gate=gate is not None, eps=EPS, kernels=kind) for _ in range(n)]
    with torch.no_grad():
        for i, r in enumerate(rs):
            r.query.copy_(torch.randn(d, generator=g))
            r.key_norm_weight.copy_(torch.empty(d).uniform_(0.5, 1.5, generator=g))
            if null:
                r.null_source.copy_(torch.randn(d, generator=g))
            if gate is not None:
                r.gate.fill_(gate + 0.2 * i)
    return rs


BASES = ["none", "x", "formed"]  # u = r; x + r; the sum of the sources + r (formed in the kernel's pass)


@pytest.mark.parametrize("null,gate,base", list(itertools.product([False, True], [None, 0.4], BASES)))
def test_routers_match_reference_and_torch_path(interpreter, null, gate, base):
    """Three routers reading 1, 2, 3 fp32 sources (source 0 has three readers, which add their gradients into
    one buffer in place; source 2 has one), with and without null source and gate, for every base: the outputs,
    the routing weights and EVERY gradient (sources, x, query, key-norm weight, null source, gate) equal the
    PyTorch path's to fp32 round-off and the float64 reference's."""
    d, shape = 40, (7, 3)  # d not a power of two: the tile's masked columns
    torch.manual_seed(3)
    vals64 = [torch.randn(*shape, d, dtype=torch.float64) * (1 + i) for i in range(3)]
    x64 = torch.randn(*shape, d, dtype=torch.float64)
    W = torch.randn(*shape, d, dtype=torch.float64)
    seed = 11 + null + 2 * (gate is not None)

    def run(kind):
        rs = _routers("torch" if kind == "ref" else kind, 3, d, null, gate, seed)
        dtype = torch.float64 if kind == "ref" else torch.float32
        vals = [v.to(dtype).requires_grad_() for v in vals64]
        params = [p for r in rs for p in r.parameters()]
        if kind == "triton":  # as SourceBuffer makes them: one gradient buffer for a source with several readers
            srcs = [make_source(v, EPS)._replace(sink=rs[0].kernel_sink(v) if i < 2 else None)
                    for i, v in enumerate(vals)]
            assert all(isinstance(s.sink, triton_router.KernelSink) for s in srcs[:2])
        else:
            srcs = [make_source(v, EPS) for v in vals]
        total, outs, alphas, xs = 0, [], [], []
        for k, r in enumerate(rs):
            x = x64.to(dtype, copy=True).requires_grad_() if base == "x" else None
            xs += [x] if x is not None else []
            if kind == "ref":
                p = {n: t.double() for n, t in r.named_parameters()}
                out, alpha = R.route(vals[: k + 1], p["query"], p["key_norm_weight"], p.get("null_source"), eps=EPS)
                out = out * p["gate"] if gate is not None else out
                out = out + (x if x is not None else sum(vals[: k + 1]) if base == "formed" else 0)
            else:
                out, alpha = r(srcs[: k + 1], True, apply_gate=True, base=x, base_sums=base == "formed")
                assert out.dtype == torch.float32 and alpha.dtype == torch.float32
            outs.append(out.detach().double())
            alphas.append(alpha.detach().double())
            total = total + (out.double() * W).sum() * (k + 1)
        grads = torch.autograd.grad(total, vals + xs + params, allow_unused=True)
        kinds = ["value"] * len(vals + xs) + [n for r in rs for n, _ in r.named_parameters()]
        return outs, alphas, grads, kinds

    with traffic.counting() as count:
        got = run("triton")
    assert [c.phase for c in _calls(count)] == ["forward"] * 3 + ["backward"] * 3, "the kernels must have run"
    with traffic.counting() as count:
        torch_path = run("torch")
    assert not _calls(count)
    ref = run("ref")
    kinds = ref[3]
    scales = {k: max(g.abs().max().item() for g, kk in zip(ref[2], kinds) if kk == k and g is not None)
              for k in set(kinds)}
    for name, cand, tol in (("float64", ref, 1e-5), ("torch", torch_path, 2e-6)):
        for o, oref in zip(got[0], cand[0], strict=True):
            torch.testing.assert_close(o, oref, rtol=tol, atol=tol * oref.abs().max().item(), msg=name)
        for a, aref in zip(got[1], cand[1], strict=True):
            torch.testing.assert_close(a, aref, rtol=tol, atol=tol, msg=name)
        for i, (g, gr) in enumerate(zip(got[2], cand[2], strict=True)):
            assert (g is None) == (gr is None), (name, i)
            if gr is not None:  # relative to the largest gradient of the same kind (alpha == 1: zero gradients)
                scale = scales[kinds[i]] if kinds[i] != "value" else gr.abs().max().item()
                torch.testing.assert_close(g.double(), gr.double(), rtol=10 * tol, atol=10 * tol * scale,
                                           msg=lambda m, name=name, i=i: f"{name} grad {i} ({kinds[i]}): {m}")


def test_traffic_per_call_is_call_rows(interpreter):
    """The counted [tokens, hidden] traffic of each kernel call is triton_router.call_rows: forward reads each
    source (and x) once and writes u once; backward reads the output gradient and each source once and writes
    each source's gradient once, reading the buffer first where an earlier reader's gradient is already in it
    (three routers over a shared source, backward in reverse order: the last router's call makes the buffer)."""
    d, shape = 32, (6, 4)
    torch.manual_seed(0)
    rs = _routers("triton", 3, d, True, 0.3, 5)
    h0 = torch.randn(*shape, d, requires_grad=True)
    mine = [torch.randn(*shape, d, requires_grad=True) for _ in range(3)]
    x = torch.randn(*shape, d, requires_grad=True)
    shared = make_source(h0, EPS)._replace(sink=rs[0].kernel_sink(h0))
    own = [make_source(m, EPS) for m in mine]  # made outside the count: make_source's 1/rms is not a kernel call
    with traffic.counting() as count:
        total = 0
        for k, r in enumerate(rs):  # router k reads h0 (shared) and its own source; router 1 adds x
            out = r([shared, own[k]], apply_gate=True, base=x if k == 1 else None, base_sums=k == 2)
            total = total + out.square().sum()
        total.backward()
    calls = _calls(count)
    rows = h0.numel()
    counted = [(sum(n * e for n, e in c.reads if n >= rows) + sum(n * e for n, e in c.writes if n >= rows))
               / (rows * 4) for c in calls]
    want = [triton_router.call_rows(2, has_base=k == 1)["forward"] for k in range(3)]
    want += [triton_router.call_rows(2, has_base=k == 1, accumulated=int(k < 2))["backward"] for k in (2, 1, 0)]
    assert counted == want == [3, 4, 3, 5, 6, 6]
    assert count.total_rows(rows, act_bytes=4) == sum(want)


def test_strided_sources(interpreter):
    """Sources that are strided views (a transposed tensor, a slice of a wider one) route as their contiguous
    copies would: outputs and gradients equal the PyTorch path's."""
    d = 16
    torch.manual_seed(4)
    base = [torch.randn(d, 3, 4), torch.randn(4, 3, 2 * d)]
    results = {}
    for kind in ("triton", "torch"):
        (r,) = _routers(kind, 1, d, False, 0.2, 3)
        leaves = [b.clone().requires_grad_() for b in base]
        vals = [leaves[0].permute(2, 1, 0), leaves[1][..., ::2]]  # [4, 3, d] each, neither contiguous
        assert not any(v.is_contiguous() for v in vals)
        out = r([make_source(v, EPS) for v in vals], apply_gate=True)
        out.square().sum().backward()
        results[kind] = [out.detach()] + [t.grad for t in leaves] + [p.grad for p in r.parameters()]
    for a, b in zip(results["triton"], results["torch"], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * b.abs().max().item())


def test_partial_sum_formed_in_the_pass(interpreter):
    """A source held as a pending sum P + v (SourceBuffer.hold_sum) whose one reader runs on the kernels is formed
    in that router's pass: the sum equals P + v bitwise, the output and every gradient (P, v, h0, the router's
    parameters, the sum's later reader) the PyTorch path's, and the traffic is call_rows with forms_partial."""
    from megatron_delta.core.router import PendingSum

    d, shape = 24, (5, 2)
    torch.manual_seed(1)
    data = [torch.randn(*shape, d) for _ in range(3)]
    W = torch.randn(*shape, d)
    results = {}
    for kind in ("triton", "torch"):
        (r,) = _routers(kind, 1, d, True, 0.3, 8)
        h0, p, v = (t.clone().requires_grad_() for t in data)
        pending = PendingSum(p, v)
        src = [make_source(h0, EPS), make_source(p, EPS)._replace(pending=pending)]
        with traffic.counting() as count:
            out = r(src, apply_gate=True, base_sums=True)
            formed = pending.value
            ((out * W).sum() + (formed * formed.detach()).sum()).backward()  # the sum has a later reader
        assert torch.equal(formed.detach(), data[1] + data[2])
        results[kind] = [out.detach(), h0.grad, p.grad, v.grad, *(q.grad for q in r.parameters())]
        calls = _calls(count)
        if kind == "triton":
            rows = h0.numel()
            counted = [count.total_rows(rows, act_bytes=4, phase=ph) for ph in ("forward", "backward")]
            want = triton_router.call_rows(2, has_base=False, forms_partial=True)
            assert len(calls) == 2 and counted == [want["forward"], want["backward"]] == [5, 6]
        else:
            assert not calls
    for a, b in zip(results["triton"], results["torch"], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * b.abs().max().item())


@pytest.fixture(scope="module")
def dist():
    from megatron_delta.platform.distributed import initialize_distributed

    initialize_distributed(1, 1, None, 1, seed=1234)
    yield


def _ran(count, group_calls):
    """Whether the Triton kernels routed: per-router calls in the traffic count, or the group router's kernels."""
    return bool(_calls(count)) or bool(group_calls)


MODEL_CASES = [("delta_block", False, False), ("delta_block", True, True), ("attnres", False, False),
               ("attnres", True, False), ("delta", True, True), ("full_attnres", False, False)]


@pytest.mark.parametrize("mode", ["delta_block", "attnres"])
def test_model_with_recompute_on_the_kernels(interpreter, dist, mode):
    """Full recompute of every layer (the forward runs once without autograd, again in backward): the logits and
    every parameter's gradient of the model on the kernels equal the PyTorch path's."""
    tok, pos, W = K.batch()
    results = {}
    for kind in ("triton", "torch"):
        model, _ = K.build(mode, True, False, kind, recompute=True)
        with traffic.counting() as count:
            logits = model(tok, pos, None)
            (logits * W).sum().backward()
        assert bool(_calls(count)) == (kind == "triton")
        results[kind] = (logits.detach(), {n: p.grad for n, p in model.named_parameters()})
    K.assert_matches_torch(results["triton"], results["torch"])


@pytest.mark.parametrize("mode,null,gate", MODEL_CASES, ids=["-".join(map(str, c)) for c in MODEL_CASES])
def test_model_on_the_kernels_matches_reference_and_torch(interpreter, dist, mode, null, gate, monkeypatch):
    """Every mode's model (4 layers, K = 2) with its routers on the kernels (delta / delta_block without a gate
    form x from the sources in the kernel's pass, with a gate u = x + a r; delta's and full_attnres' sublayer
    routers in groups on the group router's Triton kernels, --delta-router-group-size auto): the logits and every
    parameter's gradient equal the PyTorch-path model's, and the logits and the routers' gradients the float64
    reference's. For delta_block without a gate the counted traffic of the step is the sum of call_rows over its
    routers (h0 and D0 read by several routers: gradients added in place; P_b formed in the pass of its reader
    from the third sublayer of a block on)."""
    tok, pos, W = K.batch()
    group_calls = _group_kernel_calls(monkeypatch)
    results = {}
    for kind in ("triton", "torch"):
        model, fields = K.build(mode, null, gate, kind)
        group_calls.clear()
        with traffic.counting() as count:
            logits = model(tok, pos, None)
            (logits * W).sum().backward()
        assert _ran(count, group_calls) == (kind == "triton")
        results[kind] = (logits.detach(), {n: p.grad for n, p in model.named_parameters()}, model, fields, count)
    (lf, gf, model, fields, count), (lt, gt, _, _, _) = results["triton"], results["torch"]
    K.assert_matches_torch((lf, gf), (lt, gt))
    if mode == "delta_block" and not gate:
        plan = SourcePlan.from_config(fields)
        assert plan.x_from_sources  # the kernels form x from the sources
        reads = [plan.reads(j) for j in range(plan.num_sublayers)]
        readers = {name: sum(name in r for r in reads) for r in reads for name in r if not name.startswith("P")}
        formed = [j >= 2 and not plan.is_block_start(j) and not plan.is_block_start(j - 1)  # P_b = P_b + v_{j-1}
                  for j in range(plan.num_sublayers)]
        want = {ph: sum(triton_router.call_rows(len(r), has_base=False, forms_partial=f)[ph]
                        for r, f in zip(reads, formed)) for ph in ("forward", "backward")}
        want["backward"] += sum(k - 1 for k in readers.values())  # h0 and D0: added in place by all but one
        rows = count.rows(K.B * K.S * K.HIDDEN, act_bytes=4)
        got = {ph: rows[triton_router.KERNEL, ph] for ph in want}  # the kernels' calls (the rest: PyTorch's passes)
        assert sum(formed) == 4 and got == want == {"forward": 34, "backward": 58}
        # the passes outside the kernels: x = h0 + D0 + D1 handed out (2 adds), D0 and D1 formed by PyTorch's add
        # (several readers / read by that sum: not in a kernel), and autograd's adds of two gradients for h0, D0
        # (kernel sink + x's sum) and v0, v4 (their reader's kernel + the kernel that formed P from them)
        assert {k: v for k, v in rows.items() if k[0] != triton_router.KERNEL} == {
            ("x_sum", "forward"): 6, ("partial_sum", "forward"): 6, ("autograd_add", "backward"): 12}
    K.assert_matches_reference(model, fields, lf, gf, tok, W, mode, null, gate)


def test_fallback_float64_and_auto_on_cpu(interpreter):
    """float64 sources (the gradchecks) take the PyTorch path with `triton` (the kernels compute in fp32), with
    the PyTorch path's result exactly; `auto` on CPU tensors never picks the kernels (C kernels), even under the
    interpreter."""
    d = 16
    vals = [torch.randn(3, 2, d, dtype=torch.float64) for _ in range(2)]
    (rt,), (rp,) = _routers("triton", 1, d, True, 0.3, 2), _routers("torch", 1, d, True, 0.3, 2)
    outs = []
    with traffic.counting() as count:
        for r in (rt.double(), rp.double()):
            vs = [v.clone().requires_grad_() for v in vals]
            out = r([make_source(v, EPS) for v in vs], apply_gate=True)
            out.square().sum().backward()
            outs.append([out] + [v.grad for v in vs] + [p.grad for p in r.parameters()])
    assert not _calls(count)
    assert triton_router.fallback_reason(vals).startswith("sources in torch.float64")
    for a, b in zip(*outs, strict=True):
        assert torch.equal(a, b)
    auto = DepthRouter(d, null_source=False, gate=False, eps=EPS, kernels="auto")
    assert not auto.routes_in_kernel(torch.empty(2, d)) and auto.kernel_sink(torch.empty(2, d)) is None


@pytest.mark.parametrize("mode", ["delta_block", "attnres"])
def test_counted_traffic_is_the_closed_form(interpreter, dist, mode):
    """The traffic of a step of the model on the kernels, counted per (kernel, phase), equals the GPU cost model's
    closed form (perf.cost_model.step_traffic, backend triton: its kernels' call_rows, the partial sums formed in
    the pass or by PyTorch's add, x's sum and autograd's adds), with and without the null source and gate, and
    under full recompute (every layer its own checkpoint)."""
    from megatron_delta.perf import cost_model

    tok, pos, _ = K.batch()
    for null, gate, recompute in ((False, False, False), (True, mode == "delta_block", False), (False, False, True)):
        model, fields = K.build(mode, null, gate, "triton", recompute=recompute)
        with traffic.counting() as count:
            model(tok, pos, None).sum().backward()
        counted = count.rows(K.B * K.S * K.HIDDEN, act_bytes=4)
        predicted = cost_model.step_traffic(mode, 4, "triton", num_blocks=fields.delta_num_blocks, act_bytes=4,
                                            null_source=null, gate=gate,
                                            recompute=("uniform", 1) if recompute else None)
        assert counted == pytest.approx(predicted, abs=1e-9), (null, gate, recompute)


# ---------------------------------------------------------------------------------------- the group router
def _group_kernel_calls(monkeypatch):
    """Counts the calls of the group router's four Triton kernels (core/triton_group_kernels.py)."""
    from megatron_delta.core import triton_group_kernels

    calls = {}
    for name in ("old_forward", "old_backward", "merge_forward", "merge_backward"):
        fn = getattr(triton_group_kernels, name)

        def counted(*a, _fn=fn, _name=name, **k):
            calls[_name] = calls.get(_name, 0) + 1
            return _fn(*a, **k)
        monkeypatch.setattr(triton_group_kernels, name, counted)
    return calls


@pytest.mark.parametrize("config", G.CONFIGS, ids=G._cid)
def test_group_router_on_the_kernels(interpreter, config, monkeypatch):
    """The group router of delta / full_attnres on its Triton kernels (fp32), for S in {2, 3, all} with the
    groups cut by a chunk boundary: the output and every gradient (sublayer weights, so the sources; each
    router's query, key-norm weight, null source and gate; the embedding output) equal the PyTorch group path's
    (the same S and cut) and the per-router path's to fp32 round-off; each of the four kernels runs, once per
    group (old pass) or router (merge) and phase."""
    calls = _group_kernel_calls(monkeypatch)
    cut = G.CUTS["chunk"]
    h0 = G._h0(torch.float32)
    per_router = G._forward_backward(G._toy(*config, 1, torch.float32, "torch"), h0, ())
    assert not calls
    for size in (2, 3, "all"):
        S = 2 * G.L if size == "all" else size
        got = G._forward_backward(G._toy(*config, S, torch.float32, "triton"), h0, cut)
        groups = sum(-(-n // S) for n in G._scopes(cut))
        assert calls == {"old_forward": groups, "old_backward": groups, "merge_forward": 2 * G.L,
                         "merge_backward": 2 * G.L}, (size, calls)
        calls.clear()
        torch_group = G._forward_backward(G._toy(*config, S, torch.float32, "torch"), h0, cut)
        assert not calls
        for name, want, tol in (("torch group", torch_group, 2e-6), ("per-router", per_router, 1e-5)):
            torch.testing.assert_close(got[0], want[0], rtol=tol, atol=tol * want[0].abs().max().item(), msg=name)
            for i, (g, r) in enumerate(zip(got[1], want[1], strict=True)):
                assert (g is None) == (r is None), (name, size, i)
                if r is not None:
                    torch.testing.assert_close(g, r, rtol=10 * tol, atol=10 * tol * max(r.abs().max().item(), 1e-3),
                                               msg=lambda m, name=name, i=i: f"{name} S={size} grad {i}: {m}")


@pytest.mark.parametrize("config", G.CONFIGS, ids=G._cid)
def test_group_router_traffic_is_the_closed_form(interpreter, config):
    """The group router's recorded reads and writes on the Triton kernels are group_router.passes, as on the C
    kernels (fp32: one pass is one [T, d] fp32 tensor)."""
    mode, null, gate, xs = config
    S = 3
    with traffic.counting() as count:
        G._forward_backward(G._toy(*config, S, torch.float32, "triton"), G._h0(torch.float32), ())
    rows = count.rows(G.SEQ * G.BATCH * G.D, act_bytes=4)
    counted = sum(v for (kernel, _), v in rows.items() if kernel.startswith("group_"))
    n_read = 2 * G.L  # h0, v0 .. v_{2L-2}: each source a router reads
    assert counted == group_router.passes(2 * G.L, 1, S, unit=xs, base=gate) - n_read
