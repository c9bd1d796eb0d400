"""The router on fla-core's fused AttnRes kernel (megatron_delta/core/fla_router.py), on CPU.

fla's Triton kernel refuses CPU tensors, so every test here routes through fla's own pure-PyTorch
``fla.ops.attnres.naive_attnres`` (same signature), put in its place with ``fla_router.use_kernel`` -
the adapter's documented injection point; the adapter, DepthRouter, SourceBuffer and the Megatron model
run unchanged. Yardsticks: the float64 reference router (tests/helpers/reference_delta.route, written from
docs/design.md alone) and the routers' PyTorch path (kernels='torch').
"""
import itertools

import pytest
import torch
from fla.ops.attnres import naive_attnres

from megatron_delta.core import fla_router
from megatron_delta.core.router import KERNEL_CHOICES, DepthRouter, check_kernels, make_source
from megatron_delta.core.sources import SourceBuffer, SourcePlan
from tests.helpers import kernel_models as K
from tests.helpers import reference_delta as R

EPS = 1e-6


class Counting:
    """naive_attnres, counting its calls (to prove which path ran)."""

    def __init__(self):
        self.calls = 0

    def __call__(self, *a, **k):
        self.calls += 1
        return naive_attnres(*a, **k)


@pytest.fixture
def kernel():
    k = Counting()
    with fla_router.use_kernel(k, devices=("cpu",), name="naive_attnres"):
        yield k


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


def _ref_route(values, p, gate_on):
    """The float64 reference: reference_delta.route, then the gate."""
    r, alpha = R.route(list(values), p["query"], p["key_norm_weight"], p.get("null_source"), eps=EPS)
    if gate_on:
        r = p["gate"] * r
    return r, alpha


BASES = ["none", "x", "x_sums", "formed"]  # u = r; x + r; x + r with base_sums (x = sum); sum of sources + r


@pytest.mark.parametrize("null,gate,base,shared", [
    (n, g, b, s) for n, g, b, s in itertools.product([False, True], [None, 0.4], BASES, [False, True])])
def test_matches_reference_and_torch_path(kernel, null, gate, base, shared):
    """Three routers reading 1, 2, 3 fp32 sources (so sources have one and several readers; ``shared``:
    the sources were made with their readers' projections, which the kernel path ignores), with and
    without null source and gate, for every base: the output and EVERY gradient (sources, x, query,
    key-norm weight, null source, gate) equal the float64 reference's to fp32 round-off, and the PyTorch
    path's; the routing weights too (null source last)."""
    d, shape = 48, (5, 3)
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
        total, alphas, xs = 0, [], []
        for k, r in enumerate(rs):
            mine = vals[: k + 1]
            x = None
            if base in ("x", "x_sums"):  # x_sums: x equals the sum of the sources (delta_block's promise)
                x = (sum(v.detach() for v in mine) if base == "x_sums" else x64.to(dtype, copy=True)).requires_grad_()
                xs.append(x)
            if kind == "ref":
                p = {n: t.double() for n, t in r.named_parameters()}
                out, alpha = _ref_route(mine, p, gate is not None)
                if x is not None:
                    out = x + out
                elif base == "formed":
                    out = sum(mine) + out
            else:
                srcs = [make_source(v, EPS, rs[i:] if shared else ()) for i, v in enumerate(mine)]
                out, alpha = r(srcs, True, apply_gate=True, base=x, base_sums=base in ("x_sums", "formed"))
                assert out.dtype == torch.float32 and alpha.dtype == torch.float32
            alphas.append(alpha.detach())
            total = total + (out.double() * W).sum() * (k + 1)
        grads = torch.autograd.grad(total, vals + xs + params, allow_unused=True)
        kinds = ["value"] * len(vals + xs) + [n for r in rs for n, _ in r.named_parameters()]
        return total.detach(), alphas, grads, kinds

    before = kernel.calls
    got = run("fla")
    assert kernel.calls - before == 3, "the kernel path must have run"
    before = kernel.calls
    torch_path = run("torch")
    ref = run("ref")
    assert kernel.calls == before
    for name, cand in (("fla", got), ("torch", torch_path)):
        torch.testing.assert_close(cand[0], ref[0], rtol=2e-6, atol=1e-5, msg=name)
        for a, ar in zip(cand[1], ref[1], strict=True):
            torch.testing.assert_close(a.double(), ar, rtol=1e-5, atol=1e-6, msg=name)
        # errors relative to the largest reference gradient of the same kind (a router reading one source
        # has alpha == 1: its query and key-norm gradients are zero up to round-off)
        kinds = ref[3]
        scales = {k: max(g.abs().max().item() for g, kk in zip(ref[2], kinds) if kk == k and g is not None)
                  for k in set(kinds)}
        for i, (g, gr) in enumerate(zip(cand[2], ref[2], strict=True)):
            assert (g is None) == (gr is None), (name, i)
            if gr is None:
                continue
            scale = scales[kinds[i]] if kinds[i] != "value" else gr.abs().max().item()
            torch.testing.assert_close(g.double(), gr.double(), rtol=1e-4, atol=1e-5 * scale,
                                       msg=lambda m, name=name, i=i: f"{name} grad {i}: {m}")
    # and the two paths agree with each other to fp32 round-off
    for g, gt, kind in zip(got[2], torch_path[2], kinds, strict=True):
        if g is not None:
            torch.testing.assert_close(g.double(), gt.double(), rtol=1e-4, atol=2e-5 * scales[kind])


