"""tools/memory_plan.py: the activation estimate against the bytes autograd really saves (CPU, local spec).

The model is built in-process (parse_args + initialize_distributed(1, 1) + build_model_chunks); one
forward with labels runs under torch.autograd.graph.saved_tensors_hooks, and the unique storages of
the saved tensors that are not parameters are summed."""
import os
import sys

import pytest
import torch

from megatron_delta.arguments import parse_args

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "tools"))

import memory_plan  # noqa: E402

CONFIGS = [  # (layers, hidden, heads, groups, seq, micro batch, vocab)
    (4, 64, 4, 2, 32, 2, 256),
    (8, 96, 4, 2, 48, 1, 320),
]


@pytest.fixture(scope="module")
def dist():
    from megatron_delta.cpu_platform import initialize_distributed

    initialize_distributed(1, 1, seed=1234)
    yield


def _flags(mode, L, h, heads, groups, s, b, V):
    return ["--residual", mode, "--num-layers", str(L), "--hidden-size", str(h), "--num-attention-heads",
            str(heads), "--num-query-groups", str(groups), "--seq-length", str(s), "--micro-batch-size", str(b),
            "--vocab-size", str(V)]


def measured_saved_bytes(flags):
    from megatron.core import tensor_parallel

    from megatron_delta.model import build_model_chunks, transformer_config_from_args

    args = parse_args(flags + ["--mock-data"], world_size=1)
    torch.manual_seed(args.seed)
    tensor_parallel.model_parallel_cuda_manual_seed(args.seed)
    model = build_model_chunks(args, transformer_config_from_args(args), args.vocab_size)[0]
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in params:
            storages[st.data_ptr()] = st.nbytes()
        return t

    s, b = args.seq_length, args.micro_batch_size
    tokens = torch.randint(0, args.vocab_size, (b, s))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(tokens, torch.arange(s).expand(b, -1), None, labels=tokens)
    loss.sum().backward()
    return sum(storages.values())


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: "L{}h{}s{}b{}".format(c[0], c[1], c[4], c[5]))
@pytest.mark.parametrize("mode", ["baseline", "delta", "delta_block"])
def test_activation_estimate_within_10_percent(dist, mode, cfg):
    flags = _flags(mode, *cfg)
    measured = measured_saved_bytes(flags)
    plan = memory_plan.memory_plan(memory_plan.parse(flags + ["--transformer-impl", "local", "--device", "cpu"]))
    (stage,) = plan["stages"]
    assert stage["in_flight"] == 1
    estimate = stage["activations"]
    assert abs(estimate - measured) / measured < 0.10, (mode, cfg, estimate, measured)


def test_routed_modes_cost_more_and_pipeline_holds_micro_batches():
    base = ["--num-layers", "8", "--hidden-size", "256", "--seq-length", "256", "--micro-batch-size", "1",
            "--pipeline-model-parallel-size", "4", "--world-size", "4", "--global-batch-size", "8", "--bf16"]
    b = memory_plan.memory_plan(memory_plan.parse(base + ["--residual", "baseline"]))["stages"]
    d = memory_plan.memory_plan(memory_plan.parse(base + ["--residual", "delta"]))["stages"]
    assert [s["in_flight"] for s in b] == [4, 3, 2, 1]
    assert all(x["of_which_payload"] == 0 for x in b)
    assert d[0]["of_which_payload"] == 0 and all(x["of_which_payload"] > 0 for x in d[1:])
    assert all(y["activations"] > x["activations"] for x, y in zip(b, d))


def test_qwen3_8b_preset_prints_table(capsys):
    assert memory_plan.main(["--preset", "qwen3-8b"]) == 0
    out = capsys.readouterr().out
    assert "delta_block" in out and "| 0 |" in out and '"stages"' in out
