"""The router's memory traffic counted from the real tensors (megatron_delta.core.traffic) equals the
closed form the GPU cost model prices (megatron_delta.perf.cost_model.step_traffic), for every routed mode x
router backend (PyTorch ops, the C kernels, fla's fused_attnres - on CPU fla's naive_attnres runs in its place
and the count is the fused kernel's traffic per its source), with and without full recompute, per kernel and
phase, in rows of [tokens, hidden].

Two harnesses: the Megatron model itself (fp32, where every kind of pass costs the same per element, with
recompute uniform / block, the null source and the gate), and the SourceBuffer over stand-in sublayers in bf16
(activation bytes 2, the routers' math fp32: the casts and fp32 temporaries are counted apart from the bf16
passes, as on a GPU).
"""

import pytest
import torch

from megatron_delta.core import traffic
from megatron_delta.core.modes import AUTHORS_CODE, BLOCK_MODES, ROUTED_MODE_CLASSES, ROUTED_MODES
from megatron_delta.perf import benchmark, cost_model
from tests.helpers import REPO_ROOT
from tests.helpers.traffic_steps import (
    group_counts,
    model_opts,
    stand_in_step,
)

BACKENDS = ("torch", "c", "fla")
# (recompute, gate + null source)
VARIANTS = [(None, False), (("uniform", 1), False), (("block", 1), False), (None, True)]


@pytest.fixture(scope="module")
def dist(distributed_teardown):
    from megatron_delta.platform.distributed import initialize_distributed

    initialize_distributed(1, 1, None, 1, seed=1234)
    yield


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", ROUTED_MODES)
def test_counted_traffic_equals_closed_form(dist, mode, backend):
    """One training step of a 4-layer model: the traffic counted per (kernel, phase) equals step_traffic's,
    without recompute, under full recompute (uniform: every layer its own checkpoint, its forward run twice;
    block: one layer checkpointed, the rest run layer by layer), and with the null source and the gate."""
    for recompute, extras in VARIANTS:
        o = model_opts(mode, backend, recompute, extras)
        with benchmark.router_backend(backend):
            model, config = benchmark.build_model(o, mode)
            counted = benchmark.counted_step(model, benchmark.mock_batch(o, o.vocab_size), 4)
        predicted = cost_model.step_traffic(mode, 4, backend, num_blocks=config.delta_num_blocks, act_bytes=4,
                                            null_source=config.delta_null_source,
                                            gate=config.delta_gate == "scalar", recompute=recompute)
        assert predicted and counted == pytest.approx(predicted, abs=1e-9), (recompute, extras)


@pytest.mark.parametrize("backend", ["torch", "fla"])
@pytest.mark.parametrize("mode", ROUTED_MODES)
def test_bf16_counted_traffic_equals_closed_form(mode, backend):
    """In bf16 (the GPU's activations) the count, with its fp32 copies and temporaries at 2 u each, equals
    step_traffic(act_bytes=2) - the figures router_share prices - with and without the null source and gate."""
    for extras in (False, True):
        gate = extras and mode in ("delta", "delta_block")
        counted = stand_in_step(mode, backend, torch.bfloat16, extras, gate)
        predicted = cost_model.step_traffic(mode, 4, backend, num_blocks=2 if mode in BLOCK_MODES else None,
                                            act_bytes=2, null_source=extras, gate=gate)
        assert counted == pytest.approx(predicted, abs=1e-9), extras


@pytest.mark.parametrize("mode", ["delta", "full_attnres"])
def test_bf16_group_router_on_torch_counted_traffic_equals_closed_form(mode):
    """The group router on PyTorch ops (--delta-router-group-size 3: auto keeps one router per pass there) in
    bf16: its fp32 partial mixes at 2 u, delta's X = the older sources' sum at 1 u, every op counted, equal to
    step_traffic(act_bytes=2, group_size=3), with and without the null source and gate."""
    for extras in (False, True):
        gate = extras and mode == "delta"
        counted = stand_in_step(mode, "torch", torch.bfloat16, extras, gate, group_size=3)
        assert any(k[0].startswith("group_") for k in counted)
        predicted = cost_model.step_traffic(mode, 4, "torch", act_bytes=2, null_source=extras, gate=gate,
                                            group_size=3)
        assert counted == pytest.approx(predicted, abs=1e-9), extras


