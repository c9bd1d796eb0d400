"""The pipeline source cache under the interleaved schedule (megatron_delta/core/source_cache.py).

The plan (which payload tensors a boundary sends, which the receiving rank already holds) is checked against
an independent count per mode; the flag's start-up rules through pretrain_gpt.py's parser. The slow tests
train every routed mode through pretrain_gpt.py (tests/helpers/rank_runner.py) under PP2+VPP2 and PP2 with three chunks
per rank (6 layers), alone, with full recompute, with TP2+SP and with DP2 + the distributed optimizer, with
--delta-pp-source-cache off and on from the TP1 reference's initial model (tests/conftest.py's tp1_reference):
three iterations each (one launch per world size): the losses equal TP1's within 1e-5, the cached run's gradients
equal the uncached run's, the bytes each boundary received equal the plan's, and no micro-batch is left in a
cache. A checkpoint written with the cache continues without it and the other way round, with the losses of each
other.
"""
from __future__ import annotations

import pytest

from megatron_delta.core.modes import BLOCK_MODES
from megatron_delta.core.source_cache import SourceCache, SourceCachePlan
from megatron_delta.core.sources import SourcePlan
from tests.helpers import rank_runner
from tests.helpers.dist_utils import run_distributed

ROUTED = ["delta", "delta_block", "attnres", "full_attnres"]
LOSS_TOL = 1e-5  # against TP1 (the parity tests' tolerance)
GRAD_RTOL = 1e-5  # cached vs uncached gradients: the same sums in another order (observed <= 3e-8 absolute)
GRAD_ATOL = 1e-9  # ... and for a gradient near zero: 5.7e-10 measured on a 4e-5 gate gradient


def chunk_plan(mode, num_layers, num_blocks, pp, vpp, cached=True, **plan_kw) -> SourceCachePlan:
    plan = SourcePlan(mode=mode, num_layers=num_layers, num_blocks=num_blocks, **plan_kw)
    per = num_layers // (pp * vpp)
    return SourceCachePlan(plan, pp, tuple(k * per for k in range(pp * vpp)) + (num_layers,), cached)


# ------------------------------------------------------------------------------------------------ the plan
@pytest.mark.parametrize("mode,x_from_sources", [("delta", True), ("delta", False), ("delta_block", True),
                                                 ("delta_block", False), ("attnres", False),
                                                 ("full_attnres", False)])
@pytest.mark.parametrize("pp,vpp", [(2, 2), (2, 3), (4, 2), (2, 6)])
def test_plan_splits_each_payload_into_sent_and_held(mode, x_from_sources, pp, vpp):
    """Every boundary: sent + taken = the uncached payload (in its order), at least one tensor is sent, and a
    taken tensor is stable and was in the payload into the receiving rank's previous chunk's successor."""
    L, K = 12, 4
    c = chunk_plan(mode, L, K if mode in ("delta_block", "attnres") else L, pp, vpp, x_from_sources=x_from_sources)
    for k, first, sent, taken in c.boundaries():
        names = c.plan.payload_names(first)
        assert sent and sorted(sent + taken, key=names.index) == names and set(sent).isdisjoint(taken)
        assert [n for n in names if n in sent] == sent  # payload order kept
        if k < pp:
            assert taken == []  # the rank ran nothing of this micro-batch before
        for n in taken:
            assert c.plan.is_stable(n) and n in c.plan.payload_names(c.first_layers[k - pp + 1])
    uncached = chunk_plan(mode, L, K if mode in ("delta_block", "attnres") else L, pp, vpp, cached=False,
                          x_from_sources=x_from_sources)
    assert all(not taken for *_, taken in uncached.boundaries())


def test_delta_sends_only_the_outputs_of_the_chunks_in_between():
    """Fine-grained delta without a gate: a boundary into chunk k >= P carries exactly the sublayer outputs v_j
    made by chunks k-P+1 .. k-1 (the other ranks' chunks since this rank last ran), nothing else."""
    L, pp, vpp = 12, 2, 3
    c = chunk_plan("delta", L, L, pp, vpp, x_from_sources=True)
    f = c.first_layers
    for k, first, sent, taken in c.boundaries():
        if k >= pp:
            assert sent == [f"v{j}" for j in range(2 * f[k - pp + 1], 2 * f[k])], (k, sent)
            assert taken == ["h0"] + [f"v{j}" for j in range(2 * f[k - pp + 1])]
        else:
            assert sent == c.plan.payload_names(first)


