"""The memory and cost models (megatron_delta/perf/memory_model.py, cost_model.py) and tools/memory_plan.py:
the activation estimate against the bytes autograd really saves (CPU, local spec).

The model is built in-process (megatron_delta.checkpoint.model_config + initialize_distributed(1, 1) +
build_model_chunks); one forward with labels runs under torch.autograd.graph.saved_tensors_hooks, and the unique
storages of the saved tensors that are not parameters are summed."""
import importlib.util
import json
import os

import pytest
import torch

from megatron_delta.perf import cost_model, memory_model
from tests.helpers import REPO_ROOT as REPO


def _tool(name):
    """tools/<name>.py as a module (its parse() and main() run in this process)."""
    spec = importlib.util.spec_from_file_location(f"_{name}_tool", os.path.join(REPO, "tools", f"{name}.py"))
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    return tool


memory_plan = _tool("memory_plan")

CONFIGS = [  # (layers, hidden, heads, groups, seq, micro batch, vocab)
    (4, 64, 4, 2, 32, 2, 256),
    (8, 96, 4, 2, 48, 1, 320),
]


@pytest.fixture(scope="module")
def dist():
    from megatron_delta.platform.distributed import initialize_distributed

    initialize_distributed(1, 1, seed=1234)
    yield


def _flags(mode, L, h, heads, groups, s, b, V):
    return ["--residual", mode, "--num-layers", str(L), "--hidden-size", str(h), "--num-attention-heads",
            str(heads), "--num-query-groups", str(groups), "--seq-length", str(s), "--micro-batch-size", str(b),
            "--vocab-size", str(V)]


def _model(mode, L, h, heads, groups, s, V, **moe):
    """The model of the plan's fields, built in-process (``moe``: DeltaTransformerConfig's MoE fields)."""
    from megatron.core import tensor_parallel
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    from megatron_delta.checkpoint.model_config import model_config
    from megatron_delta.core.model import build_model_chunks

    MTPLossLoggingHelper.tracker.clear()  # a process-wide log sized by the first MTP model built (test_mtp's: 1)

    torch.manual_seed(1234)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    config, options = model_config(dict(residual=mode, num_layers=L, hidden_size=h, num_attention_heads=heads,
                                        num_query_groups=groups, seq_length=s), **moe)
    return build_model_chunks(config, V, **options)[0]


def measured_saved_bytes(mode, L, h, heads, groups, s, b, V, **moe):
    model = _model(mode, L, h, heads, groups, s, V, **moe)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in params:
            storages[st.data_ptr()] = st.nbytes()
        return t

    tokens = torch.randint(0, V, (b, s))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(tokens, torch.arange(s).expand(b, -1), None, labels=tokens)
    loss.sum().backward()
    return sum(storages.values())


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: "L{}h{}s{}b{}".format(c[0], c[1], c[4], c[5]))
@pytest.mark.parametrize("mode", ["baseline", "delta", "delta_block"])
def test_activation_estimate_within_10_percent(dist, mode, cfg):
    flags = _flags(mode, *cfg)
    measured = measured_saved_bytes(mode, *cfg)
    plan = memory_model.memory_plan(memory_plan.parse(flags + ["--transformer-impl", "local", "--device", "cpu"]))
    (stage,) = plan["stages"]
    assert stage["in_flight"] == 1
    estimate = stage["activations"]
    assert abs(estimate - measured) / measured < 0.10, (mode, cfg, estimate, measured)


# Mixture of experts: 8 experts of FFN 48, top-2, a shared expert of 64, the first layer dense (plan flags, and the
# same as DeltaTransformerConfig fields).
MOE_FLAGS = ["--num-experts", "8", "--moe-ffn-hidden-size", "48", "--moe-router-topk", "2",
             "--moe-shared-expert-intermediate-size", "64", "--moe-layer-freq", "([0]*1+[1]*3)"]
MOE_FIELDS = dict(num_moe_experts=8, moe_ffn_hidden_size=48, moe_router_topk=2, moe_shared_expert_intermediate_size=64,
                  moe_layer_freq=[0, 1, 1, 1], moe_aux_loss_coeff=0.01)


