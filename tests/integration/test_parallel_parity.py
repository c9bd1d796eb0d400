"""Parallel layouts reproduce TP1 training, for every residual mode.

Every layout trains tests/helpers/rank_runner.py's tiny model (4 layers, hidden 64, 4 heads / 2 query groups, seq 32,
mbs 2, gbs 8, mock data; the routers at 10x the lr) ITERS iterations from the TP1 reference's initial model of each mode
(`--load --finetune`; the session's tp1_reference fixture, tests/conftest.py); its per-iteration losses
(`--delta-metrics-file`) must equal TP1's within 1e-5 and its learning rates TP1's. One launch runs every 2-rank
layout, all five modes each, in-process. delta_block and attnres use K=2 blocks of 2 layers: under PP4 and
PP2+VPP2 (one layer per chunk) every block straddles a chunk boundary. The TP2+PP2+SP and PP4 layouts run in the
session's 4-rank launch, shared with tests/integration/test_bf16.py (tests/conftest.py four_rank_runs: its fp32
TP2+PP2+SP runs are checked here).
"""
import json
import os

import pytest

from megatron_delta.core.modes import BLOCK_MODES, RESIDUAL_MODES
from tests.helpers import rank_runner
from tests.helpers.dist_utils import run_distributed
from tests.helpers.flags import PP4, mode_flags

MODES = list(RESIDUAL_MODES)
ROUTED = MODES[1:]
TOL = 1e-5