def test_triton_counted_traffic_equals_closed_form():
    """The Triton kernels (backend triton; under Triton's interpreter, which must be on before Triton is imported:
    a fresh process) over the stand-in sublayers in fp32: every routed mode's count equals step_traffic's, with and
    without the null source and gate - delta_block and attnres with their completed sources' gradients deferred to
    one pass per block (kernel triton_block_grad: 4 routers per block, over 1 and 2 sources)."""
    import json
    import os
    import subprocess
    import sys

    pytest.importorskip("triton")
    repo = REPO_ROOT
    script = (
        "import json, torch\n"
        "from tests.helpers.traffic_steps import stand_in_step\n"
        "from megatron_delta.core.modes import ROUTED_MODES\n"
        "out = [[m, e, sorted([list(k), v] for k, v in stand_in_step(m, 'triton', torch.float32, e,"
        " e and m in ('delta', 'delta_block')).items())] for m in ROUTED_MODES for e in (False, True)]\n"
        "print(json.dumps(out))\n")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=repo + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", script], cwd=repo, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    runs = json.loads(proc.stdout.strip().splitlines()[-1])
    assert [(m, e) for m, e, _ in runs] == [(m, e) for m in ROUTED_MODES for e in (False, True)]
    for mode, extras, rows in runs:
        counted = {tuple(k): v for k, v in rows}
        predicted = cost_model.step_traffic(mode, 4, "triton", num_blocks=2 if mode in BLOCK_MODES else None,
                                            act_bytes=4, null_source=extras,
                                            gate=extras and mode in ("delta", "delta_block"))
        assert counted == pytest.approx(predicted, abs=1e-9), (mode, extras)
        assert (("triton_block_grad", "backward") in counted) == (mode in BLOCK_MODES), (mode, extras)


@pytest.mark.parametrize("mode", ["delta_block", "attnres"])
def test_triton_block_passes_save_what_they_should(mode):
    """The closed form with the block passes against the Triton kernels' in-place path (defer_blocks=False), at the
    8B layer (36 layers, K = 4: 18 routers per block; block b reads b + 1 completed sources, h0 / B0 and the b
    later ones; attnres' final router reads all four too, in place). In place, each reader of a source writes its
    gradient, all but the first in backward reading it first; deferred, each block's pass reads its 18 output
    gradients and each of its sources once and writes each gradient once, reading it first unless it is the
    source's first writer in backward (the last block's pass; attnres: the final router). The rest is the same.
    delta_block hands x out as the sum of its sources, in one pass whose gradient seeds the four sources' sinks
    (triton_group_kernels._SeededSum): the last block's pass reads the seed once for all four; in place, the first
    router call to reach each sink copies the seed into it (2) and adds to it (1 more read)."""
    R, K = 18, 4
    final = int(mode == "attnres")
    seeded = K if mode == "delta_block" else 0
    # source c is read by the routers of blocks c..K-1 (+ the final router): the routers' gradient writes and reads
    in_place = sum(2 * (R * (K - c) + final) - 1 for c in range(K)) + 3 * seeded
    deferred = sum(final for c in range(K))  # the final router's write only (the first writer in backward)
    passes = sum(R + (b + 1) for b in range(K)) + sum(2 * (K - c) - 1 + final for c in range(K)) + int(seeded > 0)
    with_passes = cost_model.step_traffic(mode, 36, "triton", num_blocks=K)
    without = cost_model.step_traffic(mode, 36, "triton", num_blocks=K, defer_blocks=False)
    assert with_passes.pop(("triton_block_grad", "backward")) == passes
    assert without[("triton_route", "backward")] - with_passes[("triton_route", "backward")] == in_place - deferred
    assert {k: v for k, v in without.items() if k[0] != "triton_route"} == {
        k: v for k, v in with_passes.items() if k[0] != "triton_route"}
    if mode == "delta_block":  # the target: 1,298 -> 1,029 u per step
        assert (cost_model.total_u(without), cost_model.total_u(with_passes) + passes) == (1298, 1029)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", [m for m in ROUTED_MODES if AUTHORS_CODE in ROUTED_MODE_CLASSES[m].source_definitions])
