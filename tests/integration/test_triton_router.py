"""The router on the project's Triton kernels (megatron_delta/core/triton_router.py), on CPU.

The kernels run under Triton's interpreter, which must be switched on (TRITON_INTERPRET=1) before anything
imports Triton; in a whole-suite pytest process fla's tests import it first, so the interpreter cases
(tests/helpers/triton_cases.py: outputs and every gradient against the PyTorch path and the float64 reference, per
router call and for each mode's whole model; the counted traffic against triton_router.call_rows) run in a
fresh pytest process. The start-up check runs here.
"""
import os
import re
import subprocess
import sys

import pytest
import torch

from megatron_delta.core import cpu_kernels, triton_router
from megatron_delta.core.router import KERNEL_CHOICES, check_kernels
from tests.helpers import REPO_ROOT as REPO

# tests/helpers/triton_cases.py: 24 router cases (12 with a block's deferred pass), the traffic per call, strided
# sources, the formed partial sum, 6 models, 2 models with full recompute, the fallbacks, the counted traffic against
# the closed form (2 modes), 6 models of 4 blocks with the deferred passes (2 modes x no recompute / 2 recompute cuts),
# 4 two-stage pipelines (2 modes x 2 cuts), the group router on its kernels and its counted traffic (5
# configurations each), the group router's counted traffic in bf16 (2 modes), kernel_rates' rate with the partial
# sums, one table copy per launch (2 modes), host_work's host time per router call and kernel_rates' kernel times, no
# view op per source (3 routers), delta on one router per pass with x's gradient seeding its sinks, only the launch
# tables made from host data (3 routers, 4 models), the capture check's launch recorder on the stream (4 plants),
# its sync counter on the stream, and what a full-iteration graph's replay needs of every routed mode's step (5 runs)
INTERPRETER_CASES = 86
# of which those marked slow there (the host work on the kernels: 3 routed streams, 4 models, kernel_rates' kernel
# times) run with the slow half of the suite
SLOW_INTERPRETER_CASES = 8


@pytest.mark.parametrize("selection", ["not slow", pytest.param("slow", marks=pytest.mark.slow)])
def test_interpreter_cases(selection):
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", selection,
                           "tests/helpers/triton_cases.py"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=600)
    summary = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
    passed = re.search(r"(\d+) passed", summary)
    want = SLOW_INTERPRETER_CASES if selection == "slow" else INTERPRETER_CASES - SLOW_INTERPRETER_CASES
    assert passed and int(passed.group(1)) == want and "skipped" not in summary, summary


def test_check_and_choices(monkeypatch):
    """`triton` is a --delta-router-kernels choice; the start-up check passes under the interpreter and refuses
    in one line, naming the flag, where there is no CUDA device (or Triton does not import)."""
    assert "triton" in KERNEL_CHOICES
    # Triton's gluon, which megatron.training imports through fla, asserts at import if triton.language was first
    # imported under the interpreter: import it before the interpreter goes on in this (pytest's) process.
    pytest.importorskip("triton.experimental.gluon.language")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    check_kernels("triton")
    monkeypatch.delenv("TRITON_INTERPRET")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError) as e:
            check_kernels("triton")
        assert str(e.value) == (
            "--delta-router-kernels triton: no CUDA device here, and the Triton kernels run on CUDA tensors only "
            "(or under TRITON_INTERPRET=1); use --delta-router-kernels auto (C kernels on CPU)")
    def no_triton():
        raise ModuleNotFoundError("No module named 'triton'")

    monkeypatch.setattr(triton_router, "_kernels", cpu_kernels.BuildOnce(no_triton, catch=Exception,
                                                                          fail=triton_router.unavailable))
    with pytest.raises(ValueError) as e:
        check_kernels("triton")
    assert str(e.value) == ("--delta-router-kernels triton: triton cannot be imported (ModuleNotFoundError: No "
                            "module named 'triton'); pip install triton; or use --delta-router-kernels auto")


