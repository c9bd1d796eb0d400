"""Mixture of experts in every residual mode: Megatron-Core's MoE layers, as Megatron-LM's pretrain_gpt.py builds and
trains them, with the routed layer's MLP sublayer the MoE layer (its output is the sublayer's source).

Fast (one in-process rank): the trainer's parse_args + model provider build Megatron-Core's MoELayer (router weight,
one expert MLP per expert, shared experts) in the layers --moe-layer-freq names and the dense MLP elsewhere, in
baseline and routed layers alike; delta at a = 0 (the baseline's function) gives the baseline's losses, logged aux
losses and gradients for each MoE option (load-balancing losses, z-loss, capacity and token dropping, shared experts
and the shared-expert gate, group-limited sigmoid routing with expert bias, the sqrtsoftplus score, Sinkhorn and
quantile balancing, a forced random router bias, router input jitter, probabilities applied on the experts' input,
forced load balancing, per-layer logging, first-k dense, router dtype fp32 / fp64, the allgather dispatcher,
recompute); --moe-grouped-gemm, which Megatron-Core's local backend has no kernel for, is refused by name; on CPU
the alltoall dispatcher's split sizes reach the all-to-all as upstream's numpy arrays (moe_splits_to_host).
Slow: gloo's uneven all_gather (moe_uneven_gather, 2 ranks); baseline EP2 through pretrain_gpt.py (2 ranks,
Megatron logs the load-balancing loss); one 4-rank launch (moe_launch) for expert parallelism in the routed modes:
EP2, EP2+TP2+SP and EP2+PP2 against EP1, the allgather dispatcher, a checkpoint under EP2+TP2 resumed and
resharded to EP1+TP1, Megatron-LM's Mixtral example flags and docs/usage.md's MoE recipe with delta_block.
"""
from __future__ import annotations

import math
import re

import pytest

from tests.helpers import REPO_ROOT
from tests.helpers.flags import tiny

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
                                   "--moe-router-topk-scaling-factor", "2.5", "--moe-router-num-groups", "2",
                                   "--moe-router-group-topk", "1"],
    "first_k_dense_fp32_router_allgather": ["--moe-layer-freq", "([0]*1+[1]*3)", "--moe-router-dtype", "fp32",
                                            "--moe-token-dispatcher-type", "allgather",
                                            "--moe-aux-loss-coeff", "0.01"],
    # activation recompute: the routed block's full recompute re-runs the MoE layers; MoE-layer recompute
    "full_recompute": ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers",
                       "1", "--moe-aux-loss-coeff", "0.01"],
    "moe_recompute": ["--recompute-granularity", "selective", "--recompute-modules", "moe", "--moe-aux-loss-coeff",
                      "0.01"],
    # router input jitter (random numbers drawn in the same order in both runs), gated shared expert
    "jitter_shared_gate": ["--moe-input-jitter-eps", "0.01", "--moe-shared-expert-intermediate-size", "32",
                           "--moe-shared-expert-gate", "--moe-aux-loss-coeff", "0.01"],
    "sqrtsoftplus_fp64_probs_on_input": ["--moe-router-score-function", "sqrtsoftplus", "--moe-router-dtype", "fp64",
                                         "--moe-router-topk", "1", "--moe-apply-probs-on-input",
                                         "--moe-aux-loss-coeff", "0.01"],
    "forced_balance_per_layer_logging": ["--moe-router-force-load-balancing", "--moe-per-layer-logging",
                                         "--moe-aux-loss-coeff", "0.01"],
    # balancing inside the router (no aux loss: the z-loss gives the routers their aux-only gradient)
    "sinkhorn": ["--moe-router-load-balancing-type", "sinkhorn", "--moe-router-topk", "1", "--moe-z-loss-coeff",
                 "0.001"],
    "quantile_balancing_forced_bias": ["--moe-router-load-balancing-type", "quantile_balancing",
                                       "--moe-router-quantile-balancing-ema", "0.9", "--moe-router-force-biased",
                                       "0.1", "--moe-z-loss-coeff", "0.001"],
}
# The aux-loss tracker's name of each load-balancing loss (what Megatron-LM's iteration line logs).
LOGGED = {"aux_loss": "load_balancing_loss", "seq_aux_loss": "seq_load_balancing_loss",
          "global_aux_loss": "global_load_balancing_loss", "z_loss": "z_loss",
          "top1_capacity_drop": "load_balancing_loss", "sigmoid_expert_bias_shared": "seq_load_balancing_loss",
          "first_k_dense_fp32_router_allgather": "load_balancing_loss", "full_recompute": "load_balancing_loss",
          "moe_recompute": "load_balancing_loss", "jitter_shared_gate": "load_balancing_loss",
          "sqrtsoftplus_fp64_probs_on_input": "load_balancing_loss",
          "forced_balance_per_layer_logging": "load_balancing_loss", "sinkhorn": "z_loss",
          "quantile_balancing_forced_bias": "z_loss"}


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


