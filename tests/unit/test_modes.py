"""megatron_delta/core/modes.py: the mode names, the one check of the residual options (each rule's message),
what each mode's sublayers read and send across a stage boundary, and that a new mode is one class there."""
import ast
import pathlib
from types import SimpleNamespace

import pytest
import torch

from megatron_delta.core import modes
from megatron_delta.core.modes import FLAGS, HF_FIELDS, check_delta_options
from megatron_delta.core.sources import SourcePlan
from tests.helpers.custom_modes import DeltaWindowMode
from tests.helpers.toy_stack import EPS, Toy, sublayer


# --------------------------------------------------------------------------------------------- names
def test_the_registry_is_the_routed_modes():
    assert modes.RESIDUAL_MODES == ("baseline", "attnres", "full_attnres", "delta", "delta_block")
    assert tuple(modes.ROUTED_MODE_CLASSES) == modes.ROUTED_MODES == modes.RESIDUAL_MODES[1:]
    assert all(cls.name == name for name, cls in modes.ROUTED_MODE_CLASSES.items())
    assert modes.ADDITIVE_MODES == ("delta", "delta_block")
    assert modes.REPLACEMENT_MODES == ("attnres", "full_attnres")
    assert modes.BLOCK_MODES == ("delta_block", "attnres")
    assert modes.SOURCE_DEFINITIONS == ("exact", "authors-code") and modes.GATES == ("none", "scalar")


def test_modes_imports_only_the_standard_library():
    """An exported HF model carries a copy of modes.py, loaded with transformers alone: stdlib imports only."""
    tree = ast.parse(pathlib.Path(modes.__file__).read_text())
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert imported <= {"__future__", "typing"}, imported


# --------------------------------------------------------------------------------------------- the rules
def options(residual="delta", num_layers=4, num_blocks=None, null_source=False, gate="none", sources="exact",
            delta_router_lr_mult=1.0, router_kernels="auto", spell=FLAGS):
    return check_delta_options(residual, num_layers, num_blocks, null_source, gate, sources, delta_router_lr_mult,
                               router_kernels, spell=spell)


BASELINE_TAIL = ("a routed residual mode; --residual baseline has no routers "
                 "(choose --residual attnres, full_attnres, delta or delta_block)")
RULES = [
    (dict(residual="deltaa"), "--residual 'deltaa' is not one of baseline, attnres, full_attnres, delta, delta_block"),
    (dict(gate="vector"), "--delta-gate 'vector' is not one of none, scalar"),
    (dict(sources="paper"), "--delta-sources 'paper' is not one of exact, authors-code"),
    (dict(residual="baseline", null_source=True), "--delta-null-source needs " + BASELINE_TAIL),
    (dict(residual="baseline", num_blocks=2, gate="scalar"),
     "--delta-num-blocks, --delta-gate scalar need " + BASELINE_TAIL),
    (dict(residual="baseline", sources="authors-code", delta_router_lr_mult=2.0, router_kernels="torch"),
     "--delta-sources authors-code, --delta-router-lr-mult, --delta-router-kernels need " + BASELINE_TAIL),
    (dict(residual="attnres", gate="scalar"),
     "--delta-gate scalar only applies to the additive modes (delta, delta_block): --residual attnres replaces "
     "the residual stream, so a zero gate would erase it"),
    (dict(residual="full_attnres", sources="authors-code"),
     "--delta-sources authors-code is defined for --residual delta and delta_block only"),
    (dict(residual="delta_block", num_layers=6, num_blocks=4),
     "--delta-num-blocks 4 must be a positive divisor of --num-layers 6 (each block holds L/K consecutive layers)"),
    (dict(residual="delta_block", num_layers=30),
     "--residual delta_block with --num-layers 30 needs --delta-num-blocks K with K dividing 30 (1, 2, 3, 5, 6, 10, "
     "15, 30); the default, 4 blocks, does not divide 30"),
    (dict(residual="attnres", num_blocks=0),
     "--delta-num-blocks 0 must be a positive divisor of --num-layers 4 (each block holds L/K consecutive layers)"),
    (dict(residual="delta", num_blocks=2),
     "--delta-num-blocks applies to --residual delta_block and attnres, not delta (every sublayer is its own "
     "source there)"),
    (dict(residual="delta", delta_router_lr_mult=0.0), "--delta-router-lr-mult must be positive (got 0.0)"),
    # the HF configuration's spelling of the same rule
    (dict(residual="attnres", num_blocks=3, spell=HF_FIELDS),
     "delta_num_blocks=3 must be a positive divisor of num_hidden_layers=4 (each block holds L/K consecutive "
     "layers)"),
    (dict(residual="attnres", num_layers=6, spell=HF_FIELDS),
     "residual=attnres with num_hidden_layers=6 needs delta_num_blocks K with K dividing 6 (1, 2, 3, 6); the "
     "default, 4 blocks, does not divide 6"),
]


