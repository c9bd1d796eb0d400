"""Mixture of experts in baseline mode, as Megatron-LM's pretrain_gpt.py builds and trains it.

Fast (one in-process rank): the trainer's parse_args + model provider build Megatron-Core's MoELayer (router
weight, one expert MLP per expert, shared experts) in the layers --moe-layer-freq names and the dense MLP
elsewhere; --moe-grouped-gemm, which Megatron-Core's local backend has no kernel for, is refused by name;
on CPU the alltoall dispatcher's split sizes reach the all-to-all as upstream's numpy arrays (moe_splits_to_host).
Slow (one launch of pretrain_gpt.py, 2 gloo ranks, expert parallelism 2): the alltoall dispatcher trains and
Megatron logs the load-balancing loss in each iteration line.
"""
from __future__ import annotations

import math
import re

import pytest

from tests.flags import tiny

HIDDEN, EXPERTS, SHARED = 64, 4, 96


def _provider_model(argv):
    """The model the trainer builds from `argv`: parse_args, then its model provider (one rank, EP1)."""
    from megatron.training.global_vars import set_args

    from megatron_delta.platform.distributed import initialize_distributed
    from megatron_delta.trainer.main import parse_args
    from megatron_delta.trainer.provider import model_provider

    args = parse_args(argv)
    args.padded_vocab_size = args.vocab_size
    initialize_distributed(seed=args.seed)
    set_args(args)
    try:
        return model_provider(pre_process=True, post_process=True)
    finally:
        set_args(None)


@pytest.mark.usefixtures("distributed_teardown")
@pytest.mark.parametrize("residual", ["baseline", "delta_block"])
def test_megatron_moe_layers_are_built_where_moe_layer_freq_puts_them(residual):
    """Every mode builds Megatron-Core's MoELayer (router, one expert MLP per expert, shared experts) where
    --moe-layer-freq says and its dense MLP elsewhere, with the same parameter names and shapes; a routed mode
    puts each layer's submodules in a DeltaTransformerLayer, with its two depth routers."""
    from megatron.core.transformer.mlp import MLP
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.moe.shared_experts import SharedExpertMLP
    from megatron.core.transformer.transformer_layer import TransformerLayer

    from megatron_delta.core.layer import DeltaTransformerLayer
    from megatron_delta.core.norms import LocalNorm

    model = _provider_model(tiny(num_layers=4, hidden=HIDDEN, train_iters=1) + [
        "--residual", residual, "--eval-interval", "1", "--num-experts", str(EXPERTS),
        "--moe-router-topk", "2", "--moe-layer-freq", "[0,1,1,0]", "--moe-ffn-hidden-size", "32",
        "--moe-shared-expert-intermediate-size", str(SHARED)])
    layers = model.decoder.layers
    assert {type(layer) for layer in layers} == {TransformerLayer if residual == "baseline" else DeltaTransformerLayer}
    mlps = [layer.mlp for layer in layers]
    # the project's sequence-parallel-capable norms, as in its dense baseline
    assert {type(layer.pre_mlp_layernorm) for layer in layers} == {LocalNorm}
    assert [type(m) for m in mlps] == [MLP, MoELayer, MoELayer, MLP]
    assert [layer.is_moe_layer for layer in layers] == [False, True, True, False]
    params = dict(model.named_parameters())
    for i in (1, 2):
        moe = mlps[i]
        assert isinstance(moe.experts, SequentialMLP) and len(moe.experts.local_experts) == EXPERTS
        assert isinstance(moe.shared_experts, SharedExpertMLP)
        assert params[f"decoder.layers.{i}.mlp.router.weight"].shape == (EXPERTS, HIDDEN)
        # SwiGLU experts: fc1 holds gate and up projections
        for e in range(EXPERTS):
            assert params[f"decoder.layers.{i}.mlp.experts.local_experts.{e}.linear_fc1.weight"].shape == (64, HIDDEN)
            assert params[f"decoder.layers.{i}.mlp.experts.local_experts.{e}.linear_fc2.weight"].shape == (HIDDEN, 32)
        assert params[f"decoder.layers.{i}.mlp.shared_experts.linear_fc1.weight"].shape == (2 * SHARED, HIDDEN)
    for i in (0, 3):
        assert not any(name.startswith(f"decoder.layers.{i}.mlp.router") for name in params)
        assert params[f"decoder.layers.{i}.mlp.linear_fc1.weight"].shape == (2 * 3 * HIDDEN, HIDDEN)
    routers = {n for n in params if "_router." in n and ".mlp.router" not in n}
    if residual == "baseline":
        assert not routers
    else:
        assert {n.split(".")[2] for n in routers if n.startswith("decoder.layers.")} == {"0", "1", "2", "3"}