def uneven_gather() -> dict:
    """(2 ranks, TP2) Megatron's _gather_along_first_dim of 2 and 3 rows, as the alltoall dispatcher calls it under
    TP > 1: the result with moe_uneven_gather, and gloo's error without it."""
    import torch
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import mappings

    from megatron_delta.platform.distributed import initialize_distributed
    from megatron_delta.platform.patches import patches_suspended

    initialize_distributed(tensor_model_parallel_size=2)
    rank, group = torch.distributed.get_rank(), parallel_state.get_tensor_model_parallel_group()
    sizes = [2, 3]
    mine = torch.arange(2.0 * sizes[rank]).view(-1, 2) + 10 * rank
    gathered = mappings._gather_along_first_dim(mine, group, output_split_sizes=sizes)
    error = None
    with patches_suspended("moe_uneven_gather"):
        try:
            mappings._gather_along_first_dim(mine, group, output_split_sizes=sizes)
        except RuntimeError as e:
            error = str(e)
    return {"gathered": gathered.tolist(), "error": error}


@pytest.mark.slow
def test_cpu_gather_of_uneven_splits_pads_for_gloo():
    """moe_uneven_gather: each rank gets every rank's rows in rank order; without it gloo refuses the uneven
    all_gather."""
    from tests.helpers.dist_utils import run_distributed

    want = [[0.0, 1.0], [2.0, 3.0], [10.0, 11.0], [12.0, 13.0], [14.0, 15.0]]
    for r in run_distributed(uneven_gather, 2, timeout=300):
        assert r["gathered"] == want
        assert r["error"] and "ProcessGroupGloo::allgather: invalid tensor size" in r["error"], r["error"]


@pytest.mark.slow
def test_baseline_moe_with_expert_parallelism_trains_through_pretrain_gpt(tmp_path):
    from tests.helpers.trainer_jobs import run_job, torchrun_cmd

    argv = tiny(num_layers=2, seq=32, mbs=2, gbs=4, train_iters=3) + [
        "--log-interval", "1", "--eval-iters", "0", "--eval-interval", "1000", "--residual", "baseline",
        "--num-experts", "4", "--moe-router-topk", "2", "--moe-token-dispatcher-type", "alltoall",
        "--expert-model-parallel-size", "2", "--moe-aux-loss-coeff", "0.01"]
    job = run_job(torchrun_cmd("pretrain_gpt.py", *argv), str(tmp_path / "moe"), timeout=900)
    assert job.proc.returncode == 0, job.tail()
    # Megatron-LM's iteration line: "... | lm loss: X | load_balancing_loss: Y | ..."
    lines = [ln for ln in job.stdout().splitlines() if re.search(r" iteration +\d+/", ln)]
    assert len(lines) == 3, job.tail()
    for ln in lines:
        lm, aux = re.search(r"\| lm loss: (\S+) \|", ln), re.search(r"\| load_balancing_loss: (\S+) \|", ln)
        assert lm and aux, ln
        lm, aux = float(lm.group(1)), float(aux.group(1))
        assert math.isfinite(lm) and math.isfinite(aux) and aux > 0, ln  # dense layers would log 0