LAYOUTS = {
    # name: (world size, flags)
    "tp2": (2, ["--tensor-model-parallel-size", "2"]),
    "tp2_sp": (2, ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
    "pp2": (2, ["--pipeline-model-parallel-size", "2"]),
    "pp4": (4, PP4),
    # Every chunk boundary carries a payload; with PP=2 both neighbours are one rank (the payload-shape
    # exchange must pair messages correctly: megatron_delta.core.payload.PayloadP2PCommunicator).
    "pp2_vpp2": (2, ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1"]),
    "tp2_pp2_sp": (4, ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                       "--sequence-parallel"]),
    "dp2_distopt": (2, ["--use-distributed-optimizer"]),
}

# Extra runs that ride on one layout's launch: the group router at S = 2 (tests/unit/test_group_router.py has its
# float64 exactness), against TP1's runs at the default group size (auto: groups of 1, 3 and 4 for one chunk of 8
# routers).
GROUPED = {"pp2": [["delta", "fp32_g2"], ["full_attnres", "fp32_g2"]]}

# Multi-latent attention (tests/unit/test_mla.py; rank_runner FLAVOURS mla, mla-moe) rides on the same launch:
# Megatron-LM's MLA in the baseline and delta_block under TP2 (+SP, with DeepSeek's MoE routing) and the interleaved
# pipeline.
MLA_RUNS = {"tp2": [["baseline/mla", "fp32"], ["delta_block/mla", "fp32"]],
            "tp2_sp": [["delta_block/mla", "fp32"], ["delta_block/mla-moe", "fp32"]],
            "pp2_vpp2": [["delta_block/mla", "fp32"]]}
MLA_SPECS = sorted({spec for runs in MLA_RUNS.values() for spec, _ in runs})

REPORT = os.environ.get("PARITY_REPORT")  # optional: append measured max |loss diff| here (JSON lines)


@pytest.fixture(scope="module")
def reference(tp1_reference):
    res = tp1_reference.runs(MODES + MLA_SPECS)
    for mode in MODES + MLA_SPECS:
        losses = res[mode]["fp32"]["losses"]
        assert losses[-1] < losses[0], (mode, losses)  # it trains
    return tp1_reference.root, {m: res[m]["fp32"] for m in MODES + MLA_SPECS}


def _max_diff(a, b):
    assert len(a) == len(b), (a, b)
    return max(abs(x - y) for x, y in zip(a, b))


@pytest.fixture(scope="module")
def two_rank_runs(reference):
    """Per rank {layout: results}: every 2-rank layout in one launch (rank_runner.run_layouts), the routers
    collected (the tp2_sp checks)."""
    root, _ = reference
    launches = [[name, flags, [[m, "fp32"] for m in MODES] + GROUPED.get(name, []) + MLA_RUNS.get(name, [])]
                for name, (world, flags) in LAYOUTS.items() if world == 2]
    return run_distributed(rank_runner.run_layouts, 2, root, launches, kwargs={"collect": ["routers"]},
                           timeout=2400)


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_matches_tp1(reference, layout, request):
    """The 2-rank layouts share one launch (two_rank_runs); tp2_pp2_sp and pp4 run in the session's 4-rank launch,
    shared with tests/integration/test_bf16.py (tests/conftest.py four_rank_runs)."""
    _, ref = reference
    world, _ = LAYOUTS[layout]
    collect = layout == "tp2_sp"
    if world == 2:
        results = [rank[layout] for rank in request.getfixturevalue("two_rank_runs")]
    elif layout == "tp2_pp2_sp":
        _, results = request.getfixturevalue("tp2_pp2_sp_runs")
    else:  # pp4
        results = [rank["pp4"] for rank in request.getfixturevalue("four_rank_runs")[1]]
    assert len(results) == world
    grouped = {f"{m}/{v}": results[-1][m][v] for m, v in GROUPED.get(layout, [])}
    results = [{m: r[m]["fp32"] for m in MODES} for r in results]
    res = results[-1]
    diffs = {m: _max_diff(res[m]["losses"], ref[m]["losses"]) for m in MODES}
    # the group router at S = 2 (groups cut by the stage boundary) against TP1's automatic group size
    diffs.update({name: _max_diff(entry["losses"], ref[name.split("/")[0]]["losses"])
                  for name, entry in grouped.items()})
    if REPORT:
        with open(REPORT, "a") as f:
            f.write(json.dumps({"layout": layout, "max_abs_loss_diff": diffs}) + "\n")
    bad = {m: d for m, d in diffs.items() if not d <= TOL}
    assert not bad, f"{layout}: losses differ from TP1 by {bad}"
    for m in MODES:
        assert res[m]["lr"] == pytest.approx(ref[m]["lr"], rel=1e-12), (layout, m)
        assert res[m]["iterations"] == list(range(1, rank_runner.ITERS + 1)), (layout, m)

    # Payload sizes actually received equal the plan's tensors x per-rank sequence: every payload
    # name, or under the interleaved schedule what the source cache sends (on by default).
    from megatron_delta.core.source_cache import SourceCachePlan
    from megatron_delta.core.sources import SourcePlan

    tp = 2 if "tp2" in layout else 1
    seq = 32 // tp if "sp" in layout else 32
    for r in results:
        for m in ROUTED:
            # no gate: the additive modes keep x as their sources, and x does not travel
            plan = SourcePlan(mode=m, num_layers=4, num_blocks=2 if m in BLOCK_MODES else 4,
                              sources="exact", x_from_sources=m in ("delta", "delta_block"))
            pp = 4 if "pp4" in layout else 2 if "pp2" in layout else 1
            chunks = SourceCachePlan.even(plan, pp, 2 if "vpp2" in layout else 1)
            sent = {first: names for _, first, names, _ in chunks.boundaries()}
            for first, size in r[m]["payloads"].items():
                assert size == len(sent[int(first)]) * seq, (layout, m, first, size)
    if "pp" in layout:
        assert any(r["delta"]["payloads"] for r in results), "no pipeline payload was received"

    if collect:
        # SP router gradients: TP replicas bitwise equal, and equal to TP1's.
        for m in ROUTED:
            r0, r1 = results[0][m]["routers"], results[1][m]["routers"]
            assert r0["params"] == r1["params"], f"{m}: TP replicas of router parameters differ"
            assert r0["grads"] == r1["grads"], f"{m}: TP replicas of router gradients differ"
            ref_r = ref[m]["routers"]
            assert set(r0["params"]) == set(ref_r["params"]) and r0["params"]
            for kind in ("params", "grads"):
                for name, vals in r0[kind].items():
                    d = _max_diff(vals, ref_r[kind][name])
                    assert d <= TOL, f"{m}: router {kind} {name} differs from TP1 by {d}"


# ------------------------------------------------------------------------------------ recompute
@pytest.mark.slow
@pytest.mark.parametrize("layout", list(MLA_RUNS))
def test_mla_layout_matches_tp1(reference, layout, two_rank_runs):
    """Multi-latent attention (baseline and delta_block; with DeepSeek's MoE routing under TP2+SP) under 2-rank
    layouts: TP1's losses within TOL (the same launch as the other modes, two_rank_runs)."""
    _, ref = reference
    res = two_rank_runs[-1][layout]
    diffs = {f"{spec}": _max_diff(res[spec][v]["losses"], ref[spec]["losses"]) for spec, v in MLA_RUNS[layout]}
    if REPORT:
        with open(REPORT, "a") as f:
            f.write(json.dumps({"layout": layout, "mla_max_abs_loss_diff": diffs}) + "\n")
    bad = {m: d for m, d in diffs.items() if not d <= TOL}
    assert not bad, f"{layout}: MLA losses differ from TP1 by {bad}"
    for spec, v in MLA_RUNS[layout]:
        assert res[spec][v]["iterations"] == list(range(1, rank_runner.ITERS + 1)), (layout, spec)


# Activation recompute (full uniform / block, selective) in the training loop changes nothing:
# same losses and gradients as without, for every residual mode (single process).

RECOMPUTE_TOL = 1e-6


@pytest.mark.slow
def test_recompute_same_losses_and_grads(tmp_path):
    variants = list(rank_runner.RECOMPUTE_VARIANTS)
    res = run_distributed(rank_runner.recompute_compare, 1, str(tmp_path), MODES + ["delta_block/mla"], variants,
                          timeout=1800)[0]
    bad = []
    for mode, by_v in res.items():
        ref = by_v["none"]["losses"]
        assert len(ref) == 2
        for v, r in by_v.items():
            dl = max(abs(a - b) for a, b in zip(r["losses"], ref))
            if dl > RECOMPUTE_TOL or r["max_grad_diff"] > RECOMPUTE_TOL:
                bad.append((mode, v, dl, r["max_grad_diff"]))
    assert not bad, bad


# ------------------------------------------------------------------------------ stage payloads
def _usable(plan, first_layer):
    """What layers >= first_layer (and the final router) read, plus the residual stream x."""
    names = {"x"}
    for j in range(2 * first_layer, plan.num_sublayers):
        names.update(plan.reads(j))
    names.update(plan.final_reads())
    return names


@pytest.mark.parametrize("mode", MODES[1:])
@pytest.mark.parametrize("L, K", [(4, 2), (6, 3), (8, 2), (8, 4), (12, 4)])
def test_payload_holds_only_usable_sources(mode, L, K):
    """No stage receives a source it cannot use; what it reads from earlier stages is all there."""
    from megatron_delta.core.sources import SourcePlan

    variants = [("exact", False)]
    if mode in ("delta", "delta_block"):
        variants += [("exact", True), ("authors-code", False)]
    for sources, x_from_sources in variants:
        plan = SourcePlan(mode=mode, num_layers=L, num_blocks=K if mode in BLOCK_MODES else L,
                          sources=sources, x_from_sources=x_from_sources)
        for f in range(1, L):
            names = plan.payload_names(f)
            assert len(set(names)) == len(names), (mode, f, names)
            useless = set(names) - _usable(plan, f)
            assert not useless, f"{mode} L={L} K={K} {sources}: stage at layer {f} receives {useless}"


def test_describe_stage_payloads_one_line_per_boundary(monkeypatch):
    from megatron_delta.core.payload import describe_stage_payloads
    from megatron_delta.trainer.main import parse_args
    from megatron_delta.trainer.provider import transformer_config

    monkeypatch.setenv("WORLD_SIZE", "4")

    for mode in MODES[1:]:
        for layout, chunks in ((["--pipeline-model-parallel-size", "2"], 2),
                               (["--pipeline-model-parallel-size", "4"], 4),
                               ):
            args = parse_args(rank_runner.COMMON + mode_flags(mode) + layout + ["--train-iters", "1"])
            lines = describe_stage_payloads(transformer_config(args), args.seq_length, args.micro_batch_size)
            assert len(lines) == chunks - 1, lines
            plan = __import__("megatron_delta.core.block", fromlist=["source_plan"]).SourcePlan.from_config(args)
            assert plan.x_from_sources == (mode in ("delta", "delta_block"))  # no gate in these flags
            for k, line in enumerate(lines, start=1):
                first = k * 4 // chunks
                assert f"into layer {first} " in line and f"{len(plan.payload_names(first))} tensors" in line, line


# (flags, per pipeline rank: its first layer) of 8-layer models: even stages, and an uneven first stage
PIPELINES = [(["--pipeline-model-parallel-size", "2"], [0, 4]),
             (["--pipeline-model-parallel-size", "4"], [0, 2, 4, 6]),
             (["--pipeline-model-parallel-size", "3", "--decoder-first-pipeline-num-layers", "2"], [0, 2, 5])]


@pytest.mark.parametrize("mode", MODES[1:])
def test_one_chunk_per_rank_receives_the_plans_payload_lengths(mode, monkeypatch):
    """With one pipeline chunk per rank no payload shape travels (variable_seq_lengths off, no host-read message
    per transfer, nothing a CUDA graph capture cannot hold): each rank receives from the previous stage the payload
    into its first layer and from the next stage the gradient of the payload into the next rank's first layer, in
    [s, b, d] tensors (even and uneven stages). Under the interleaved schedule the shapes still travel."""
    from megatron_delta.core.payload import payload_shapes_travel, rank_payload_tensors
    from megatron_delta.core.sources import SourcePlan
    from megatron_delta.trainer.main import parse_args
    from megatron_delta.trainer.provider import transformer_config

    for flags, firsts in PIPELINES:
        monkeypatch.setenv("WORLD_SIZE", str(len(firsts)))
        args = parse_args(rank_runner.COMMON + mode_flags(mode, 8) + flags + ["--num-layers", "8",
                                                                              "--train-iters", "1"])
        config = transformer_config(args)
        assert not config.variable_seq_lengths and not payload_shapes_travel(config)
        plan = SourcePlan.from_config(config)
        count = [len(plan.payload_names(f)) for f in firsts]
        for r in range(len(firsts)):
            into = 0 if r == 0 else count[r]
            out = 0 if r == len(firsts) - 1 else count[r + 1]
            assert rank_payload_tensors(config, r) == (into, out), (mode, flags, r)
    monkeypatch.setenv("WORLD_SIZE", "2")
    args = parse_args(rank_runner.COMMON + mode_flags(mode) + ["--pipeline-model-parallel-size", "2",
                                                               "--num-layers-per-virtual-pipeline-stage", "1",
                                                               "--train-iters", "1"])
    config = transformer_config(args)
    assert config.variable_seq_lengths and payload_shapes_travel(config)
