"""DepthRouter / make_source: exact math against the independent float64 reference's router
(tests/helpers/reference_delta.route), dtypes, init facts, memory."""
import itertools

import pytest
import torch
from torch.func import functional_call

from megatron_delta.core.router import DepthRouter, make_source
from tests.helpers import reference_delta as R

EPS = 1e-6


def reference_route(values, w, g, z, a, eps):
    """The independent float64 reference's router (tests/helpers/reference_delta.route: every source stacked, null last,
    softmax over depth), with the gate applied as the routed layer applies it: r = a * r."""
    r, alpha = R.route(list(values), w, g, z, eps)
    return (a * r if a is not None else r), alpha


def _params(router):
    return {k: v for k, v in router.named_parameters()}


@pytest.mark.parametrize("n,null,gate", list(itertools.product([1, 2, 7], [False, True], [False, True])))
def test_gradcheck_against_the_reference(n, null, gate):
    torch.manual_seed(n + 10 * null + 100 * gate)
    s, b, d = 2, 2, 4
    router = DepthRouter(d, null_source=null, gate=gate, eps=EPS).double()
    w = torch.randn(d, dtype=torch.float64, requires_grad=True)
    g = (1 + 0.3 * torch.randn(d, dtype=torch.float64)).requires_grad_()
    z = torch.randn(d, dtype=torch.float64, requires_grad=True) if null else None
    a = torch.tensor([0.7], dtype=torch.float64, requires_grad=True) if gate else None
    values = [torch.randn(s, b, d, dtype=torch.float64, requires_grad=True) for _ in range(n)]

    def ours(w, g, z, a, *vals):
        params = {"query": w, "key_norm_weight": g}
        if z is not None:
            params["null_source"] = z
        if a is not None:
            params["gate"] = a
        srcs = [make_source(v, EPS) for v in vals]
        r, alpha = functional_call(router, params, (srcs, True), {"apply_gate": True})
        return r, alpha

    inputs = [t for t in (w, g, z, a) if t is not None] + values

    def f(*flat):
        it = iter(flat)
        ww, gg = next(it), next(it)
        zz = next(it) if null else None
        aa = next(it) if gate else None
        return ours(ww, gg, zz, aa, *it)[0]

    r, alpha = ours(w, g, z, a, *values)
    r_ref, alpha_ref = reference_route(values, w, g, z, a, EPS)
    torch.testing.assert_close(r, r_ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(alpha, alpha_ref, rtol=1e-12, atol=1e-12)
    assert alpha.shape == (s, b, n + int(null))

    # Same gradients as the reference router (autograd through torch.stack) ...
    go = torch.randn_like(r)
    grads = torch.autograd.grad(r, inputs, go)
    grads_ref = torch.autograd.grad(r_ref, inputs, go)
    for x, y in zip(grads, grads_ref):
        torch.testing.assert_close(x, y, rtol=1e-10, atol=1e-12)
    # ... and the custom backward is the derivative of the custom forward.
    assert torch.autograd.gradcheck(f, inputs, eps=1e-6, atol=1e-8, rtol=1e-6, fast_mode=(n > 2))


def test_make_source_inv_rms():
    v = torch.randn(3, 2, 6, dtype=torch.float64, requires_grad=True)
    src = make_source(v, 1e-3)
    ref = torch.rsqrt(v.pow(2).mean(-1) + 1e-3)
    torch.testing.assert_close(src.inv_rms, ref, rtol=1e-14, atol=0)
    assert src.value is v
    # a cache: the router differentiates through it analytically (checked by the gradchecks)
    assert not src.inv_rms.requires_grad
    vb = torch.randn(4, 1, 32).bfloat16()
    inv = make_source(vb, 1e-6).inv_rms
    assert inv.dtype == torch.float32 and inv.shape == (4, 1)
    torch.testing.assert_close(inv, torch.rsqrt(vb.float().pow(2).mean(-1) + 1e-6))


def test_init_params_and_attributes_no_rng():
    state = torch.get_rng_state()
    router = DepthRouter(16, null_source=True, gate=True, eps=EPS, sequence_parallel=True)
    assert torch.equal(torch.get_rng_state(), state), "router init must not consume random numbers"
    assert torch.equal(router.query, torch.zeros(16))
    assert torch.equal(router.key_norm_weight, torch.ones(16))
    assert torch.equal(router.null_source, torch.zeros(16))
    assert router.gate.shape == (1,) and router.gate.item() == 0.0
    for p in router.parameters():
        assert p.dtype == torch.float32
        assert p.sequence_parallel is True
        assert p.tensor_model_parallel is False
        assert p.is_delta_router is True
    plain = DepthRouter(16, null_source=False, gate=False, eps=EPS)
    assert plain.null_source is None and plain.gate is None
    assert [n for n, _ in plain.named_parameters()] == ["query", "key_norm_weight"]
    assert all(p.sequence_parallel is False for p in plain.parameters())


@pytest.mark.parametrize("null", [False, True])
def test_zero_query_gives_uniform_mean(null):
    torch.manual_seed(0)
    router = DepthRouter(8, null_source=null, gate=False, eps=EPS)
    vals = [torch.randn(4, 2, 8) for _ in range(5)]
    r, alpha = router([make_source(v, EPS) for v in vals], True)
    m = 5 + int(null)
    torch.testing.assert_close(alpha, torch.full((4, 2, m), 1.0 / m))
    # zero null source: its value is 0, so the readout is sum(values) / m
    torch.testing.assert_close(r, torch.stack(vals).sum(0) / m)


def test_bf16_sources_fp32_math():
    torch.manual_seed(1)
    router = DepthRouter(32, null_source=True, gate=True, eps=EPS)
    with torch.no_grad():
        router.query.normal_()
        router.null_source.normal_()
        router.gate.fill_(0.5)
    vals = [torch.randn(6, 2, 32).bfloat16() for _ in range(4)]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        r = router([make_source(v, EPS) for v in vals])
        rg = router([make_source(v, EPS) for v in vals], apply_gate=True)
    assert r.dtype == torch.bfloat16 and rg.dtype == torch.bfloat16
    r32 = router([make_source(v.float(), EPS) for v in vals])
    assert r32.dtype == torch.float32
    # fp32 math on the bf16 values, one final rounding
    assert torch.equal(r, r32.bfloat16())
    assert torch.equal(rg, (0.5 * r32).bfloat16())
    assert router.gated(r).dtype == torch.bfloat16
    # inv_rms is fp32 even for bf16 values
    assert make_source(vals[0], EPS).inv_rms.dtype == torch.float32


def test_bf16_parameters_fp32_math():
    """--bf16: Megatron-Core's Float16Module makes the router parameters bf16; q = w * g and the null source's
    logit are still formed in fp32 (design.md 2.5). Against a router holding the same (bf16-representable)
    values in fp32: q equal (a product of two bf16 values is exact in fp32), the weights equal to fp32
    rounding; q rounded to bf16 moves the weights by ~1e-3."""
    torch.manual_seed(5)
    d = 64
    router32 = DepthRouter(d, null_source=True, gate=True, eps=EPS)
    with torch.no_grad():
        router32.query.normal_(std=2.0)
        router32.key_norm_weight.copy_(1 + 0.3 * torch.randn(d))
        router32.null_source.normal_()
        router32.gate.fill_(0.5)
        for p in router32.parameters():
            p.copy_(p.bfloat16().float())  # values a bf16 parameter holds exactly
    router16 = DepthRouter(d, null_source=True, gate=True, eps=EPS)
    router16.load_state_dict(router32.state_dict())
    router16.bfloat16()  # as Float16Module does
    assert {p.dtype for p in router16.parameters()} == {torch.bfloat16}
    q16, q32 = router16.query_vector(), router32.query_vector()
    assert q16.dtype == torch.float32 and torch.equal(q16, q32)
    vals = [torch.randn(5, 2, d).bfloat16() for _ in range(3)]
    r16, a16 = router16([make_source(v, EPS) for v in vals], True)
    r32, a32 = router32([make_source(v, EPS) for v in vals], True)
    assert a16.dtype == torch.float32 and a16.shape[-1] == 4  # the null source last
    torch.testing.assert_close(a16, a32, rtol=0, atol=2e-6)
    torch.testing.assert_close(r16.float(), r32.float(), rtol=0, atol=0)
    # the null source alone (no sources): its logit is fp32 too, r is z itself
    like = torch.zeros(2, 1, d, dtype=torch.bfloat16)
    z16, w16 = router16([], True, like=like)
    z32, w32 = router32([], True, like=like)
    assert torch.equal(z16, z32) and torch.equal(w16, w32)


def test_like_sets_output_dtype():
    router = DepthRouter(8, null_source=False, gate=True, eps=EPS)
    vals = [torch.randn(3, 1, 8).bfloat16() for _ in range(2)]
    x = torch.randn(3, 1, 8)  # e.g. an fp32 residual stream with bf16 sublayer outputs
    r = router([make_source(v, EPS) for v in vals], like=x, apply_gate=True)
    assert r.dtype == torch.float32


@pytest.mark.parametrize("kernels", ["torch", "auto"])
def test_fp32_under_autocast(kernels):
    """Under torch.autocast the routers' math stays fp32 (router._no_autocast switches it off around it): the same
    bits as without autocast, with the sources projected for their reader in one pass (_ProjectSource: a matmul,
    which autocast would run in bf16) and by the router itself, on PyTorch ops and on the C kernels."""
    torch.manual_seed(3)
    router = DepthRouter(64, null_source=True, gate=False, eps=EPS, kernels=kernels)
    with torch.no_grad():
        router.query.normal_()
        router.null_source.normal_()
    vals = [torch.randn(5, 2, 64) for _ in range(3)]
    for readers in ([router], []):
        want = router([make_source(v, EPS, readers) for v in vals])
        with torch.autocast("cpu", dtype=torch.bfloat16):
            r = router([make_source(v, EPS, readers) for v in vals])
        assert r.dtype == torch.float32 and torch.equal(r, want), readers


def test_gate_zero_is_identity_and_fused_matches():
    torch.manual_seed(2)
    router = DepthRouter(8, null_source=False, gate=True, eps=EPS)
    with torch.no_grad():
        router.query.normal_()
    x = torch.randn(3, 2, 8)
    srcs = [make_source(torch.randn(3, 2, 8), EPS) for _ in range(3)]
    assert torch.equal(x + router.gated(router(srcs)), x)
    assert torch.equal(x + router(srcs, apply_gate=True), x)
    with torch.no_grad():
        router.gate.fill_(0.3)
    torch.testing.assert_close(router(srcs, apply_gate=True), router.gated(router(srcs)))


@pytest.mark.parametrize("null,gate", [(False, False), (True, True), (False, True)])
def test_zero_sources(null, gate):
    router = DepthRouter(4, null_source=null, gate=gate, eps=EPS)
    with torch.no_grad():
        if null:
            router.null_source.copy_(torch.tensor([1.0, -2.0, 3.0, 0.5]))
        if gate:
            router.gate.fill_(2.0)
    like = torch.randn(3, 2, 4).bfloat16()
    r, alpha = router([], True, like=like, apply_gate=True)
    assert r.shape == like.shape and r.dtype == like.dtype
    expect = torch.zeros(4) if not null else router.null_source.detach()
    if gate:
        expect = 2.0 * expect
    assert torch.equal(r, expect.bfloat16().expand(3, 2, 4))
    assert alpha.shape == (3, 2, int(null))
    r.float().sum().backward()
    for name, p in router.named_parameters():
        assert p.grad is not None, name  # every parameter takes part (DDP-friendly)
    with pytest.raises(ValueError, match="like"):
        router([])


def test_router_saves_no_copies_of_sources():
    """The router saves the sources by reference plus O(N * tokens) fp32 scalars, never a stack."""
    torch.manual_seed(3)
    s, b, d, n = 8, 2, 64, 6
    router = DepthRouter(d, null_source=True, gate=True, eps=EPS)
    vals = [torch.randn(s, b, d, requires_grad=True) for _ in range(n)]
    srcs = [make_source(v, EPS) for v in vals]
    known = {v.untyped_storage().data_ptr() for v in vals}
    known |= {src.inv_rms.untyped_storage().data_ptr() for src in srcs}
    new_bytes = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in known:
            new_bytes[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        r = router(srcs, apply_gate=True)
    # new saved storage: dots [n, s*b] + a few [d] / scalar router tensors
    assert sum(new_bytes.values()) <= 4 * n * s * b + 4 * 8 * d + 64
    r.sum().backward()
    assert all(v.grad is not None for v in vals)


def test_shared_projection_grads_and_second_backward():
    """Sources projected once for several routers (make_source readers=...) give the reference
    gradients; a second backward of a retained graph gives them again (the sinks are emptied)."""
    torch.manual_seed(4)
    d = 8
    routers = [DepthRouter(d, null_source=True, gate=True, eps=EPS).double() for _ in range(3)]
    with torch.no_grad():
        for r in routers:
            r.query.normal_()
            r.null_source.normal_()
            r.gate.fill_(0.6)
    vals = [torch.randn(3, 2, d, dtype=torch.float64, requires_grad=True) for _ in range(3)]
    x = torch.randn(3, 2, d, dtype=torch.float64, requires_grad=True)

    def run(shared):
        # router k reads the first k+1 sources, as sublayer k of `delta` does
        srcs = [make_source(v, EPS, routers[i:] if shared else ()) for i, v in enumerate(vals)]
        return sum(routers[k](srcs[: k + 1], base=x, apply_gate=True).pow(2).sum() for k in range(3))

    def reference():
        total = 0
        for k, r in enumerate(routers):
            rr, _ = reference_route(vals[: k + 1], r.query, r.key_norm_weight, r.null_source, r.gate, EPS)
            total = total + (x + rr).pow(2).sum()
        return total

    leaves = vals + [x] + [p for r in routers for p in r.parameters()]
    ref = torch.autograd.grad(reference(), leaves)
    loss = run(shared=True)
    torch.testing.assert_close(loss, run(shared=False), rtol=1e-12, atol=1e-12)
    for _ in range(2):
        got = torch.autograd.grad(loss, leaves, retain_graph=True)
        for g, gr in zip(got, ref):
            torch.testing.assert_close(g, gr, rtol=1e-10, atol=1e-12)


def _kernel_calls(monkeypatch):
    """Count the C kernel calls (to prove a test ran the path it means to)."""
    from megatron_delta.core import cpu_kernels

    calls = {"forward": 0, "backward": 0}
    fwd, bwd = cpu_kernels.route_forward, cpu_kernels.route_backward

    def counting_fwd(*a, **k):
        calls["forward"] += 1
        return fwd(*a, **k)

    def counting_bwd(*a, **k):
        calls["backward"] += 1
        return bwd(*a, **k)

    monkeypatch.setattr(cpu_kernels, "route_forward", counting_fwd)
    monkeypatch.setattr(cpu_kernels, "route_backward", counting_bwd)
    return calls


@pytest.mark.parametrize("null,gate,with_base,shared", list(itertools.product([False, True], repeat=4)))
def test_c_kernels_match_reference(null, gate, with_base, shared, monkeypatch):
    """The fused C kernels (kernels='c', fp32) give the float64 reference router's outputs and every
    gradient (sources, base, query, key norm, null source, gate) to fp32 round-off, as the PyTorch
    path does; three routers reading 1, 2, 3 sources, so sinks are both created and accumulated."""
    calls = _kernel_calls(monkeypatch)
    torch.manual_seed(7 + null + 2 * gate + 4 * with_base + 8 * shared)
    d = 48
    routers = {k: [DepthRouter(d, null_source=null, gate=gate, eps=EPS, kernels=k) for _ in range(3)]
               for k in ("c", "torch")}
    with torch.no_grad():
        for i, r in enumerate(routers["c"]):
            r.query.normal_()
            r.key_norm_weight.uniform_(0.5, 1.5)
            if null:
                r.null_source.normal_()
            if gate:
                r.gate.fill_(0.4 + 0.2 * i)
        for rc, rt in zip(routers["c"], routers["torch"]):
            rt.load_state_dict(rc.state_dict())
    vals64 = [torch.randn(5, 3, d, dtype=torch.float64) for _ in range(3)]
    x64 = torch.randn(5, 3, d, dtype=torch.float64)

    def run(rs, dtype):
        vals = [v.to(dtype).requires_grad_() for v in vals64]
        x = x64.to(dtype).requires_grad_()
        params = [p for r in rs for p in r.parameters()]
        if dtype == torch.float64:
            total = 0
            for k, r in enumerate(rs):
                p = {n: t.double() for n, t in r.named_parameters()}
                rr, _ = reference_route(vals[: k + 1], p["query"], p["key_norm_weight"], p.get("null_source"),
                                    p.get("gate"), EPS)
                total = total + ((x if with_base else 0) + rr).pow(2).sum() * (k + 1)
        else:
            srcs = [make_source(v, EPS, rs[i:] if shared else ()) for i, v in enumerate(vals)]
            total = sum(r(srcs[: k + 1], base=x if with_base else None, apply_gate=True).pow(2).sum() * (k + 1)
                        for k, r in enumerate(rs))
        leaves = vals + ([x] if with_base else []) + params
        return total, torch.autograd.grad(total, leaves)

    ref_loss, ref_grads = run(routers["c"], torch.float64)
    for kind in ("c", "torch"):
        before = dict(calls)
        loss, grads = run(routers[kind], torch.float32)
        ran_c = calls["forward"] > before["forward"] and calls["backward"] > before["backward"]
        assert ran_c == (kind == "c")
        torch.testing.assert_close(loss.double(), ref_loss, rtol=2e-6, atol=1e-5)
        for g, gr in zip(grads, ref_grads):  # fp32 round-off, relative to each gradient's scale
            scale = gr.abs().max().item()
            torch.testing.assert_close(g.double(), gr.double(), rtol=1e-4, atol=1e-5 * scale, msg=kind)


@pytest.mark.parametrize("fallback", [False, True])
def test_base_sums_rebuilds_the_local_source(fallback, monkeypatch):
    """route(base_sums=True) with base = sum of the sources (delta_block's x): the C path saves the
    output u instead of the local source and rebuilds it in backward - with the kernel, or with PyTorch
    ops where the backward cannot use the kernel (``fallback``) - and gives the float64 reference router's
    gradients. Without base_sums the local source itself is saved."""
    from megatron_delta.core import cpu_kernels

    torch.manual_seed(21)
    d = 40
    r = DepthRouter(d, null_source=True, gate=True, eps=EPS, kernels="c")
    with torch.no_grad():
        r.query.normal_()
        r.null_source.normal_()
        r.gate.fill_(-0.4)
    vals64 = [torch.randn(4, 3, d, dtype=torch.float64) * (1 + i) for i in range(3)]

    def run(dtype, base_sums):
        vals = [v.to(dtype).requires_grad_() for v in vals64]
        x = sum(v.detach() for v in vals).requires_grad_()  # the residual stream: the sources' sum
        params = list(r.parameters())
        if dtype == torch.float64:
            p = {n: t.double() for n, t in r.named_parameters()}
            rr, _ = reference_route(vals, p["query"], p["key_norm_weight"], p["null_source"], p["gate"], EPS)
            out = x + rr
        else:
            srcs = [make_source(v, EPS, [r]) for v in vals[:2]] + [make_source(vals[2], EPS)]  # last: local
            saved = []
            with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
                out = r(srcs, base=x, apply_gate=True, base_sums=base_sums)
            assert any(t.data_ptr() == vals[2].data_ptr() for t in saved) != base_sums  # P kept, or not
        loss = (out * torch.linspace(-1, 1, out.numel(), dtype=dtype).view(out.shape)).sum()
        if fallback and dtype == torch.float32:
            monkeypatch.setattr(cpu_kernels, "eligible", lambda *t: False)  # the backward's kernel check
        grads = torch.autograd.grad(loss, vals + [x] + params)
        monkeypatch.undo()
        return grads

    ref = run(torch.float64, False)
    for base_sums in (True, False):
        for g, gr in zip(run(torch.float32, base_sums), ref, strict=True):
            scale = gr.abs().max().item()
            torch.testing.assert_close(g.double(), gr.double(), rtol=1e-4, atol=2e-5 * scale,
                                       msg=lambda m: f"base_sums={base_sums}: {m}")


@pytest.mark.parametrize("kernels", ["c", "torch"])
@pytest.mark.parametrize("null,gate", [(False, None), (True, -0.4), (True, 0.8)])
def test_base_formed_from_the_sources(kernels, null, gate):
    """route(base=None, base_sums=True): the base is the sum of the sources, formed in the router's
    pass (the additive modes keeping x as its sources): out = sum_i (1 + a alpha_i) v_i + a alpha_null z,
    equal to the float64 reference router's x + a r with x = sum v, in value and in every gradient (each
    source's includes x's share); the C path keeps the local source out of memory (rebuilt from u)."""
    torch.manual_seed(22)
    d = 40
    r = DepthRouter(d, null_source=null, gate=gate is not None, eps=EPS, kernels=kernels)
    with torch.no_grad():
        r.query.normal_()
        if null:
            r.null_source.normal_()
        if gate is not None:
            r.gate.fill_(gate)
    vals64 = [torch.randn(4, 3, d, dtype=torch.float64) * (1 + i) for i in range(3)]
    weights = torch.linspace(-1, 1, vals64[0].numel(), dtype=torch.float64).view(vals64[0].shape)
    params = list(r.parameters())

    p = {n: t.double() for n, t in r.named_parameters()}
    vals = [v.clone().requires_grad_() for v in vals64]
    rr, _ = reference_route(vals, p["query"], p["key_norm_weight"], p.get("null_source"), p.get("gate"), EPS)
    ref_out = sum(vals) + rr
    ref = [ref_out.detach()] + list(torch.autograd.grad((ref_out * weights).sum(),
                                                        vals + [p[n] for n, _ in r.named_parameters()]))

    vals = [v.float().requires_grad_() for v in vals64]
    srcs = [make_source(v, EPS, [r]) for v in vals[:2]] + [make_source(vals[2], EPS)]  # last: local
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = r(srcs, apply_gate=True, base_sums=True)
    kept = any(t.data_ptr() == vals[2].data_ptr() for t in saved)
    assert kept == (kernels == "torch")  # the C path rebuilds the local source from u
    got = [out.detach()] + list(torch.autograd.grad((out * weights.float()).sum(), vals + params))
    for g, want in zip(got, ref, strict=True):
        scale = want.abs().max().item()
        torch.testing.assert_close(g.double(), want, rtol=1e-4, atol=2e-5 * scale)
    with pytest.raises(ValueError, match="base_sums without base makes x the sum of the sources"):
        r([], like=vals[0], base_sums=True)


def test_c_kernels_bitwise_across_thread_counts():
    """Each token's row is computed by one thread in a fixed order: the kernels give the same bits
    with 1 or 2 threads (PyTorch's own ops make no such promise: its softmax over depth can differ
    in the last bit between thread counts), and they compute what they say (float64 math written
    here): two sources with logit columns, two local ones projected in the kernel, null source, gate;
    and the backward that rebuilds a local source from the output (base = sum of the sources)."""
    from megatron_delta.core import cpu_kernels as K

    lib = K.load()
    g = torch.Generator().manual_seed(12)
    rows, d, n, eps, gate, null_logit = 131, 72, 4, 1e-6, 0.7, 0.3
    vals = [torch.randn(rows, d, generator=g) for _ in range(n)]
    cols = [torch.randn(rows, generator=g), None, torch.randn(rows, generator=g), None]
    q = torch.randn(d, generator=g) / d ** 0.5
    base, grad, null = torch.randn(rows, d, generator=g), torch.randn(rows, d, generator=g), torch.randn(d, generator=g)
    sink0 = torch.randn(rows, d, generator=g)

    def run(base=base, recover=None, unit=False):
        alpha, proj = torch.empty(n + 1, rows), [None, torch.empty(2, rows), None, torch.empty(2, rows)]
        pairs = [p if p is None else (p[0], p[1]) for p in proj]
        out = K.route_forward(lib, vals, cols, q, eps, null_logit, null, gate, base, alpha, pairs, torch.empty(rows, d),
                              unit)
        # sinks: accumulated, fresh; locals: a fresh gradient, and none (only the query's share is wanted)
        targets = [(sink0.clone(), False), (torch.empty(rows, d), True), (torch.empty(rows, d), True), (None, False)]
        dw, dlogit, dq = torch.empty(n + 1, rows), torch.empty(n + 1, rows), torch.empty(d)
        # recover: the backward gets the output u in place of source 3 and rebuilds it (base = sum of sources)
        held = vals if recover is None else vals[:recover] + [out] + vals[recover + 1:]
        K.route_backward(lib, grad, held, alpha, gate, null, q, pairs, targets, dw, dlogit, dq, recover, unit)
        return [out, alpha, proj[1], proj[3], dw, dlogit, dq] + [t for t, _ in targets if t is not None]

    summed = vals[0] + vals[1] + vals[2] + vals[3]
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one, one_rec, one_unit = run(), run(summed, 3), run(None, 3, True)
        torch.set_num_threads(2)
        two, two_rec, two_unit = run(), run(summed, 3), run(None, 3, True)
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(a, b) for a, b in zip(one + one_rec + one_unit, two + two_rec + two_unit, strict=True))
    with pytest.raises(ValueError, match="unit=True forms the base from the values"):
        run(summed, None, True)

    # float64 reference of what they say
    v64, g64, q64 = [v.double() for v in vals], grad.double(), q.double()
    inv = {i: torch.rsqrt(v64[i].pow(2).mean(1) + eps) for i in (1, 3)}
    z = {i: (v64[i] @ q64) * inv[i] for i in (1, 3)}
    logits = torch.stack([cols[0].double(), z[1], cols[2].double(), z[3], torch.full((rows,), null_logit).double()])
    alpha = torch.softmax(logits, 0)
    w = alpha * gate
    mix = sum(w[i].unsqueeze(1) * v64[i] for i in range(n)) + w[n].unsqueeze(1) * null.double()
    dw = torch.stack([(g64 * v).sum(1) for v in v64] + [g64 @ null.double()])
    da = dw * gate
    dlogit = alpha * (da - (alpha * da).sum(0, keepdim=True))
    c1, c3 = dlogit[1] * inv[1], dlogit[3] * inv[3]
    local1 = (w[1].unsqueeze(1) * g64 + c1.unsqueeze(1) * q64
              - (dlogit[1] * z[1] * inv[1] ** 2 / d).unsqueeze(1) * v64[1])
    grads = [dw, dlogit, c1 @ v64[1] + c3 @ v64[3], sink0.double() + w[0].unsqueeze(1) * g64, local1,
             w[2].unsqueeze(1) * g64]
    head = [alpha, torch.stack([inv[1], z[1]]), torch.stack([inv[3], z[3]])]
    for got, ref in zip(one, [base.double() + mix] + head + grads, strict=True):
        torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
    # the rebuilt source: the same gradients to fp32 round-off of u (|u| ~ |sum of sources|)
    for got, ref in zip(one_rec, [sum(v64) + mix] + head + grads, strict=True):
        torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=2e-5 * ref.abs().max().item())
    # unit: the base is the sum of the sources, formed in the pass; each source's weight is 1 + w_i
    unit_grads = grads[:3] + [grads[3] + g64, grads[4] + g64, grads[5] + g64]
    for got, ref in zip(one_unit, [sum(v64) + mix] + head + unit_grads, strict=True):
        torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=2e-5 * ref.abs().max().item())


def test_router_kernels_choice_is_checked():
    with pytest.raises(ValueError, match="kernels='cuda' is not one of auto, c, torch"):
        DepthRouter(8, null_source=False, gate=False, eps=EPS, kernels="cuda")