@pytest.mark.parametrize("kwargs,message", RULES, ids=[m[:40] for _, m in RULES])
def test_each_rule_raises_its_message(kwargs, message):
    with pytest.raises(ValueError) as err:
        options(**kwargs)
    assert str(err.value) == message


def test_accepted_options_resolve_the_number_of_blocks():
    assert options(residual="baseline") is None and options(residual="delta") is None
    assert options(residual="delta_block", num_layers=8) == 4  # the paper's K
    assert options(residual="attnres", num_layers=4) == 4
    assert options(residual="attnres", num_layers=2) == 2  # L for a model of at most 4 layers
    assert options(residual="delta_block", num_layers=6, num_blocks=3, gate="scalar", null_source=True,
                   sources="authors-code", delta_router_lr_mult=10.0, router_kernels="torch") == 3


@pytest.mark.parametrize("residual", modes.BLOCK_MODES)
def test_the_default_number_of_blocks_is_at_most_four(residual):
    """Without --delta-num-blocks a block mode never has more than 4 blocks, for L = 1..64: K = min(L, 4) where
    that divides L; otherwise refused, naming the flag and every K that divides L. A SourcePlan built from a
    config without K (the perf models' way) resolves the same K, or refuses with the same line."""
    def plan(L):
        cfg = SimpleNamespace(residual=residual, num_layers=L, delta_num_blocks=None, delta_sources="exact")
        return SourcePlan.from_config(cfg)

    accepted = []
    for L in range(1, 65):
        if L > 4 and L % 4:
            divisors = ", ".join(str(k) for k in range(1, L + 1) if L % k == 0)
            message = (f"--residual {residual} with --num-layers {L} needs --delta-num-blocks K with K dividing {L} "
                       f"({divisors}); the default, 4 blocks, does not divide {L}")
            for resolve in (lambda: options(residual=residual, num_layers=L), lambda: plan(L)):
                with pytest.raises(ValueError) as err:
                    resolve()
                assert str(err.value) == message
            continue
        k = options(residual=residual, num_layers=L)
        assert k == min(L, 4) and L % k == 0 and plan(L).num_blocks == k
        accepted.append(L)
    assert accepted == [1, 2, 3, 4] + list(range(8, 65, 4))


def test_the_model_config_resolves_the_number_of_blocks_or_refuses():
    """DeltaTransformerConfig (pretrain_gpt.py's model, the tools' models) applies the same default in its
    __post_init__: refused for 30 layers without K, the given K kept, 4 for 36 layers."""
    from megatron_delta.core.config import DeltaTransformerConfig

    kw = dict(hidden_size=32, num_attention_heads=4, use_cpu_initialization=True)
    with pytest.raises(ValueError) as err:
        DeltaTransformerConfig(residual="delta_block", num_layers=30, **kw)
    assert str(err.value) == ("--residual delta_block with --num-layers 30 needs --delta-num-blocks K with K dividing "
                              "30 (1, 2, 3, 5, 6, 10, 15, 30); the default, 4 blocks, does not divide 30")
    assert DeltaTransformerConfig(residual="attnres", num_layers=30, delta_num_blocks=5, **kw).delta_num_blocks == 5
    assert DeltaTransformerConfig(residual="attnres", num_layers=36, **kw).delta_num_blocks == 4