def test_authors_code_counted_traffic_equals_closed_form(mode, backend):
    """--delta-sources authors-code over the stand-in sublayers: layer 0's attention reads no source (u = x + the
    null source or zero, broadcast), and delta_block's list gains A<b> = x - A<b-1> at each block's first layer, a
    subtraction of its own (source_difference: reads x and A<b-1>, writes A<b>). The count equals step_traffic's
    in fp32 and, on the GPU backends, in bf16, with and without the null source and the gate."""
    dtypes = (torch.float32, torch.bfloat16) if backend in cost_model.GPU_BACKENDS else (torch.float32,)
    for dtype in dtypes:
        for extras in (False, True):
            counted = stand_in_step(mode, backend, dtype, extras, extras, AUTHORS_CODE)
            predicted = cost_model.step_traffic(mode, 4, backend, num_blocks=2 if mode in BLOCK_MODES else None,
                                                act_bytes=torch.tensor([], dtype=dtype).element_size(),
                                                null_source=extras, gate=extras, sources=AUTHORS_CODE)
            assert counted == pytest.approx(predicted, abs=1e-9), (dtype, extras)
            # delta_block, 2 blocks: one difference (x and A0 read, A1 written)
            assert counted.get(("source_difference", "forward"), 0) == (3 if mode in BLOCK_MODES else 0)


def test_counting_is_off_by_default_and_nests():
    """Nothing is recorded outside a counting() block; nested blocks each see every call."""
    x = torch.ones(4, 8)
    traffic.record("k", "forward", [x], [x])
    with traffic.counting() as outer:
        traffic.record("k", "forward", [x], [x])
        with traffic.counting() as inner:
            traffic.record("k", "backward", [x, None], [])
    assert not traffic.active()
    assert outer.rows(32, 4) == {("k", "forward"): 2.0, ("k", "backward"): 1.0}
    assert inner.rows(32, 4) == {("k", "backward"): 1.0}
    assert outer.rows(64, 4) == {}  # tensors smaller than a row are not rows


def test_docs_traffic_table_is_the_closed_form():
    """docs/performance.md's `benchmark.py --traffic` table (default size: 12 layers, K = 4): its counted and
    closed-form columns agree and are today's step_traffic, in fp32 and bf16 (a table that cannot drift)."""
    import os
    import re

    doc = open(os.path.join(REPO_ROOT, "docs", "performance.md"), encoding="utf-8").read()
    rows = re.findall(r"^\| (\w+) \| (torch|c|fla) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+|-) \|", doc, re.M)
    assert {(m, b) for m, b, *_ in rows} == {(m, b) for m in ROUTED_MODES for b in BACKENDS}
    for mode, backend, counted, per_sublayer, fp32, bf16 in rows:
        kw = dict(num_blocks=4 if mode in BLOCK_MODES else None)
        assert float(counted) == float(fp32) == cost_model.total_u(cost_model.step_traffic(mode, 12, backend,
                                                                                          act_bytes=4, **kw))
        assert float(per_sublayer) == pytest.approx(float(counted) / 24, abs=0.005)
        if backend in cost_model.GPU_BACKENDS:
            assert float(bf16) == cost_model.total_u(cost_model.step_traffic(mode, 12, backend, act_bytes=2, **kw))
        else:
            assert bf16 == "-"


def test_docs_traffic_table_is_the_tools_output():
    """The whole `benchmark.py --traffic` block of docs/performance.md (heading line, every column, "where it goes"
    included) is what the tool's format_traffic prints for today's closed form, which the counting tests above
    hold equal to the count, in the order the tool runs the modes and backends."""
    import importlib.util
    import os

    root = REPO_ROOT
    spec = importlib.util.spec_from_file_location("_benchmark_tool", os.path.join(root, "tools", "benchmark.py"))
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    opts = tool.build_parser().parse_args(["--traffic"])
    report = {}
    for mode in (m for m in opts.modes.split(",") if m != "baseline"):
        for backend in benchmark.TRAFFIC_BACKENDS:
            kw = dict(num_blocks=4 if mode in BLOCK_MODES else None)
            fp32 = cost_model.step_traffic(mode, opts.num_layers, backend, act_bytes=4, **kw)
            bf16 = (cost_model.step_traffic(mode, opts.num_layers, backend, act_bytes=2, **kw)
                    if backend in cost_model.GPU_BACKENDS else None)
            report[f"{mode}/{backend}"] = {
                "mode": mode, "backend": backend, "sublayers": 2 * opts.num_layers,
                "counted": {f"{k}/{p}": v for (k, p), v in sorted(fp32.items())},
                "counted_u": cost_model.total_u(fp32), "closed_form_u": cost_model.total_u(fp32),
                "closed_form_bf16_u": None if bf16 is None else cost_model.total_u(bf16)}
    doc = open(os.path.join(root, "docs", "performance.md"), encoding="utf-8").read()
    assert f"python tools/benchmark.py --traffic\n```\n\n{tool.format_traffic(report, opts, None)}\n\n" in doc