@pytest.mark.parametrize("mode", ["baseline", "delta_block"])
def test_moe_parameters_exact_and_activations_within_10_percent(dist, mode):
    """An MoE model built in-process (CPU, local spec, EP1): the plan's parameter count is its own, exactly, and
    its activation estimate is within 10 % of what autograd saves."""
    cfg = (4, 64, 4, 2, 32, 2, 256)
    flags = _flags(mode, *cfg) + MOE_FLAGS + ["--transformer-impl", "local", "--device", "cpu"]
    plan = memory_model.memory_plan(memory_plan.parse(flags))
    (stage,) = plan["stages"]
    model = _model(mode, *cfg[:5], cfg[6], **MOE_FIELDS)
    assert stage["params"] == sum(p.numel() for p in model.parameters())
    measured = measured_saved_bytes(mode, *cfg, **MOE_FIELDS)
    assert abs(stage["activations"] - measured) / measured < 0.10, (mode, stage["activations"], measured)


def test_expert_parallelism_divides_the_experts_and_their_optimizer_state():
    """EP2 halves the experts on a rank (8 -> 4 SwiGLU MLPs of 3 x h x FFN each, in the 3 MoE layers); with the
    distributed optimizer the experts' Adam state is sharded over world / (ETP x EP x PP), the rest over DP."""
    base = ["--num-layers", "4", "--hidden-size", "64", "--residual", "delta_block", "--world-size", "4",
            "--use-distributed-optimizer"] + MOE_FLAGS
    ep1 = memory_model.memory_plan(memory_plan.parse(base))["stages"][0]
    ep2 = memory_model.memory_plan(memory_plan.parse(base + ["--expert-model-parallel-size", "2"]))["stages"][0]
    expert = 3 * 64 * 48
    assert ep1["params"] - ep2["params"] == 3 * 4 * expert
    # fp32 Adam: m and v (8 B); dense part over DP 4 in both; experts over 4 (EP1) and 2 (EP2) ranks
    dense = ep2["params"] - 3 * 4 * expert
    assert ep2["optimizer"] == pytest.approx(dense * 8 / 4 + 3 * 4 * expert * 8 / 2)
    assert ep1["optimizer"] == pytest.approx(ep1["params"] * 8 / 4)


@pytest.mark.parametrize("flags, message", [
    (["--expert-model-parallel-size", "3"], "--expert-model-parallel-size 3 must divide --num-experts 8"),
    (["--moe-layer-freq", "[1,1]"], "--moe-layer-freq [1, 1] must give 0 or 1 for each of the 4 layers"),
    (["--moe-layer-freq", "__import__('os')"], "--moe-layer-freq \"__import__('os')\" is not an integer or a list "
                                               "expression like '([0]*1+[1]*3)'"),
])
def test_moe_flags_that_do_not_fit_are_refused(flags, message, capsys):
    with pytest.raises(SystemExit) as e:
        memory_plan.main(["--num-layers", "4", "--world-size", "6"] + MOE_FLAGS + flags)
    assert e.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith(": error: " + message)


def test_moe_plan_prints_the_experts(capsys):
    assert memory_plan.main(["--num-layers", "4", "--world-size", "4", "--expert-model-parallel-size", "2"]
                            + MOE_FLAGS) == 0
    assert " | MoE: 3 of 4 layers, 8 experts (ffn 48) top-2, EP 2 ETP 1\n" in capsys.readouterr().out


def test_routed_modes_cost_more_and_pipeline_holds_micro_batches():
    base = ["--num-layers", "8", "--hidden-size", "256", "--seq-length", "256", "--micro-batch-size", "1",
            "--pipeline-model-parallel-size", "4", "--world-size", "4", "--global-batch-size", "8", "--bf16"]
    b = memory_model.memory_plan(memory_plan.parse(base + ["--residual", "baseline"]))["stages"]
    d = memory_model.memory_plan(memory_plan.parse(base + ["--residual", "delta"]))["stages"]
    assert [s["in_flight"] for s in b] == [4, 3, 2, 1]
    assert all(x["of_which_payload"] == 0 for x in b)
    assert d[0]["of_which_payload"] == 0 and all(x["of_which_payload"] > 0 for x in d[1:])
    assert all(y["activations"] > x["activations"] for x, y in zip(b, d))


