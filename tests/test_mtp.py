"""Multi-token prediction (--mtp-num-layers) in baseline mode, as Megatron-LM's pretrain_gpt.py runs it.

Fast (one in-process rank): the model provider builds Megatron's MTP block from the decoder's layer spec
(without it GPTModel splits the decoder output in two for the MTP loss and the cross entropy fails), the
main head is untouched by it, and the trainer's model call hands the loss mask to the MTP loss.
Slow (two one-process launches of pretrain_gpt.py): baseline trains with MTP, Megatron logs `mtp_1 loss`
each iteration, and the iteration-1 lm loss is the one of the same run without MTP.
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
import torch.nn.functional as F

from tests.flags import tiny

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VOCAB, SEQ = 64, 16


def _config(mtp_num_layers):
    from megatron_delta.core.config import DeltaTransformerConfig

    return DeltaTransformerConfig(
        num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=64,
        normalization="RMSNorm", layernorm_epsilon=1e-6, qk_layernorm=True, gated_linear_unit=True,
        activation_func=F.silu, add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0,
        init_method_std=0.02, use_cpu_initialization=True, bias_activation_fusion=False,
        masked_softmax_fusion=False, gradient_accumulation_fusion=False, persist_layer_norm=False,
        apply_rope_fusion=False, bias_dropout_fusion=False, mtp_num_layers=mtp_num_layers)


def _model(mtp_num_layers, seed=1234):
    from megatron_delta.core.model import gpt_model
    from megatron_delta.platform.distributed import initialize_distributed

    initialize_distributed(seed=seed)  # re-seeds: both models start from the same random numbers
    return gpt_model(_config(mtp_num_layers), VOCAB, pre_process=True, post_process=True,
                     max_sequence_length=SEQ, position_embedding_type="rope",
                     share_embeddings_and_output_weights=True)  # Megatron-LM's default (no --untie-...)


def _batch(tokens, loss_mask=None):
    labels = torch.roll(tokens, -1, dims=1)
    return {"tokens": tokens, "labels": labels, "position_ids": torch.arange(SEQ).expand_as(tokens),
            "loss_mask": torch.ones(tokens.shape) if loss_mask is None else loss_mask}


@pytest.fixture(scope="module")
def models(distributed_teardown):
    return _model(None), _model(1)


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
    batch = _batch(torch.randint(0, VOCAB, (2, SEQ)))
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
    for batch in (_batch(tokens, torch.stack([torch.ones(SEQ), torch.zeros(SEQ)])), _batch(tokens[:1])):
        MTPLossLoggingHelper.clean_metrics_in_tracker()
        with torch.no_grad():
            model_output(mtp, batch)
        logged.append(float(MTPLossLoggingHelper.tracker["loss_values"][0]))
    MTPLossLoggingHelper.clean_metrics_in_tracker()
    assert logged[0] > 0 and logged[0] == pytest.approx(logged[1], rel=1e-6, abs=0)


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