# ------------------------------------------------------------------------------------ expert parallelism
# One 4-rank launch (moe_launch): every EP layout trains each routed mode's MoE model (tests/helpers/rank_runner.py's
# `moe` flavour: 4 experts, top-2, alltoall, first layer dense, shared expert, aux and z-losses, fp32 router) from
# the TP1 reference's initial model (EP1, one process; tests/conftest.py), then the allgather dispatcher under
# EP2+TP2+SP, the checkpoint saved under EP2+TP2 at iteration 2 resumed in its layout and under EP1+TP1 (data
# parallel 4), and Megatron-LM's Mixtral flag list and docs/usage.md's MoE recipe with --residual delta_block.
MOE_MODES = ["delta_block", "delta", "attnres"]
MOE_SPECS = [f"{m}/moe" for m in MOE_MODES]
ALLGATHER = "delta_block/moe-allgather"
EP2 = ["--expert-model-parallel-size", "2"]
EP_LAYOUTS = [["ep2", EP2],
              ["ep2_tp2_sp", EP2 + ["--tensor-model-parallel-size", "2", "--sequence-parallel"]],
              ["ep2_pp2", EP2 + ["--pipeline-model-parallel-size", "2"]]]
CKPT_TAG, CKPT_SPEC = "ep2_tp2_sp", "delta_block/moe"
TOL = 1e-5
# Router parameters after Adam steps: Adam's normalised update turns the reduction-order difference of a near-zero
# gradient component into a parameter difference of up to the step size, so they get twice the losses' tolerance
# (measured: 1.02e-5 for attnres's key-norm weight under EP2+TP2+SP on a 2-core x86_64 host).
PARAM_TOL = 2e-5


def mixtral_example_flags(ckpt: str) -> list[str]:
    """Megatron-LM's examples/mixtral/train_mixtral_8x7b_distributed.sh (core_v0.19.0), array by array, scaled to
    the tiny model: 32 -> 4 layers, hidden 4096 -> 64 (FFN 3.5 x hidden, 32 heads / 8 groups -> 4 / 2, positions 8 x
    the sequence), 8 -> 4 experts, GBS 256 -> 8, TP1 x PP4 x EP8 -> TP1 x PP2 x EP2 (4 ranks), 3 iterations, one
    evaluation iteration. Data: mock data and NullTokenizer instead of the Llama-2 tokenizer and DATA_PATH. Dropped:
    --moe-grouped-gemm (Megatron-Core's local backend has no grouped GEMM: refused by name, see
    test_grouped_gemm_on_the_local_backend_is_refused_by_name). The CPU switches added. Nothing else changed."""
    from tests.helpers.flags import CPU

    model_args = ["--use-mcore-models", "--disable-bias-linear", "--seq-length", "32", "--max-position-embeddings",
                  "256", "--num-layers", "4", "--hidden-size", "64", "--ffn-hidden-size", "224",
                  "--num-attention-heads", "4", "--init-method-std", "0.01", "--attention-dropout", "0.0",
                  "--hidden-dropout", "0.0", "--normalization", "RMSNorm", "--position-embedding-type", "rope",
                  "--swiglu", "--untie-embeddings-and-output-weights", "--group-query-attention",
                  "--num-query-groups", "2", "--no-masked-softmax-fusion", "--no-position-embedding",
                  "--rotary-base", "1000000"]
    moe_args = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-router-load-balancing-type", "aux_loss",
                "--moe-aux-loss-coeff", "1e-2", "--moe-token-dispatcher-type", "alltoall", "--overlap-param-gather",
                "--overlap-grad-reduce"]
    data_args = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "256", "--split", "99990,8,2"]
    training_args = ["--micro-batch-size", "1", "--global-batch-size", "8", "--lr", "1e-4", "--train-iters", "3",
                     "--lr-decay-iters", "320000", "--lr-decay-style", "cosine", "--min-lr", "1.0e-5",
                     "--weight-decay", "0.1", "--lr-warmup-iters", "500", "--clip-grad", "1.0", "--bf16"]
    model_parallel_args = ["--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "2",
                           "--expert-model-parallel-size", "2", "--use-distributed-optimizer", "--sequence-parallel"]
    logging_args = ["--log-interval", "1", "--save-interval", "10000", "--eval-interval", "1000", "--eval-iters", "1",
                    "--save", ckpt, "--load", ckpt, "--tensorboard-dir", f"{ckpt}/tensorboard", "--no-load-optim",
                    "--no-load-rng"]
    return model_args + moe_args + data_args + training_args + model_parallel_args + logging_args + CPU


def variant(tag: str, spec: str) -> str:
    """fp32; the checkpointed run also saves at iteration 2 (rank_runner.VARIANTS distopt_ckpt2)."""
    return "distopt_ckpt2" if (tag, spec) == (CKPT_TAG, CKPT_SPEC) else "fp32"