@pytest.mark.parametrize("mode", ["delta", "full_attnres"])
def test_group_router_against_the_per_router_path(dist, mode):
    """The fine-grained modes with --delta-router-group-size 1 (the per-router path) and auto (the group router,
    S resolved per buffer scope): each count equals its closed form, and the group router moves less (C kernels,
    fp32)."""
    totals = {}
    for size in (1, "auto"):
        counted, predicted = group_counts(mode, "c", size)
        assert counted == pytest.approx(predicted, abs=1e-9), size
        assert any(k[0].startswith("group_") for k in counted) == (size == "auto")
        totals[size] = cost_model.total_u(predicted)
    assert totals["auto"] < totals[1]


# slow: a fresh Triton-interpreter process; the group router's and the per-router kernels' counts against the closed
# form stay in the fast set (tests/helpers/triton_cases.py through tests/integration/test_triton_router.py, and on
# the C kernels here)
@pytest.mark.slow
def test_triton_group_router_count_is_the_closed_form():
    """The fine-grained modes on the Triton kernels (run by Triton's interpreter, in a fresh process: it must be
    switched on before anything imports Triton): with --delta-router-group-size auto (the group router on its
    Triton kernels; with full recompute; with the null source and the gate) and 1 (the per-router kernels), the
    count equals step_traffic(backend triton), and the group router moves less."""
    import json
    import os
    import subprocess
    import sys

    pytest.importorskip("triton")
    repo = REPO_ROOT
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=repo + os.pathsep + os.environ.get("PYTHONPATH", ""))
    code = "from tests.helpers.traffic_steps import triton_group_counts as f; f()"
    proc = subprocess.run([sys.executable, "-c", code],
                          cwd=repo, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(rows) == 8
    totals = {}
    for mode, size, recompute, extras, counted, predicted in rows:
        counted, predicted = ({(k, ph): v for k, ph, v in c} for c in (counted, predicted))
        assert counted == pytest.approx(predicted, abs=1e-9), (mode, size, recompute, extras)
        assert any(k.startswith("group_") for k, _ in counted) == (size == "auto")
        if recompute is None and not extras:
            totals[mode, size] = sum(counted.values())
    for mode in ("delta", "full_attnres"):
        assert totals[mode, "auto"] < totals[mode, 1]


@pytest.mark.parametrize("mode", ROUTED_MODES)
def test_model_step_makes_no_tensor_from_host_data(dist, mode):
    """One training step of the 4-layer model on the PyTorch routers, which run wherever the tensors are (null
    source, gate, full recompute): no op of this package makes a tensor from host data or reads a value back
    (tests/helpers/host_data.HOST_DATA_OPS: on a GPU each waits for the GPU), in the block, the layers, the source
    buffer or the routers. Megatron's own (its cross-entropy's scalar fills) are not this test's; nor are the C
    kernels' (CPU tensors only: a scalar read there waits for nothing). The Triton kernels:
    tests/helpers/triton_cases.py, test_models_on_the_kernels_make_only_their_tables_from_host_data."""
    from tests.helpers.host_data import host_data_ops

    o = model_opts(mode, "torch", ("uniform", 1), True)
    with benchmark.router_backend("torch"):
        model, _ = benchmark.build_model(o, mode)
        batch = benchmark.mock_batch(o, o.vocab_size)
        benchmark.step(model, batch)
        with host_data_ops("megatron_delta/") as ops:
            benchmark.step(model, batch)
    assert not ops, dict(ops)