def test_interleaved_traffic_with_and_without_the_source_cache(capsys):
    """Per boundary: without the cache every payload name travels, with it only what SourcePlan-based
    SourceCachePlan sends; the stages then hold less payload, and the printed lines give both sizes."""
    from megatron_delta.core.source_cache import SourceCachePlan
    from megatron_delta.core.sources import SourcePlan

    flags = ["--num-layers", "12", "--hidden-size", "256", "--seq-length", "128", "--micro-batch-size", "1",
             "--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "2",
             "--global-batch-size", "8", "--residual", "delta"]
    on = memory_model.memory_plan(memory_plan.parse(flags))
    off = memory_model.memory_plan(memory_plan.parse(flags + ["--delta-pp-source-cache", "off"]))
    one = 128 * 256 * 4
    plan = SourcePlan(mode="delta", num_layers=12, num_blocks=12, x_from_sources=True)
    expect = SourceCachePlan.even(plan, 2, 3).boundaries()
    assert [b["first_layer"] for b in on["boundaries"]] == [2, 4, 6, 8, 10]
    assert [b["bytes"] for b in on["boundaries"]] == [len(sent) * one for _, _, sent, _ in expect]
    assert [b["bytes"] for b in on["boundaries"]] == [5 * one] + [4 * one] * 4  # v's of the other rank's chunk
    assert [b["bytes_without_cache"] for b in on["boundaries"]] == [(1 + 4 * k) * one for k in range(1, 6)]
    assert [b["bytes"] for b in off["boundaries"]] == [b["bytes_without_cache"] for b in on["boundaries"]]
    assert all(a["of_which_payload"] <= b["of_which_payload"] for a, b in zip(on["stages"], off["stages"]))
    assert sum(a["of_which_payload"] for a in on["stages"]) < sum(b["of_which_payload"] for b in off["stages"])
    memory_plan.main(flags)
    assert "payload into layer 10 (chunk 5): 4 tensors = 0.50 MiB per micro-batch (without the cache: 21 = 2.62 " \
           "MiB)" in capsys.readouterr().out


def test_qwen3_8b_preset_prints_table(capsys):
    assert memory_plan.main(["--preset", "qwen3-8b"]) == 0
    out = capsys.readouterr().out
    assert "delta_block" in out and "| 0 |" in out and '"stages"' in out


def test_block_mode_without_blocks_that_divide_is_refused(capsys):
    """memory_plan.py and the cost model resolve K as pretrain_gpt.py does (modes.default_num_blocks): 4 blocks
    by default, a layer count 4 does not divide refused in one line naming the flag, a given K kept."""
    def message(L, divisors):
        return (f"--residual delta_block with --num-layers {L} needs --delta-num-blocks K with K dividing {L} "
                f"({divisors}); the default, 4 blocks, does not divide {L}")

    with pytest.raises(SystemExit) as e:
        memory_plan.main(["--num-layers", "30", "--residual", "delta_block"])
    assert e.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith(
        ": error: " + message(30, "1, 2, 3, 5, 6, 10, 15, 30"))
    flags = ["--num-layers", "30", "--residual", "delta_block", "--delta-num-blocks", "5"]
    assert memory_plan.parse(flags).delta_num_blocks == 5
    assert memory_plan.parse(["--num-layers", "36", "--residual", "attnres"]).delta_num_blocks == 4
    # the cost model (gpu_check's predictions): a 13-layer slice of the 8B shape has no default K
    with pytest.raises(ValueError) as err:
        cost_model.router_share("H100", "8B", "delta_block", num_layers=13)
    assert str(err.value) == message(13, "1, 13")
    default = cost_model.router_share("H100", "8B", "delta_block")  # 36 layers
    assert default == cost_model.router_share("H100", "8B", "delta_block", num_blocks=4)
    assert default["router_ms"] < cost_model.router_share("H100", "8B", "delta_block", num_blocks=36)["router_ms"]


# ------------------------------------------------------------------ the router's share of a step
def test_router_share_predictions():
    """Every routed mode on both shapes: the fused kernel moves fewer bytes than the PyTorch path;
    delta (O(L^2) source reads) costs more than delta_block (<= K+1 sources); faster HBM, smaller share."""
    for shape in ("1B", "8B"):
        base = cost_model.router_share("H100", shape, "baseline")
        assert base["router_ms"] == 0 and base["tokens_per_sec_ratio"] == 1
        for mode in ("delta", "delta_block", "attnres", "full_attnres"):
            t = cost_model.router_share("H100", shape, mode, "torch")
            f = cost_model.router_share("H100", shape, mode, "fla")
            assert 0 < f["router_ms"] < t["router_ms"], (shape, mode)
            assert f["gemm_ms"] == t["gemm_ms"] == base["gemm_ms"]
            b200 = cost_model.router_share("B200", shape, mode, "fla")
            h200 = cost_model.router_share("H200", shape, mode, "fla")
            assert h200["router_ms"] < f["router_ms"] and h200["gemm_ms"] == f["gemm_ms"]
            assert b200["gemm_ms"] < f["gemm_ms"]
        assert (cost_model.router_share("H200", shape, "delta", "fla")["router_share"]
                > cost_model.router_share("H200", shape, "delta_block", "fla")["router_share"])