def test_gate_zero_is_x_bitwise_and_bf16(kernel):
    """bf16 sources: u = x + a r with a = 0 is x bitwise (the scalar gate's promise: the model starts as
    the baseline); with a != 0 the kernel path stays within bf16 rounding of the PyTorch path, and its
    gradients too (the kernel's r is rounded to bf16 once before the add: one unit of r at most)."""
    d = 64
    torch.manual_seed(5)
    vals = [torch.randn(8, 2, d).bfloat16() for _ in range(4)]
    x = torch.randn(8, 2, d).bfloat16()
    (rf,), (rt,) = _routers("fla", 1, d, True, 0.0, 1), _routers("torch", 1, d, True, 0.0, 1)
    with torch.no_grad():
        rf.gate.zero_()
        rt.gate.zero_()
    u = rf([make_source(v, EPS) for v in vals], base=x, apply_gate=True)
    assert kernel.calls == 1 and u.dtype == torch.bfloat16 and torch.equal(u, x)
    with torch.no_grad():
        rf.gate.fill_(0.7)
        rt.gate.fill_(0.7)
    outs, grads = [], []
    for r in (rf, rt):
        vs = [v.clone().requires_grad_() for v in vals]
        xx = x.clone().requires_grad_()
        out = r([make_source(v, EPS) for v in vs], base=xx, apply_gate=True)
        (out.float() * torch.linspace(-1, 1, out.numel()).view(out.shape)).sum().backward()
        outs.append(out.float())
        grads.append([t.grad.float() for t in vs + [xx]] + [p.grad.clone() for p in r.parameters()])
    assert kernel.calls == 2
    unit = outs[1].abs().max().item() * 2 ** -7
    assert (outs[0] - outs[1]).abs().max().item() <= unit
    for g, gt in zip(*grads, strict=True):
        torch.testing.assert_close(g, gt, rtol=2e-2, atol=2e-2 * gt.abs().max().item())


BF16_BOUND = 2e-2  # bf16 results vs float64, relative to the float64 tensor's max abs
FP32_BOUND = 1e-4  # the PyTorch path's parameter gradients (computed in fp32) vs float64


