"""Smoke tests of the analysis tools: benchmark, routing report, loss plots, run comparison.

Tiny sizes only and no timing assertions: performance is read from tools/benchmark.py's table.
The tools run as subprocesses (each initialises and tears down its own one-process world).
"""
import json
import math
import os
import subprocess
import sys

import pytest

from tests.helpers import REPO_ROOT
from tests.helpers.dist_utils import run_distributed
from tests.helpers.flags import tiny

TINY = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
        "--micro-batch-size", "2"]
# the same model in pretrain_gpt.py's (Megatron-LM's) flags
TINY_TRAIN = tiny(num_layers=4, hidden=32, heads=4, groups=2, seq=16, mbs=2) + ["--save-interval", "1000",
                                                                           "--eval-interval", "1000"]


def _run(script, *argv, timeout=600):
    env = dict(os.environ, PYTHONPATH=REPO_ROOT, OMP_NUM_THREADS="1")
    p = subprocess.run([sys.executable, os.path.join(REPO_ROOT, script), *argv], cwd=REPO_ROOT, env=env,
                       capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, f"{script} failed ({p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    return p.stdout


# ------------------------------------------------------------------------------------ benchmark
def test_benchmark_refuses_a_block_mode_without_blocks_that_divide():
    """benchmark.py builds its models from flags as pretrain_gpt.py does: 6 layers without --delta-num-blocks
    has no default K (4 does not divide 6), one line naming the flag before any model is built."""
    env = dict(os.environ, PYTHONPATH=REPO_ROOT, OMP_NUM_THREADS="1")
    p = subprocess.run([sys.executable, os.path.join(REPO_ROOT, "tools/benchmark.py"), *TINY, "--num-layers", "6",
                        "--modes", "baseline,attnres"], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr[-3000:]
    assert p.stderr.strip().splitlines()[-1] == (
        "benchmark.py: error: --residual attnres with --num-layers 6 needs --delta-num-blocks K with K dividing 6 "
        "(1, 2, 3, 6); the default, 4 blocks, does not divide 6")


def test_benchmark_smoke(tmp_path):
    out = tmp_path / "bench.json"
    text = _run("tools/benchmark.py", *TINY, "--modes", "baseline,delta_block,delta,full_attnres",
                "--repeats", "1", "--warmup", "1", "--pp-layout", "2x2", "--routing-breakdown",
                "--model-breakdown", "--output", str(out))
    assert "| delta_block |" in text and ("pass" in text or "MISS" in text)
    rep = json.load(open(out))["modes"]
    assert set(rep) == {"baseline", "delta_block", "delta", "full_attnres"}
    base = rep["baseline"]
    assert base["added_parameters"] == 0 and base["time_ratio"] == 1.0
    assert base["saved_bytes"] > 0 and base["peak_bytes"] and base["peak_bytes"] > 0
    for mode in ("delta_block", "delta", "full_attnres"):
        r = rep[mode]
        assert r["added_parameters"] > 0  # the routers
        assert r["time_s"] > 0 and r["saved_ratio"] > 0 and r["peak_ratio"] > 0
        assert math.isclose(r["loss"], base["loss"], rel_tol=0.05)  # same backbone, same tokens
        assert r["routing_alone_ms"] > 0 and r["routing_alone_share"] > 0  # routing costs more than x + v
    assert "routing_alone_ms" not in base and "Routing alone" in text
    for mode in ("delta_block", "delta", "full_attnres"):  # --routing-breakdown
        split = rep[mode]["routing_breakdown_ms"]
        assert split["total"] == rep[mode]["routing_alone_ms"] and split["rest"] > 0
        assert f"- {mode}: " in text and "touching each tensor once" in text
    assert rep["delta"]["fused_router_passes"] == 86  # the group router's passes: test_fused_router_passes_by_hand
    for mode in ("delta_block", "delta", "full_attnres"):  # --model-breakdown: timed with each stand-in
        b = rep[mode]["model_breakdown"]
        assert {len(v) for v in rep[mode]["stand_in_cpu_s"].values()} == {1} and b["both_stand_ins_ratio"] > 0
        assert math.isclose(1 + b["fused_passes"] + b["shared_projections"] + b["rest"], rep[mode]["cpu_ratio"])
        assert f"- {mode}: {b['cpu_ratio']:.3f}x = 1 + routers' fused passes" in text
    assert "model_breakdown" not in base
    cfg = json.load(open(out))["config"]
    assert cfg["stream_gbps"] > 0 and len(cfg["op_ms"]) == 4 and min(cfg["op_ms"].values()) > 0
    assert cfg["memory_gbps"] > 0 and cfg["memory_rotation_bytes"] >= 256 << 20  # beyond the caches
    assert "touching each tensor once" in text and ", from memory >= " in text
    # Payloads: 3 boundaries (2 stages x 2 virtual chunks of 1 layer); baseline sends one tensor.
    one = 16 * 2 * 32 * 4
    assert [p["bytes"] for p in base["payloads"]] == [one] * 3
    # uncached: h0, v0..v(2f-1) (x is their sum); the source cache sends what the rank lacks (design.md 2.3)
    assert [p["bytes_without_cache"] for p in rep["delta"]["payloads"]] == [3 * one, 5 * one, 7 * one]
    assert [p["names"] for p in rep["delta"]["payloads"]] == [["h0", "v0", "v1"], ["v2", "v3"], ["v4", "v5"]]
    assert rep["delta"]["payloads"][2]["bytes"] == 2 * one and "[0.03 uncached]" in text
    assert "targets" in rep["delta_block"] and set(rep["delta_block"]["pass"]) == {"time", "saved", "peak"}
    assert rep["delta"]["max_sources"] == 8  # h0 + v0..v6 for the last MLP of 4 layers


def test_fused_router_passes_by_hand():
    """The pass count behind the benchmark's fused-router floor, counted by hand from docs/design.md."""
    from types import SimpleNamespace

    from megatron_delta.perf.benchmark import mode_config
    from megatron_delta.perf.router_breakdown import fused_router_passes

    def passes(mode, layers, blocks=None, gate=False, group_size=1, kernels="auto"):
        opts = SimpleNamespace(num_layers=layers, hidden_size=32, num_attention_heads=4, num_query_groups=None,
                               ffn_hidden_size=None, seq_length=16, vocab_size=1024, delta_num_blocks=blocks,
                               delta_gate="scalar" if gate else "none", delta_router_kernels=kernels,
                               delta_router_group_size=group_size)
        return fused_router_passes(mode, mode_config(opts, mode)[0])

    # Per router with N sources: N (forward, beyond the stand-in's copy) + 3N + 1 (backward) in the
    # additive modes that hold x (with the gate), N - 1 + 3N + 1 in the replacement ones and where x is
    # the sum of the sources (no gate: the router reads no x); 4 per source with several readers
    # (a source with one reader is projected inside its router: no extra pass).
    # delta, 1 layer: sublayer 0 reads h0 (N=1), sublayer 1 reads h0, v0 (N=2); h0 has 2 readers, v0 one.
    assert passes("delta", 1, gate=True) == (1 + 4) + (2 + 7) + 4 * 1
    assert passes("delta", 1) == (0 + 4) + (1 + 7) + 4 * 1
    # delta, 4 layers: N = 1..8; h0 and v0..v5 have several readers, v6 only sublayer 7.
    assert passes("delta", 4, gate=True) == sum(n + 3 * n + 1 for n in range(1, 9)) + 4 * 7 == 180
    assert passes("delta", 4) == 180 - 8
    # delta_block, 2 layers in 2 blocks: reads [h0], [h0 P0], [h0 D0], [h0 D0 P1] -> N = 1, 2, 2, 3;
    # h0 and D0 have several readers, P0 and P1 one each.
    assert passes("delta_block", 2, 2, gate=True) == sum(4 * n + 1 for n in (1, 2, 2, 3)) + 4 * 2
    assert passes("delta_block", 2, 2) == sum(4 * n for n in (1, 2, 2, 3)) + 4 * 2
    # full_attnres, 1 layer: reads [h0] (p = h0), [h0, v0]; final router [h0, v0, v1]; v1 has one reader.
    assert passes("full_attnres", 1) == sum(4 * n for n in (1, 2, 3)) + 4 * 2
    # The group router (delta / full_attnres, --delta-router-group-size auto on the C kernels): 8 routers whose
    # first reads 1 source, split as the fewest counted passes (group_plan.auto_group_sizes): groups [0, 1),
    # [1, 2), [2, 5), [5, 8) over 1, 2, 3, 6 older sources (with the gate: [0, 2), [2, 5), [5, 8) over 1, 3, 6).
    # Per group of s routers over n_g older sources: the old pass reads the n_g sources and writes s partial mixes
    # (+ X, the older part of x, when x is the sum of the sources), and in backward reads the n_g sources and the
    # s output gradients and reads and writes the n_g gradients (4 n_g + s); merge k reads r_k (+ X or the held x)
    # and its k in-group sources and writes u, and in backward reads its output gradient, r_k and the k sources,
    # and reads and writes the gradient of its newest in-group source, adding the shares the later merges k + 1 ..
    # s - 1 deferred to it (reading their output gradients again): s (3 + 2) + (X or x: 1 + 1) ...: 6 s in all, + s
    # with X or x, + 1 for X's write, + sum over k = 1 .. s - 1 of (2 k + 2 + s - 1 - k) = (s - 1)(3 s + 2) / 2 for
    # the in-group sources; less the stand-in merge's copy (2 per router). Without the held x the old pass writes
    # the first router's u in place of r_0 and that router has no merge: 2 + X fewer forward, 2 fewer backward.
    # Where x is the sum of the sources (unit), x's gradient seeds every sink and the pass that writes a sink first
    # reads the seed once for all it writes first: the last group's old pass (n_g sinks), so n_g - 1 reads fewer.
    # A group that defers to the one before (group_plan.deferring_groups: here the second and the fourth, with
    # the gate the third) leaves the previous group's n_prev older sources' gradients to that group's old pass,
    # which reads its s output gradients again: 2 n_prev - s fewer, and the seed read once more by that pass where
    # the deferring group is the last one and x is the sum of the sources.
    def group(n_g, s, extra, unit, first_u):
        return 4 * n_g + s * (6 + extra) + unit + (s - 1) * (3 * s + 2) // 2 - first_u * (4 + unit)

    def split(extra, unit, first_u):
        groups, deferred = ([(1, 2), (3, 3), (6, 3)], [(3, 3, True)]) if not first_u else (
            [(1, 1), (2, 1), (3, 3), (6, 3)], [(1, 1, False), (3, 3, True)])
        saved = sum(2 * n_prev - s - unit * last for n_prev, s, last in deferred)
        return sum(group(n_g, s, extra, unit, first_u) for n_g, s in groups) - 16 - unit * (6 - 1) - saved

    assert passes("delta", 4, group_size="auto") == split(1, 1, True) == 86 < passes("delta", 4) == 172
    assert passes("delta", 4, gate=True, group_size="auto") == split(1, 0, False) == 103
    # full_attnres: neither X nor x; its final router (9 sources, one reader each there) per router: 8 + 28
    assert passes("full_attnres", 4, group_size="auto") == split(0, 0, True) + 8 + 28 == 118
    # S = 2 given; on PyTorch ops auto resolves to one router per pass (the per-router count)
    # (groups over 1, 3, 5, 7 older sources; the second and the fourth defer: 2 x 1 - 2 and 2 x 5 - 2 - 1 fewer)
    assert passes("delta", 4, group_size=2) == (sum(group(1 + a, 2, 1, 1, True) for a in (0, 2, 4, 6)) - 16 - (7 - 1)
                                                - (2 * 5 - 2 - 1))
    assert passes("delta", 4, group_size="auto", kernels="torch") == 172


def test_last_level_cache_bytes(tmp_path):
    """The memory rate's rotation is sized from the largest cache sysfs lists; unreadable entries are skipped."""
    from megatron_delta.perf.machine_rates import last_level_cache_bytes

    for entry, size in {"index0": "48K", "index2": "2048K", "index3": "260M", "index4": "n/a"}.items():
        (tmp_path / entry).mkdir()
        (tmp_path / entry / "size").write_text(size + "\n")
    (tmp_path / "index5").mkdir()  # no size file
    assert last_level_cache_bytes(str(tmp_path)) == 260 << 20
    assert last_level_cache_bytes(str(tmp_path / "missing")) is None


def test_stand_ins_are_restored():
    """--routing-breakdown swaps the router's kernels; they must come back, even after an error."""
    from megatron_delta.core import group_router, router
    from megatron_delta.perf.router_breakdown import (
        MergeStandIn,
        OldPassStandIn,
        ProjectStandIn,
        RouteStandIn,
        stand_ins,
    )

    originals = router._RouteFunction, router._ProjectSource, group_router._OldPass, group_router._Merge
    with pytest.raises(RuntimeError, match="inside"):
        with stand_ins(True, True):
            assert router._RouteFunction is RouteStandIn
            assert router._ProjectSource is ProjectStandIn
            assert (group_router._OldPass, group_router._Merge) == (OldPassStandIn, MergeStandIn)
            raise RuntimeError("inside")
    assert (router._RouteFunction, router._ProjectSource, group_router._OldPass, group_router._Merge) == originals


@pytest.mark.parametrize("mode,gate", [("delta", False), ("delta", True), ("full_attnres", False)])
def test_group_router_passes_are_stood_in(mode, gate):
    """--routing-breakdown's fused-pass stand-ins cover the group router (delta / full_attnres in groups): the
    routing loop over stand-in sublayers runs the group router's old passes and merges (their calls in the
    traffic count) as is, none of them with the route stand-ins, and still hands every sublayer's scale and h0
    a gradient (with the stand-ins: the loop still runs forward and backward, h0 gets a gradient)."""
    import torch

    from megatron_delta.core import traffic
    from megatron_delta.core.router import DepthRouter
    from megatron_delta.core.sources import SourceBuffer, SourcePlan
    from megatron_delta.perf.router_breakdown import stand_ins

    L, d = 3, 16
    plan = SourcePlan(mode=mode, num_layers=L, num_blocks=L, x_from_sources=mode == "delta" and not gate,
                      router_group_size=2)
    keys = [*range(2 * L)] + (["final"] if plan.final_reads() else [])
    routers = {k: DepthRouter(d, null_source=False, gate=gate, eps=1e-6) for k in keys}

    def run(stood_in):
        h0 = torch.randn(4, 2, d, requires_grad=True)
        scales = [torch.full((d,), 0.5, requires_grad=True) for _ in range(2 * L)]
        buf = SourceBuffer.start(plan, h0 * 1.0, 1e-6, readers=routers)
        with traffic.counting() as count:
            for j in range(2 * L):
                buf.commit(j, buf.routed_input(j, routers[j]) * scales[j])
            out = buf.output(routers.get("final"))
            out.sum().backward()
        assert out.shape == h0.shape and h0.grad is not None
        assert stood_in or all(s.grad is not None for s in scales)
        return {c.kernel for c in count.calls}

    assert {"group_old_pass", "group_merge"} <= run(False)
    with stand_ins(True, False):
        assert not {"group_old_pass", "group_merge"} & run(True)


# ------------------------------------------------------------------------- routing report (PP2 ckpt)
@pytest.fixture(scope="module")
def pp2_run(tmp_path_factory):
    """A 5-iteration delta_block run on mock tokens, saved under PP2 (reloaded as PP1 by the report)."""
    d = tmp_path_factory.mktemp("pp2run")
    run_distributed(os.path.join(REPO_ROOT, "pretrain_gpt.py"), 2, "--residual", "delta_block",
                    "--delta-num-blocks", "2", "--delta-null-source", *TINY_TRAIN,
                    "--pipeline-model-parallel-size", "2",
                    "--train-iters", "5", "--eval-iters", "1", "--eval-interval", "5",
                    "--save", str(d / "ckpt"), "--delta-metrics-file", str(d / "metrics.jsonl"), timeout=600)
    return d


# slow: pp2_run is a two-rank torchrun training; the routing statistics stay in the fast set (tests/test_sources.py,
# tests/test_mtp_routing_report.py)
@pytest.mark.slow
def test_routing_report_from_pp2_checkpoint(pp2_run, tmp_path):
    out = tmp_path / "report"
    text = _run("tools/routing_report.py", "--load", str(pp2_run / "ckpt"), "--output", str(out), "--mock-data",
                "--num-batches", "2", "--micro-batch-size", "2")
    assert "read as TP1 PP1" in text
    rep = json.load(open(out / "routing.json"))
    assert rep["residual"] == "delta_block" and rep["iteration"] == 5
    st = rep["datasets"]["mock"]
    assert st["order"] == [str(j) for j in range(8)]  # 4 layers x 2 sublayers, additive: no final router
    # Receiver j of block b reads h0, D0..D(b-1), P_b (unless it starts the block), plus the null source.
    assert st["receivers"]["0"]["source_names"] == ["h0", "null"]
    assert st["receivers"]["5"]["source_names"] == ["h0", "D0", "P1", "null"]
    assert st["columns"][-1] == "null" and set(st["columns"]) == {"h0", "P0", "D0", "P1", "null"}
    for key, row in zip(st["order"], st["aligned_matrix"]):
        rec = st["receivers"][key]
        present = [w for w in row if w is not None]
        assert len(present) == rec["num_sources"] and math.isclose(sum(present), 1.0, rel_tol=1e-6)
        assert rec["uniform_max_weight"] == pytest.approx(1.0 / rec["num_sources"])
        assert 1.0 / rec["num_sources"] - 1e-9 <= rec["max_weight"] <= 1.0
        assert 0.0 <= rec["entropy"] <= 1.0 + 1e-9
    for name in ("routing_matrix_mock.png", "routing_curves_mock.png"):
        assert (out / name).stat().st_size > 1000


@pytest.mark.slow  # pp2_run: a two-rank torchrun training
def test_plot_metrics(pp2_run, tmp_path):
    from megatron_delta.evaluation import loss_curves

    m = loss_curves.read_metrics(str(pp2_run / "metrics.jsonl"))
    assert [it for it, _ in m["train"]] == [1, 2, 3, 4, 5] and m["valid"]
    png = tmp_path / "loss.png"
    assert loss_curves.main(["--metrics-file", str(pp2_run / "metrics.jsonl"), str(pp2_run / "metrics.jsonl"),
                             "--labels", "a", "b", "--output", str(png)]) == 0
    assert png.stat().st_size > 1000


# -------------------------------------------------------------------------------- compare_runs
def _fake_run(root, name, residual, valid, heldout, tps, params, rss, sources):
    d = root / name
    d.mkdir()
    with open(d / "metrics.jsonl", "w") as f:
        f.write(json.dumps({"iteration": 10, "lm_loss": valid + 0.1, "tokens_per_sec": tps}) + "\n")
        f.write(json.dumps({"iteration": 10, "split": "valid", "lm_loss": valid, "ppl": math.exp(valid)}) + "\n")
        f.write(json.dumps({"iteration": 10, "split": "heldout", "lm_loss": heldout, "ppl": 0}) + "\n")
    json.dump({"residual": residual, "parameters": params, "peak_rss_bytes": rss, "max_sources": sources,
               "delta_num_blocks": None}, open(d / "summary.json", "w"))
    return str(d)


def test_compare_runs_table(tmp_path):
    from megatron_delta.evaluation import run_comparison as compare_runs

    runs = [compare_runs.read_run(_fake_run(tmp_path, "delta", "delta", math.log(90), math.log(200), 500, 1100,
                                            2 * 2**30, 25)),
            compare_runs.read_run(_fake_run(tmp_path, "base", "baseline", math.log(100), math.log(200), 1000, 1000,
                                            2**30, 0))]
    table = compare_runs.make_table(runs)
    assert "Baseline: base" in table
    row = next(line for line in table.splitlines() if line.startswith("| delta |"))
    assert "90.000" in row and "-10.00%" in row and "+0.00%" in row and "0.500x" in row and "2.000x" in row
    assert "| 25 | 100 |" in row


# slow: a training run through the tool; its table stays in the fast set (test_compare_runs_table)
@pytest.mark.slow
def test_compare_runs_train_summary(tmp_path):
    run_dir = tmp_path / "delta"
    _run("tools/compare_runs.py", "train", "--run-dir", str(run_dir), "--", "--residual", "delta",
         *TINY_TRAIN, "--train-iters", "2", "--eval-iters", "1")
    s = json.load(open(run_dir / "summary.json"))
    assert s["residual"] == "delta" and s["max_sources"] == 8 and s["router_parameters"] > 0
    assert s["peak_rss_bytes"] > 0
    out = _run("tools/compare_runs.py", "table", str(run_dir))
    assert "| delta | delta |" in out