def test_step_traffic_by_hand():
    """One delta_block layer (K = 1) on fla's kernel (x kept as a stream), bf16 (a = 2 bytes, fp32 c = 4), counted
    by hand from the passes. Router 0 reads [h0] over base x = h0; its output v0 gives x1 = h0 + v0 and is the
    partial sum P0; router 1 reads [h0, P0] over x1; x2 = x1 + v1; the last block's sum is not formed (only x
    needs it). Gradient contributions: h0 4 (a source of both routers, router 0's base, x1's add), v0 2 (x1's add,
    router 1's P0), x1 2 (router 1's base, x2's add), v1 and x2 1: 3 + 1 + 1 = 5 autograd adds of 3 rows each."""
    a, c = 2, 4
    fla_fwd = (a + a) + (2 * a + a)  # residuals read, r written
    fla_bwd = (a + 3 * a + 2 * c) + (a + 6 * a + 2 * c)  # do, residuals twice, a dv each, dqw fp32 written + read
    want = {("fla", "forward"): fla_fwd / a, ("fla", "backward"): fla_bwd / a,
            ("fla_combine", "forward"): 2 * 3,  # u = x + r, twice
            ("x_add", "forward"): 2 * 3, ("autograd_add", "backward"): 5 * 3}
    assert cost_model.step_traffic("delta_block", 1, "fla", num_blocks=1, act_bytes=2) == want
    # the PyTorch path: x is the sum of the sources (no x_add); h0, read by both routers, is projected once
    # (an fp32 copy and two reads of it: a + 3c bytes)
    torch_u = cost_model.step_traffic("delta_block", 1, "torch", num_blocks=1, act_bytes=2)
    assert ("x_add", "forward") not in torch_u and torch_u[("project", "forward")] == (a + c + 2 * c) / a
    assert cost_model.total_u(torch_u) > cost_model.total_u(want)