def rank_train_on_the_kernels(root: str) -> dict:
    """Two iterations of pretrain_gpt.py's tiny delta_block model with --delta-router-kernels triton and torch
    (one rank, TRITON_INTERPRET=1 from its start): the losses, and how many kernel calls the traffic count saw."""
    from megatron_delta.core import traffic
    from tests.helpers.flags import MODEL, mode_flags
    from tests.helpers.rank_runner import train

    out = {}
    for kind in ("triton", "torch"):
        flags = MODEL + ["--log-interval", "1", "--train-iters", "2", "--delta-router-kernels", kind]
        with traffic.counting() as count:
            run = train(flags + mode_flags("delta_block"), os.path.join(root, f"{kind}.jsonl"))
        out[kind] = {"losses": run["losses"], "iteration": run["iteration"],
                     "calls": sum(c.kernel == triton_router.KERNEL for c in count.calls)}
    return out


@pytest.mark.slow
def test_training_steps_on_the_kernels(tmp_path):
    """pretrain_gpt.py trains the tiny delta_block model with --delta-router-kernels triton (under the
    interpreter): the kernels route every sublayer, and the losses of two iterations equal the PyTorch path's
    to fp32 round-off."""
    pytest.importorskip("triton")
    from tests.helpers.dist_utils import run_distributed

    r = run_distributed(rank_train_on_the_kernels, 1, str(tmp_path), timeout=600, env={"TRITON_INTERPRET": "1"})[0]
    assert r["triton"]["iteration"] == r["torch"]["iteration"] == 2
    # forward + backward of 8 sublayers, 4 micro-batches, 2 iterations
    assert r["torch"]["calls"] == 0 and r["triton"]["calls"] >= 2 * 8 * 4 * 2
    assert len(r["triton"]["losses"]) == 2
    for a, b in zip(r["triton"]["losses"], r["torch"]["losses"], strict=True):
        assert abs(a - b) <= 1e-5 * abs(b), (a, b)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (the interpreter cases run on CPU)")
