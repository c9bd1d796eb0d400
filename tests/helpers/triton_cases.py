"""The interpreter cases of tests/integration/test_triton_router.py: the router on the project's Triton kernels
(megatron_delta/core/triton_router.py), on CPU. Run by that test in a fresh process with TRITON_INTERPRET=1:
Triton reads the variable when its own functions are jitted, at its import, so it must be set before anything
imports Triton (in a whole-suite pytest process fla's tests import it first). fp32 only (the interpreter's bf16
is not trustworthy), except one count of bf16 traffic, where only the tensors each call passes matter.
Yardsticks: the float64 reference router (tests/helpers/reference_delta.route, written from docs/design.md alone) and
the routers' PyTorch path (kernels='torch'). That the kernels ran is proven by their calls in the traffic count
(core/traffic.py), which is also checked against triton_router.call_rows.
"""
import itertools

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_delta.core import group_plan, traffic, triton_router
from megatron_delta.core.router import DepthRouter, make_source
from megatron_delta.core.sources import SourcePlan
from tests.helpers import group_toys as G
from tests.helpers import kernel_models as K
from tests.helpers import reference_delta as R
from tests.helpers.host_data import host_data_ops

EPS = 1e-6


@pytest.fixture(scope="module")
def interpreter():
    if not triton_router.interpreting():
        pytest.fail("run through tests/integration/test_triton_router.py (it sets TRITON_INTERPRET=1 before Triton is "
                    "imported)")


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


@pytest.mark.parametrize("null,gate,base,defer", list(itertools.product([False, True], [None, 0.4], BASES,
                                                                         [False, True])))
