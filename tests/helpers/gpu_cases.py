"""The checks of the CUDA tests (tests/gpu/test_*.py), written for any device: on CUDA they run the project's
Triton kernels compiled, on CPU under the Triton interpreter (tests/helpers/gpu_interpreter_cases.py, fp32), the same
code.

- router_case: one router call over N sources on the Triton kernels against the PyTorch path and the float64
  reference (tests/reference_delta.route): the output and every gradient (sources, x, query, key-norm weight,
  null source, gate);
- model_case: a mode's 4-layer model (tests/helpers/kernel_models.py) on the kernels against the PyTorch-path model
  (logits and every parameter's gradient) and the float64 reference model;
- stream_case: a mode's routed stream at depth (perf/routed_stream.py: SourceBuffer, routers; stand-in sublayers
  that roll u's features)
  on the kernels against the PyTorch path, relative to the fp32 PyTorch path where the stream runs in bf16;
- capture_case: that stream captured once (``capture``: cuda_graph_capture, or a stand-in) and replayed on new
  contents of its static inputs, equal to an eager run on the same inputs: its output and every gradient.
"""
import torch

from tests.helpers import kernel_models as K
from tests.helpers import reference_delta as R

EPS = 1e-6
FP32_TOL = 1e-4  # relative L2 error against the float64 reference and the PyTorch path in fp32
BF16_TOL = 2e-2  # in bf16: always accepted ...
BF16_SLACK = 1.5  # ... or at most this times the PyTorch path's own error against the reference
# (null source, gate, x) of each router case
ROUTER_CASES = [(False, False, False), (False, False, True), (True, False, True), (False, True, True),
                (True, True, True), (True, False, False)]


def rel(a, b):
    """Relative L2 error of ``a`` against ``b``."""
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def _router_setup(kind, device, dtype, null, gate, with_x, vals, x, W):
    """One router (``kind``: triton / torch / ref, the float64 reference) and its inputs on ``device``: every copy
    to the device made here, before the call."""
    from megatron_delta.core.router import DepthRouter

    d = vals[0].shape[-1]
    r = DepthRouter(d, null_source=null, gate=gate, eps=EPS, kernels="torch" if kind == "ref" else kind)
    g = torch.Generator().manual_seed(6)
    with torch.no_grad():
        r.query.copy_(torch.randn(d, generator=g))
        r.key_norm_weight.copy_(1 + 0.2 * torch.randn(d, generator=g))
        if null:
            r.null_source.copy_(torch.randn(d, generator=g))
        if gate:
            r.gate.fill_(0.7)
    work = torch.float64 if kind == "ref" else dtype
    r = r.to(device, torch.float64) if kind == "ref" else r.to(device)
    vs = [v.to(device, work, copy=True).requires_grad_() for v in vals]  # leaves of their own, per run
    xx = x.to(device, work, copy=True).requires_grad_() if with_x else None
    return kind, r, vs, xx, W.to(device), gate, with_x


def _router_call(kind, r, vs, xx, W, gate, with_x):
    """The call and its backward: (output, {name: gradient})."""
    from megatron_delta.core.router import make_source

    if kind == "ref":
        p = dict(r.named_parameters())
        out, _ = R.route(vs, p["query"], p["key_norm_weight"], p.get("null_source"), eps=EPS)
        out = out * p["gate"] if gate else out
        out = out + xx if with_x else out
    else:
        out = r([make_source(v, EPS) for v in vs], base=xx, apply_gate=True)
    (out.double() * W).sum().backward()
    grads = {f"s{i}": v.grad for i, v in enumerate(vs)}
    grads.update({"x": xx.grad} if with_x else {})
    grads.update({k: q.grad for k, q in r.named_parameters()})
    return out.detach(), grads


def router_case(device, dtype, null, gate, with_x, n=5, tokens=24, d=64, no_syncs=False):
    """The Triton kernels' router call against the float64 reference and the PyTorch path on the same ``dtype``
    inputs. fp32: each within FP32_TOL of both. bf16: each within BF16_TOL of the reference or at most BF16_SLACK
    times as far as the PyTorch path in bf16 (the null source's gradient, a sum over tokens of bf16 per-token
    terms, 3x). ``no_syncs``: the kernels' call and backward (after one that compiles them; its router and inputs
    copied to the GPU before) run under torch.cuda.set_sync_debug_mode("error"): no stream synchronisation.
    Returns {tensor: error against the reference}."""
    g = torch.Generator().manual_seed(5)
    vals = [(torch.randn(tokens, 1, d, generator=g) * (1 + i)).to(dtype) for i in range(n)]  # the inputs as rounded
    x = torch.randn(tokens, 1, d, generator=g).to(dtype)
    W = torch.randn(tokens, 1, d, generator=g, dtype=torch.float64)
    args = (device, dtype, null, gate, with_x, vals, x, W)
    if no_syncs:
        _router_call(*_router_setup("triton", *args))  # compiles
        ready = _router_setup("triton", *args)
        torch.cuda.synchronize()
        previous = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("error")
        try:
            got = _router_call(*ready)
        finally:
            torch.cuda.set_sync_debug_mode(previous)
    else:
        got = _router_call(*_router_setup("triton", *args))
    torch_path, ref = (_router_call(*_router_setup(kind, *args)) for kind in ("torch", "ref"))
    errors = {"out": rel(got[0], ref[0]), **{k: rel(got[1][k], ref[1][k]) for k in ref[1]}}
    if dtype == torch.float32:
        vs_torch = {"out": rel(got[0], torch_path[0]), **{k: rel(got[1][k], torch_path[1][k]) for k in ref[1]}}
        bad = {k: (e, vs_torch[k]) for k, e in errors.items() if e > FP32_TOL or vs_torch[k] > FP32_TOL}
    else:
        own = {"out": rel(torch_path[0], ref[0]), **{k: rel(torch_path[1][k], ref[1][k]) for k in ref[1]}}
        bad = {k: (e, own[k]) for k, e in errors.items()
               if e > (3 if k == "null_source" else 1) * max(BF16_TOL, BF16_SLACK * own[k])}
    assert not bad, f"errors (kernels, other path) beyond the limit: {bad}"
    return errors