def test_bf16_gradients_vs_float64(kernel):
    """bf16 sources on a realistic token count (2048 x 2 tokens, d = 64, 4 sources, base x, gate 0.7, null
    source; 3 seeds), against a float64 PyTorch-path run on the same inputs upcast (float64 routers, same
    parameter values; the loss weights are bf16 numbers, so every run gets the same upstream gradient): the
    output, the source and x gradients and every parameter gradient (query, key-norm weight, null source,
    gate) of the kernel path AND of the PyTorch path are within BF16_BOUND of the float64 tensor's max abs,
    and the PyTorch path's parameter gradients within FP32_BOUND.

    Measured (max over the seeds; print with -s): output and source gradients <= 0.46 % on both paths, x's
    gradient exact; parameter gradients, PyTorch path <= 3e-6 (fp32 from the bf16 inputs), kernel path query
    0.23 %, key-norm weight 0.30 %, gate 0.60 %, null source 0.80 % (z enters the kernel rounded to bf16 and
    its per-token gradients leave it in bf16 before the fp32 sum; the kernel also takes r's gradient in bf16,
    and the gate's gradient reads r rounded to bf16: docs/gpu.md, "Precision in bf16"). A 10 % error in any
    one of them, on either path, fails."""
    d, shape = 64, (2048, 2)
    W = torch.linspace(-1, 1, shape[0] * shape[1] * d, dtype=torch.float64).view(*shape, d).bfloat16().double()
    params = ["query", "key_norm_weight", "null_source", "gate"]
    worst = {}
    for seed in range(3):
        torch.manual_seed(seed)
        vals = [torch.randn(*shape, d).bfloat16() for _ in range(4)]
        x = torch.randn(*shape, d).bfloat16()
        results = {}
        for kind, dtype in (("fla", torch.bfloat16), ("torch", torch.bfloat16), ("ref", torch.float64)):
            (r,) = _routers("torch" if kind == "ref" else kind, 1, d, True, 0.7, seed)
            if kind == "ref":
                r = r.double()
            vs = [v.to(dtype, copy=True).requires_grad_() for v in vals]
            xx = x.to(dtype, copy=True).requires_grad_()
            before = kernel.calls
            out = r([make_source(v, EPS) for v in vs], base=xx, apply_gate=True)
            assert kernel.calls - before == (kind == "fla"), f"{kind}: the kernel must run on the kernel path only"
            assert out.dtype == dtype
            (out.double() * W).sum().backward()
            names = ["output"] + [f"source {i}" for i in range(4)] + ["x"]
            tensors = [out.detach()] + [t.grad for t in vs + [xx]]
            results[kind] = {n: t.double() for n, t in zip(names, tensors, strict=True)}
            results[kind].update({n: p.grad.double() for n, p in r.named_parameters()})
        ref = results.pop("ref")
        assert list(ref) == names + params
        for kind, got in results.items():
            for n, want in ref.items():
                err = ((got[n] - want).abs().max() / want.abs().max()).item()
                worst[kind, n] = max(err, worst.get((kind, n), 0.0))
    for n in ref:
        print(f"bf16 vs float64, max rel. error over 3 seeds: {n:16s} torch {worst['torch', n]:.2e}  "
              f"kernel {worst['fla', n]:.2e}")
    bound = {k: FP32_BOUND if k[0] == "torch" and k[1] in params else BF16_BOUND for k in worst}
    bad = {k: v for k, v in worst.items() if not v <= bound[k]}
    assert not bad, f"beyond the bound (bf16 {BF16_BOUND}, PyTorch-path parameters {FP32_BOUND}): {bad}"


@pytest.mark.parametrize("case", ["float64", "mixed", "like_dtype", "row_bytes", "misaligned", "cpu_auto"])
def test_fallbacks(kernel, case):
    """Where the kernel cannot express a case, the PyTorch path runs (the kernel is not called) and the
    result is the PyTorch path's exactly; a misaligned source is copied and still routed by the kernel."""
    d = 6 if case == "row_bytes" else 32
    torch.manual_seed(9)
    dt = torch.float64 if case == "float64" else torch.float32
    vals = [torch.randn(4, 2, d, dtype=dt) for _ in range(3)]
    like = None
    if case == "mixed":
        vals[1] = vals[1].bfloat16()
    if case == "like_dtype":
        like = torch.empty(4, 2, d, dtype=torch.bfloat16)
    if case == "misaligned":
        buf = torch.randn(4 * 2 * d + 1)
        vals[2] = buf[1:].view(4, 2, d)  # storage offset 4 bytes: not 16-byte aligned
        assert vals[2].data_ptr() % 16
    kind = "auto" if case == "cpu_auto" else "fla"
    other = "c" if case == "cpu_auto" else "torch"  # auto on fp32 CPU tensors: the C kernels, not this kernel
    (rf,), (rt,) = _routers(kind, 1, d, True, 0.3, 2), _routers(other, 1, d, True, 0.3, 2)
    if case == "float64":
        rf, rt = rf.double(), rt.double()
    outs = []
    for r in (rf, rt):
        vs = [v.clone().requires_grad_() for v in vals] if case != "misaligned" else \
            [v.clone().requires_grad_() for v in vals[:2]] + [vals[2].requires_grad_()]
        out = r([make_source(v, EPS) for v in vs], like=like, apply_gate=True)
        out.float().square().sum().backward()
        outs.append([out] + [v.grad for v in vs] + [p.grad for p in r.parameters()])
        if case == "misaligned":
            vals[2].grad = None
    if case == "misaligned":
        assert kernel.calls == 1
        for a, b in zip(*outs, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * b.abs().max().item())
        return
    assert kernel.calls == 0
    expect = fla_router.fallback_reason(vals, None if like is None else like.dtype)
    assert (expect is None) == (case == "cpu_auto"), expect
    for a, b in zip(*outs, strict=True):
        assert torch.equal(a, b)