@pytest.mark.parametrize("mode,stable,mutable", [
    ("delta", ["h0", "v0", "v5"], ["x"]),
    ("delta_block", ["h0", "D0", "D1"], ["x", "P0", "P1"]),
    ("attnres", ["B0", "B2"], ["p"]),
    ("full_attnres", ["B0", "B7"], ["p"]),
])
def test_stable_sources(mode, stable, mutable):
    plan = SourcePlan(mode=mode, num_layers=8, num_blocks=4 if mode in ("delta_block", "attnres") else 8)
    assert all(plan.is_stable(n) for n in stable) and not any(plan.is_stable(n) for n in mutable)


def test_out_of_order_chunks_are_an_error():
    cache = SourceCache(chunk_plan("delta", 4, 4, 2, 2), pp_rank=0, num_chunks_here=2)
    with pytest.raises(RuntimeError, match=r"virtual chunk 1 starts micro-batch 0 before chunk 0 ran it.*"
                                           r"--delta-pp-source-cache off"):
        cache.begin(1)
    n = cache.begin(0)
    with pytest.raises(RuntimeError, match=r"micro-batch 0 lacks \['v0'\] on pipeline rank 0"):
        cache.take(n, ["v0"])


def test_cached_tensors_return_their_gradients_to_the_keeping_chunk():
    """One rank's two chunks (global 0 and 2 of PP2 x VPP2, delta) linked by a SourceCache, run by hand in the
    interleaved schedule's order for two micro-batches, each chunk its own graph cut at its boundaries: the
    gradients equal those of the uncached path in one graph, where chunk 2 reads the kept tensors through chunk
    1 (the other rank). A taken tensor's gradient must go back to chunk 0 (w's), not be dropped."""
    import torch

    c = chunk_plan("delta", 4, 4, 2, 2, x_from_sources=True)
    into1, into2, taken, sent = c.payload_names(1), c.payload_names(2), c.taken_names(2), c.sent_names(2)
    assert taken and sent and c.kept_names(0) == taken
    f64 = dict(dtype=torch.float64)
    torch.manual_seed(0)
    w0, w1 = torch.randn(len(into1), 6, **f64), torch.randn(6, **f64)
    w2 = torch.randn(len(into2), 6, **f64)
    inputs = [torch.randn(6, **f64) for _ in range(2)]  # one per micro-batch

    def chunk0(w, x):  # rank 0, global chunk 0: makes every tensor of the payload into chunk 1
        return {n: torch.tanh(w[i] * x + i) for i, n in enumerate(into1)}

    def chunk1(w, held):  # rank 1, global chunk 1: passes the stable ones on, adds its own outputs
        made = {n: torch.sin(w * sum(held.values()) + i) for i, n in enumerate(into2) if n not in held}
        return {**held, **made}

    def chunk2(w, got):  # rank 0, global chunk 2: reads every tensor of its payload
        return sum(((w[i] * got[n]) ** 2).sum() * (i + 1) for i, n in enumerate(into2))

    def params():
        return [t.detach().clone().requires_grad_() for t in (w0, w1, w2)]

    ref = params()
    sum(chunk2(ref[2], chunk1(ref[1], chunk0(ref[0], x))) for x in inputs).backward()

    ours = params()
    cache = SourceCache(c, pp_rank=0, num_chunks_here=2)
    fwd = []
    for x in inputs:  # chunk 0 of both micro-batches, then chunk 1 (other rank), then chunk 2
        n = cache.begin(0)
        t0 = chunk0(ours[0], x)
        out0 = cache.keep(n, 0, torch.stack([t0[k] for k in into1]), {k: t0[k] for k in c.kept_names(0)})
        recv1 = out0.detach().requires_grad_()
        t1 = chunk1(ours[1], dict(zip(into1, recv1.unbind(0))))
        out1 = torch.stack([t1[k] for k in sent])
        fwd.append([n, out0, recv1, out1])
    for entry in fwd:
        n, _, _, out1 = entry
        assert cache.begin(1) == n
        recv2 = out1.detach().requires_grad_()
        got = {**cache.take(n, taken), **dict(zip(sent, recv2.unbind(0)))}
        entry += [recv2, chunk2(ours[2], got)]
    assert cache.in_flight == 2
    for n, out0, recv1, out1, recv2, loss in fwd:  # backward: chunk 2, then 1, then 0 (releases the micro-batch)
        loss.backward()
        out1.backward(recv2.grad)
        out0.backward(recv1.grad)
    assert cache.in_flight == 0
    for name, a, b in zip(("chunk 0", "chunk 1", "chunk 2"), ours, ref):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-12, atol=0, msg=f"{name}'s parameter gradient")