@pytest.mark.parametrize("defer", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_kernels_match_torch_path(dtype, defer):
    """On a GPU, compiled (not interpreted): three routers over shared sources, one formed partial sum, null
    source and gate, in fp32 and bf16, with the shared source's gradient added in place or (``defer``) written by
    a block pass (triton_router.BlockDeferral): the outputs and every gradient equal the PyTorch path's (bf16: to
    a few bf16 units of the largest entry)."""
    from megatron_delta.core.router import DepthRouter, PendingSum, make_source

    d, shape = 256, (64, 2)
    gen = torch.Generator().manual_seed(0)
    data = [torch.randn(*shape, d, generator=gen) for _ in range(4)]
    W = torch.randn(*shape, d, generator=gen).cuda()
    results = {}
    for kind in ("triton", "torch"):
        rs = [DepthRouter(d, null_source=True, gate=True, eps=1e-6, kernels=kind).cuda() for _ in range(3)]
        for i, r in enumerate(rs):  # the same parameters for both kinds
            g = torch.Generator().manual_seed(10 + i)
            with torch.no_grad():
                r.query.copy_(torch.randn(d, generator=g) * 0.3)
                r.null_source.copy_(torch.randn(d, generator=g) * 0.1)
                r.gate.fill_(0.5 + 0.1 * i)
        vals = [t.to("cuda", dtype).requires_grad_() for t in data]
        h0, a, p, v = vals
        sink = rs[0].kernel_sink(h0)
        if defer and kind == "triton":
            (sink,) = triton_router.BlockDeferral([h0], [sink]).slots()
        total = 0
        for k, r in enumerate(rs):
            srcs = [make_source(h0, 1e-6)._replace(sink=sink), make_source(a, 1e-6)]
            if k == 2:
                srcs.append(make_source(p, 1e-6)._replace(pending=PendingSum(p, v)))
            total = total + (r(srcs, apply_gate=True, base_sums=True).float() * W).sum()
        total.backward()
        results[kind] = [total.detach()] + [t.grad.float() for t in vals] + [q.grad for r in rs for q in r.parameters()]
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for got, want in zip(results["triton"], results["torch"], strict=True):
        torch.testing.assert_close(got, want, rtol=tol, atol=tol * want.abs().max().item())


def test_tiles_and_warps():
    """The kernels' tiles: at most TILE_ELEMENTS fp32 values per live array, fewer tokens for wider rows, and a
    group tile that one token of S x hidden already overfills ([1, 8, 4096] at the 8B width) on 16 warps, not 8."""
    from megatron_delta.core import triton_group_kernels

    assert triton_router._tile(4096) == (2, 4096, 8) and triton_router._tile(64) == (16, 64, 4)
    assert triton_group_kernels._tile(4096, 8) == (1, 8, 4096, 16)
    assert triton_group_kernels._tile(2048, 4) == (1, 4, 2048, 8)
    assert triton_group_kernels._tile(64, 3) == (16, 4, 64, 8)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (the interpreter cases run on CPU)")
def test_cuda_kernels_do_not_wait_for_the_gpu():
    """On a GPU: the per-router kernels (a block's deferred pass included) and the group router's kernels queue
    their work without a stream synchronisation (torch.cuda.set_sync_debug_mode("error") raises at one), so that
    the CPU runs ahead of the GPU as it does for the baseline's layers; so does delta's routed stream at 14 layers
    on the group router (its old passes defer shares: router._rows, no index list copied to the GPU)."""
    from megatron_delta.core.router import DepthRouter, make_source
    from megatron_delta.perf.routed_stream import routed_stream
    from tests.helpers import group_toys as G

    d, shape = 256, (64, 2)
    rs = [DepthRouter(d, null_source=True, gate=True, eps=1e-6, kernels="triton").cuda() for _ in range(2)]
    vals = [torch.randn(*shape, d, device="cuda", dtype=torch.bfloat16).requires_grad_() for _ in range(3)]
    toy = G.make_toy("delta", True, True, False, 3, torch.float32, "triton")
    toy.weights = [w.detach().cuda().requires_grad_() for w in toy.weights]
    for r in toy.routers:
        r.cuda()
    h0 = G.make_h0(torch.float32).detach().cuda().requires_grad_()
    stream, _ = routed_stream("delta", 14, "triton", "auto", 64, d, "cuda", torch.bfloat16, seed=3)
    stream()  # compiles the kernels its groups launch
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        (sink,) = triton_router.BlockDeferral([vals[0]], [rs[0].kernel_sink(vals[0])]).slots()
        total = sum(r([make_source(vals[0], 1e-6)._replace(sink=sink), make_source(vals[i + 1], 1e-6)],
                      apply_gate=True, base_sums=True).float().sum() for i, r in enumerate(rs))
        total.backward()
        out, _ = toy.run(h0, G.CUTS["chunk"])
        out.sum().backward()
        stream()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert all(v.grad is not None for v in vals) and h0.grad is not None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (the interpreter cases run on CPU)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_group_kernels_match_torch_path(dtype, monkeypatch):
    """On a GPU, compiled (not interpreted): the group router of delta and full_attnres (null source, gate) on its
    Triton kernels, S = 3 with a chunk boundary, fp32 and bf16 sources: the output and every gradient equal the
    PyTorch group path's (bf16: to a few bf16 units of the largest entry), and the Triton kernels ran."""
    from megatron_delta.core import triton_group_kernels
    from tests.helpers import group_toys as G

    ran = []
    forward = triton_group_kernels.old_forward
    monkeypatch.setattr(triton_group_kernels, "old_forward", lambda *a: ran.append(1) or forward(*a))
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for config in (("delta", True, True, False), ("delta", False, False, True), ("full_attnres", True, False, False)):
        results = {}
        for kind in ("triton", "torch"):
            toy = G.make_toy(*config, 3, torch.float32, kind)
            toy.weights = [w.detach().to("cuda", dtype).requires_grad_() for w in toy.weights]
            for r in toy.routers + ([toy.final] if toy.final else []):
                r.cuda()
            h0 = G.make_h0(torch.float32).detach().to("cuda", dtype).requires_grad_()
            before = len(ran)
            results[kind] = G.forward_backward(toy, h0, G.CUTS["chunk"])
            assert (len(ran) > before) == (kind == "triton")
        (out, grads), (ref, ref_grads) = results["triton"], results["torch"]
        torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol * ref.float().abs().max().item())
        for g, r in zip(grads, ref_grads, strict=True):
            assert (g is None) == (r is None)
            if r is not None:
                torch.testing.assert_close(g.float(), r.float(), rtol=10 * tol,
                                           atol=10 * tol * max(r.float().abs().max().item(), 1e-3))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (graph capture)")
