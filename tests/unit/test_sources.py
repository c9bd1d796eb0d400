"""SourcePlan / SourceBuffer / payload / routing_stats on a toy stack of sublayers (plain PyTorch)."""
import json

import pytest
import torch

from megatron_delta.core.payload import pack_stage_payload, payload_seq_length, unpack_stage_payload
from megatron_delta.core.sources import SourceBuffer, SourcePlan
from megatron_delta.evaluation.routing_stats import RoutingStatsAccumulator, routing_stats
from tests.helpers import reference_delta as R
from tests.helpers.toy_stack import EPS, Toy, sublayer

PLANS = [
    SourcePlan("delta", 4, 1),
    SourcePlan("delta", 4, 1, "authors-code"),
    SourcePlan("delta_block", 4, 2),
    SourcePlan("delta_block", 4, 4),
    SourcePlan("delta_block", 4, 1),
    SourcePlan("delta_block", 6, 3, "authors-code"),
    SourcePlan("delta_block", 4, 4, "authors-code"),
    SourcePlan("attnres", 4, 2),
    SourcePlan("attnres", 4, 4),
    SourcePlan("full_attnres", 4, 1),
    SourcePlan("delta", 4, 1, x_from_sources=True),
    SourcePlan("delta_block", 4, 2, x_from_sources=True),
    SourcePlan("delta_block", 4, 1, x_from_sources=True),
]


def _id(plan):
    return (f"{plan.mode}-L{plan.num_layers}-K{plan.num_blocks}-{plan.sources}"
            + ("-xsum" if plan.x_from_sources else ""))


# --------------------------------------------------------------------------- SourcePlan
# (each mode's reads and payloads, and the checks of a plan: tests/unit/test_modes.py)
@pytest.mark.parametrize("mode,sources,gate,expected", [
    ("delta", "exact", "none", True), ("delta_block", "exact", "none", True),
    ("delta", "exact", "scalar", False), ("delta_block", "exact", "scalar", False),  # u = x + 0 r at init
    ("delta", "authors-code", "none", False), ("delta_block", "authors-code", "none", False),
    ("attnres", "exact", "none", False), ("full_attnres", "exact", "none", False)])
def test_from_config_keeps_x_as_its_sources_without_a_gate(mode, sources, gate, expected):
    from types import SimpleNamespace

    cfg = SimpleNamespace(residual=mode, num_layers=4, delta_num_blocks=2, delta_sources=sources, delta_gate=gate)
    plan = SourcePlan.from_config(cfg)
    assert plan.x_from_sources is expected
    assert ("x" in plan.payload_names(2)) is (plan.additive and not expected)


