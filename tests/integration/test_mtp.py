"""Multi-token prediction (--mtp-num-layers): baseline as Megatron-LM's pretrain_gpt.py runs it, and every routed
mode as docs/design.md section 1.7 defines it.

Fast (one in-process rank): the model provider builds Megatron's MTP block from the decoder's layer spec
(without it GPTModel splits the decoder output in two for the MTP loss and the cross entropy fails), the
main head is untouched by it, and the trainer's model call hands the loss mask to the MTP loss. Every mode
with two MTP depths against the float64 reference (tests/helpers/reference_delta.py): the main and each depth's
logits, and every router's gradient. The refusal of full recompute with routed MTP depths.
Slow (two one-process launches of pretrain_gpt.py): baseline trains with MTP, Megatron logs `mtp_1 loss`
each iteration, and the iteration-1 lm loss is the one of the same run without MTP. One PP2 launch (MTP on
the last stage) gives the TP1 losses of attnres and delta_block with MTP.
"""
from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys

import pytest
import torch

from tests.helpers import REPO_ROOT as REPO
from tests.helpers.flags import tiny
from tests.helpers.mtp_models import DEPTHS, SEQ, VOCAB, mtp_batch, mtp_config, mtp_model, routed_mtp_model


@pytest.fixture(scope="module")
def models(distributed_teardown):
    return mtp_model(None), mtp_model(1)


def test_baseline_builds_megatron_mtp_block_from_the_decoder_layer_spec(models):
    from megatron.core.transformer.multi_token_prediction import MultiTokenPredictionLayer

    from megatron_delta.core.norms import LocalNorm

    plain, mtp = models
    assert getattr(plain, "mtp", None) is None
    assert len(mtp.mtp.layers) == 1 and isinstance(mtp.mtp.layers[0], MultiTokenPredictionLayer)
    layer = mtp.mtp.layers[0]
    assert all(type(m) is LocalNorm for m in (layer.enorm, layer.hnorm, layer.final_layernorm))
    inner, decoder_layer = layer.mtp_model_layer, mtp.decoder.layers[-1]
    assert ([(n, type(m)) for n, m in inner.named_modules()]
            == [(n, type(m)) for n, m in decoder_layer.named_modules()])


def test_main_head_loss_is_the_one_without_mtp(models):
    plain, mtp = models
    torch.manual_seed(0)
    batch = mtp_batch(torch.randint(0, VOCAB, (2, SEQ)))
    from megatron_delta.trainer.provider import model_output

    plain.train(), mtp.train()
    expected = model_output(plain, batch)
    got = model_output(mtp, batch)  # failed here: IndexError in vocab_parallel_cross_entropy
    assert got.shape == (2, SEQ)
    assert torch.equal(got, expected)
    got.sum().backward()  # the MTP loss reaches the MTP block's weights through MTPLossAutoScaler
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in mtp.mtp.parameters())


def test_mtp_loss_reads_the_loss_mask(models):
    """A micro-batch [A, B] with B masked out logs A's MTP loss alone (the model call passes the mask)."""
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    from megatron_delta.trainer.provider import model_output

    _, mtp = models
    mtp.train()
    torch.manual_seed(1)
    tokens = torch.randint(0, VOCAB, (2, SEQ))
    logged = []
    for batch in (mtp_batch(tokens, torch.stack([torch.ones(SEQ), torch.zeros(SEQ)])), mtp_batch(tokens[:1])):
        MTPLossLoggingHelper.clean_metrics_in_tracker()
        with torch.no_grad():
            model_output(mtp, batch)
        logged.append(float(MTPLossLoggingHelper.tracker["loss_values"][0]))
    MTPLossLoggingHelper.clean_metrics_in_tracker()
    assert logged[0] > 0 and logged[0] == pytest.approx(logged[1], rel=1e-6, abs=0)


# ------------------------------------------------------------------------------- the routed modes
REF_VARIANTS = [("baseline", False), ("delta", False), ("delta_block", False), ("attnres", False),
                ("attnres", True), ("full_attnres", False)]