PLAN_RULES = [
    (dict(mode="baseline", num_layers=4, num_blocks=4), "--residual baseline has no depth sources (no routers)"),
    (dict(mode="deltaa", num_layers=4, num_blocks=4),
     "--residual 'deltaa' is not one of baseline, attnres, full_attnres, delta, delta_block"),
    (dict(mode="delta", num_layers=4, num_blocks=4, sources="paper"),
     "--delta-sources 'paper' is not one of exact, authors-code"),
    (dict(mode="attnres", num_layers=4, num_blocks=2, sources="authors-code"),
     "--delta-sources authors-code is defined for --residual delta and delta_block only"),
    (dict(mode="delta_block", num_layers=12, num_blocks=5),
     "--delta-num-blocks 5 must be a positive divisor of --num-layers 12 (each block holds L/K consecutive layers)"),
    (dict(mode="delta", num_layers=0, num_blocks=1), "the number of layers must be a positive integer, got 0"),
    (dict(mode="attnres", num_layers=4, num_blocks=2, x_from_sources=True),
     "x_from_sources: only the additive modes' exact sources sum to the residual stream, not --residual attnres "
     "--delta-sources exact"),
    (dict(mode="delta_block", num_layers=4, num_blocks=2, sources="authors-code", x_from_sources=True),
     "x_from_sources: only the additive modes' exact sources sum to the residual stream, not --residual "
     "delta_block --delta-sources authors-code"),
    (dict(mode="delta", num_layers=4, num_blocks=4, sources="authors-code", x_from_sources=True),
     "x_from_sources: only the additive modes' exact sources sum to the residual stream, not --residual delta "
     "--delta-sources authors-code"),
]


@pytest.mark.parametrize("kwargs,message", PLAN_RULES, ids=[m[:40] for _, m in PLAN_RULES])
def test_a_plan_checks_with_the_same_rules(kwargs, message):
    with pytest.raises(ValueError) as err:
        SourcePlan(**kwargs)
    assert str(err.value) == message


def test_a_plan_ignores_the_number_of_blocks_of_a_fine_grained_mode():
    assert SourcePlan("delta", 12, 5).reads(3) == ["h0", "v0", "v1", "v2"]


# --------------------------------------------------------------------------------------------- what is read and sent
# Written by hand from docs/design.md section 1 (a 2-layer model, or 4 layers in K = 2 blocks): reads of j = 0..2L-1,
# the final router's reads, and the payload into first layer f = 0..L.
EXPECTED = {
    SourcePlan("delta", 2, 2): (
        [["h0"], ["h0", "v0"], ["h0", "v0", "v1"], ["h0", "v0", "v1", "v2"]], [],
        [["h0"], ["x", "h0", "v0", "v1"], ["x"]]),
    SourcePlan("delta", 2, 2, x_from_sources=True): (
        [["h0"], ["h0", "v0"], ["h0", "v0", "v1"], ["h0", "v0", "v1", "v2"]], [],
        [["h0"], ["h0", "v0", "v1"], ["x"]]),
    SourcePlan("delta", 2, 2, "authors-code"): (
        [[], ["h0", "v0"], ["h0", "v0", "v1"], ["h0", "v0", "v1", "v2"]], [],
        [["h0"], ["x", "h0", "v0", "v1"], ["x"]]),
    SourcePlan("delta_block", 4, 2): (
        [["h0"], ["h0", "P0"], ["h0", "P0"], ["h0", "P0"], ["h0", "D0"], ["h0", "D0", "P1"], ["h0", "D0", "P1"],
         ["h0", "D0", "P1"]], [],
        [["h0"], ["x", "h0", "P0"], ["x", "h0", "D0"], ["x", "h0", "D0", "P1"], ["x"]]),
    SourcePlan("delta_block", 4, 2, x_from_sources=True): (
        [["h0"], ["h0", "P0"], ["h0", "P0"], ["h0", "P0"], ["h0", "D0"], ["h0", "D0", "P1"], ["h0", "D0", "P1"],
         ["h0", "D0", "P1"]], [],
        [["h0"], ["h0", "P0"], ["h0", "D0"], ["h0", "D0", "P1"], ["x"]]),
    SourcePlan("delta_block", 4, 2, "authors-code"): (
        [[], ["A0"], ["A0"], ["A0"], ["A0"], ["A0", "A1"], ["A0", "A1"], ["A0", "A1"]], [],
        [["h0"], ["x", "A0"], ["x", "A0"], ["x", "A0", "A1"], ["x"]]),
    SourcePlan("attnres", 4, 2): (
        [["p"], ["B0", "p"], ["B0", "p"], ["B0", "p"], ["B0", "p"], ["B0", "B1", "p"], ["B0", "B1", "p"],
         ["B0", "B1", "p"]], ["B0", "B1", "p"],
        [["h0"], ["B0", "p"], ["B0", "p"], ["B0", "B1", "p"], ["B0", "B1", "p"]]),
    SourcePlan("full_attnres", 2, 2): (
        [["p"], ["B0", "p"], ["B0", "B1", "p"], ["B0", "B1", "B2", "p"]], ["B0", "B1", "B2", "B3", "p"],
        [["h0"], ["B0", "B1", "p"], ["B0", "B1", "B2", "B3", "p"]]),
}