def test_source_counts():
    L = 12
    p = SourcePlan("delta", L, 1)
    assert [p.num_sources_read(j) for j in range(2 * L)] == [j + 1 for j in range(2 * L)]
    assert p.max_sources() == 2 * L == 24  # +1 with a null source = 25
    pa = SourcePlan("delta", L, 1, "authors-code")
    assert [pa.num_sources_read(j) for j in range(2 * L)] == [0] + [j + 1 for j in range(1, 2 * L)]

    for K in (1, 2, 3, 4, 6, 12):
        pb = SourcePlan("delta_block", L, K)
        counts = [pb.num_sources_read(j) for j in range(2 * L)]
        assert max(counts) == pb.max_sources() == min(K + 1, 2 * L) and max(counts) <= K + 1
        lb = L // K
        for j in range(2 * L):
            b = (j // 2) // lb
            assert counts[j] == 1 + b + (0 if j == 2 * b * lb else 1)
        pab = SourcePlan("delta_block", L, K, "authors-code")
        counts = [pab.num_sources_read(j) for j in range(2 * L)]
        assert counts[0] == 0 and max(counts) == K
        pr = SourcePlan("attnres", L, K)
        counts = [pr.num_sources_read(j) for j in range(2 * L)]
        assert counts[0] == 1 and max(counts) <= K + 1 and len(pr.final_reads()) == K + 1
    pf = SourcePlan("full_attnres", L, 1)
    assert [pf.num_sources_read(j) for j in range(2 * L)] == [j + 1 for j in range(2 * L)]
    assert len(pf.final_reads()) == 2 * L + 1 == pf.max_sources()


@pytest.mark.parametrize("plan", PLANS + [SourcePlan("delta_block", 12, 4),
                                          SourcePlan("attnres", 12, 3)], ids=_id)
def test_payload_never_carries_an_unread_source(plan):
    L = plan.num_layers
    for f in range(1, L + 1):
        later = set(plan.final_reads())
        for j in range(2 * f, 2 * L):
            later |= set(plan.reads(j))
        names = plan.payload_names(f)
        assert len(set(names)) == len(names)
        unused = [n for n in names if n != "x" and n not in later]
        assert not unused, (f, unused)
        # and everything a later sublayer reads that already exists at f travels
        if f < L:
            assert set(plan.reads(2 * f)) <= set(names)


# --------------------------------------------------------------------------- SourceBuffer
def _grads(out, params, h0):
    go = torch.linspace(-1, 1, out.numel()).reshape(out.shape)
    return torch.autograd.grad(out, params + [h0], go, allow_unused=True)


@pytest.mark.parametrize("null,gate", [(False, False), (True, True)])
@pytest.mark.parametrize("plan", PLANS, ids=_id)
def test_pipeline_split_gives_the_same_model(plan, null, gate):
    """A stage split changes only which routers share a projection GEMM, or project a source inside
    their own pass when they are its one reader in the stage (fp32 round-off: 1.5e-6 seen)."""
    d, s, b = 16, 3, 2
    toy = Toy(plan, d, null=null, gate=gate, seed=1)
    h0 = torch.randn(s, b, d, generator=torch.Generator().manual_seed(2), requires_grad=True)
    ref, _ = toy.run(h0)
    ref_grads = _grads(ref, toy.params(), h0)
    L = plan.num_layers
    splits = [(f,) for f in range(1, L + 1)] + [tuple(range(L + 1))]
    for boundaries in splits:
        received = []

        def check(layer, buf):
            # what a stage receives is exactly its payload, and x besides sources only
            assert buf.to_tensors() is not None
            received.extend((layer, n, buf._entries[n]) for n in buf._entries)

        out, _ = toy.run(h0, boundaries, check=check)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5, msg=str(boundaries))
        grads = _grads(out, toy.params(), h0)
        for g, gr in zip(grads, ref_grads):
            assert (g is None) == (gr is None)
            if g is not None:
                # gradients meet in a different summation order across a boundary: round-off only
                err = (g - gr).abs().max() / gr.abs().max().clamp_min(1e-30)
                assert err < 5e-5, (boundaries, err)
        # every source a stage received was read by one of its routers (inv_rms is lazy)
        for layer, name, entry in received:
            if layer > 0:
                assert entry.source is not None, (boundaries, layer, name)


@pytest.mark.parametrize("plan", [SourcePlan("delta", 3, 1), SourcePlan("delta_block", 6, 3),
                                  SourcePlan("delta_block", 6, 6), SourcePlan("delta_block", 6, 1)],
                         ids=_id)
def test_exact_sources_sum_to_x(plan):
    toy = Toy(plan, 8, seed=3)
    h0 = torch.randn(4, 2, 8)
    buf = SourceBuffer.start(plan, h0, EPS)
    for j in range(plan.num_sublayers):
        total = sum(src.value for src in buf.read(j))
        torch.testing.assert_close(total, buf.x, rtol=1e-5, atol=1e-5)
        u = buf.routed_input(j, toy.routers[j])
        buf.commit(j, sublayer(u, toy.weights[j]))