def _rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.mark.parametrize("mode,null", REF_VARIANTS, ids=[m + ("-null" if n else "") for m, n in REF_VARIANTS])
def test_mtp_depths_match_the_float64_reference(models, mode, null):
    """Main logits, each depth's logits (its hidden state through the shared output layer) and the gradient of
    every router (decoder and MTP depths) of sum(W * depth logits) against tests/helpers/reference_delta.py."""
    from tests.helpers.reference_compare import randomise
    from tests.helpers.reference_delta import RefConfig, reference_forward, weights_from_megatron_state_dict

    model = routed_mtp_model(mode, null)
    randomise(model)  # random routers (every source's weight matters), perturbed norm weights
    model.eval()
    routers = {n: p for n, p in model.named_parameters() if n.rsplit(".", 1)[-1] in ("query", "key_norm_weight",
                                                                                      "null_source")}
    if mode in ("attnres", "full_attnres"):  # each depth: two sublayer routers and a final router
        assert sum(n.startswith("mtp.layers.") and n.endswith(".query") for n in routers) == 3 * DEPTHS
    else:  # baseline's and the additive modes' depths are Megatron's residual layers
        assert not any(n.startswith("mtp.") for n in routers)
    tok = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(0))
    captured = []
    handle = model.mtp.register_forward_hook(lambda mod, args, out: captured.append(out))
    try:
        logits = model(tok, torch.arange(SEQ).expand_as(tok), None)
    finally:
        handle.remove()
    hidden = torch.chunk(captured[0], 1 + DEPTHS, dim=0)[1:]
    weight = model.shared_embedding_or_output_weight()
    depth_logits = [model.output_layer(h, weight=weight)[0].transpose(0, 1) for h in hidden]
    W = [torch.randn(2, SEQ, VOCAB, generator=torch.Generator().manual_seed(3 + k)) for k in range(DEPTHS)]
    sum((w * lg).sum() for w, lg in zip(W, depth_logits)).backward()

    cfg = RefConfig(vocab_size=VOCAB, hidden_size=32, num_layers=4, num_attention_heads=4, num_query_groups=2,
                    ffn_hidden_size=64, norm_eps=1e-6, share_embeddings_and_output_weights=True)
    ref_w = {k: v.requires_grad_(k in routers) for k, v in weights_from_megatron_state_dict(model.state_dict()).items()}
    ref_logits, ref_depths = reference_forward(ref_w, cfg, tok, mode, num_blocks=2 if "block" in mode or mode ==
                                               "attnres" else None, null_source=null, eps=1e-6,
                                               mtp_num_layers=DEPTHS)
    assert _rel(logits.double(), ref_logits) < 1e-5
    for got, want in zip(depth_logits, ref_depths):
        assert _rel(got.double(), want) < 1e-5
    if not routers:
        return
    sum((w.double() * lg).sum() for w, lg in zip(W, ref_depths)).backward()
    for name, p in routers.items():
        want = ref_w[name].grad
        assert p.grad is not None and want is not None, name
        # (a router that reads one source, h0 at layer 0, has a zero gradient in both)
        assert (p.grad.double() - want).abs().max().item() <= 1e-4 * want.abs().max().item() + 1e-12, name


def test_additive_modes_mtp_layer_is_megatrons_own():
    """The additive modes' MTP depths are the residual layer baseline builds, also from a routed layer spec (or a
    block spec of them, as the MoE block spec of a routed mode is): same submodules, Megatron's bias-dropout-add."""
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
    from megatron.core.transformer.transformer_layer import TransformerLayer

    from megatron_delta.core.mtp import megatron_layer_of
    from megatron_delta.core.specs import get_gpt_layer_local_spec_sp, get_gpt_layer_with_delta_spec

    plain, routed = get_gpt_layer_local_spec_sp(), get_gpt_layer_with_delta_spec()
    for spec in (routed, TransformerBlockSubmodules(layer_specs=[plain, routed])):
        got = megatron_layer_of(spec)
        assert got.module is TransformerLayer and repr(got.submodules) == repr(plain.submodules)  # (partials: by value)
    assert megatron_layer_of(plain) is plain