def test_router_share_json(capsys):
    """--format json: {shape: {mode: {backend: ratio}}} for 1b and 8b, every routed mode, the GPU backends."""
    assert memory_plan.main(["--router-share", "H100", "--format", "json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert sorted(out) == ["1b", "8b"]
    for shape, modes in out.items():
        assert sorted(modes) == sorted(["delta", "delta_block", "attnres", "full_attnres"])
        for mode, per in modes.items():
            assert sorted(per) == sorted(cost_model.GPU_BACKENDS)
            want = cost_model.router_share("H100", shape.upper(), mode, "fla")["tokens_per_sec_ratio"]
            assert 0 < per["fla"] < 1 and per["fla"] == want


def test_docs_router_share_tables_are_the_tools_output(capsys):
    """docs/performance.md's predicted tables are what `memory_plan.py --router-share GPU` prints today, for every
    GPU the model knows (so they cannot drift from the counted model)."""
    doc = open(os.path.join(REPO, "docs", "performance.md"), encoding="utf-8").read()
    for gpu in cost_model.GPUS:
        assert memory_plan.main(["--router-share", gpu]) == 0
        table = capsys.readouterr().out.strip()
        assert f"python tools/memory_plan.py --router-share {gpu}\n```\n\n{table}\n" in doc, gpu


@pytest.mark.parametrize("argv", [["--preset", "qwen3-8b"], ["--preset", "qwen3-8b", "--residual", "baseline"]])
def test_docs_plan_tables_are_the_tools_output(capsys, argv):
    """docs/performance.md's memory plans of the 8B recipe are what the command printed above them prints today
    (its table, before the plan's JSON)."""
    doc = open(os.path.join(REPO, "docs", "performance.md"), encoding="utf-8").read()
    assert memory_plan.main(argv) == 0
    out = capsys.readouterr().out
    table = out[:out.index("\n{")]
    assert f"python tools/memory_plan.py {' '.join(argv)}\n```\n\n```\n{table}\n```\n" in doc


def test_router_share_cli(capsys):
    assert memory_plan.main(["--router-share", "B200"]) == 0
    out = capsys.readouterr().out
    assert "Predicted on B200" in out and "| 8B | delta_block | 36 |" in out and "| 1B | full_attnres | 28 |" in out


# ----------------------------------------------------------------------------------- multi-token prediction
@pytest.mark.parametrize("mode", ["baseline", "delta_block", "attnres", "full_attnres"])
def test_mtp_params_and_activations_match_the_model(dist, mode):
    """--mtp-num-layers 2: the plan's parameter count is the model's, its MTP activations (the saved bytes of the
    model with MTP less those without) within 10 %; with PP 2 the last stage also holds the embedding."""
    from megatron.core import tensor_parallel
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    from megatron_delta.checkpoint.model_config import model_config
    from megatron_delta.core.model import build_model_chunks

    MTPLossLoggingHelper.tracker.clear()  # a process-wide log sized by the first MTP model built (test_mtp's: 1)

    L, h, heads, groups, s, b, V = CONFIGS[0]
    flags = _flags(mode, *CONFIGS[0]) + ["--transformer-impl", "local", "--device", "cpu"]
    measured, params = [], []
    for mtp in (None, 2):
        torch.manual_seed(1234)
        tensor_parallel.model_parallel_cuda_manual_seed(1234)
        config, options = model_config(dict(residual=mode, num_layers=L, hidden_size=h, num_attention_heads=heads,
                                            num_query_groups=groups, seq_length=s), mtp_num_layers=mtp)
        model = build_model_chunks(config, V, **options)[0]
        params.append(sum(p.numel() for p in model.parameters()))
        storages = {}
        owned = {p.untyped_storage().data_ptr() for p in model.parameters()}

        def pack(t):
            if t.untyped_storage().data_ptr() not in owned:
                storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        tokens = torch.randint(0, V, (b, s))
        model.train()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = model(tokens, torch.arange(s).expand(b, -1), None, labels=tokens)
        loss.sum().backward()
        measured.append(sum(storages.values()))
    plans = [memory_model.memory_plan(memory_plan.parse(flags + extra))["stages"][0]
             for extra in ([], ["--mtp-num-layers", "2"])]
    assert [p["params"] for p in plans] == params
    estimate, actual = plans[1]["activations"] - plans[0]["activations"], measured[1] - measured[0]
    assert abs(estimate - actual) / actual < 0.10, (mode, estimate, actual)
    pp1, pp2 = (memory_model.plan_config(residual=mode, num_layers=L, hidden_size=h, num_attention_heads=heads,
                                         num_query_groups=groups, seq_length=s, vocab_size=V, mtp_num_layers=2,
                                         pipeline_model_parallel_size=pp) for pp in (1, 2))
    assert memory_model.mtp_params(pp2) - memory_model.mtp_params(pp1) == V * h


# ------------------------------------------------------------ the Triton kernels' deferred block pass
STASH_CASES = [  # (mode, layers, blocks, hidden, seq, micro batch, PP, VPP layers): the scopes the run splits into
    ("delta_block", 12, 3, 24, 6, 2, 2, None),  # two stages of 6 layers: block 1 cut 4, 5 | 6, 7
    ("attnres", 12, 3, 24, 6, 2, 2, 3),  # 2 x 2 chunks of 3 layers: chunk 1's layer 3 (block 0) does not defer
]


@pytest.mark.parametrize("case", STASH_CASES, ids=[c[0] for c in STASH_CASES])
def test_deferred_block_stash_is_what_the_kernels_stash(case):
    """The plan's deferred_block_stash against the bytes BlockDeferral really holds when each block pass starts
    (tests/helpers/triton_stash_count.py: SourceBuffer over stand-in sublayers on the Triton kernels under the
    interpreter, fp32, one buffer scope per pipeline chunk): the same passes (routers, completed sources) per chunk,
    each pass's stash R x (output gradient + 3 x C fp32 coefficients per token + query), and per stage the largest."""
    pytest.importorskip("triton")
    import subprocess
    import sys

    mode, L, K, h, s, b, pp, vpp_layers = case
    chunks = pp * (L // pp // vpp_layers if vpp_layers else 1)
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, os.path.join(REPO, "tests", "helpers", "triton_stash_count.py"), mode,
                           *map(str, (L, K, chunks, h, s, b))], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    counted = {int(k): v for k, v in json.loads(proc.stdout.strip().splitlines()[-1]).items()}
    a = memory_model.plan_config(residual=mode, num_layers=L, delta_num_blocks=K, hidden_size=h, num_attention_heads=4,
                                 seq_length=s, micro_batch_size=b, pipeline_model_parallel_size=pp,
                                 num_layers_per_virtual_pipeline_stage=vpp_layers, delta_router_kernels="triton")
    per_chunk = L // chunks
    for c in range(chunks):
        passes = memory_model.block_deferrals(a, c * per_chunk, per_chunk)
        # backward runs the chunk's blocks last to first; each stashed router holds [T, h] fp32, [3, C, T], [h]
        assert counted.get(c, []) == [[r, n, r * (s * b * h * 4 + 3 * n * s * b * 4 + h * 4)]
                                      for _, r, n in reversed(passes)], c
    assert len(counted) == chunks and any(len(v) > 1 for v in counted.values())
    for stage in range(pp):
        largest = max(p[2] for c in range(stage, chunks, pp) for p in counted.get(c, []))
        plan = memory_model.plan_stage(a, stage)
        assert plan["deferred_block_stash"] == memory_model.deferred_block_stash(a, stage) == largest
        without = memory_model.plan_stage(memory_model.plan_config(**{**{k: getattr(a, k) for k in
                                                                         memory_model.PLAN_DEFAULTS},
                                                                      "delta_router_kernels": "torch"}), stage)
        assert plan["total"] - without["total"] == largest and plan["activations"] == without["activations"]


def test_deferred_block_stash_where_it_applies(capsys):
    """The 8B preset (TP2 + SP, bf16): per stage one block's stash, 18 routers x ([1024, 4096] bf16 + 3 x 4 fp32
    coefficients per token for the last block's 4 completed sources + the fp32 query), about 151 MB, with
    --delta-router-kernels triton and auto (the trainer's default, the Triton kernels on a GPU); none for fla's
    kernel, the PyTorch path, --device cpu, the baseline and the fine-grained modes. In the table, the JSON and the
    total."""
    from megatron_delta.perf.shapes import PRESETS

    stash = 18 * (1024 * 4096 * 2 + 3 * 4 * 4 * 1024 + 4 * 4096)
    assert stash == 152_174_592
    for kernels in ("triton", "auto"):
        a = memory_model.plan_config(**PRESETS["qwen3-8b"], delta_router_kernels=kernels)
        assert a.router_backend == "triton" and memory_model.plan_stage(a, 0)["deferred_block_stash"] == stash
    assert memory_model.plan_config(**PRESETS["qwen3-8b"]).delta_router_kernels == "auto"
    for change in (dict(delta_router_kernels="fla"), dict(delta_router_kernels="torch"),
                   dict(delta_router_kernels="c"), dict(device="cpu"), dict(residual="baseline"),
                   dict(residual="delta"), dict(residual="full_attnres")):
        a = memory_model.plan_config(**{**PRESETS["qwen3-8b"], **change})
        assert memory_model.plan_stage(a, 0)["deferred_block_stash"] == 0, change
    assert memory_plan.main(["--preset", "qwen3-8b"]) == 0
    out = capsys.readouterr().out
    assert "| in flight | deferred stash (bwd) | total GiB |" in out and "| 1 | 0.14 | 36.31 |" in out
    stage = json.loads(out[out.index("{"):])["stages"][0]
    assert stage["deferred_block_stash"] == stash
    assert stage["total"] == pytest.approx(sum(stage[k] for k in ("weights", "grads", "optimizer", "activations",
                                                                  "deferred_block_stash")))


def test_bad_router_kernels_are_refused(capsys):
    """--delta-router-kernels takes pretrain_gpt.py's values with its default; others are refused."""
    import argparse

    from megatron_delta.trainer.arguments import add_delta_args

    def flag(parser):
        return next(x for x in parser._actions if "--delta-router-kernels" in x.option_strings)

    trainer = flag(add_delta_args(argparse.ArgumentParser()))
    assert list(flag(memory_plan.build_parser()).choices) == list(trainer.choices)
    assert memory_plan.parse([]).delta_router_kernels == trainer.default == "auto"
    with pytest.raises(SystemExit) as e:
        memory_plan.main(["--preset", "qwen3-8b", "--delta-router-kernels", "cuda"])
    assert e.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith(
        "error: argument --delta-router-kernels: invalid choice: 'cuda' (choose from 'auto', 'c', 'torch', 'fla', "
        "'triton')")
    with pytest.raises(memory_model.PlanError) as err:
        memory_model.plan_config(residual="delta_block", num_layers=8, delta_router_kernels="cuda")
    assert str(err.value) == "--delta-router-kernels 'cuda' is not one of auto, c, torch, fla, triton"