# Megatron MoE options, each trained in a routed mode (delta with the scalar gate at a = 0 computes the
# baseline's function, so every number must be the baseline's): routing, load balancing, capacity, experts.
MOE_OPTIONS = {
    "aux_loss": ["--moe-router-load-balancing-type", "aux_loss", "--moe-aux-loss-coeff", "0.01"],
    "seq_aux_loss": ["--moe-router-load-balancing-type", "seq_aux_loss", "--moe-aux-loss-coeff", "0.01"],
    "global_aux_loss": ["--moe-router-load-balancing-type", "global_aux_loss", "--moe-aux-loss-coeff", "0.01"],
    "z_loss": ["--moe-router-load-balancing-type", "none", "--moe-z-loss-coeff", "0.001"],
    "top1_capacity_drop": ["--moe-router-topk", "1", "--moe-router-pre-softmax", "--moe-expert-capacity-factor", "1.0",
                           "--moe-token-drop-policy", "probs", "--moe-pad-expert-input-to-capacity",
                           "--moe-aux-loss-coeff", "0.01"],
    "sigmoid_expert_bias_shared": ["--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
                                   "--moe-router-load-balancing-type", "seq_aux_loss", "--moe-aux-loss-coeff",
                                   "0.0001", "--moe-shared-expert-intermediate-size", "32",
                                   "--moe-router-topk-scaling-factor", "2.5"],
    "first_k_dense_fp32_router_allgather": ["--moe-layer-freq", "([0]*1+[1]*3)", "--moe-router-dtype", "fp32",
                                            "--moe-token-dispatcher-type", "allgather",
                                            "--moe-aux-loss-coeff", "0.01"],
}
# The aux-loss tracker's name of each load-balancing loss (what Megatron-LM's iteration line logs).
LOGGED = {"aux_loss": "load_balancing_loss", "seq_aux_loss": "seq_load_balancing_loss",
          "global_aux_loss": "global_load_balancing_loss", "z_loss": "z_loss",
          "top1_capacity_drop": "load_balancing_loss", "sigmoid_expert_bias_shared": "seq_load_balancing_loss",
          "first_k_dense_fp32_router_allgather": "load_balancing_loss"}


def _moe_step(argv, lm_scale):
    """One micro-batch through the trainer's model for `argv`: (per-token losses, the aux-loss tracker's
    per-layer values, each parameter's gradient) after backward of lm_scale x the mean loss."""
    import torch
    from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker, get_moe_layer_wise_logging_tracker

    model = _provider_model(argv)
    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    labels = torch.roll(tokens, -1, dims=1)
    clear_aux_losses_tracker()
    losses = model(tokens, torch.arange(32).expand(2, -1), None, labels=labels)
    (lm_scale * losses.float().mean()).backward()
    tracker = {name: v["values"].clone() for name, v in get_moe_layer_wise_logging_tracker().items()}
    clear_aux_losses_tracker()
    return losses.detach(), tracker, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.usefixtures("distributed_teardown")
@pytest.mark.parametrize("option", list(MOE_OPTIONS))
def test_routed_moe_computes_the_baseline_numbers_with_its_aux_losses(option):
    """delta with the scalar gate at a = 0 (u = x + 0 r: the baseline's function) and an MoE option: the
    per-token losses, the aux losses Megatron logs (its tracker, per layer) and every backbone gradient are the
    baseline's. With the LM loss scaled by 0, the MoE routers' gradients are the aux losses' alone: non-zero
    and the baseline's, so the aux losses reach the backward pass through the routed layers as in baseline."""
    import torch

    argv = tiny(num_layers=4, hidden=HIDDEN, seq=32, mbs=2, train_iters=1) + [
        "--eval-interval", "1", "--num-experts", str(EXPERTS), "--moe-router-topk", "2",
        "--moe-ffn-hidden-size", "32", "--moe-token-dispatcher-type", "alltoall"] + MOE_OPTIONS[option]
    routed = argv + ["--residual", "delta", "--delta-gate", "scalar"]
    base = _moe_step(argv + ["--residual", "baseline"], 1.0)
    got = _moe_step(routed, 1.0)
    assert torch.equal(got[0], base[0])
    assert set(got[1]) == set(base[1]) and LOGGED[option] in got[1], (got[1].keys(), option)
    for name in base[1]:
        assert torch.equal(got[1][name], base[1][name]), name
    assert base[1][LOGGED[option]].count_nonzero() > 0  # the MoE layers' entries (dense layers log 0)
    assert set(base[2]) <= set(got[2])
    for name, g in base[2].items():
        torch.testing.assert_close(got[2][name], g, rtol=0, atol=1e-7, msg=name)
    aux_only_base, aux_only = _moe_step(argv + ["--residual", "baseline"], 0.0)[2], _moe_step(routed, 0.0)[2]
    moe_routers = [n for n in aux_only_base if n.endswith(".mlp.router.weight")]
    assert moe_routers
    for name in moe_routers:
        assert aux_only_base[name].abs().max() > 0, name
        torch.testing.assert_close(aux_only[name], aux_only_base[name], rtol=0, atol=1e-9, msg=name)