def test_routed_mtp_refuses_full_recompute():
    with pytest.raises(ValueError) as e:
        mtp_config(1, num_layers=4, residual="attnres", delta_num_blocks=2, recompute_granularity="full",
                recompute_method="uniform", recompute_num_layers=1)
    assert str(e.value) == (
        "--recompute-granularity full cannot be used with --mtp-num-layers and --residual attnres: each MTP depth "
        "reads the decoder's sources, which Megatron's MTP recompute does not take as inputs. Use "
        "--recompute-granularity selective, or no recompute")
    # the additive modes' depths are Megatron's own layers, which recompute as upstream
    mtp_config(1, num_layers=4, residual="delta", recompute_granularity="full", recompute_method="uniform",
            recompute_num_layers=1)


def test_trainer_refuses_routed_mtp_with_full_recompute_before_startup(monkeypatch, capsys):
    from megatron_delta.trainer import main as trainer_main

    def started(args):
        raise AssertionError("the run started: the flags were not refused at start-up")

    monkeypatch.setattr(trainer_main, "run", started)
    rc = trainer_main.main(tiny(num_layers=2, hidden=32, heads=2, groups=2, seq=16, mbs=2, train_iters=1) + [
        "--residual", "full_attnres", "--mtp-num-layers", "1", "--recompute-granularity", "full",
        "--recompute-method", "uniform", "--recompute-num-layers", "1"])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err, err
    assert err.strip().splitlines()[-1] == (
        "pretrain_gpt.py: error: --recompute-granularity full cannot be used with --mtp-num-layers and --residual "
        "full_attnres: each MTP depth reads the decoder's sources, which Megatron's MTP recompute does not take as "
        "inputs. Use --recompute-granularity selective, or no recompute")


@pytest.mark.parametrize("flag, why", [
    ("--mtp-use-repeated-layer", "each depth has its own routers over the decoder's sources; one layer shared by "
     "every depth is not built or tested for them"),
    ("--mtp-detach-heads", "it detaches the depths' hidden-state input only, while the routed depths also read the "
     "decoder's sources, so the MTP loss would still train the decoder"),
    ("--mtp-standalone", "it puts the MTP block on a pipeline stage of its own, while the routed depths read the "
     "decoder's sources, which stay on the stage of the decoder's last layer")])
def test_trainer_refuses_routed_mtp_options_it_does_not_build(monkeypatch, capsys, flag, why):
    """Megatron's MTP options the replacement modes' routed depths do not implement: one line at start-up; the
    additive modes (Megatron's own MTP layer) and baseline keep them."""
    from megatron_delta.trainer import main as trainer_main

    started = []
    monkeypatch.setattr(trainer_main, "run", lambda args: started.append(args))
    base = tiny(num_layers=2, hidden=32, heads=2, groups=2, seq=16, mbs=2, train_iters=1) + [
        "--mtp-num-layers", "2", flag, "--eval-interval", "10", "--eval-iters", "0"]
    rc = trainer_main.main(base + ["--residual", "full_attnres"])
    err = capsys.readouterr().err
    assert rc == 2 and not started and "Traceback" not in err, err
    assert err.strip().splitlines()[-1] == (
        f"pretrain_gpt.py: error: {flag} cannot be used with --mtp-num-layers and --residual full_attnres: {why}. "
        f"Drop {flag}")
    assert trainer_main.main(base + ["--residual", "delta"]) == 0 and len(started) == 1, capsys.readouterr().err