def moe_launch(root: str) -> dict:
    """The rank side of the EP launch (4 ranks): {"layouts": {tag: rank_runner.run_specs' results}, "resumed",
    "resharded": the EP2+TP2 checkpoint's iteration 2 trained on to ITERS in its layout / under EP1+TP1,
    "mixtral": the Mixtral flag list's metrics and (last rank) Megatron-LM's iteration lines}."""
    import contextlib
    import io
    import os

    from tests.helpers import rank_runner

    out = {"layouts": {tag: rank_runner.run_specs(root, tag, flags, [[s, variant(tag, s)] for s in MOE_SPECS],
                                                  collect=["routers"], save=["distopt_ckpt2"])
                       for tag, flags in EP_LAYOUTS}}
    # the allgather dispatcher from the alltoall model's initial weights (the dispatcher is no part of the model)
    out["allgather"] = rank_runner.train(
        rank_runner.spec_flags(ALLGATHER) + dict(EP_LAYOUTS)["ep2_tp2_sp"] + [
            "--train-iters", str(rank_runner.ITERS), "--load", rank_runner.init_dir(root, CKPT_SPEC), "--finetune"],
        os.path.join(root, "moe-allgather.jsonl"))
    ckpt = os.path.join(root, f"ckpt-{CKPT_TAG}-distopt_ckpt2-{CKPT_SPEC.replace('/', '-')}")
    iters = ["--train-iters", str(rank_runner.ITERS), "--load", ckpt, "--ckpt-step", "2"]
    flags = rank_runner.spec_flags(CKPT_SPEC) + rank_runner.VARIANTS["distopt_ckpt2"][:2]
    out["resumed"] = rank_runner.train(flags + dict(EP_LAYOUTS)[CKPT_TAG] + iters,
                                       os.path.join(root, "moe-resumed.jsonl"))
    out["resharded"] = rank_runner.train(flags + iters + ["--no-load-rng"], os.path.join(root, "moe-resharded.jsonl"))
    mixtral = mixtral_example_flags(os.path.join(root, "mixtral")) + ["--residual", "delta_block"]
    recipe = rank_runner.COMMON + usage_moe_recipe() + ["--train-iters", "3", "--log-interval", "1"]
    for name, argv in (("mixtral", mixtral), ("recipe", recipe)):
        log = io.StringIO()
        with contextlib.redirect_stdout(log):
            r = rank_runner.train(argv, os.path.join(root, f"{name}.jsonl"))
        out[name] = {"losses": r["losses"], "iterations": r["iterations"],
                     "log": [ln for ln in log.getvalue().splitlines() if " iteration " in ln]}
    # last (a failed load leaves the run's state behind): the EP1 load without expert_parallel_optimizer_reshard
    from megatron_delta.platform.patches import patches_suspended
    from megatron_delta.trainer import main as trainer

    try:
        with patches_suspended("expert_parallel_optimizer_reshard"):
            out["resharded_unpatched"] = trainer.main(flags + iters + ["--no-load-rng"])
    except KeyError as e:  # Megatron-LM's load_checkpoint raises it on
        out["resharded_unpatched"] = repr(e)
    return out


def usage_moe_recipe() -> list[str]:
    """The pretrain_gpt.py flags of docs/usage.md's MoE recipe (the torchrun command with --num-experts of its
    "Mixture of experts" section), less --save: trained on the tiny model of the launch (its flags win over the
    tiny model's)."""
    import os
    import shlex

    text = open(os.path.join(REPO_ROOT, "docs", "usage.md")).read()
    text = text[text.index("### Mixture of experts"):]
    text = text[:re.search(r"\n#{2,3} ", text[1:]).start() + 1]  # to the next section
    commands = [" ".join(block.replace("\\\n", " ").split()) for block in re.findall(r"```bash\n(.*?)```", text, re.S)]
    (command,) = [c for c in commands if c.startswith("torchrun") and "--num-experts" in c]
    argv = shlex.split(command)
    argv = argv[argv.index("pretrain_gpt.py") + 1:]
    i = argv.index("--save")
    return argv[:i] + argv[i + 2:]