def test_cuda_graph_replays_the_captured_launch_tables():
    """A launch table copied during a CUDA graph capture (--cuda-graph-impl full_iteration) is kept
    (triton_router.CAPTURED_HOST_TABLES): the graph's copy node re-reads its pinned host buffer at every replay.
    Tables made eagerly after the capture, which take freed pinned blocks, do not overwrite it: the replay copies
    the capture's entries."""
    kept = len(triton_router.CAPTURED_HOST_TABLES)
    out = torch.zeros(4, dtype=torch.int64, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        (table,) = triton_router.device_tables([11, 12, 13, 14], device="cuda")
        out.copy_(table[:4])
    assert len(triton_router.CAPTURED_HOST_TABLES) == kept + 1
    for k in range(64):  # eager tables of the same size: freed pinned blocks are reused for them
        triton_router.device_tables([100 + k] * 4, device="cuda")
    torch.cuda.synchronize()
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert out.tolist() == [11, 12, 13, 14]


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_pretrain_gpt_refuses_triton_without_cuda(monkeypatch, capsys):
    """pretrain_gpt.py --delta-router-kernels triton on a machine without CUDA (and without the interpreter):
    exit code 2 and one line naming the flag and what to use, before the distributed start-up."""
    from megatron_delta.trainer.main import main
    from tests.helpers.flags import tiny

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setenv("WORLD_SIZE", "1")
    rc = main(tiny(num_layers=2, hidden=32, heads=2, groups=2, seq=16, mbs=2, train_iters=1)
              + ["--residual", "delta_block", "--delta-router-kernels", "triton"])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert "Traceback" not in err, err
    assert err.strip().splitlines()[-1] == (
        "pretrain_gpt.py: error: --delta-router-kernels triton: no CUDA device here, and the Triton kernels run on "
        "CUDA tensors only (or under TRITON_INTERPRET=1); use --delta-router-kernels auto (C kernels on CPU)")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (the interpreter cases run on CPU)")
def test_cuda_host_time_counts_as_on_cpu():
    """gpu_check's (h) on a GPU: the launches run (JITFunction.run counted), one table copy each, as many per router
    call as under the interpreter (tests/helpers/triton_cases.py: the same code path); and the host's time without the
    launches, then without the copies too."""
    from types import SimpleNamespace

    from megatron_delta.core import group_plan
    from megatron_delta.perf import host_work

    env = SimpleNamespace(dry=False, device="cuda")
    routers = 2 * host_work.HOST_STREAM_LAYERS
    groups = group_plan.auto_group_sizes(routers, 1)
    got = {(m, g): host_work.host_time(env, m, g) for m, g in host_work.host_runs(env)}
    assert all(r["ok"] and r["host_us"] > 0 for r in got.values())
    # the same stream without its launches, then without its table copies too: each takes the host less time
    assert all(r["host_us"] > r["host_us_no_launches"] > r["host_us_no_launches_no_copies"] > 0 for r in got.values())
    assert got["delta", 1]["launches"] == 2
    assert got["delta", "auto"]["launches"] == pytest.approx((2 * len(groups) + 2 * routers + 1) / routers)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (the interpreter cases run on CPU)")
def test_cuda_kernel_times_name_the_router_kernels():
    """kernel_rates' (k) on a GPU (small shape): the profiler's CUDA kernels include the group router's and the
    per-router kernels under their names, each with its counted bytes and a rate; the device time is a share of
    the wall time."""
    from types import SimpleNamespace

    from megatron_delta.perf import gpu_check, kernel_rates

    env = SimpleNamespace(dry=False, device="cuda", shapes=gpu_check.DRY_SHAPES, gpu_kind=lambda: "H100")
    grouped = kernel_rates.kernel_times(None, env, "delta", "auto")
    single = kernel_rates.kernel_times(None, env, "delta", 1)
    for r, names in ((grouped, {"_old_forward", "_old_backward", "_merge_forward", "_merge_backward", "_final_sum"}),
                     (single, {"_forward", "_backward"})):
        rated = {k["name"] for k in r["kernels"] if k.get("of_modelled_rate", 0) > 0}
        assert r["ok"] and names <= rated, r["kernels"]
        assert 0 < r["device_share"] <= 1.5  # profiled device time against the unprofiled wall time


def test_floor_routers_route_nothing_but_pass_the_gradient():
    """host_work.floor_routers (the host floor of a router call, tools/host_work.py's "floor" runs): inside it a
    router call is one autograd node over the router's query and its newest source, u an uninitialised tensor of
    the source's shape and dtype whose gradient goes to that source as it is; the query is made (its gradient
    none); outside it the buffer routes again."""
    from megatron_delta.core.router import DepthRouter
    from megatron_delta.core.sources import SourceBuffer, SourcePlan
    from megatron_delta.perf import host_work

    plan = SourcePlan("delta", 2, 2, x_from_sources=True)
    routers = [DepthRouter(8, null_source=False, gate=False, eps=1e-6, kernels="torch") for _ in range(4)]
    h0 = torch.randn(3, 1, 8, requires_grad=True)
    v = torch.randn(3, 1, 8, requires_grad=True)
    g = torch.randn(3, 1, 8)

    def second_input():
        buf = SourceBuffer.start(plan, h0, 1e-6, readers=dict(enumerate(routers)))
        buf.routed_input(0, routers[0])
        buf.commit(0, 2 * v)  # sublayer 0's output, the newest source of sublayer 1
        return buf.routed_input(1, routers[1])

    with host_work.floor_routers():
        u = second_input()
        assert type(u.grad_fn).__name__ == "_FloorRouteBackward" and u.shape == v.shape and u.dtype == v.dtype
        dv, dq = torch.autograd.grad(u, [v, routers[1].query], g, allow_unused=True)
    assert dq is None and torch.equal(dv, 2 * g)
    assert type(second_input().grad_fn).__name__ != "_FloorRouteBackward"


# slow: the tool end to end; the launches per router call of the same stream stay in the fast set (tests/triton_cases.py
# test_gpu_check_host_time, through test_interpreter_cases)
@pytest.mark.slow
def test_host_work_tool(tmp_path):
    """tools/host_work.py (the routers' host work on CPU, the proxy of a host-bound GPU step) at a small size: per
    router call one table copy per launch; delta on one router per pass launches its forward and backward and
    x's final sum once, on the group router each group's old pass twice, each router's merge twice (but a group's first
    router's: its u is the old pass's) and x's final sum once (group_plan.auto_group_sizes' groups); the training
    step of every mode against the baseline's, which launches no Triton kernel, and of each mode with its router
    calls at their host floor (host_work.floor_routers: none launches a kernel either)."""
    from megatron_delta.core import group_plan

    pytest.importorskip("triton")
    out = tmp_path / "host.json"
    layers = 4
    proc = subprocess.run([sys.executable, os.path.join(REPO, "tools/host_work.py"), "--num-layers", "4",
                           "--stream-layers", str(layers), "--iters", "2", "--micro-batches", "2", "--reps", "1",
                           "--rounds", "1",
                           "--output", str(out)], cwd=REPO, capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", "")))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    import json

    result = json.loads(out.read_text())
    calls = {(r["mode"], r["group_size"]): r for r in result["per_call"]}
    assert set(calls) == {("delta", "auto"), ("delta", 1), ("delta_block", 1)}
    for r in calls.values():
        assert r["launches"] == r["table_copies"] > 0 and r["host_us"] > 0
        assert r["torch_ops"] == pytest.approx(r["views"] + r["allocations"] + r["other_ops"])
    routers = 2 * layers
    groups = group_plan.auto_group_sizes(routers, 1)
    assert calls["delta", 1]["launches"] == pytest.approx(2 + 1 / routers)  # and x's final sum (its sinks seeded)
    merges = routers - len(groups)
    assert calls["delta", "auto"]["launches"] == pytest.approx((2 * len(groups) + 2 * merges + 1) / routers)
    steps = {(r["mode"], r["kernels"], r["group_size"]): r for r in result["step"]}
    assert set(steps) == {("baseline", "-", None), ("delta", "triton", "auto"), ("delta", "triton", 1),
                          ("delta_block", "triton", None), ("delta", "floor", None), ("delta_block", "floor", None)}
    assert steps["baseline", "-", None]["ratio"] == 1.0 and steps["baseline", "-", None]["launches_per_step"] == 0
    assert all(r["launches_per_step"] > 0 and r["ratio"] > 0 for k, r in steps.items() if k[1] == "triton")
    assert all(r["launches_per_step"] == 0 and r["ratio"] > 0 for k, r in steps.items() if k[1] == "floor")