@pytest.mark.parametrize("plan", [p for p in PLANS if p.additive and not p.x_from_sources], ids=_id)
def test_residual_updated_in_place_only_when_nobody_else_holds_it(plan):
    """commit adds v_j into x in place once x is its own: h0, the tensors to_tensors() handed out
    (payload / checkpoint outputs) and the authors-code A0 (= x) keep their values, and outputs and
    gradients equal a run in which every commit makes a new x."""
    toy = Toy(plan, 8, seed=5)
    h0 = torch.randn(4, 2, 8, requires_grad=True)
    h0_before = h0.detach().clone()

    def run(in_place):
        handed, snapshots, xs = [], [], []
        buf = SourceBuffer.start(plan, h0, EPS)
        for j in range(plan.num_sublayers):
            u = buf.routed_input(j, toy.routers[j])
            if not in_place:
                buf._x_own = False  # as if x were held elsewhere: commit makes a new tensor
            buf.commit(j, sublayer(u, toy.weights[j]))
            xs.append(buf._x)  # kept alive, so distinct tensors have distinct storages (not .x: it marks x shared)
            if j % 4 == 1 and j + 1 < plan.num_sublayers:  # a layer boundary: what a payload carries
                handed += buf.to_tensors()
                snapshots += [t.detach().clone() for t in handed[len(snapshots):]]
        out = buf.output(None)
        for t, snap in zip(handed, snapshots):
            assert torch.equal(t.detach(), snap)
        assert (len({x.data_ptr() for x in xs}) < plan.num_sublayers) == in_place  # the in-place path ran
        for p in [h0] + toy.params():
            p.grad = None
        out.square().sum().backward()
        return out.detach(), [p.grad.clone() for p in [h0] + toy.params()]

    out, grads = run(in_place=True)
    assert torch.equal(h0.detach(), h0_before)
    ref, ref_grads = run(in_place=False)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r)


def test_authors_code_block_sources_are_alternating_sums():
    plan = SourcePlan("delta_block", 6, 3, "authors-code")
    toy = Toy(plan, 8, seed=4)
    h0 = torch.randn(2, 2, 8)
    buf = SourceBuffer.start(plan, h0, EPS)
    H = {}
    for j in range(plan.num_sublayers):
        if plan.is_block_start(j):
            H[plan.block_of(j)] = buf.x
        u = buf.routed_input(j, toy.routers[j])
        buf.commit(j, sublayer(u, toy.weights[j]))
    assert buf.read(5)[0].value is h0
    assert [s.value.shape for s in buf.read(11)] == [h0.shape] * 3
    a = [s.value for s in buf.read(11)]
    assert torch.equal(a[0], H[0])
    torch.testing.assert_close(a[1], H[1] - H[0])
    torch.testing.assert_close(a[2], H[2] - H[1] + H[0])
    assert plan.reads(0) == [] and plan.reads(2) == ["A0"] and plan.reads(4) == ["A0"]


def test_replacement_bookkeeping():
    plan = SourcePlan("attnres", 4, 2)
    toy = Toy(plan, 8, seed=5)
    h0 = torch.randn(2, 1, 8)
    buf = SourceBuffer.start(plan, h0, EPS)
    outs = []
    for j in range(plan.num_sublayers):
        u = buf.routed_input(j, toy.routers[j])
        v = sublayer(u, toy.weights[j])
        outs.append(v)
        buf.commit(j, v)
    assert buf.names == ["B0", "B1", "p"]
    assert buf._entries["B0"].value is h0
    torch.testing.assert_close(buf._entries["B1"].value, outs[0] + outs[1] + outs[2] + outs[3])
    torch.testing.assert_close(buf._entries["p"].value, outs[4] + outs[5] + outs[6] + outs[7])
    plan = SourcePlan("full_attnres", 2, 1)
    toy = Toy(plan, 8, seed=5)
    buf = SourceBuffer.start(plan, h0, EPS)
    outs = []
    for j in range(4):
        outs.append(sublayer(buf.routed_input(j, toy.routers[j]), toy.weights[j]))
        buf.commit(j, outs[-1])
    assert buf.names == ["B0", "B1", "B2", "B3", "p"]
    assert [buf._entries[n].value for n in buf.names] == [h0] + outs