def _max_diff(a, b) -> float:
    """Largest |a - b| over two equal-shaped nests of dicts / lists / numbers (other leaves must be equal)."""
    if isinstance(a, dict):
        assert set(a) == set(b), (set(a), set(b))
        return max([_max_diff(a[k], b[k]) for k in a], default=0.0)
    if isinstance(a, (list, tuple)):
        assert len(a) == len(b), (a, b)
        return max([_max_diff(x, y) for x, y in zip(a, b)], default=0.0)
    if isinstance(a, (int, float)) and not isinstance(a, bool):
        return abs(a - b)
    assert a == b, (a, b)
    return 0.0


@pytest.fixture(scope="module")
def ep_runs(tp1_reference):
    from tests.helpers.dist_utils import run_distributed

    ref = tp1_reference.runs(MOE_SPECS)
    ranks = run_distributed(moe_launch, 4, tp1_reference.root, kwargs={}, timeout=1800)
    return {s: ref[s]["fp32"] for s in ref}, ranks


@pytest.mark.slow
def test_expert_parallel_layouts_give_the_ep1_losses_routers_and_routing(ep_runs):
    """EP2 (DP4), EP2+TP2+SP and EP2+PP2: each routed mode's losses, learning rates, depth-router parameters and
    gradients, and the routing statistics of its final validation equal EP1's within 1e-5; under EP2+PP2 each
    payload a stage received holds exactly the sources the plan sends (x sequence length). The allgather
    dispatcher under EP2+TP2+SP (its collectives on gloo) gives the EP1 alltoall run's losses too."""
    from megatron_delta.core.modes import BLOCK_MODES
    from megatron_delta.core.sources import SourcePlan
    from tests.helpers import rank_runner

    ref, ranks = ep_runs
    for spec in MOE_SPECS:
        losses = ref[spec]["losses"]
        assert losses[-1] < losses[0], (spec, losses)  # it trains
    for tag, _ in EP_LAYOUTS:
        last = ranks[-1]["layouts"][tag]
        for spec in MOE_SPECS:
            got, want = last[spec][variant(tag, spec)], ref[spec]
            assert got["iterations"] == list(range(1, rank_runner.ITERS + 1)), (tag, spec)
            assert _max_diff(got["losses"], want["losses"]) <= TOL, (tag, spec, got["losses"], want["losses"])
            assert got["lr"] == pytest.approx(want["lr"], rel=1e-12), (tag, spec)
            assert got["routing"] and _max_diff(got["routing"], want["routing"]) <= TOL, (tag, spec)
            # every rank holding a layer's routers has the EP1 values (tensor-parallel replicas included); the
            # gradients too, except under the distributed optimizer (its buffer holds reduced values for the
            # rank's shard only)
            for rank in ranks:
                routers = rank["layouts"][tag][spec][variant(tag, spec)]["routers"]
                assert routers["params"], (tag, spec)
                for kind in ("params", "grads") if variant(tag, spec) == "fp32" else ("params",):
                    for name, vals in routers[kind].items():
                        d = _max_diff(vals, want["routers"][kind][name])
                        assert d <= PARAM_TOL, f"{tag} {spec}: router {kind} {name} differs from EP1 by {d}"
        if tag == "ep2_pp2":
            for spec in MOE_SPECS:
                mode = spec.split("/")[0]
                # no gate: the additive modes keep x as their sources, and x does not travel
                plan = SourcePlan(mode=mode, num_layers=4, num_blocks=2 if mode in BLOCK_MODES else 4,
                                  sources="exact", x_from_sources=mode in ("delta", "delta_block"))
                received = [r["layouts"][tag][spec][variant(tag, spec)]["payloads"] for r in ranks]
                # ranks 2 and 3 (the second stage, expert-parallel pair) received layer 3's inputs
                assert received[2:] == [{"2": len(plan.payload_names(2)) * 32}] * 2, (spec, received)
                assert received[:2] == [{}, {}], (spec, received)
    allgather = ranks[-1]["allgather"]
    assert allgather["iterations"] == list(range(1, rank_runner.ITERS + 1))
    assert _max_diff(allgather["losses"], ref[CKPT_SPEC]["losses"]) <= TOL  # delta_block/moe (alltoall), EP1