def model_case(device, mode, null, gate, group_size=None):
    """A mode's 4-layer model (tests/kernel_models.build: K = 2, fp32, eval mode) with its routers on the kernels:
    logits and every parameter's gradient equal the PyTorch-path model's (K.assert_matches_torch), and the logits
    and the routers' gradients the float64 reference model's (K.assert_matches_reference, on CPU)."""
    tok, pos, W = (t.to(device) for t in K.batch())
    results = {}
    for kind in ("triton", "torch"):
        model, fields = K.build(mode, null, gate, kind, group_size=group_size)
        model = model.to(device)
        logits = model(tok, pos, None)
        (logits * W).sum().backward()
        results[kind] = logits.detach(), {n: p.grad for n, p in model.named_parameters()}, model, fields
    (lf, gf, model, fields), (lt, gt, _, _) = results["triton"], results["torch"]
    K.assert_matches_torch((lf, gf), (lt, gt))
    gf = {n: None if v is None else v.cpu() for n, v in gf.items()}
    K.assert_matches_reference(model.cpu(), fields, lf.cpu(), gf, tok.cpu(), W.cpu(), mode, null, gate)


def rolled(j, u):
    """The stand-in sublayer j of the streams: u's features rolled by j + 1 (a permutation, exact in any dtype), so
    that the sources differ in direction and the routers' gradients are more than round-off."""
    return u.roll(j % u.shape[-1] + 1, dims=-1)


def stream_case(device, dtype, mode, group_size, layers, seq, hidden):
    """``mode``'s routed stream (every_gradient: the output, h0's and every router parameter's gradients) on the
    kernels against the PyTorch path: in fp32 within FP32_TOL; in bf16 each tensor within BF16_TOL of the fp32
    PyTorch path or at most BF16_SLACK times as far as the PyTorch path in bf16. Returns the kernels' errors."""
    from megatron_delta.perf.routed_stream import routed_stream

    def run(kernels, dt):
        call, _ = routed_stream(mode, layers, kernels, group_size, seq, hidden, device, dt, seed=3,
                                every_gradient=True, sublayer=rolled)
        return call()

    got, ref = run("triton", dtype), run("torch", torch.float32)
    errors = [rel(a, b) for a, b in zip(got, ref, strict=True)]
    if dtype == torch.float32:
        bad = {i: e for i, e in enumerate(errors) if e > FP32_TOL}
    else:
        own = [rel(a, b) for a, b in zip(run("torch", dtype), ref, strict=True)]
        bad = {i: (e, own[i]) for i, e in enumerate(errors) if e > max(BF16_TOL, BF16_SLACK * own[i])}
    assert not bad, f"tensors (0: output, 1: h0's gradient, then the routers' parameters) beyond the limit: {bad}"
    return errors


def cuda_graph_capture(step):
    """``step`` warmed up on a side stream (its Triton kernels compiled, the caching allocator settled), then
    captured with torch.cuda.graph: (its static outputs, replay)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = step()
    return static, graph.replay


def capture_case(device, dtype, mode, group_size, layers, seq, hidden, capture=cuda_graph_capture):
    """``mode``'s routed stream on the kernels captured (``capture``), its static inputs (h0, the output's gradient,
    the routers' queries) then given new contents in place, and replayed: the output and every gradient (h0's and
    every router parameter's) bitwise equal to an eager run on the same inputs - the same kernels with the same
    launches on the same values. The eager run goes first, twice: its launch tables are made anew, in memory the
    capture's tables could have been given back to, which a replay that copied freed tables would then read.
    Returns the number of tensors compared."""
    from megatron_delta.perf.routed_stream import routed_stream

    step, (routers, h0, grad) = routed_stream(mode, layers, "triton", group_size, seq, hidden, device, dtype, seed=3,
                                              every_gradient=True, sublayer=rolled)
    static, replay = capture(step)
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for t in (h0, grad, *(r.query for r in routers)):
            t.copy_(torch.randn(t.shape, generator=g).to(t.dtype))
    for _ in range(2):
        eager = [t.clone() for t in step()]
    replay()
    if device != "cpu":
        torch.cuda.synchronize()
    assert len(static) == len(eager) == 2 + sum(len(list(r.parameters())) for r in routers)
    differ = [i for i, (a, b) in enumerate(zip(static, eager, strict=True)) if not torch.equal(a, b)]
    assert not differ, (f"replay != eager for tensors {differ} (0: output, 1: h0's gradient, then the routers' "
                        f"parameters); largest difference {max(rel(static[i], eager[i]) for i in differ):.3e}")
    return len(static)