def test_unlinked_interleaved_chunks_refuse_to_run():
    """A rank's chunks built without link_chunks would misread the cached payloads its neighbours send."""
    from types import SimpleNamespace

    from megatron_delta.core.block import DeltaTransformerBlock

    cfg = SimpleNamespace(residual="delta", virtual_pipeline_model_parallel_size=2, pipeline_model_parallel_size=2,
                          pipeline_model_parallel_layout=None, delta_pp_source_cache=True)
    with pytest.raises(RuntimeError, match=r"^--delta-pp-source-cache on: this rank's model chunks were never "
                                           r"linked.*link_chunks\(model_chunks\)"):
        DeltaTransformerBlock._linked_source_cache(SimpleNamespace(source_cache=None, config=cfg))
    cfg.delta_pp_source_cache = False
    assert DeltaTransformerBlock._linked_source_cache(SimpleNamespace(source_cache=None, config=cfg)) is None


# ------------------------------------------------------------------------------------------------ the flag
PP2_VPP2 = ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1"]


def _args(monkeypatch, flags, world=2):
    from megatron_delta.trainer.main import parse_args

    monkeypatch.setenv("WORLD_SIZE", str(world))
    return parse_args(rank_runner.COMMON + flags + ["--train-iters", "1"])


def test_flag_defaults_on_where_it_applies(monkeypatch):
    assert _args(monkeypatch, ["--residual", "delta"] + PP2_VPP2).delta_pp_source_cache is True
    assert _args(monkeypatch, ["--residual", "delta", "--delta-pp-source-cache", "off"] + PP2_VPP2
                 ).delta_pp_source_cache is False
    assert _args(monkeypatch, ["--residual", "delta", "--pipeline-model-parallel-size", "2"]
                 ).delta_pp_source_cache is False
    assert _args(monkeypatch, ["--residual", "baseline"] + PP2_VPP2).delta_pp_source_cache is False


@pytest.mark.parametrize("flags", [["--residual", "delta", "--pipeline-model-parallel-size", "2"],
                                   ["--residual", "baseline"] + PP2_VPP2,
                                   ["--residual", "delta_block"]])
def test_explicit_on_where_it_does_not_apply_is_refused(monkeypatch, flags):
    from megatron_delta.trainer.arguments import TrainerArgumentError

    with pytest.raises(TrainerArgumentError, match=r"^--delta-pp-source-cache on applies only to a routed "
                                                   r"--residual under the interleaved pipeline schedule"):
        _args(monkeypatch, flags + ["--delta-pp-source-cache", "on"])


def test_start_up_lines_give_both_sizes(monkeypatch):
    """The payload lines count what is sent and add the uncached size; without the cache they are as before."""
    from megatron_delta.core.payload import describe_stage_payloads
    from megatron_delta.trainer.provider import transformer_config

    args = _args(monkeypatch, ["--residual", "delta"] + PP2_VPP2)
    lines = describe_stage_payloads(transformer_config(args), args.seq_length, args.micro_batch_size)
    mib = 32 * 2 * 64 * 4 / 2**20  # one [seq, mbs, hidden] fp32 tensor
    assert lines[0] == (f" pipeline payload into layer 1 (chunk 1): 3 tensors [h0, v0, v1] = {3 * mib:.2f} MiB "
                        f"per micro-batch (x3 the baseline's) (without the cache: {3 * mib:.2f} MiB; kept on the "
                        f"rank: [])")
    assert lines[2] == (f" pipeline payload into layer 3 (chunk 3): 2 tensors [v4, v5] = {2 * mib:.2f} MiB per "
                        f"micro-batch (x2 the baseline's) (without the cache: {7 * mib:.2f} MiB; kept on the rank: "
                        f"[h0, v0, v1, v2, v3])")
    args = _args(monkeypatch, ["--residual", "delta", "--delta-pp-source-cache", "off"] + PP2_VPP2)
    off = describe_stage_payloads(transformer_config(args), args.seq_length, args.micro_batch_size)
    assert off[2] == (f" pipeline payload into layer 3 (chunk 3): 7 tensors [h0, v0, v1, v2, v3, v4, v5] = "
                      f"{7 * mib:.2f} MiB per micro-batch (x7 the baseline's)")


# ------------------------------------------------------------------------------------------------ training
# Iteration 3's loss shows iteration 2's update; iteration 2's alone would not show a gradient that is wrong in size
# only (Adam's first step is about lr * sign(gradient)). The gradients of the last iteration are compared too.
ITERS = 3
TP2_SP = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
CONFIGS = {
    # name: (world, layout, [[configuration (tests/helpers/rank_runner.py spec: "6:" six layers), variant], ...])
    "pp2_vpp2": (2, PP2_VPP2, [[s, v] for s in ROUTED + ["delta/authors-code", "delta_block/authors-code",
                                                          "delta/gate"] for v in ("off", "on")]),
    # three chunks per rank (6 layers), the cache with and without recompute
    "pp2_vpp3": (2, PP2_VPP2, [[f"6:{m}", v] for m in ROUTED for v in ("off", "on", "on_recompute")]),
    # data parallelism: each replica's ranks keep their own micro-batches (distributed optimizer too)
    "dp2_distopt_pp2_vpp2": (4, ["--use-distributed-optimizer"] + PP2_VPP2,
                             [[m, v] for m in ("delta", "delta_block") for v in ("off", "on")]),
    # tensor + sequence parallelism: three chunks per rank, the cache with and without recompute
    "tp2_sp_pp2_vpp3": (4, TP2_SP + PP2_VPP2, [[f"6:{m}", v] for m in ROUTED for v in ("off", "on", "on_recompute")]),
}