def _id(plan):
    return f"{plan.mode}-{plan.sources}" + ("-xsum" if plan.x_from_sources else "")


@pytest.mark.parametrize("plan", list(EXPECTED), ids=_id)
def test_reads_and_payloads(plan):
    reads, final, payloads = EXPECTED[plan]
    assert [plan.reads(j) for j in range(plan.num_sublayers)] == reads
    assert plan.final_reads() == final
    assert [plan.payload_names(f) for f in range(plan.num_layers + 1)] == payloads


def test_lifetime_of_a_source_value():
    """Which receivers read the value a source holds when receiver j reads it: a value the commit of j rewrites
    (P<b>, p) has the one reader j, unless j's routing makes it a completed source first."""
    block = SourcePlan("delta_block", 4, 2)
    assert block.value_readers("h0", 0) == tuple(range(8))
    assert block.value_readers("P0", 1) == (1,) and block.value_readers("D0", 4) == (4, 5, 6, 7)
    attnres = SourcePlan("attnres", 4, 2)
    assert attnres.value_readers("p", 0) == (0, 1, 2, 3, 4, 5, 6, 7, "final")  # h0 becomes B0
    assert attnres.value_readers("p", 3) == (3,)
    assert attnres.value_readers("p", 4) == (4, 5, 6, 7, "final")  # the block sum becomes B1
    full = SourcePlan("full_attnres", 2, 2)
    assert full.value_readers("p", 3) == (3, "final") and full.value_readers("B1", 2) == (2, 3, "final")


# --------------------------------------------------------------------------------------------- a new mode
def _routed(router, sources):
    """r = sum_i softmax_i(q . s_i / rms(s_i)) s_i, q = w * g, written out (no null source, no gate)."""
    s = torch.stack(sources)
    logits = (s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + EPS) * router.query_vector()).sum(-1)
    return (torch.softmax(logits, 0).unsqueeze(-1) * s).sum(0)


def test_a_new_mode_is_one_class_in_modes(monkeypatch):
    """Registered in modes.py alone, a mode is accepted by the option check and by SourcePlan, and its
    micro-batches run through SourceBuffer (one stage or split into three) as its rules say."""
    monkeypatch.setitem(modes.ROUTED_MODE_CLASSES, "delta_window", DeltaWindowMode)
    assert options(residual="delta_window", num_layers=3) is None
    with pytest.raises(ValueError, match="--delta-num-blocks applies to --residual delta_block and attnres, not "
                                         "delta_window"):
        options(residual="delta_window", num_blocks=3)
    cfg = SimpleNamespace(residual="delta_window", num_layers=3, delta_num_blocks=None, delta_sources="exact",
                          delta_gate="none")
    plan = SourcePlan.from_config(cfg)
    assert isinstance(plan.rules, DeltaWindowMode) and plan.additive and not plan.x_from_sources
    assert plan.reads(5) == ["h0", "v3", "v4"] and plan.payload_names(1) == ["x", "h0", "v0", "v1"]

    toy = Toy(plan, 8, seed=13)
    h0 = torch.randn(3, 2, 8, generator=torch.Generator().manual_seed(14))
    x, outputs = h0, []
    for j in range(plan.num_sublayers):  # the mode written out: u = x + r([h0, v_{j-2}, v_{j-1}]), x <- x + v
        v = sublayer(x + _routed(toy.routers[j], [h0] + outputs[max(0, j - 2):j]), toy.weights[j])
        x = x + v
        outputs.append(v)
    with torch.no_grad():
        whole, _ = toy.run(h0)
        split, _ = toy.run(h0, boundaries=(1, 2))
    torch.testing.assert_close(whole, x, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(split, whole, rtol=1e-5, atol=1e-5)