def test_sources_local_and_x_kept_with_the_kernel(kernel, monkeypatch):
    """With routers on the kernel, SourceBuffer makes no shared projection (the kernel computes every
    logit in its own pass) and the additive plans keep x as a running stream; with the PyTorch path the
    shared projections and x_from_sources stay as before."""
    from types import SimpleNamespace

    from megatron_delta.core import router as router_mod

    for kind, keeps in (("fla", True), ("torch", False), ("auto", False)):  # auto: no CUDA here
        cfg = SimpleNamespace(residual="delta", num_layers=2, delta_num_blocks=None, delta_sources="exact",
                              delta_gate="none", delta_router_kernels=kind)
        assert SourcePlan.from_config(cfg).x_from_sources is not keeps
    projections = []
    real = router_mod._ProjectSource.apply
    monkeypatch.setattr(router_mod._ProjectSource, "apply", lambda *a: projections.append(1) or real(*a))
    d = 32
    for kind in ("fla", "torch"):
        cfg = SimpleNamespace(residual="delta", num_layers=2, delta_num_blocks=None, delta_sources="exact",
                              delta_gate="none", delta_router_kernels=kind)
        plan = SourcePlan.from_config(cfg)
        routers = _routers(kind, 4, d, False, None, 4)
        buf = SourceBuffer.start(plan, torch.randn(3, 2, d), EPS, readers=dict(enumerate(routers)))
        projections.clear()
        before = kernel.calls
        for j in range(4):
            u = buf.routed_input(j, routers[j])
            buf.commit(j, torch.tanh(u))
        assert (kernel.calls - before == 4) == (kind == "fla")
        assert (len(projections) == 0) == (kind == "fla"), (kind, len(projections))


def test_check_and_start_up_line():
    """`--delta-router-kernels fla` is checked at start-up (DepthRouter and config accept the choice);
    without CUDA and without an injected CPU kernel it is refused naming the flag; the start-up line
    says which kernels run."""
    assert "fla" in KERNEL_CHOICES
    assert fla_router.available()  # fla-core 0.6.0 is installed in this environment
    prev = fla_router.set_kernel(None)
    try:
        with pytest.raises(ValueError, match="--delta-router-kernels fla: no CUDA device"):
            check_kernels("fla")
        assert "fused C kernels for fp32 CPU tensors" in fla_router.describe("auto", cuda=False)
        line = fla_router.describe("fla", cuda=True)
        assert "fla 0.6.0 fused_attnres for CUDA tensors" in line and "(--delta-router-kernels fla)" in line
        assert "C kernels for fp32 CPU tensors" in fla_router.describe("auto", cuda=True)
        assert fla_router.describe("torch") == "router kernels: PyTorch ops (--delta-router-kernels torch)"
        with fla_router.use_kernel(naive_attnres, devices=("cpu",)):
            check_kernels("fla")
            assert "naive_attnres (injected) for CPU tensors" in fla_router.describe("fla", cuda=False)
    finally:
        fla_router.set_kernel(prev.fn if prev else None, *(prev[1:] if prev else ()))
    assert fla_router.kernel_for("auto", "cpu") is None and fla_router.kernel_for("c", "cuda") is None


# --------------------------------------------------------------------------- the model, every mode
@pytest.fixture(scope="module")
def dist():
    from megatron_delta.platform.distributed import initialize_distributed

    initialize_distributed(1, 1, None, 1, seed=1234)
    yield


MODEL_CASES = [("delta", False, False), ("delta", True, True), ("delta_block", False, False),
               ("delta_block", True, True), ("attnres", False, False), ("attnres", True, False),
               ("full_attnres", False, False), ("full_attnres", True, False)]


@pytest.mark.parametrize("mode,null,gate", MODEL_CASES, ids=["-".join(map(str, c)) for c in MODEL_CASES])
def test_model_on_the_kernel_matches_reference_and_torch(dist, kernel, mode, null, gate):
    """Every mode's model with its routers on the kernel (null source, gate; delta / delta_block without
    a gate keep x as a stream here, with a gate base = x, base_sums for delta_block): logits and every
    parameter's gradient equal the PyTorch-path model's, and the logits and router gradients the float64
    reference's (tests/helpers/reference_delta.reference_forward)."""
    tok, pos, W = K.batch()
    results = {}
    for kind in ("fla", "torch"):
        model, fields = K.build(mode, null, gate, kind)
        before = kernel.calls
        logits = model(tok, pos, None)
        assert (kernel.calls > before) == (kind == "fla")
        (logits * W).sum().backward()
        results[kind] = (logits.detach(), {n: p.grad for n, p in model.named_parameters()}, model, fields)
    (lf, gf, model, fields), (lt, gt, _, _) = results["fla"], results["torch"]
    K.assert_matches_torch((lf, gf), (lt, gt))
    K.assert_matches_reference(model, fields, lf, gf, tok, W, mode, null, gate)