@pytest.fixture(scope="module")
def launches(tp1_reference):
    """{world size: per-rank results}: one launch per world size runs all its configurations in turn
    (rank_runner.run_layouts), each run from the TP1 reference's initial model of its configuration (4 or 6
    layers); launched when a test first asks for that world size."""
    tp1_reference.runs(sorted({spec for _, _, runs in CONFIGS.values() for spec, _ in runs}))
    done = {}

    def results(world):
        if world not in done:
            configs = [[name, layout, runs] for name, (w, layout, runs) in CONFIGS.items() if w == world]
            done[world] = run_distributed(rank_runner.run_layouts, world, tp1_reference.root, configs, ITERS,
                                          kwargs={"collect": ["grads", "cache"]}, timeout=2400)
        return done[world]

    return results


@pytest.mark.slow
@pytest.mark.parametrize("config", list(CONFIGS))
def test_cached_training_equals_uncached_and_tp1(tp1_reference, launches, config):
    world, layout, runs = CONFIGS[config]
    specs = list(dict.fromkeys(spec for spec, _ in runs))
    ref = tp1_reference.runs(specs)
    results = [rank[config] for rank in launches(world)]
    tp = 2 if "tp2" in config else 1
    seq = 32 // tp if "sp" in config else 32
    for spec in specs:
        name, flavour, num_layers = rank_runner.parse_spec(spec)
        blocks = num_layers // 2 if name in BLOCK_MODES else num_layers  # tests/helpers/flags.py mode_flags: K = L / 2
        for v in [v for s, v in runs if s == spec]:
            last = results[-1][spec][v]
            # the reference trained rank_runner.ITERS iterations: its first ITERS are these (the mock data's order
            # and the lr schedule do not depend on --train-iters)
            d = max(abs(a - b) for a, b in zip(last["losses"], ref[spec]["fp32"]["losses"][:ITERS]))
            assert len(last["losses"]) == ITERS and d <= LOSS_TOL, \
                f"{config} {spec} {v}: losses differ from TP1 by {d}"
            cached = v != "off"
            plan = chunk_plan(name, num_layers, blocks, 2, num_layers // 2, cached=cached,
                              sources="authors-code" if flavour == "authors-code" else "exact",
                              x_from_sources=name in ("delta", "delta_block") and not flavour)
            for r, rank in enumerate(results):
                entry = rank[spec][v]
                pp_rank = r // (world // 2)  # Megatron's rank order: tensor- and data-parallel ranks vary faster
                # the bytes each boundary received: what the plan sends, per rank sequence and micro-batch
                expect = {str(first): len(sent) * seq for k, first, sent, _ in plan.boundaries() if k % 2 == pp_rank}
                assert entry["payloads"] == expect, (config, spec, v, r, entry["payloads"], expect)
                assert entry["cache"] == {"linked": int(cached), "in_flight": 0}, (config, spec, v, entry["cache"])
                if v == "off":
                    continue
                base = rank[spec]["off"]["grads"]
                assert set(entry["grads"]) == set(base) and base
                for pname, g in entry["grads"].items():
                    scale = max(abs(x) for x in base[pname]) or 1.0
                    diff = max(abs(a - b) for a, b in zip(g, base[pname]))
                    assert diff <= GRAD_RTOL * scale + GRAD_ATOL, \
                        f"{config} {spec} {v}: gradient of {pname} off by {diff}"


@pytest.mark.slow
def test_checkpoints_cross_between_cached_and_uncached(tmp_path):
    """Saved half-way with the cache and resumed without it (and the other way): the resumed iterations give
    the straight run's losses (the cache holds no state and writes nothing into a checkpoint)."""
    res = run_distributed(rank_runner.checkpoint_swap, 2, str(tmp_path), PP2_VPP2, "delta", 4, timeout=1200)[-1]
    for swap, r in res.items():
        assert len(r["straight"]) == 4 and len(r["resumed"]) == 2, (swap, r)
        d = max(abs(a - b) for a, b in zip(r["straight"][2:], r["resumed"]))
        assert d <= LOSS_TOL, f"{swap}: resumed losses differ from the straight run's by {d}"