@pytest.mark.slow
def test_checkpoint_under_ep2_tp2_resumes_exactly_and_reshards_to_ep1_tp1(ep_runs):
    """The EP2+TP2+SP run's checkpoint at iteration 2 (model, distributed optimizer in its fully reshardable format,
    scheduler, data position): resumed in its layout, iterations 3-4 repeat the straight run's losses bitwise;
    loaded under EP1+TP1 (data parallel 4: the experts, the tensor-parallel shards and Adam's moments with them
    resharded; the registry's expert_parallel_optimizer_reshard merges the two chained optimizers' common state),
    within 1e-5."""
    from tests.helpers import rank_runner

    _, ranks = ep_runs
    straight = ranks[-1]["layouts"][CKPT_TAG][CKPT_SPEC]["distopt_ckpt2"]
    split = 2
    for what in ("resumed", "resharded"):
        got = ranks[-1][what]
        assert got["iterations"] == list(range(split + 1, rank_runner.ITERS + 1)), what
        assert got["lr"] == pytest.approx(straight["lr"][split:], rel=1e-12), what
    assert ranks[-1]["resumed"]["losses"] == straight["losses"][split:]
    assert _max_diff(ranks[-1]["resharded"]["losses"], straight["losses"][split:]) <= TOL
    # without the registry's expert_parallel_optimizer_reshard, Megatron-Core hands the EP1 run's one optimizer
    # both chained entries of the EP2 checkpoint
    assert ranks[-1]["resharded_unpatched"] == "KeyError('optimizer')"


@pytest.mark.slow
def test_routing_report_reads_the_ep2_tp2_moe_checkpoint(ep_runs, tp1_reference, tmp_path):
    """tools/routing_report.py on the MoE checkpoint saved under EP2+TP2+SP (run_config.json records the MoE
    flags; the report rebuilds the model as EP1 TP1 PP1): every sublayer's routing row sums to one."""
    import json
    import math
    import os
    import subprocess
    import sys

    ckpt = os.path.join(tp1_reference.root, f"ckpt-{CKPT_TAG}-distopt_ckpt2-{CKPT_SPEC.replace('/', '-')}")
    out = tmp_path / "report"
    p = subprocess.run([sys.executable, os.path.join(REPO_ROOT, "tools", "routing_report.py"), "--load", ckpt,
                        "--output", str(out), "--mock-data", "--num-batches", "1", "--micro-batch-size", "2"],
                       cwd=REPO_ROOT, env=dict(os.environ, PYTHONPATH=REPO_ROOT, OMP_NUM_THREADS="1"),
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    rep = json.load(open(out / "routing.json"))
    assert rep["residual"] == "delta_block"
    st = rep["datasets"]["mock"]
    assert st["order"] == [str(j) for j in range(8)]  # 4 layers (one dense, three MoE) x 2 sublayers
    for key, row in zip(st["order"], st["aligned_matrix"]):
        present = [w for w in row if w is not None]
        assert len(present) == st["receivers"][key]["num_sources"] and math.isclose(sum(present), 1.0, rel_tol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("job, logged", [("mixtral", "load_balancing_loss"), ("recipe", "seq_load_balancing_loss")])
def test_megatron_lm_mixtral_flags_and_the_usage_recipe_train_with_delta_block(ep_runs, job, logged):
    """Megatron-LM's Mixtral example flags (mixtral_example_flags: scaled to tiny, CPU switches, PP2 x EP2 on 4
    ranks, bf16, distributed optimizer with overlapped gradient reduce and parameter gather) + --residual
    delta_block, and docs/usage.md's DeepSeek-V3-style recipe (sigmoid router in groups, expert bias, sequence
    aux loss, shared expert; EP2 x PP2) on the tiny model, train 3 iterations, and Megatron-LM's iteration line
    logs the load-balancing loss."""
    _, ranks = ep_runs
    run = ranks[-1][job]
    assert run["iterations"] == [1, 2, 3]
    assert all(math.isfinite(x) for x in run["losses"]), run
    lines = [ln for ln in run["log"] if re.search(r" iteration +\d+/", ln)]  # not the validation lines
    assert len(lines) == 3, run["log"]
    for ln in lines:
        aux = re.search(rf"\| {logged}: (\S+) \|", ln)
        assert aux and math.isfinite(float(aux.group(1))) and float(aux.group(1)) > 0, ln