def test_grouped_gemm_on_the_local_backend_is_refused_by_name(capsys):
    from megatron_delta.trainer.main import TrainerArgumentError, parse_args

    with pytest.raises(TrainerArgumentError) as e:
        parse_args(tiny(train_iters=1) + ["--residual", "baseline", "--eval-interval", "1", "--num-experts", "4",
                                          "--moe-grouped-gemm"])
    assert str(e.value) == (
        "--moe-grouped-gemm needs --transformer-impl transformer_engine: Megatron-Core's local backend has no "
        "grouped GEMM and would build one MLP per expert (SequentialMLP). Drop --moe-grouped-gemm, or use "
        "Transformer Engine on a GPU")


@pytest.mark.usefixtures("distributed_teardown")
def test_cpu_alltoall_split_sizes_reach_the_collective_as_numpy():
    """moe_splits_to_host: the alltoall dispatcher's split sizes, in the all_to_all_single call upstream's
    all-to-all (tensor_parallel.mappings._AllToAll) makes under expert parallelism."""
    import numpy as np
    import torch
    from megatron.core.transformer.moe import token_dispatcher

    from megatron_delta.platform.distributed import initialize_distributed
    from megatron_delta.platform.patches import patches_suspended

    initialize_distributed()
    tokens, splits = torch.arange(6.0).view(3, 2), torch.tensor([3])

    def exchange():
        host = token_dispatcher.maybe_move_tensor_to_cpu(splits, as_numpy=True)
        out = torch.empty_like(tokens)
        torch.distributed.all_to_all_single(out, tokens, output_split_sizes=host, input_split_sizes=host)
        return host, out

    with patches_suspended("moe_splits_to_host"):
        with pytest.raises(TypeError, match="all_to_all_single"):
            exchange()
    host, out = exchange()
    assert isinstance(host, np.ndarray) and host.tolist() == [3] and torch.equal(out, tokens)
    assert token_dispatcher.maybe_move_tensor_to_cpu(splits) is splits  # without as_numpy: upstream's


@pytest.mark.slow
def test_baseline_moe_with_expert_parallelism_trains_through_pretrain_gpt(tmp_path):
    from tests.test_trainer_cluster import _run, _torchrun

    argv = tiny(num_layers=2, seq=32, mbs=2, gbs=4, train_iters=3) + [
        "--log-interval", "1", "--eval-iters", "0", "--eval-interval", "1000", "--residual", "baseline",
        "--num-experts", "4", "--moe-router-topk", "2", "--moe-token-dispatcher-type", "alltoall",
        "--expert-model-parallel-size", "2", "--moe-aux-loss-coeff", "0.01"]
    job = _run(_torchrun("pretrain_gpt.py", *argv), str(tmp_path / "moe"), timeout=900)
    assert job.proc.returncode == 0, job.tail()
    # Megatron-LM's iteration line: "... | lm loss: X | load_balancing_loss: Y | ..."
    lines = [ln for ln in job.stdout().splitlines() if re.search(r" iteration +\d+/", ln)]
    assert len(lines) == 3, job.tail()
    for ln in lines:
        lm, aux = re.search(r"\| lm loss: (\S+) \|", ln), re.search(r"\| load_balancing_loss: (\S+) \|", ln)
        assert lm and aux, ln
        lm, aux = float(lm.group(1)), float(aux.group(1))
        assert math.isfinite(lm) and math.isfinite(aux) and aux > 0, ln  # dense layers would log 0
