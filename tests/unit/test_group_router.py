"""core/group_router.py: the group router of delta and full_attnres computes the independent float64 reference's
function (tests/helpers/reference_delta.route; float64 to 1e-12, outputs and every gradient) for S in {1, 2, 3, 4, all,
auto}, with groups cut by pipeline chunks and by recompute chunks; so do its C kernels in fp32, to fp32 round-off
(its Triton kernels: tests/helpers/triton_cases.py);
its counted traffic is the closed form (perf/cost_model.step_traffic; group_plan.passes on the C kernels);
auto chooses S per backend; the option is refused outside the fine-grained modes with a line naming the flag."""
import math

import pytest
import torch

from megatron_delta.core import group_kernels, group_router, router, traffic
from megatron_delta.core.group_plan import (
    AUTO_MAX_GROUP,
    auto_group_sizes,
    block_defers,
    check_group_size,
    deferring_groups,
    group_spans,
    passes,
    resolve_sizes,
)
from megatron_delta.core.sources import SourcePlan
from tests.helpers.group_toys import (
    BATCH,
    CONFIGS,
    CUTS,
    SEQ,
    D,
    L,
    against_reference,
    config_id,
    forward_backward,
    make_h0,
    make_toy,
    reference,
    run_capturing_sources,
    scope_runs,
)
from tests.helpers.host_data import host_data_ops
from tests.helpers.toy_stack import Toy

SIZES = [1, 2, 3, 4, "all", "auto"]  # 4: groups of 4 and 2; auto: 1 on PyTorch ops (group_plan.resolve_sizes)


@pytest.fixture
def group_passes(monkeypatch):
    """Counts the old passes (one per group) the group router makes."""
    count = [0]
    apply = group_router._OldPass.apply

    def counted(*a):
        count[0] += 1
        return apply(*a)
    monkeypatch.setattr(group_router._OldPass, "apply", counted)
    return count


@pytest.mark.parametrize("cut", list(CUTS))
@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("config", CONFIGS, ids=config_id)
def test_float64_equals_the_reference(config, size, cut, group_passes):
    """Every group size and cut (and the per-router path, S = 1) computes the float64 reference's function
    (tests/helpers/reference_delta.route): the output and every gradient (sublayer weights, each source, each router's
    query, key-norm weight, null source and gate, the embedding output) to 1e-12, in one pass per group."""
    S = 2 * L if size == "all" else size
    against_reference(make_toy(*config, S), make_h0(torch.float64), CUTS[cut], 1e-12)
    expected = sum(math.ceil(n / S) for n in scope_runs(CUTS[cut])) if S not in (1, "auto") else 0
    assert group_passes[0] == expected * (2 if cut == "recompute" else 1)  # recompute runs each forward twice


@pytest.mark.parametrize("config", CONFIGS, ids=config_id)
def test_routing_weights_recorded_as_the_reference(config):
    """With routing recorded, each grouped router's alpha (older sources, in-group sources, null source last)
    is the float64 reference's."""
    h0 = make_h0(torch.float64)
    toy = make_toy(*config, 3)
    _, bufs = toy.run(h0, (), record_routing=True)
    ref_alphas = reference(toy, h0)[3]
    for j in range(2 * L):
        a, r = bufs[0].routing[j], ref_alphas[j]
        assert a.shape == r.shape and (a - r).abs().max().item() <= 1e-12


@pytest.mark.parametrize("size", [1, 2, 4, "auto"])
@pytest.mark.parametrize("config", CONFIGS, ids=config_id)
def test_c_kernels_in_fp32(config, size, monkeypatch):
    """The fused CPU kernels (fp32), groups cut by a chunk boundary, compute the float64 reference's function
    (outputs and every gradient: sublayer weights, sources, query, key-norm weight, null source, gate, h0) to fp32
    round-off (gradients to 2e-5: the kernels sum in other orders), as the PyTorch ops do; each of the four kernels
    runs (S = 1: none, the per-router path)."""
    calls = {}
    for name in ("old_forward", "old_backward", "merge_forward", "merge_backward"):
        fn = getattr(group_kernels, name)

        def counted(*a, _fn=fn, _name=name, **k):
            calls[_name] = calls.get(_name, 0) + 1
            return _fn(*a, **k)
        monkeypatch.setattr(group_kernels, name, counted)
    for kernels in ("c", "torch"):
        against_reference(make_toy(*config, size, torch.float32, kernels), make_h0(torch.float32), (2,), 1e-6, 2e-5)
    assert set(calls) == (set() if size == 1 else {"old_forward", "old_backward", "merge_forward", "merge_backward"})