def test_routers_match_reference_and_torch_path(interpreter, null, gate, base, defer):
    """Three routers reading 1, 2, 3 fp32 sources (source 0 has three readers, which add their gradients into
    one buffer in place; source 2 has one), with and without null source and gate, for every base; ``defer``:
    sources 0 and 1 are a block's completed sources (triton_router.BlockDeferral: the routers leave their
    coefficients, one pass writes both gradients; router 0 does not read source 1). The outputs, the routing
    weights and EVERY gradient (sources, x, query, key-norm weight, null source, gate) equal the PyTorch path's to
    fp32 round-off and the float64 reference's."""
    # d not a power of two: the tile's masked columns; 35 tokens: three tiles of 16, so that a reducing program
    # (triton_router.reducing_programs: two under the interpreter) takes two tiles and the other one
    d, shape = 40, (7, 5)
    assert triton_router.reducing_programs(-(-35 // triton_router._tile(d)[0]), "cpu") == 2
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
            if defer:
                slots = triton_router.BlockDeferral(vals[:2], [s.sink for s in srcs[:2]]).slots()
                srcs[:2] = [s._replace(sink=slot) for s, slot in zip(srcs[:2], slots)]
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
    passes = [c for c in count.calls if c.kernel == triton_router.DEFERRED_KERNEL]
    rows = vals64[0].numel()
    # the pass reads the 3 output gradients, the 2 sources, and writes their 2 gradients (fp32: a row is rows * 4)
    assert [(sum(n * e for n, e in c.reads if n >= rows), sum(n * e for n, e in c.writes if n >= rows))
            for c in passes] == ([(5 * rows * 4, 2 * rows * 4)] if defer else [])
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


def test_gpu_check_rate_counts_the_partial_sums(interpreter):
    """kernel_rates' (b2) rate of a router call on the kernels counts the bytes of every row-sized tensor its
    kernels move and the per-program partial sums below a row (partial_bytes: the backward's fp32 [programs, hidden]
    partials, written and read back by their sum), as the cost model prices them."""
    from types import SimpleNamespace

    from megatron_delta.perf import kernel_rates

    d, shape = 40, (7, 5)  # three tiles of 16 tokens: the interpreter's two reducing programs
    torch.manual_seed(0)
    (r,) = _routers("triton", 1, d, False, None, 3)
    vals = [torch.randn(*shape, d, requires_grad=True) for _ in range(2)]

    def call():
        out = r([make_source(v, EPS) for v in vals], apply_gate=True)
        return torch.autograd.grad(out.square().sum(), vals)

    with traffic.counting() as count:
        call()
    rows = 35 * d
    row_bytes = sum(rd + wr for (k, _), (rd, wr) in count.bytes(rows).items() if k != triton_router.REDUCE_KERNEL)
    programs, bd = triton_router.reducing_programs(3, "cpu"), triton_router._tile(d)[1]
    out = kernel_rates._rate(SimpleNamespace(dry=True), call, rows, 1, 1.0)
    assert out["partial_bytes"] == 2 * programs * bd * 4 > 0  # part_q written and read: no null source
    assert out["bytes"] == row_bytes + out["partial_bytes"]


def test_gpu_check_host_time(interpreter):
    """gpu_check's (h): the host's work per router call of delta (group router, one router per pass) and
    delta_block on the kernels, each launch with one table copy; one router per pass launches its forward and
    backward only, the group router each group's old pass twice, each merge twice (none for a group's first router:
    its u is the old pass's) and x's final sum once (one router per pass too: x's gradient seeds its sinks)."""
    from types import SimpleNamespace

    from megatron_delta.perf import host_work

    env = SimpleNamespace(dry=True, device="cpu")
    runs = host_work.host_runs(env)
    assert runs == [("delta", "auto"), ("delta", 1), ("delta_block", 1)]
    got = {(m, g): host_work.host_time(env, m, g) for m, g in runs}
    assert all(r["ok"] and r["launches"] == r["table_copies"] and r["host_us"] > 0 for r in got.values())
    routers = 2 * host_work.HOST_STREAM_LAYERS
    groups = group_plan.auto_group_sizes(routers, 1)
    assert got["delta", 1]["launches"] == pytest.approx(2 + 1 / routers)
    merges = routers - len(groups)  # a group's first router takes its u from the old pass
    assert got["delta", "auto"]["launches"] == pytest.approx((2 * len(groups) + 2 * merges + 1) / routers)
    assert got["delta_block", 1]["launches"] > 2  # and the blocks' deferred passes
    # on a GPU (h) also times the stream without its table copies: tables laid out as device_tables lays them
    lists = ([1, 2, 3], [4], [], [5, 6])
    sent, kept = triton_router.device_tables(*lists, device="cpu"), host_work._uncopied_tables("cpu")(*lists,
                                                                                                     device="cpu")
    assert [len(v) for v in kept] == [len(v) for v in sent] == [4, 2, 0, 2]
    assert all(v.data_ptr() % 16 == 0 for v in kept + sent)


@pytest.mark.parametrize("mode, group", [("delta", 2), ("delta", 1), ("delta_block", 1)])
def test_no_view_op_per_source(interpreter, mode, group):
    """A router call on the kernels hands them its sources, output gradients, base and partial sums in their own
    [s, b, d] shape where they are contiguous (the kernels read addresses: triton_router.kernel_rows) and makes u
    and its gradients in that shape: no view op per source read, so the host's view ops per router call do not
    grow with depth. The routed stream at 4 and 8 layers (the group router in groups of 2: each old pass reads
    every older source), PyTorch's ops counted (perf.host_work)."""
    from megatron_delta.perf import host_work

    views = {layers: host_work.per_call(mode, layers, "triton", group, reps=1)["views"] for layers in (4, 8)}
    assert views[8] <= views[4], views


# slow (with the two below): host work on the kernels; on PyTorch ops and the C kernels the routed step's host data
# stays in the fast set (tests/test_group_router.py test_routed_step_makes_no_tensor_from_host_data)
@pytest.mark.slow
@pytest.mark.parametrize("mode, group", [("delta", "auto"), ("delta", 1), ("delta_block", 1)])
def test_only_the_launch_tables_come_from_host_data(interpreter, mode, group):
    """On the kernels, the one tensor a router call makes from host data is each launch's table
    (triton_router.device_tables: on a GPU one pinned copy, without blocking): no other, and nothing read back."""
    from megatron_delta.perf import host_work
    from megatron_delta.perf.routed_stream import routed_stream

    call, _ = routed_stream(mode, 14, "triton", group, 8, 16, "cpu", torch.float32, seed=3)
    counts = host_work._Counts()
    with host_work._counting_tables(counts):  # the table copies, counted
        call()
        counts.reset()
        with host_data_ops() as ops:
            call()
    assert counts.tables and dict(ops) == {"lift_fresh": counts.tables}, (counts.tables, dict(ops))


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["delta", "delta_block", "attnres", "full_attnres"])
def test_models_on_the_kernels_make_only_their_tables_from_host_data(interpreter, dist, mode):
    """Every mode's model on the kernels, with the null source (and the gate where the mode has one) under full
    recompute, one forward + backward: of this package's ops, only the launch tables come from host data."""
    from megatron_delta.perf import host_work

    tok, pos, W = K.batch()
    model, _ = K.build(mode, True, mode in ("delta", "delta_block"), "triton", recompute=True)
    counts = host_work._Counts()
    with host_work._counting_tables(counts):
        (model(tok, pos, None) * W).sum().backward()
        counts.reset()
        with host_data_ops("megatron_delta/") as ops:
            (model(tok, pos, None) * W).sum().backward()
    assert counts.tables and sum(ops.values()) == counts.tables and {k[:2] for k in ops} == {
        ("lift_fresh", "triton_router.py")}, (counts.tables, dict(ops))


@pytest.mark.slow
def test_gpu_check_kernel_times(interpreter):
    """kernel_rates' (k) in the dry run: the routed streams at the (dry) 1B shape's width and depth on the kernels,
    and each router kernel's counted bytes - exactly the traffic records it maps (KERNEL_OF_RECORD), none dropped: the
    group router's old passes, merges and final sum for delta on groups, the per-router pass and the block pass for
    one router per pass and delta_block."""
    from types import SimpleNamespace

    from megatron_delta.core import traffic
    from megatron_delta.perf import gpu_check, kernel_rates
    from megatron_delta.perf.routed_stream import routed_stream

    env = SimpleNamespace(dry=True, device="cpu", shapes=gpu_check.DRY_SHAPES)
    assert kernel_rates.kernel_time_runs(env) == [("delta", "auto"), ("delta_block", 1)]
    runs = kernel_rates.kernel_time_runs(env) + [("delta", 1)]  # one router per pass: what its bytes map to
    got = {(m, g): kernel_rates.kernel_times(None, env, m, g) for m, g in runs}
    assert all(r["ok"] and r["wall_ms"] > 0 and r["kernels"] == [] and r["device_share"] is None
               and r["layers"] == gpu_check.DRY_SHAPES["1B"]["layers"] for r in got.values())
    assert set(got["delta", "auto"]["counted_bytes"]) == {"_old_forward", "_old_backward", "_merge_forward",
                                                          "_merge_backward", "_final_sum"}
    assert set(got["delta", 1]["counted_bytes"]) == {"_forward", "_backward"}
    assert {"_forward", "_backward", "_block_grad"} <= set(got["delta_block", 1]["counted_bytes"])
    # the bytes are the stream's own records: the group passes of the same stream, counted here
    s = gpu_check.DRY_SHAPES["1B"]
    call, _ = routed_stream("delta", s["layers"], "triton", "auto", s["seq"], s["hidden"], "cpu", torch.float32,
                            seed=9)
    with traffic.counting() as count:
        call()
    rows = count.bytes(s["seq"] * s["hidden"])
    assert got["delta", "auto"]["counted_bytes"]["_old_backward"] == sum(rows["group_old_pass", "backward"])
    assert got["delta", "auto"]["counted_bytes"]["_merge_forward"] == sum(rows["group_merge", "forward"])


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
        formed = [j >= 2 and not plan.is_block_start(j) and not plan.is_block_start(j - 1)  # P_b = P_b + v_{j-1}
                  for j in range(plan.num_sublayers)]
        # h0 (block 0) and h0, D0 (block 1) are each block's completed sources: their gradients are deferred to
        # the block's pass (4 routers, 1 and 2 sources: group_plan.block_defers), so no router call writes them
        completed = [sum(not n.startswith("P") for n in r) for r in reads]
        assert all(group_plan.block_defers(4, k) for k in (1, 2))
        want = {ph: sum(triton_router.call_rows(len(r), has_base=False, forms_partial=f, grads=len(r) - k)[ph]
                        for r, f, k in zip(reads, formed, completed)) for ph in ("forward", "backward")}
        rows = count.rows(K.B * K.S * K.HIDDEN, act_bytes=4)
        got = {ph: rows[triton_router.KERNEL, ph] for ph in want}  # the kernels' calls (the rest: PyTorch's passes)
        assert sum(formed) == 4 and got == want == {"forward": 34, "backward": 36}
        # the block passes: each reads its 4 routers' output gradients and its sources once and writes their
        # gradients (h0's second writer adds in place: 1 read more); the last block's pass, the first to write h0's
        # and D0's gradients, adds x's gradient, which seeds their sinks (triton_group_kernels._SeededSum): 1 read
        assert rows[triton_router.DEFERRED_KERNEL, "backward"] == (4 + 2 * 1) + (4 + 2 * 2) + 1 + 1 == 16
        assert sum(c.kernel == triton_router.DEFERRED_KERNEL for c in count.calls) == 2
        # the passes outside the kernels: x = h0 + D0 + D1 handed out (one pass: 3 reads, 1 write), D0 and D1 formed by
        # PyTorch's add (several readers / read by that sum: not in a kernel), and autograd's adds of two gradients
        # for v0, v4 (their reader's kernel + the kernel that formed P from them); none for h0 and D0, whose sinks x's
        # gradient seeds
        assert {k: v for k, v in rows.items() if k[0] not in (triton_router.KERNEL, triton_router.DEFERRED_KERNEL)} == {
            ("x_sum", "forward"): 4, ("partial_sum", "forward"): 6, ("autograd_add", "backward"): 6}
    K.assert_matches_reference(model, fields, lf, gf, tok, W, mode, null, gate)


def _on_triton_and_torch(tok, pos, W, mode, null, gate, **build):
    """One step of the model (K.build) on the Triton kernels and on the PyTorch path, whose logits and every
    parameter's gradient must agree; the Triton run's (logits, gradients, model, fields, traffic count)."""
    results = {}
    for kind in ("triton", "torch"):
        model, fields = K.build(mode, null, gate, kind, **build)
        with traffic.counting() as count:
            logits = model(tok, pos, None)
            (logits * W).sum().backward()
        results[kind] = (logits.detach(), {n: p.grad for n, p in model.named_parameters()}, model, fields, count)
    (lf, gf, model, fields, count), (lt, gt, _, _, _) = results["triton"], results["torch"]
    K.assert_matches_torch((lf, gf), (lt, gt))
    return lf, gf, model, fields, count


def test_delta_one_router_per_pass_seeds_its_sinks(interpreter, dist):
    """delta without a gate on one router per pass (--delta-router-group-size 1): x, handed out as the sum of the
    sources, is summed in one pass and its gradient seeds every source's KernelSink (triton_group_kernels
    ._SeededSum); with no block pass, the first router call to reach each sink in backward copies the seed in and
    adds its share. The logits and every gradient equal the PyTorch path's and the float64 reference's, and the
    counted traffic is the closed form's (one x_sum pass, no autograd add of x's gradient)."""
    from megatron_delta.perf import cost_model

    tok, pos, W = K.batch()
    lf, gf, model, fields, count = _on_triton_and_torch(tok, pos, W, "delta", False, False, group_size=1)
    rows = count.rows(K.B * K.S * K.HIDDEN, act_bytes=4)
    predicted = cost_model.step_traffic("delta", 4, "triton", act_bytes=4, group_size=1)
    assert rows == pytest.approx(predicted, abs=1e-9)
    assert rows[("x_sum", "forward")] == 9 + 1  # h0, v0 .. v7 read once, x written once
    K.assert_matches_reference(model, fields, lf, gf, tok, W, "delta", False, False)


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
        reductions = []
        predicted = cost_model.step_traffic(mode, 4, "triton", num_blocks=fields.delta_num_blocks, act_bytes=4,
                                            null_source=null, gate=gate,
                                            recompute=("uniform", 1) if recompute else None, reductions=reductions)
        assert counted == pytest.approx(predicted, abs=1e-9), (null, gate, recompute)
        _assert_partials_priced(count, reductions, K.B * K.S, K.HIDDEN)


# 8 layers, K = 4 (two layers, four routers per block): blocks 0..3 read 1..4 completed sources. Recompute uniform 5
# cuts block 2 between two checkpoints (layer 4 | layer 5): each part (two routers over three sources) still defers;
# block (3) runs layers 0..2 as checkpoints and the rest layer by layer, each layer its own buffer scope (two routers:
# they defer over three or four sources, not over one or two).
DEFER_CASES = [(m, r) for m in ("delta_block", "attnres") for r in (None, ("uniform", 5), ("block", 3))]


@pytest.mark.parametrize("mode,recompute", DEFER_CASES, ids=["-".join(map(str, c)) for c in DEFER_CASES])
def test_deferred_block_passes_with_recompute_cuts(interpreter, dist, mode, recompute):
    """Several blocks, cut by recompute boundaries (each checkpoint's buffer scope has its own block passes):
    the logits and every parameter's gradient equal the PyTorch path's, the logits and the routers' gradients the
    float64 reference's; the block passes ran where group_plan.block_defers says, and the counted traffic is the
    closed form's (perf.cost_model.step_traffic)."""
    from megatron_delta.perf import cost_model

    L, blocks = 8, 4
    tok, pos, W = K.batch()
    lf, gf, model, fields, count = _on_triton_and_torch(tok, pos, W, mode, True, False, recompute=recompute or False,
                                                        num_layers=L, num_blocks=blocks)
    # the block passes: per buffer scope (recompute: the checkpoints' recomputed forwards), the blocks whose routers
    # there defer (routers in the scope x sources the block reads through sinks)
    scopes = {None: [range(0, 8)], ("uniform", 5): [range(0, 5), range(5, 8)],
              ("block", 3): [range(0, 1), range(1, 2), range(2, 3), *[range(i, i + 1) for i in range(3, 8)]]}[recompute]
    passes = 0
    for layers in scopes:
        for b in sorted({i // 2 for i in layers}):
            routers = 2 * sum(i // 2 == b for i in layers)
            passes += group_plan.block_defers(routers, b + 1)  # h0 (B0) and the b completed sums (B1..Bb)
    assert sum(c.kernel == triton_router.DEFERRED_KERNEL for c in count.calls) == passes
    assert passes == {None: 4, ("uniform", 5): 5, ("block", 3): 4}[recompute]  # block: layers 4..7 (3, 4 sources)
    counted = count.rows(K.B * K.S * K.HIDDEN, act_bytes=4)
    predicted = cost_model.step_traffic(mode, L, "triton", num_blocks=blocks, act_bytes=4, null_source=True,
                                        recompute=recompute)
    assert counted == pytest.approx(predicted, abs=1e-9)
    K.assert_matches_reference(model, fields, lf, gf, tok, W, mode, True, False)


@pytest.mark.parametrize("mode", ["delta_block", "attnres"])
@pytest.mark.parametrize("cut", [5, 3])
def test_deferred_block_passes_across_a_pipeline_boundary(interpreter, mode, cut):
    """Two pipeline stages as the schedule runs them (SourceBuffer over stand-in sublayers, 8 layers, K = 4): the
    first stage's payload (to_tensors) goes to the second as new leaves (from_tensors), the second's backward
    runs first and hands the payload's gradients back. The boundary cuts block 2 (layer 5: each side two routers
    over three sources: both defer) or block 1 (layer 3: two sources, neither side defers). The output and every
    gradient (h0, the sublayers' scales, every router parameter) equal the PyTorch path's on one stage, and the
    float64 PyTorch path's."""
    from megatron_delta.core.sources import SourceBuffer

    L, K, d, tokens = 8, 4, 24, (6, 2)
    g = torch.Generator().manual_seed(5)
    data = torch.randn(*tokens, d, generator=g, dtype=torch.float64)
    scales64 = [1 + 0.3 * torch.randn(d, generator=g, dtype=torch.float64) for _ in range(2 * L)]
    W = torch.randn(*tokens, d, generator=g, dtype=torch.float64)

    def run(kind, dtype, stages):
        plan = SourcePlan(mode=mode, num_layers=L, num_blocks=K, x_from_sources=mode == "delta_block")
        keys = [*range(2 * L)] + (["final"] if plan.final_reads() else [])
        rs = dict(zip(keys, _routers(kind, len(keys), d, True, None, 9)))
        for r in rs.values():
            r.to(dtype)
        h0 = data.to(dtype).requires_grad_()
        scales = [s.to(dtype).requires_grad_() for s in scales64]
        bounds = [0, cut, L] if stages == 2 else [0, L]
        with traffic.counting() as count:
            payload, handed, inputs = [h0 * 1.0], [], []
            for first, end in zip(bounds, bounds[1:]):
                scope = {k: rs[k] for k in keys if k == "final" and end == L or k != "final" and first <= k // 2 < end}
                if first:
                    inputs = [t.detach().requires_grad_() for t in payload]
                    buf = SourceBuffer.from_tensors(plan, first, inputs, EPS, readers=scope)
                else:
                    buf = SourceBuffer.start(plan, payload[0], EPS, readers=scope)
                for j in range(2 * first, 2 * end):
                    buf.commit(j, buf.routed_input(j, rs[j]) * scales[j])
                if end < L:
                    payload = buf.to_tensors()
                    handed = payload
            out = buf.output(rs.get("final"))
            (out.double() * W).sum().backward()
            if stages == 2:  # the first stage's backward, seeded with the payload's gradients
                pairs = [(t, i.grad) for t, i in zip(handed, inputs) if i.grad is not None]
                torch.autograd.backward([t for t, _ in pairs], [gr for _, gr in pairs])
        grads = [h0.grad] + [s.grad for s in scales] + [p.grad for k in keys for p in rs[k].parameters()]
        return out.detach().double(), [None if gr is None else gr.double() for gr in grads], count

    out, grads, count = run("triton", torch.float32, 2)
    ref_out, ref_grads, _ = run("torch", torch.float32, 1)
    out64, grads64, _ = run("torch", torch.float64, 1)
    # the block passes: stage 1 has blocks 0, 1 whole (4 routers over 1 and 2 sources) and, cut at 5, layer 4 of
    # block 2; stage 2 layer 5 of block 2 (2 routers over 3 sources) and block 3; cut at 3: layer 2 | layer 3 of
    # block 1 (2 routers over 2 sources: in place), blocks 2 and 3 whole in stage 2
    assert sum(c.kernel == triton_router.DEFERRED_KERNEL for c in count.calls) == (5 if cut == 5 else 3)
    for name, o, gs, tol in (("torch", ref_out, ref_grads, 2e-6), ("float64", out64, grads64, 1e-5)):
        torch.testing.assert_close(out, o, rtol=tol, atol=tol * o.abs().max().item(), msg=name)
        for i, (a, b) in enumerate(zip(grads, gs, strict=True)):
            assert (a is None) == (b is None), (name, i)
            if b is not None:
                torch.testing.assert_close(a, b, rtol=10 * tol, atol=10 * tol * b.abs().max().item(),
                                           msg=lambda m, name=name, i=i: f"{name} grad {i}: {m}")


# ---------------------------------------------------------------------------------------- the group router
def _group_kernel_calls(monkeypatch):
    """Counts the calls of the group router's five Triton kernels (core/triton_group_kernels.py)."""
    from megatron_delta.core import triton_group_kernels

    calls = {}
    for name in ("old_forward", "old_backward", "merge_forward", "merge_backward", "final_sum"):
        fn = getattr(triton_group_kernels, name)

        def counted(*a, _fn=fn, _name=name, **k):
            calls[_name] = calls.get(_name, 0) + 1
            return _fn(*a, **k)
        monkeypatch.setattr(triton_group_kernels, name, counted)
    return calls


@pytest.mark.parametrize("config", G.CONFIGS, ids=G.config_id)
def test_group_router_on_the_kernels(interpreter, config, monkeypatch):
    """The group router of delta / full_attnres on its Triton kernels (fp32), for S in {2, 3 (a scope of 4: groups
    of 3 and 1), all, auto} with the groups cut by a chunk boundary: the output and every gradient (sublayer weights,
    each source, each router's query, key-norm weight, null source and gate; the embedding output) equal the float64
    reference's (tests/reference_delta.route) to fp32 round-off; each of the four kernels runs, once per
    group (old pass) or router (merge, but for each group's first router without a gate: its u is the old pass's)
    and phase, and delta's hand-out of x as the sum of its sources once (its
    gradient seeds the sources' sinks: a dropped or doubled seed fails the gradients)."""
    calls = _group_kernel_calls(monkeypatch)
    cut = G.CUTS["chunk"]
    # 51 tokens: four tiles of 16, so that each of the two reducing programs of a backward kernel takes two
    # (triton_router.reducing_programs) and sums its query gradients over both
    h0 = G.make_h0(torch.float32, seq=17, batch=3)
    assert triton_router.reducing_programs(-(-51 // 16), "cpu") == 2
    for size in (2, 3, "all", "auto"):
        S = 2 * G.L if size == "all" else size
        # fp32 round-off of a different summation order (tiles, programs) over 51 tokens
        G.against_reference(G.make_toy(*config, S, torch.float32, "triton"), h0, cut, 1e-5, 1e-4)
        bounds = [0, *cut, G.L]  # each scope's groups; its first router reads h0 and the sources before it
        groups = sum(len(set(group_plan.group_spans(range(2 * a, 2 * b), group_plan.resolve_sizes(
            S, 2 * (b - a), 2 * a + 1, one_router_per_call=False, fused_passes=True, first_u=not config[2])).values()))
            for a, b in zip(bounds, bounds[1:]))
        merges = 2 * G.L - (0 if config[2] else groups)  # without a gate each group's first u is its old pass's
        want = {"old_forward": groups, "old_backward": groups, "merge_forward": merges, "merge_backward": merges}
        if config[3]:  # x as the sources: the last scope hands it out
            want["final_sum"] = 1
        assert calls == want, (size, calls)
        calls.clear()


@pytest.mark.parametrize("config", G.CONFIGS, ids=G.config_id)
def test_group_router_traffic_is_the_closed_form(interpreter, config):
    """The group router's recorded reads and writes on the Triton kernels are group_plan.passes, as on the C
    kernels (fp32: one pass is one [T, d] fp32 tensor)."""
    mode, null, gate, xs = config
    S = 3
    with traffic.counting() as count:
        G.forward_backward(G.make_toy(*config, S, torch.float32, "triton"), G.make_h0(torch.float32), ())
    rows = count.rows(G.SEQ * G.BATCH * G.D, act_bytes=4)
    counted = sum(v for (kernel, _), v in rows.items() if kernel.startswith("group_"))
    # h0, v0 .. v_{2L-2}: each source a router reads; its first gradient is written, not updated - unless x's
    # hand-out as the sum of the sources seeded its sink (group_router._FinalSum)
    n_read = 0 if xs else 2 * G.L
    assert counted == group_plan.passes(2 * G.L, 1, S, unit=xs, base=gate) - n_read
    # x = the last group's X (the sources older than it, summed by its old pass) + the sources made in it, x written
    last = 2 * G.L - (2 * G.L) % S if (2 * G.L) % S else 2 * G.L - S  # the last group's first router
    assert rows.get(("x_sum", "forward"), 0) == (1 + (2 * G.L - last) + 1 if xs else 0)
    assert ("autograd_add", "backward") not in rows or not xs


@pytest.mark.parametrize("mode", ["delta", "full_attnres"])
def test_bf16_group_router_traffic_is_the_closed_form(interpreter, mode):
    """In bf16 the counts only (the interpreter's bf16 values are not trustworthy; the tensors each call reads and
    writes are the call's): a 4-layer stream of delta / full_attnres with the group router on its kernels - the fp32
    partial mixes at 2 u, delta's X in the sources' dtype at 1 u, u and the gradients in bf16 - moves what
    cost_model.step_traffic(act_bytes=2), the figures router_share prices, says; with and without the null source
    and gate."""
    from megatron_delta.perf import cost_model
    from tests.helpers.traffic_steps import STAND_IN_HIDDEN, STAND_IN_TOKENS, stand_in_step

    for extras in (False, True):
        gate = extras and mode == "delta"
        counted, count = stand_in_step(mode, "triton", torch.bfloat16, extras, gate, with_count=True)
        assert any(k[0].startswith("group_") for k in counted)
        reductions = []
        predicted = cost_model.step_traffic(mode, 4, "triton", act_bytes=2, null_source=extras, gate=gate,
                                            reductions=reductions)
        assert counted == pytest.approx(predicted, abs=1e-9), extras
        _assert_partials_priced(count, reductions, STAND_IN_TOKENS, STAND_IN_HIDDEN)


def _assert_partials_priced(count, reductions, tokens, hidden):
    """The per-program partial sums the kernels wrote and their sums read back (triton_router.REDUCE_KERNEL, below
    a row, so outside count.rows) are the bytes cost_model.reduction_bytes prices from the closed form's calls, at
    the interpreter's program count."""
    from megatron_delta.perf import cost_model

    read, written = count.bytes().get((triton_router.REDUCE_KERNEL, "backward"), (0, 0))
    assert reductions and read == written
    assert read + written == cost_model.reduction_bytes(reductions, triton_router.INTERPRETER_REDUCING_PROGRAMS,
                                                        tokens, hidden)


# ---------------------------------------------------------------------------------------- host work per launch
@pytest.mark.parametrize("mode", ["delta_block", "delta"])
def test_one_table_copy_per_launch(interpreter, dist, mode, monkeypatch):
    """The host's work per launch, counted. Every launch of the kernels (per-router, deferred block pass, group
    passes, final sum) sends all its tables of addresses, flags and slots in ONE copy (triton_router.device_tables),
    each table 16 bytes aligned: on a GPU each copy costs the host tens of microseconds, and at the 1B shape the
    host, not the GPU, sets the step's pace (docs/performance.md). And backward makes or adds no zero-size
    tensor: the sink tokens that order the routers' backward against their sources' (triton_router._SinkToken,
    _DeferredPass) get no gradient, where a zero-size one per reader cost an allocation and autograd an add,
    about 20 ops per router call. A model step with null source and gate, on the kernels (delta: the group
    router)."""
    import triton.runtime.interpreter as interp

    launches, copies, inside = [], [], []
    run, tables = interp.InterpretedFunction.run, triton_router.device_tables

    def counted_run(self, *a, **k):  # (the interpreter runs a kernel on PyTorch ops: not the host's, not counted)
        launches.append(self.fn.__name__)
        inside.append(True)
        try:
            return run(self, *a, **k)
        finally:
            inside.pop()

    def counted_tables(*lists, device):
        views = tables(*lists, device=device)
        copies.append(len({v.untyped_storage().data_ptr() for v in views}))
        assert all(v.data_ptr() % 16 == 0 for v in views)
        assert all(v[:len(t)].tolist() == list(t) and len(v) - len(t) < triton_router.TABLE_ALIGN
                   for v, t in zip(views, lists, strict=True))
        return views

    class EmptyResults(TorchDispatchMode):  # backward's allocations and adds of zero-size tensors
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if (not inside and func.overloadpacket.__name__ in ("new_empty", "add", "add_")
                    and any(isinstance(t, torch.Tensor) and t.numel() == 0 for t in (out, *args))):
                empty.append(func.overloadpacket.__name__)
            return out

    monkeypatch.setattr(interp.InterpretedFunction, "run", counted_run)
    monkeypatch.setattr(triton_router, "device_tables", counted_tables)
    tok, pos, W = K.batch()
    model, _ = K.build(mode, True, True, "triton")
    loss, empty = (model(tok, pos, None) * W).sum(), []
    with EmptyResults():
        loss.backward()
    # the sink tokens order backward and carry no gradient: nothing is made for them, nothing added by autograd
    assert empty == [], sorted(set(empty))
    kernels = set(launches)
    assert kernels >= ({"_forward", "_backward", "_block_grad"} if mode == "delta_block" else
                       {"_old_forward", "_old_backward", "_merge_forward", "_merge_backward"}), kernels
    assert copies == [1] * len(launches), (len(copies), len(launches))


# ---------------------------------------------------------------------------------------- the capture check
@pytest.mark.parametrize("plant", [None, "grid", "constant", "address"])
def test_capture_recorder_on_the_stream(interpreter, plant, monkeypatch):
    """perf/capture_check.LaunchRecorder over two iterations of delta_block's routed stream (4 layers): each
    launch's recorded tensor addresses and int64 table entries are those the launch was passed, its table copies
    per iteration those host_work's own counter counts; the kernels and the grids repeat, and so do the constants
    unless one is planted: a grid or a constant changed in one launch of the second iteration is one launch that
    differs in that part alone; a tensor argument swapped for a copy is recorded at the copy's address."""
    import triton.runtime.interpreter as interp

    from megatron_delta.perf import capture_check, host_work

    call, _, _ = capture_check.stream_case("delta_block", "plain", "triton", 1, layers=4)
    passed, state = [], {"armed": False, "k": 0, "copy": None}
    counts = host_work._Counts()
    with host_work._counting_tables(counts), capture_check.LaunchRecorder() as rec:
        recording = interp.InterpretedFunction.run

        def planting(self, *args, grid, warmup, **kwargs):  # before the recorder: as if a router had changed it
            if state["armed"]:
                state["k"] += 1
                if state["k"] == 3 and plant == "grid":
                    grid = (grid[0] + 1, *grid[1:])
                elif state["k"] == 3 and plant == "constant":
                    key = next(k for k, v in kwargs.items() if type(v) is int)
                    kwargs = dict(kwargs, **{key: kwargs[key] + 1})
                elif state["k"] == 3 and plant == "address":
                    i = next(i for i, a in enumerate(args) if isinstance(a, torch.Tensor))
                    state["copy"] = args[i].clone()
                    args = (*args[:i], state["copy"], *args[i + 1:])
            tensors = [a for a in args if isinstance(a, torch.Tensor)] + [
                v for _, v in sorted(kwargs.items()) if isinstance(v, torch.Tensor)]
            passed.append(([t.data_ptr() for t in tensors],
                           [t.tolist() for t in tensors if t.dtype == torch.int64]))
            return recording(self, *args, grid=grid, warmup=warmup, **kwargs)

        monkeypatch.setattr(interp.InterpretedFunction, "run", planting)
        call()
        first = counts.tables
        rec.mark()
        state["armed"] = True
        call()
    assert rec.copies == [first, counts.tables - first] and first > 0
    launches = rec.iterations[0] + rec.iterations[1]
    assert len(launches) == len(passed) and len(rec.iterations[0]) == len(rec.iterations[1]) > 3
    for sig, (addresses, entries) in zip(launches, passed, strict=True):
        assert [a for _, a in sig[3]] == addresses and [list(e) for _, e in sig[4]] == entries
    differ, parts = capture_check.signature_changes(rec.iterations)
    assert (parts["kernel"], parts["grid"], parts["scalars"]) == (0, int(plant == "grid"), int(plant == "constant"))
    if plant == "address":
        sig = rec.iterations[1][2]
        assert state["copy"].data_ptr() in [a for _, a in sig[3]]


@pytest.mark.parametrize("mode, group", [(m, g) for _, m, g in __import__(
    "megatron_delta.perf.capture_check", fromlist=["RUNS"]).RUNS], ids=lambda v: str(v))
def test_routed_step_repeats_for_a_full_iteration_graph(interpreter, mode, group):
    """What a --cuda-graph-impl full_iteration replay needs of the routed step, for every routed mode over the five
    cases (plain; null source and gate; full recompute; a PP2 cut with one micro-batch in flight, and with two in
    1F1B order), 3 iterations on the kernels: the same launches in every iteration, no synchronisation after the
    first, and from one iteration to the next no launch differing in its kernel, grid or constants (only in tensor
    addresses and table entries, which a replay takes from its capture)."""
    from megatron_delta.perf import capture_check

    figures, detail = capture_check.capture_figures(mode, group, iterations=3, compile_layers=None)
    assert capture_check.full_iteration_replay(figures, detail) == dict(
        launches_fixed=True, syncs=0, differ_beyond_addresses=0, ready=True), detail


def test_capture_sync_counter_on_the_stream(interpreter, monkeypatch):
    """perf/capture_check.counting_syncs over delta's routed stream on the kernels (group router, 4 layers): a
    planted .item() in every commit is counted once per sublayer; the recorder's own reads are not counted."""
    from megatron_delta.core.sources import SourceBuffer
    from megatron_delta.perf import capture_check

    call, _, _ = capture_check.stream_case("delta", "plain", "triton", "auto", layers=4)
    commit = SourceBuffer.commit

    def reading(self, j, out):
        out.sum().item()
        return commit(self, j, out)

    monkeypatch.setattr(SourceBuffer, "commit", reading)
    with capture_check.LaunchRecorder() as rec:
        call()
        with capture_check.counting_syncs(lambda: rec.busy) as counts:
            call()
    assert dict(counts) == {"_local_scalar_dense": 2 * 4} and len(rec.iterations[0]) > 0