def test_protocol_errors():
    plan = SourcePlan("delta", 2, 1)
    toy = Toy(plan, 4)
    buf = SourceBuffer.start(plan, torch.randn(1, 1, 4), EPS)
    with pytest.raises(RuntimeError, match="expected sublayer 0"):
        buf.routed_input(1, toy.routers[1])
    u = buf.routed_input(0, toy.routers[0])
    with pytest.raises(RuntimeError):
        buf.to_tensors()
    buf.commit(0, u)
    with pytest.raises(RuntimeError, match="layer boundary"):
        buf.to_tensors()
    with pytest.raises(ValueError, match="expected 4 tensors"):
        SourceBuffer.from_tensors(SourcePlan("delta", 2, 1), 1, [u], EPS)


def _baseline(toy, h0):
    x = h0
    for j, w in enumerate(toy.weights):
        x = x + sublayer(x, w)
    return x


@pytest.mark.parametrize("mode", ["delta", "delta_block"])
def test_init_gate_gives_baseline_and_no_gate_preserves_function(mode):
    plan = SourcePlan(mode, 4, 2)
    h0 = torch.randn(3, 2, 16)
    gated = Toy(plan, 16, gate=True, null=True, seed=6, random_routers=False)
    assert torch.equal(gated.run(h0)[0], _baseline(gated, h0))
    plain = Toy(plan, 16, seed=6, random_routers=False)
    # uniform weights: u = (1 + 1/N) x, and the pre-norm is scale invariant (up to eps)
    torch.testing.assert_close(plain.run(h0)[0], _baseline(plain, h0), rtol=1e-4, atol=1e-4)
    summed = Toy(SourcePlan(mode, 4, 2, x_from_sources=True), 16, seed=6, random_routers=False)
    torch.testing.assert_close(summed.run(h0)[0], _baseline(summed, h0), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kernels", ["c", "torch"])
@pytest.mark.parametrize("null,gate_value", [(False, None), (True, 0.7), (False, -0.3)])
@pytest.mark.parametrize("mode,blocks", [("delta", 1), ("delta_block", 2), ("delta_block", 1)])
def test_x_from_sources_is_the_update_rule(mode, blocks, null, gate_value, kernels):
    """A plan that keeps x as its sources (u = sum_i (1 + a alpha_i) s_i, x summed only at the end)
    computes docs/design.md's update rule (u = x + a r, x <- x + v_j): outputs and every gradient as the
    plan that holds x, against float64, to fp32 round-off; it holds no x and sends none."""
    d, L = 16, 4
    h0 = torch.randn(3, 2, d, generator=torch.Generator().manual_seed(7), dtype=torch.float64)

    def run(x_from_sources, dtype):
        plan = SourcePlan(mode, L, blocks, x_from_sources=x_from_sources)
        toy = Toy(plan, d, null=null, gate=gate_value is not None, gate_value=gate_value or 0.0, seed=8,
                  kernels=kernels)
        for t in toy.params():
            t.data = t.data.to(dtype)
        h = h0.to(dtype).requires_grad_()
        out, bufs = toy.run(h, boundaries=(2,))
        assert all((b._x is None) == x_from_sources for b in bufs)
        return [out] + list(_grads(out, toy.params(), h))

    ref = run(False, torch.float64)
    summed, held = run(True, torch.float32), run(False, torch.float32)
    for k, (a, b, want) in enumerate(zip(summed, held, ref, strict=True)):
        err_summed, err_held = ((t.double() - want).abs().max().item() for t in (a, b))
        # both are fp32 round-off (seen: up to 5e-6 at scale 10, either within 3.2x of the other); a
        # gate's gradient is a sum that cancels to ~1e-5, hence the term relative to the held-x error
        assert err_summed <= 3e-6 * max(want.abs().max().item(), 1.0) + 3 * err_held, (k, err_summed, err_held)


@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.parametrize("plan", [SourcePlan("delta", 3, 1), SourcePlan("delta_block", 4, 2),
                                  SourcePlan("attnres", 4, 2)], ids=_id)
def test_activation_recompute_per_layer(plan, reentrant):
    """A checkpointed layer takes the sources as explicit tensors and rebuilds the buffer."""
    from torch.utils.checkpoint import checkpoint

    toy = Toy(plan, 8, null=True, gate=True, seed=10)
    h0 = torch.randn(3, 2, 8, requires_grad=True)
    per_layer = tuple(range(1, plan.num_layers + 1))  # the same router scopes as one stage per layer
    ref, _ = toy.run(h0, per_layer)
    ref_grads = _grads(ref, toy.params(), h0)

    def layer_fn(layer):
        def fn(*tensors):
            buf = SourceBuffer.from_tensors(plan, layer, tensors, EPS, readers=toy.readers(layer, per_layer))
            for j in (2 * layer, 2 * layer + 1):
                buf.commit(j, sublayer(buf.routed_input(j, toy.routers[j]), toy.weights[j]))
            return tuple(buf.to_tensors())
        return fn

    tensors = [h0]
    for layer in range(plan.num_layers):
        tensors = checkpoint(layer_fn(layer), *tensors, use_reentrant=reentrant)
    out = SourceBuffer.from_tensors(plan, plan.num_layers, tensors, EPS,
                                    readers=toy.readers(plan.num_layers, per_layer)).output(toy.final)
    assert torch.equal(out, ref)
    leaves = toy.params() + [h0]
    for t in leaves:
        t.grad = None
    go = torch.linspace(-1, 1, out.numel()).reshape(out.shape)
    out.backward(go)  # reentrant checkpointing supports .backward() only
    for t, gr in zip(leaves, ref_grads):
        g = t.grad
        if gr is not None:
            assert (g - gr).abs().max() <= 1e-5 * gr.abs().max()


@pytest.mark.parametrize("plan", PLANS, ids=_id)
def test_one_projection_per_source(plan, monkeypatch):
    """With its chunk's readers known, a buffer projects each source value with several readers ONCE
    for all of them (make_source), and leaves a value with one reader to that router, which projects
    it inside its own pass (a local source); the result equals every router projecting for itself."""
    from megatron_delta.core import router as router_mod

    calls, local = [], []
    orig, orig_route = router_mod._ProjectSource.apply, router_mod._RouteFunction.apply

    def counting(value, eps, sink, *queries):
        calls.append(len(queries))
        return orig(value, eps, sink, *queries)

    def counting_route(n, *args):
        local.append(sum(c is None for c in args[10 + n:]))
        return orig_route(n, *args)

    monkeypatch.setattr(router_mod._ProjectSource, "apply", counting)
    monkeypatch.setattr(router_mod._RouteFunction, "apply", counting_route)
    toy = Toy(plan, 8, null=True, seed=11)
    h0 = torch.randn(3, 2, 8, generator=torch.Generator().manual_seed(12), requires_grad=True)
    pairs = sum(plan.num_sources_read(j) for j in range(plan.num_sublayers)) + len(plan.final_reads())
    for boundaries in [(), (1, 3)]:
        calls.clear(), local.clear()
        ref, _ = toy.run(h0, boundaries, scoped=False)
        assert calls == [] and sum(local) == pairs  # unscoped: every router projects every source itself
        ref_grads = _grads(ref, toy.params(), h0)
        calls.clear(), local.clear()
        out, _ = toy.run(h0, boundaries)
        assert calls and min(calls) >= 2, calls  # make_source only for values with several readers
        assert sum(calls) + sum(local) == pairs and len(calls) + sum(local) < pairs, (calls, local, pairs)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
        for g, gr in zip(_grads(out, toy.params(), h0), ref_grads):
            assert (g is None) == (gr is None)
            if g is not None:  # summation order differs: fp32 round-off relative to the largest entry
                assert (g - gr).abs().max() <= 1e-5 * gr.abs().max(), boundaries


# --------------------------------------------------------------------------- memory
def _saved_bytes(fn, exclude=()):
    """Bytes of the unique storages autograd saves for backward (weights in `exclude` not counted)."""
    storages = {}
    skip = {t.untyped_storage().data_ptr() for t in exclude}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in skip:
            storages[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return sum(storages.values()), out


def _stacking_delta(h0, toy):
    """delta on the float64 reference's router (tests/helpers/reference_delta.route), which stacks every source at every
    sublayer: the function of the buffer's, at memory quadratic in depth (what the buffer avoids)."""
    x, srcs = h0, [h0]
    for j, w in enumerate(toy.weights):
        r = toy.routers[j]
        u = x + R.route(srcs, r.query, r.key_norm_weight, eps=EPS)[0]
        v = sublayer(u, w)
        x = x + v
        srcs.append(v)
    return x


def _quadratic_fit(ls, ys):
    a = torch.tensor([[1.0, depth, depth * depth] for depth in ls], dtype=torch.float64)
    return torch.linalg.solve(a, torch.tensor(ys, dtype=torch.float64)).tolist()


def test_saved_bytes_grow_linearly_with_depth():
    d, s, b = 256, 4, 1
    h0 = torch.randn(s, b, d)
    ours, block, stacking = [], [], []
    ls = (4, 8, 16)
    for L in ls:
        toy = Toy(SourcePlan("delta", L, 1), d, seed=8)
        n_ours, out = _saved_bytes(lambda: toy.run(h0)[0], toy.params())
        n_stacking, out2 = _saved_bytes(lambda: _stacking_delta(h0, toy), toy.params())
        torch.testing.assert_close(out, out2, rtol=1e-4, atol=1e-4)
        ours.append(n_ours)
        stacking.append(n_stacking)
        toy = Toy(SourcePlan("delta_block", L, 4), d, seed=8)
        block.append(_saved_bytes(lambda: toy.run(h0)[0], toy.params())[0])
    # The only quadratic term is the per-token routing scalars: for each (source, reader) pair one
    # fp32 logit (saved by the source's projection) and one softmax weight (saved by the router).
    pairs = [sum(SourcePlan("delta", L, 1).num_sources_read(j) for j in range(2 * L)) for L in ls]
    scalars = [8 * s * b * p for p in pairs]
    _, lin, quad = _quadratic_fit(ls, [o - c for o, c in zip(ours, scalars)])
    assert abs(quad) * ls[-1] < 0.01 * lin, (ours, scalars, lin, quad)
    _, lin_b, quad_b = _quadratic_fit(ls, block)
    assert abs(quad_b) * ls[-1] < 0.01 * lin_b, (block, lin_b, quad_b)
    _, lin_n, quad_n = _quadratic_fit(ls, stacking)
    assert quad_n * ls[-1] > 0.5 * lin_n, (stacking, lin_n, quad_n)
    assert stacking[-1] > 2 * ours[-1]


@pytest.mark.parametrize("null,gate_value", [(False, None), (True, 0.7), (True, -0.3), (False, -0.6)])
@pytest.mark.parametrize("plan", [SourcePlan("delta_block", 6, 3), SourcePlan("delta_block", 4, 1)], ids=_id)
def test_partial_block_sum_rebuilt_not_kept(plan, null, gate_value):
    """delta_block's sources sum to x, so the fp32 C path keeps no partial block sum P for backward:
    each router that reads one rebuilds it from its output u (which the sublayer's norm saves anyway).
    Exactly one [T, d] fp32 tensor fewer is saved per such router than on the PyTorch path (which keeps
    P); outputs and gradients match a float64 run to fp32 round-off (a gate's gradient no worse than twice
    the PyTorch path's). A gate below -1/2 could make 1 + gate * alpha_P small, so there P is kept (no
    saving)."""
    d, s, b = 64, 5, 2
    h0 = torch.randn(s, b, d, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    runs = {}
    for kernels, dtype in (("c", torch.float32), ("torch", torch.float32), ("torch", torch.float64)):
        toy = Toy(plan, d, null=null, gate=gate_value is not None, seed=4, kernels=kernels,
                  gate_value=gate_value or 0.0)
        params = toy.params()
        for p in params:
            p.data = p.data.to(dtype)
        x0 = h0.to(dtype).requires_grad_()
        nbytes, out = _saved_bytes(lambda: toy.run(x0)[0], params + [x0])
        runs[kernels, dtype] = (nbytes, [out] + list(_grads(out, params, x0)))
    # Readers of a P summing >= 2 outputs (P after one sublayer IS its output, which the toy's tanh saves).
    sums = sum(not plan.is_block_start(j) and not plan.is_block_start(j - 1) for j in range(plan.num_sublayers))
    kept = 0 if gate_value is not None and gate_value < -0.5 else sums
    c32, t32, t64 = runs["c", torch.float32], runs["torch", torch.float32], runs["torch", torch.float64]
    assert sums > 0 and t32[0] - c32[0] == kept * s * b * d * 4
    # A scalar gate's gradient is a sum over tokens that can cancel to near zero; its fp32 round-off is
    # that of the sum's terms, so it is measured against the largest gate gradient of the model (the
    # C kernels' -march=native vectorisation rounds such a sum differently from the PyTorch path).
    gate_scale = max((r.abs().max().item() for r in t64[1] if r is not None and r.numel() == 1), default=0.0)
    for c, t, ref in zip(c32[1], t32[1], t64[1], strict=True):
        assert (c is None) == (ref is None)
        if c is not None:  # fp32 round-off (1e-4, as the router tests)
            scale = max(ref.abs().max().item(), gate_scale if ref.numel() == 1 else 0.0)
            err_c, err_t = ((x.double() - ref).abs().max().item() for x in (c, t))
            assert err_c <= max(1e-4 * scale, 2 * err_t), (err_c, err_t)


# --------------------------------------------------------------------------- payload
def test_pack_unpack_roundtrip_and_grads():
    ts = [torch.randn(3, 2, 4, requires_grad=True) for _ in range(3)]
    payload = pack_stage_payload(ts)
    assert payload.shape == (9, 2, 4)
    parts = unpack_stage_payload(payload, 3)
    assert all(torch.equal(p, t) for p, t in zip(parts, ts))
    sum((i + 1) * p.sum() for i, p in enumerate(parts)).backward()
    for i, t in enumerate(ts):
        assert torch.equal(t.grad, torch.full_like(t, i + 1.0))
    assert pack_stage_payload(ts[:1]) is ts[0]
    assert unpack_stage_payload(ts[0], 1)[0] is ts[0]
    with pytest.raises(ValueError):
        unpack_stage_payload(payload, 2)
    plan = SourcePlan("delta", 4, 1)
    assert [payload_seq_length(plan, f, 8) for f in range(5)] == [8, 32, 48, 64, 8]


# --------------------------------------------------------------------------- routing stats
def test_routing_stats_values():
    uni = torch.full((5, 2, 4), 0.25)
    st = routing_stats(uni)
    assert st["num_sources"] == 4 and abs(st["max_weight"] - 0.25) < 1e-12
    assert abs(st["entropy"] - 1.0) < 1e-12
    hot = torch.zeros(5, 2, 4)
    hot[..., 2] = 1.0
    st = routing_stats(hot)
    assert st["entropy"] == 0.0 and st["max_weight"] == 1.0 and st["mean_weights"][2] == 1.0
    assert routing_stats(torch.ones(3, 1, 1))["entropy"] is None


def test_routing_stats_accumulator_from_buffer():
    plan = SourcePlan("attnres", 2, 2)
    toy = Toy(plan, 8, seed=9)
    acc = RoutingStatsAccumulator()
    for seed in range(2):
        h0 = torch.randn(3, 2, 8, generator=torch.Generator().manual_seed(seed))
        _, bufs = toy.run(h0, boundaries=(1,), record_routing=True)
        for buf in bufs:
            acc.add_buffer(buf)
    assert acc.receivers() == [0, 1, 2, 3, "final"]
    d = json.loads(acc.to_json())
    assert d["receivers"]["0"]["entropy"] is None  # layer 0's attention sees h0 only
    assert d["receivers"]["0"]["tokens"] == 12
    for key in ("1", "2", "3", "final"):
        st = d["receivers"][key]
        assert 0.0 <= st["entropy"] <= 1.0 and abs(sum(st["mean_weights"]) - 1.0) < 1e-6
    text = acc.format_text().splitlines()
    assert len(text) == 3 and text[0].startswith("layer   0: attn N=1") and "final" in text[2]