@pytest.mark.parametrize("size", [5, 14])
@pytest.mark.parametrize("config", [CONFIGS[1], CONFIGS[2], CONFIGS[4]], ids=config_id)
def test_c_kernels_at_wide_shapes(config, size, monkeypatch):
    """Hidden 72 (two full column chunks of the C kernels' register blocks and a narrower one, two full dot-product
    lane sweeps and a narrower one) and 14 routers in groups of 5 (5, 5, 4: a group deferring its old share) or one
    of 14: every block of the kernels (four routers, four sources, dot tiles of 2 x 4 and 1 x 8 rows) full and
    partial. The fp32 C kernels compute the float64 reference's function to fp32 round-off."""
    layers, d = 7, 72
    received = []
    old_backward = group_kernels.old_backward

    def counted(*a, **k):
        received.append(k.get("received", a[15] if len(a) > 15 else None) is not None)
        return old_backward(*a, **k)
    monkeypatch.setattr(group_kernels, "old_backward", counted)

    def run(size, dtype, kernels):
        mode, null, gate, xs = config
        plan = SourcePlan(mode, layers, layers, x_from_sources=xs, router_group_size=size)
        toy = Toy(plan, d, null=null, gate=gate, seed=11, kernels=kernels)
        toy.weights = [w.detach().to(dtype).requires_grad_() for w in toy.weights]
        for r in toy.routers + ([toy.final] if toy.final else []):
            r.to(dtype)
        h0 = torch.randn(SEQ, BATCH, d, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
        h0 = h0.to(dtype).requires_grad_()
        out = toy.run(h0, ())[0]
        go = torch.linspace(-1, 1, out.numel(), dtype=torch.float64).reshape(out.shape)
        ref_out, ref_leaves, _, _ = reference(toy, h0)
        ref_grads = torch.autograd.grad(ref_out, ref_leaves, go, allow_unused=True)
        return out, torch.autograd.grad(out, toy.params() + [h0], go.to(dtype), allow_unused=True), ref_out, ref_grads

    errors = {}
    for kernels in ("torch", "c"):
        out, grads, ref_out, ref_grads = run(size, torch.float32, kernels)
        errors[kernels] = [(out.double() - ref_out).abs().max().item() / ref_out.abs().max().item()] + [
            (g.double() - r).abs().max().item() / max(r.abs().max().item(), 1e-3)
            for g, r in zip(grads, ref_grads) if r is not None]
    assert received == ([False, True, False] if size == 5 else [False]), received
    # fp32 round-off grows with depth and width (up to 5e-4 here, with the gate; the kernels sum in other orders
    # than the PyTorch ops): each output and each leaf's gradient within 1e-4 of the float64 function, or as close
    # as ten times the PyTorch ops' in fp32
    for c, t in zip(errors["c"], errors["torch"]):
        assert c <= max(10 * t, 1e-4), (c, t)


@pytest.mark.parametrize("kernels", ["c", "torch"])
@pytest.mark.parametrize("config", CONFIGS, ids=config_id)
def test_counted_traffic_is_the_closed_form(config, kernels):
    """The group router's recorded reads and writes of [T, d] tensors, forward and backward, per kernel and
    phase, are perf/cost_model.step_traffic's (fp32: one pass is one [T, d] fp32 tensor); on the C kernels
    their sum is group_plan.passes, the closed form auto sizes the groups by."""
    from megatron_delta.perf import cost_model

    mode, null, gate, xs = config
    S = 3
    toy = make_toy(*config, S, torch.float32, kernels)
    with traffic.counting() as count:
        forward_backward(toy, make_h0(torch.float32), ())
    rows = count.rows(SEQ * BATCH * D, act_bytes=4)
    counted = {k: v for k, v in rows.items() if k[0].startswith("group_")}
    predicted = cost_model.step_traffic(mode, L, kernels, act_bytes=4, null_source=null, gate=gate, group_size=S)
    assert counted == pytest.approx({k: v for k, v in predicted.items() if k[0].startswith("group_")}, abs=1e-9)
    if kernels == "c":
        # h0, v0 .. v_{2L-2}: each source a router reads; its first gradient is written, not updated - unless x,
        # handed out as the sum of the sources, seeded its sink (group_router._FinalSum)
        n_read = 0 if xs else 2 * L - 1 + 1
        assert sum(counted.values()) == passes(2 * L, 1, S, unit=xs, base=gate, null=null) - n_read
        assert ("autograd_add", "backward") not in rows or not xs, rows


def _compositions(n):
    """Every split of n consecutive routers into groups, as the groups' sizes in order."""
    if n == 0:
        yield ()
        return
    for s in range(1, n + 1):
        for rest in _compositions(n - s):
            yield (s,) + rest


def test_group_spans_and_auto_sizes():
    assert group_spans([0, 1, 2, 3, 4, 5], 4) == {0: (0, 4), 1: (0, 4), 2: (0, 4), 3: (0, 4), 4: (4, 6), 5: (4, 6)}
    assert group_spans([4, 5, 6], 2) == {4: (4, 6), 5: (4, 6), 6: (6, 7)}
    assert group_spans([0, 1, 3], 3) == {0: (0, 2), 1: (0, 2), 3: (3, 4)}  # never across a gap
    # the groups' sizes in order; the last one repeats, and a gap ends a group early
    assert group_spans(range(6), (1, 3)) == {0: (0, 1), 1: (1, 4), 2: (1, 4), 3: (1, 4), 4: (4, 6), 5: (4, 6)}
    assert group_spans([0, 1, 3, 4, 5], (3, 2)) == {0: (0, 2), 1: (0, 2), 3: (3, 5), 4: (3, 5), 5: (5, 6)}
    assert passes(6, 1, (2, 4)) == passes(2, 1, 2) + passes(4, 3, 4) and passes(7, 2, (3,)) == passes(7, 2, 3)
    # auto: the split with the fewest counted passes, against every split of up to 10 routers; the groups grow
    # (each group's first router takes its u from the old pass, so a group of one router is one pass), and every
    # other group from the scope's end defers its older sources' gradient shares to the group before it
    assert auto_group_sizes(24, 1) == (1, 1, 2, 3, 5, 6, 6) and auto_group_sizes(6, 1) == (1, 1, 2, 2)
    assert deferring_groups((1, 1, 2, 3, 5, 6, 6), 1) == (False, False, True, False, True, False, True)
    assert auto_group_sizes(1, 5) == 1 and auto_group_sizes(2, 40) == (2,)
    # with a gate (the merges read the held x: no first router's u from the old pass), the groups are larger
    assert auto_group_sizes(24, 1, False) == (3, 4, 5, 6, 6) and auto_group_sizes(6, 1, False) == (2, 4)
    assert passes(24, 1, 5, base=True) - passes(24, 1, 5) == 24 + 5 * (4 + 1)  # per router 1, per group 4 + unit
    for n, n0 in [(4, 1), (6, 1), (8, 1), (10, 1), (6, 13), (9, 4)]:
        sizes = auto_group_sizes(n, n0)
        assert passes(n, n0, sizes) == min(passes(n, n0, c) for c in _compositions(n)), (n, n0)
        assert list(sizes) == sorted(sizes), sizes
    # and never more than the best equal groups: at 24 routers 449 passes against 471 (S = 5)
    for n, n0 in [(24, 1), (56, 1), (12, 13), (48, 1)]:
        assert passes(n, n0, auto_group_sizes(n, n0)) <= min(passes(n, n0, s) for s in range(1, n + 1))
    assert passes(24, 1, auto_group_sizes(24, 1)) == 449 and passes(24, 1, 5) == 471
    # at most AUTO_MAX_GROUP routers a group (the kernels pad S to a power of two: 9-16 pad to 16 and spill): the 1B
    # depth's 56 routers end in groups of 8, where the split without the cap ends in 8, 9 and 10
    assert auto_group_sizes(56, 1) == (1, 1, 2, 3, 4, 6, 7, 8, 8, 8, 8) and AUTO_MAX_GROUP == 8
    assert max(auto_group_sizes(72, 1)) == AUTO_MAX_GROUP and passes(72, 1, auto_group_sizes(72, 1)) < passes(72, 1, 8)


def test_resolve_sizes_takes_auto_only_where_fused_passes_run():
    """``auto`` is the split of auto_group_sizes on fused passes (C or Triton), 1 on PyTorch ops or fla's kernel; an
    explicit S stands as given (check_group_size refuses what S cannot run on)."""
    def resolve(size, *, fla=False, fused=True, first_u=True):
        return resolve_sizes(size, 24, 1, one_router_per_call=fla, fused_passes=fused, first_u=first_u)

    assert resolve("auto") == auto_group_sizes(24, 1) == (1, 1, 2, 3, 5, 6, 6)
    assert resolve("auto", first_u=False) == auto_group_sizes(24, 1, False)
    assert resolve("auto", fused=False) == 1 and resolve("auto", fla=True) == 1
    assert resolve(4, fused=False) == 4 and resolve(1) == 1


def test_block_deferral_pays_where_it_moves_fewer_rows():
    """A block's R routers defer the C sources they all read to one pass where 2 R C rows in place exceed the pass's
    R + 3 C: never for one router, from 3 sources for 2 routers, from 1 source for 4."""
    for routers in range(1, 9):
        for sources in range(0, 9):
            assert block_defers(routers, sources) == (sources > 0 and 2 * routers * sources > routers + 3 * sources)
    assert not any(block_defers(1, c) for c in range(9))
    assert not block_defers(2, 2) and block_defers(2, 3) and not block_defers(3, 1) and block_defers(4, 1)


@pytest.mark.parametrize("value,residual,sources,kernels,message", [
    (2, "delta_block", "exact", "auto", "--delta-router-group-size 2 applies to --residual delta and full_attnres "
     "(every sublayer's output is a source), not delta_block; drop --delta-router-group-size or set it to 1"),
    (3, "baseline", "exact", "auto", "--delta-router-group-size 3 applies to --residual delta and full_attnres "
     "(every sublayer's output is a source), not baseline; drop --delta-router-group-size or set it to 1"),
    (2, "delta", "authors-code", "auto", "--delta-router-group-size 2 needs --delta-sources exact (the authors' "
     "delta starts with a router that reads no source); drop --delta-router-group-size or set it to 1"),
    (4, "full_attnres", "exact", "fla", "--delta-router-group-size 4 cannot run on fla's kernel "
     "(--delta-router-kernels fla routes one router per call); use --delta-router-kernels auto, triton, c or "
     "torch, or --delta-router-group-size 1"),
    ("0", "delta", "exact", "auto", "--delta-router-group-size '0' is not 'auto' or a positive integer (1 = one "
     "router per pass)"),
    ("two", "delta", "exact", "auto", "--delta-router-group-size 'two' is not 'auto' or a positive integer (1 = "
     "one router per pass)"),
])
def test_refusals_name_the_flag(value, residual, sources, kernels, message):
    with pytest.raises(ValueError) as e:
        check_group_size(value, residual, sources, kernels)
    assert str(e.value) == message


def test_accepted_values():
    assert check_group_size("auto", "delta_block") == "auto"  # auto and 1 mean the per-router path there
    assert check_group_size("1", "attnres") == 1
    assert check_group_size("4", "delta") == 4 and check_group_size(2, "full_attnres", kernels="c") == 2
    assert check_group_size(3, "delta", kernels="triton") == 3  # the group router's Triton kernels
    assert not SourcePlan("delta_block", 4, 2, router_group_size="auto").groups_routers
    assert not SourcePlan("delta", 4, 1, "authors-code", router_group_size="auto").groups_routers
    assert SourcePlan("delta", 4, 1, router_group_size="auto").groups_routers


def test_config_and_flag_refuse_a_size_for_another_mode():
    from megatron_delta.core.config import DeltaTransformerConfig
    from megatron_delta.trainer.arguments import TrainerArgumentError
    from megatron_delta.trainer.main import parse_args
    from tests.helpers.flags import CLI_MOCK, CLI_TINY

    with pytest.raises(ValueError, match="^--delta-router-group-size 2 applies to --residual delta and full_attnres"):
        DeltaTransformerConfig(num_layers=2, hidden_size=8, num_attention_heads=2, residual="delta_block",
                               delta_router_group_size=2)
    config = DeltaTransformerConfig(num_layers=2, hidden_size=8, num_attention_heads=2, residual="delta",
                                    delta_router_group_size="3")
    assert config.delta_router_group_size == 3
    with pytest.raises(TrainerArgumentError, match="^--delta-router-group-size 2 applies to --residual delta"):
        parse_args(CLI_TINY + CLI_MOCK + ["--residual", "attnres", "--delta-router-group-size", "2"])
    args = parse_args(CLI_TINY + CLI_MOCK + ["--residual", "full_attnres", "--delta-router-group-size", "2"])
    assert args.delta_router_group_size == 2
    assert parse_args(CLI_TINY + CLI_MOCK + ["--residual", "delta"]).delta_router_group_size == "auto"


@pytest.mark.parametrize("config", CONFIGS, ids=config_id)
def test_bf16_activations(config):
    """bf16 sources (PyTorch ops, fp32 router math, fp32 partial mixes): the float64 function to bf16 round-off,
    no worse than the per-router path in bf16; a graph kept for a second backward gives the same gradients."""
    ref_out, ref_grads = forward_backward(make_toy(*config, 1), make_h0(torch.float64), ())
    errors = []
    for size in (1, 3):
        toy = make_toy(*config, size, torch.bfloat16)
        for r in toy.routers + ([toy.final] if toy.final else []):
            r.float()  # as Megatron's --bf16 keeps them trainable in fp32 math (query_vector is fp32)
        h0 = make_h0(torch.bfloat16)
        out = toy.run(h0, (2,))[0]
        go = torch.linspace(-1, 1, out.numel(), dtype=out.dtype, device=out.device).reshape(out.shape)
        leaves = toy.params() + [h0]
        first = torch.autograd.grad(out, leaves, go, retain_graph=True, allow_unused=True)
        second = torch.autograd.grad(out, leaves, go, allow_unused=True)
        assert all(torch.equal(a, b) for a, b in zip(first, second) if a is not None)
        errors.append(max([(out.double() - ref_out).abs().max().item() / ref_out.abs().max().item()] +
                          [(g.double() - r).abs().max().item() / max(r.abs().max().item(), 1e-3)
                           for g, r in zip(first, ref_grads) if r is not None]))
    assert errors[1] <= max(2 * errors[0], 2e-2), errors


@pytest.mark.parametrize("cut,groups", [((), 4), ((2,), 4)])
def test_auto_resolves_per_scope(cut, groups, group_passes):
    """auto on the C kernels: the split with the fewest counted passes per buffer scope (auto_group_sizes): one
    chunk of 6 routers reading 1 source first -> groups of 1, 1, 2 and 2; chunks of 4 (n0 = 1: 1, 1 and 2) and 2
    routers (n0 = 5: one group of 2) -> 4 groups, two of a single router. The result is the float64 reference's to
    fp32 round-off."""
    config = ("delta", True, False, True)
    against_reference(make_toy(*config, "auto", torch.float32, "c"), make_h0(torch.float32), cut, 1e-6, 1e-5)
    assert group_passes[0] == groups


@pytest.mark.parametrize("kernels,dtype,grouped", [("c", torch.float32, True), ("auto", torch.float32, True),
                                                   ("torch", torch.float32, False), ("c", torch.float64, False),
                                                   ("auto", torch.float64, False)])
def test_auto_groups_only_on_the_kernels(kernels, dtype, grouped, group_passes):
    """auto groups the routers (auto_group_sizes: 6 routers over 1 source -> groups of 1, 1, 2 and 2) where it runs
    on the C kernels (fp32 CPU tensors under c / auto), and keeps one router per pass where it would run on
    PyTorch ops (torch, or float64 which the C kernels do not take): counted per op, the group router's
    PyTorch path moves more than the per-router path."""
    config = ("delta", True, False, True)
    toy = make_toy(*config, "auto", dtype, kernels)
    forward_backward(toy, make_h0(dtype), ())
    assert group_passes[0] == (4 if grouped else 0)


def test_closed_form_prices_what_auto_runs():
    """perf/cost_model prices auto as group_router.GroupRouting.resolve runs it: one router per pass on torch
    (and fla), auto_group_sizes' split on the C and Triton kernels - whose group passes on the C kernels are
    group_plan.passes of that split (less the first gradients the final sum's seed turns into updates: none)."""
    from megatron_delta.perf import cost_model

    n = 2 * 12
    for mode, unit in (("delta", True), ("full_attnres", False)):
        for backend in ("torch", "fla"):
            auto = cost_model.step_traffic(mode, 12, backend, act_bytes=4, null_source=True, group_size="auto")
            assert auto == cost_model.step_traffic(mode, 12, backend, act_bytes=4, null_source=True,
                                                   group_size=1), (mode, backend)
        auto = cost_model.step_traffic(mode, 12, "c", act_bytes=4, null_source=True, group_size="auto")
        grouped = sum(v for (kernel, _), v in auto.items() if kernel.startswith("group_"))
        first_writes = 0 if unit else n  # h0, v0 .. v_{n-2}: read by the groups; the last by the final router
        assert grouped == passes(n, 1, auto_group_sizes(n, 1), unit=unit, null=True) - first_writes, mode
        for backend, act in (("c", 4), ("triton", 4), ("triton", 2)):
            auto = sum(cost_model.step_traffic(mode, 12, backend, act_bytes=act, group_size="auto").values())
            assert auto < min(sum(cost_model.step_traffic(mode, 12, backend, act_bytes=act, group_size=s).values())
                              for s in (3, 4, 5, 6)), (mode, backend, act)
        assert (sum(cost_model.step_traffic(mode, 12, "torch", act_bytes=4, group_size=5).values())
                > sum(cost_model.step_traffic(mode, 12, "torch", act_bytes=4, group_size=1).values()))


def _source_grads(toy, h0, cut):
    """The output and the float64 gradient of ``go . x`` with respect to every source: h0 and each sublayer's
    output v_j (captured as SourceBuffer.commit receives it)."""
    out, vs = run_capturing_sources(toy, h0, cut)
    go = torch.linspace(-1, 1, out.numel(), dtype=out.dtype, device=out.device).reshape(out.shape)
    if cut == "recompute":  # the checkpoints' recomputed outputs are not these tensors: the leaves' gradients
        return out, torch.autograd.grad(out, [h0] + toy.params(), go, allow_unused=True)
    return out, torch.autograd.grad(out, [h0] + vs, go)


@pytest.mark.parametrize("kernels,dtype", [("torch", torch.float64), ("c", torch.float32)])
@pytest.mark.parametrize("cut", ["none", "chunk", "recompute"])
@pytest.mark.parametrize("size", [2, 3, "all"])
def test_final_sum_seeds_the_sinks_once(size, cut, kernels, dtype, monkeypatch):
    """delta with x as the sum of its sources: the hand-out sum in a grouped scope (group_router._FinalSum) gives
    every source exactly x's gradient once - each source's gradient equals the per-router path's (float64 to
    1e-12; fp32 C kernels to round-off), so a dropped or doubled contribution (off by x's gradient, of norm ~1)
    fails - and it runs on every grouped scope that hands x out, with no autograd addition of that gradient."""
    runs = []
    apply = group_router._FinalSum.apply

    def counted(lib, *a):
        runs.append(lib)
        return apply(lib, *a)
    monkeypatch.setattr(group_router._FinalSum, "apply", counted)
    config = ("delta", False, False, True)
    ref_out, ref = _source_grads(make_toy(*config, 1), make_h0(torch.float64), CUTS[cut])
    assert runs == []  # S = 1: SourceBuffer.x's chain of adds
    S = 2 * L if size == "all" else size
    toy = make_toy(*config, S, dtype, kernels)
    with traffic.counting() as count:
        out, grads = _source_grads(toy, make_h0(dtype), CUTS[cut])
    # the last scope's hand-out; recompute: this checkpoint's recomputation stops at the last tensor backward needs
    # (torch.utils.checkpoint's early stop), before the sum, which saves nothing
    assert len(runs) == 1
    assert all((lib is None) == (kernels == "torch") for lib in runs)
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    assert (out.double() - ref_out).abs().max().item() <= tol * ref_out.abs().max().item()
    assert len(grads) == len(ref)
    for g, r in zip(grads, ref):
        assert (g is None) == (r is None)
        if r is not None:
            assert (g.double() - r).abs().max().item() <= tol * max(1.0, r.abs().max().item())
    if cut == "none":  # one scope: every source's gradient comes through its sink alone
        assert ("autograd_add", "backward") not in count.rows(SEQ * BATCH * D, act_bytes=dtype.itemsize)


def test_seed_sinks_adds_where_a_writer_came_first():
    """router.seed_sinks, the backward of x handed out as the sum of the sources, for both kinds of sink (the group
    router's and the per-router Triton kernels'): a sink no writer reached holds x's gradient by reference (no
    pass); one a writer reached first (a gradient or a seed there already) adds it now; a source without a sink
    gets it as is."""
    from megatron_delta.core import triton_router

    gen = torch.Generator().manual_seed(2)
    grad = torch.randn(3, 2, 4, generator=gen, dtype=torch.float64)
    flat = grad.reshape(-1, 4)
    for make in (group_router._Sink, triton_router.KernelSink):
        fresh, written, seeded = make(), make(), make()
        w0, s0 = torch.randn(6, 4, generator=gen, dtype=torch.float64), torch.randn(6, 4, generator=gen,
                                                                                   dtype=torch.float64)
        written.grad, seeded.seed = w0.clone(), s0
        out = router.seed_sinks([fresh, None, written, seeded], grad)
        assert out[0] is None and out[1] is grad and out[2] is None and out[3] is None
        assert fresh.grad is None and torch.equal(fresh.seed, flat) and fresh.seed.data_ptr() == grad.data_ptr()
        assert torch.equal(written.grad, w0 + flat) and written.seed is None
        assert torch.equal(seeded.grad, s0 + flat) and seeded.seed is None


def _old_share(gen, n, S, T, d, dtype):
    """A random group_router.OldShare over n sources from S routers, two of which sent an output gradient."""
    r = lambda *shape: torch.randn(*shape, generator=gen, dtype=dtype)  # noqa: E731
    return group_router.OldShare((r(T, d), r(T, d)), r(2, n, T), r(S, n, T), r(S, d), r(n, T))


def _share_of(share, i, value):
    """Source i's gradient share, written out: E_i v + sum_k A_ki G_k + sum_k C_ki Q_k."""
    return (share.E[i, :, None] * value + sum(share.A[k, i, :, None] * g for k, g in enumerate(share.grads))
            + share.C[:, i].t() @ share.Q)


@pytest.mark.parametrize("shape", [(6, 4), (3, 2, 4)], ids=["rows", "seq-batch"])
def test_old_shares_settle_where_no_old_pass_adds_them(shape):
    """A group's old pass on the kernels defers its share of the gradients of the previous group's older sources to
    that group's old pass (group_router.OldShare on _Sink.old). Where that pass does not add it (it did not run),
    the source's _Collect adds it on PyTorch ops, so none is lost: the gradient is the one given plus the share.
    The sources and the routers' output gradients in the share come as [T, d] rows or, as the Triton kernels
    leave them (no view op per call), in the sources' own [s, b, d] shape."""
    d = shape[-1]
    T = torch.Size(shape).numel() // d
    gen = torch.Generator().manual_seed(4)
    value = torch.randn(*shape, generator=gen, dtype=torch.float64, requires_grad=True)
    sink = group_router._Sink()
    alias = group_router._Collect.apply(value, sink)
    rows = _old_share(gen, 3, 3, T, d, torch.float64)
    share = rows._replace(grads=tuple(g.reshape(shape) for g in rows.grads))
    sink.old = (share, 1)
    given = torch.randn(*shape, generator=gen, dtype=torch.float64)
    grad, = torch.autograd.grad(alias, value, given)
    want = given + _share_of(rows, 1, value.detach().reshape(T, d)).reshape(shape)
    assert grad.shape == value.shape and torch.allclose(grad, want, rtol=0, atol=1e-12)
    assert sink.old is None


def test_old_pass_settles_a_share_its_kernel_cannot_read():
    """An old pass whose kernel cannot read the next group's share (group_router._received with kernel_reads
    false: say the share's gradients are in another dtype) settles it on PyTorch ops into each source's sink, also
    where its sources come in their [s, b, d] shape (on the Triton kernels: no view op per call)."""
    s_, b, d, n = 3, 2, 4, 3
    T = s_ * b
    gen = torch.Generator().manual_seed(6)
    share = _old_share(gen, n, 2, T, d, torch.float64)
    values = [torch.randn(s_, b, d, generator=gen, dtype=torch.float64) for _ in range(n)]
    sinks = [group_router._Sink() for _ in range(n)]
    for i, sink in enumerate(sinks):
        sink.old = (share, i)
    got = group_router._received(sinks, [True] * n, values, [v.dtype for v in values], lambda sh: False)
    assert got is None
    for i, sink in enumerate(sinks):
        assert sink.old is None and sink.grad.shape == (T, d)
        assert torch.allclose(sink.grad, _share_of(share, i, values[i].reshape(T, d)), rtol=0, atol=1e-12)


@pytest.mark.parametrize("mode", [1, 0, 2])
def test_old_pass_kernel_adds_a_received_share(mode):
    """The C old pass's backward given the next group's share (received) writes each target as without it plus the
    share, E_i v_i + sum_k A_ki G_k + sum_k C_ki Q_k: assigned (mode 1), added in place (0) and on a seed (2)."""
    T, d, n, S = 7, 6, 3, 2
    gen = torch.Generator().manual_seed(5)
    r = lambda *shape: torch.randn(*shape, generator=gen)  # noqa: E731
    values = [r(T, d) for _ in range(n)]
    G, w, dlse, inv, z, p, Q = [r(T, d) for _ in range(S)], r(S, T), r(S, T), r(n, T).abs(), r(S, n, T), \
        r(S, n, T).softmax(1), r(S, d)
    share = _old_share(gen, n, 3, T, d, torch.float32)
    lib = group_kernels.load()
    start = [r(T, d) for _ in range(n)]
    outs = []
    for received in (None, share):
        targets = [(t.clone(), mode == 1, t if mode == 2 else None) for t in start]
        dz, dq = torch.empty(S, n, T), torch.zeros(S, d)
        group_kernels.old_backward(lib, G, list(range(S)), w, dlse, values, inv, z, p, Q, None, targets, True, dz,
                                   dq, received)
        outs.append([t for t, _, _ in targets])
    for i in range(n):
        assert torch.allclose(outs[1][i] - outs[0][i], _share_of(share, i, values[i]), rtol=1e-5, atol=1e-4)


def test_old_pass_logits_have_the_same_bits_in_any_tile():
    """The C old pass takes its dot products in tiles of up to four sources by three queries (csrc: dot_table); a
    logit z_ki depends on its pair of rows only, with the same bits whichever tile, group or set of sources
    computes it (the parallel layouts cut the groups differently). hidden 72: a chunk of 64 columns and a tail."""
    T, d, n, S = 9, 72, 7, 5
    gen = torch.Generator().manual_seed(11)
    values = [torch.randn(T, d, generator=gen) for _ in range(n)]
    Q = torch.randn(S, d, generator=gen) * 0.3
    lib = group_kernels.load()

    def logits(ks, a, b):
        m, s = b - a, len(ks)
        z = torch.empty(s, m, T)
        group_kernels.old_forward(lib, values[a:b], Q[ks], 1e-6, None, None, torch.empty(m, T), z,
                                  torch.empty(s, m, T), torch.empty(s, T), torch.empty(s, T, d), None)
        return z

    full = logits(list(range(S)), 0, n)
    expect = torch.stack([torch.stack([(values[i] * Q[k]).sum(-1, dtype=torch.float64)
                                       / values[i].double().pow(2).mean(-1).add(1e-6).sqrt() for i in range(n)])
                          for k in range(S)])
    assert torch.allclose(full.double(), expect, rtol=1e-5, atol=1e-5)
    for ks, a, b in [([0], 0, n), ([4], 0, n), ([1, 2], 0, 5), ([3, 4, 0], 2, 7), ([2], 6, 7), ([0, 1, 2, 3], 1, 4)]:
        assert torch.equal(logits(ks, a, b), full[ks, a:b]), (ks, a, b)


def test_deferred_shares_settle_where_no_merge_adds_them():
    """A merge on the kernels defers each older in-group source's share of its gradient, w G + c q + e v, to the
    merge of the source's next router (group_router._Sink.pending). Where that merge does not run (its router's u
    got no gradient), the source's _Collect adds the shares on PyTorch ops before handing the gradient on, so none
    is lost: the gradient is the one given plus every share."""
    T, d = 5, 4
    gen = torch.Generator().manual_seed(3)
    value = torch.randn(T, d, generator=gen, dtype=torch.float64, requires_grad=True)
    sink = group_router._Sink()
    alias = group_router._Collect.apply(value, sink)
    # two later merges of 3 in-group sources each, of which this source is the second and the first
    shares = [group_router.DeferredShare(torch.randn(3, 3, T, generator=gen, dtype=torch.float64), i,
                                         torch.randn(T, d, generator=gen, dtype=torch.float64),
                                         torch.randn(d, generator=gen, dtype=torch.float64)) for i in (1, 0)]
    sink.pending = list(shares)
    given = torch.randn(T, d, generator=gen, dtype=torch.float64)
    grad, = torch.autograd.grad(alias, value, given)
    want = given + sum(x.coef[0, x.index, :, None] * x.grad + x.coef[1, x.index, :, None] * x.q[None, :]
                       + x.coef[2, x.index, :, None] * value.detach() for x in shares)
    assert torch.allclose(grad, want, rtol=0, atol=1e-12) and sink.pending == []


# ops that, on a GPU, make a tensor from host data or read one back: each a copy the host waits for (a
# synchronisation, which drains the GPU's queue of launched work) and an error under CUDA graph capture
@pytest.mark.parametrize("mode, group", [("delta", "auto"), ("delta", 3), ("delta_block", "auto")])
@pytest.mark.parametrize("kernels", ["torch", "c"])
def test_routed_step_makes_no_tensor_from_host_data(mode, group, kernels):
    """A routed stream's forward + backward (14 layers: the group router's old passes defer shares, the PyTorch
    path's projections take gradients from some of their routers) makes no tensor from host data and reads none
    back: no index list copied to the device (router._rows takes rows without one), no .item()."""
    from megatron_delta.perf.routed_stream import routed_stream

    call, _ = routed_stream(mode, 14, kernels, group, 8, 16, "cpu", torch.float32, seed=3)
    call()
    with host_data_ops() as ops:
        call()
    assert not ops, dict(ops)


@pytest.mark.parametrize("index", [[0, 1, 2, 3], [1, 2], [2], [0, 2, 3], [3, 1], []])
def test_rows_takes_the_rows_an_index_list_takes(index):
    """router._rows(t, index) is t[index] (values and shape), made without an index tensor."""
    t = torch.randn(4, 5, dtype=torch.float64)
    with host_data_ops() as ops:
        got = router._rows(t, index)
    assert not ops
    assert torch.equal(got, t[index])