@pytest.mark.parametrize("residual", ["baseline", "attnres"])
def test_trainer_refuses_tied_mtp_checkpoints_under_pp_before_startup(monkeypatch, capsys, tmp_path, residual):
    """megatron-core 0.19.2 cannot save or load a tied model's MTP stage under PP > 1 (NVIDIA/Megatron-LM PR
    #7577): refused at start-up, naming the flag that works; with it the check passes."""
    from megatron_delta.trainer import main as trainer_main

    started = []
    monkeypatch.setattr(trainer_main, "run", lambda args: started.append(args))
    argv = tiny(num_layers=2, hidden=32, heads=2, groups=2, seq=16, mbs=2, train_iters=1) + [
        "--residual", residual, "--mtp-num-layers", "1", "--pipeline-model-parallel-size", "2",
        "--save", str(tmp_path / "ckpt"), "--save-interval", "1", "--eval-interval", "10", "--eval-iters", "0"]
    rc = trainer_main.main(argv)
    err = capsys.readouterr().err
    assert rc == 2 and not started and "Traceback" not in err, err
    assert err.strip().splitlines()[-1] == (
        "pretrain_gpt.py: error: --mtp-num-layers with --pipeline-model-parallel-size > 1 cannot save or load a "
        "checkpoint with tied embeddings in megatron-core 0.19.2 (NVIDIA/Megatron-LM PR #7577); add "
        "--untie-embeddings-and-output-weights")
    rc = trainer_main.main(argv + ["--untie-embeddings-and-output-weights"])
    err = capsys.readouterr().err
    # past this check, Megatron-LM's own validation of the one-process world is the next to speak
    assert rc == 2 and "#7577" not in err and "world size (1) is not divisible" in err, err


# ------------------------------------------------------------------------------- through pretrain_gpt.py
def _train(tmp_path, name, extra):
    metrics = str(tmp_path / f"{name}.jsonl")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO)
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        env.pop(k, None)
    argv = tiny(num_layers=2, seq=32, mbs=2, train_iters=3) + [
        "--log-interval", "1", "--eval-iters", "0", "--eval-interval", "1000", "--residual", "baseline",
        "--delta-metrics-file", metrics] + extra
    p = subprocess.run([sys.executable, "pretrain_gpt.py"] + argv, cwd=REPO, env=env, capture_output=True,
                       text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    records = [json.loads(line) for line in open(metrics)]
    return p.stdout, {r["iteration"]: r["lm_loss"] for r in records if "split" not in r and "lm_loss" in r}


@pytest.mark.slow
def test_baseline_mtp_trains_through_pretrain_gpt(tmp_path):
    out, with_mtp = _train(tmp_path, "mtp", ["--mtp-num-layers", "1"])
    _, without = _train(tmp_path, "plain", [])
    # Megatron-LM's log line: "... | lm loss: X | mtp_1 loss: Y | ..." at every iteration.
    mtp_losses = [float(x) for x in re.findall(r"\| mtp_1 loss: (\S+) \|", out)]
    assert len(mtp_losses) == 3 and all(math.isfinite(x) and x > 0 for x in mtp_losses), out[-3000:]
    assert sorted(with_mtp) == [1, 2, 3]
    # Before any update the main head sees the same weights and data: MTP adds only its own loss.
    assert with_mtp[1] == without[1], (with_mtp, without)
    assert with_mtp[3] != without[3]  # the MTP loss's gradients reach the shared weights


MTP_SPECS = ["attnres/mtp", "delta_block/mtp"]  # a replacement and an additive mode (the fast test has all)


@pytest.mark.slow
def test_pp2_with_mtp_on_the_last_stage_gives_the_tp1_losses(tp1_reference):
    """The MTP block is on the last stage, which receives the decoder's sources in the stage payload: its
    depths read them (replacement modes) or the final hidden state (additive), and the MTP loss's gradients
    reach both stages. ITERS iterations from the same initial model give TP1's losses within 1e-5."""
    from tests.helpers import rank_runner
    from tests.helpers.dist_utils import run_distributed

    ref = tp1_reference.runs(MTP_SPECS)
    got = run_distributed(rank_runner.run_specs, 2, tp1_reference.root, "pp2", ["--pipeline-model-parallel-size", "2"],
                          [[s, "fp32"] for s in MTP_SPECS], timeout=1500)[-1]
    for spec in MTP_SPECS:
        want, have = ref[spec]["fp32"]["losses"], got[spec]["fp32"]["losses"]
        assert want[-1] < want[0], (spec, want)  # it trains
        assert len(have) == len(want) and max(abs(a - b) for a, b in zip(have, want)) <= 1e-5, (spec, have, want)
