"""megatron_delta.trainer (Megatron-LM's own trainer): what the project adds around pretrain -
the metrics file (--delta-metrics-file), --delta-heldout-data-path, routing statistics at every evaluation, the
pipeline payload lines, run_config.json in every checkpoint (readable by the tools' one-process loader),
the embedded default run and one-line errors after start-up."""
from __future__ import annotations

import json
import math
import os

import pytest

from tests.helpers.dist_utils import run_distributed
from tests.helpers.trainer_driver import rank_embedded, rank_errors, rank_features, rank_load_one_process

TRAIN_KEYS = {"iteration", "lm_loss", "lr", "grad_norm", "tokens_per_sec"}
EVAL_KEYS = {"iteration", "split", "lm_loss", "ppl"}


# ------------------------------------------------------------------------------------------ fast, no launch
def test_embedded_run_is_chosen_by_the_absence_of_data_flags():
    from megatron_delta.trainer.embedded import is_embedded

    assert is_embedded([]) and is_embedded(["--residual", "delta_block", "--num-layers", "8"])
    assert is_embedded(["--delta-heldout-data-path", "x"])
    for flags in (["--mock-data"], ["--data-path", "x"], ["--train-data-path", "x"], ["--data-path=x"],
                  ["--valid-data-path", "v"], ["--help"]):
        assert not is_embedded(flags), flags


def test_embedded_argv_fills_what_is_not_given():
    from megatron_delta.trainer.embedded import EmbeddedRunError, embedded_argv

    argv = embedded_argv(["--residual", "delta_block", "--num-layers", "8", "--train-iters", "40"])

    def value(flag):
        return [argv[i + 1] for i, a in enumerate(argv) if a == flag]

    assert value("--num-layers") == ["8"] and value("--hidden-size") == ["128"] and value("--train-iters") == ["40"]
    assert value("--lr-warmup-iters") == ["2"] and value("--lr-decay-iters") == ["40"]
    assert value("--save") == [os.path.join("runs", "default-delta_block")] and value("--save-interval") == ["40"]
    assert value("--tokenizer-type") == ["SentencePieceTokenizer"] and len(value("--delta-heldout-data-path")) == 1
    for switch in ("--swiglu", "--qk-layernorm", "--disable-bias-linear", "--group-query-attention"):
        assert switch in argv
    with pytest.raises(EmbeddedRunError, match="--vocab-size needs --data-path"):
        embedded_argv(["--vocab-size", "100"])


def test_recorded_config_uses_the_old_flag_names():
    import types

    from megatron_delta.checkpoint.run_config import RECORDED_FLAGS, recorded_config

    args = types.SimpleNamespace(layernorm_epsilon=1e-6, add_bias_linear=False, num_layers=4)
    rc = recorded_config(args)
    assert set(rc) == set(RECORDED_FLAGS)
    assert rc["norm_epsilon"] == 1e-6 and rc["disable_bias_linear"] is True and rc["num_layers"] == 4


def test_run_error_message_is_one_line_and_names_the_right_flag():
    from megatron_delta.trainer.main import run_error_message

    e = RuntimeError("x: not supported for DistributedOptimizer with sharding type dp_reshardable.\n"
                     " Please use `--ckpt-fully-parallel-save` flag during checkpoint saving.")
    msg = run_error_message(e)
    assert "\n" not in msg and "--dist-ckpt-optim-fully-reshardable" in msg and "--ckpt-fully-parallel" not in msg


# ------------------------------------------------------------------------------------------ launches
@pytest.fixture(scope="module")
def features(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("trainer_features"))
    last = run_distributed(rank_features, 2, root, timeout=900)[-1]
    one = run_distributed(rank_load_one_process, 1, os.path.join(root, "tp2", "ckpt"), 4, timeout=300)[0]
    return root, last, one


@pytest.mark.slow
def test_metrics_file_in_the_old_format(features):
    _, r, _ = features
    assert r["tp2"]["code"] == 0, r["tp2"]["out"][-3000:]
    records = r["tp2"]["records"]
    train = [x for x in records if "lm_loss" in x and "split" not in x]
    assert [x["iteration"] for x in train] == [1, 2, 3, 4]
    assert all(set(x) == TRAIN_KEYS and x["tokens_per_sec"] > 0 and math.isfinite(x["lm_loss"]) for x in train)
    evals = [x for x in records if "split" in x]
    assert all(set(x) == EVAL_KEYS and x["ppl"] == pytest.approx(math.exp(x["lm_loss"])) for x in evals)
    # at 2, at 4 (the loop's evaluation) and the final one: valid and heldout each time, no test split
    assert [(x["iteration"], x["split"]) for x in evals] == [(2, "valid"), (2, "heldout"), (4, "valid"),
                                                            (4, "heldout"), (4, "valid"), (4, "heldout")]
    # held-out reads the same first batches every time: same model (iteration 4) -> same loss
    assert evals[3]["lm_loss"] == evals[5]["lm_loss"]
    out = r["tp2"]["out"]
    assert " validation [heldout] at iteration 2 | lm loss" in out
    assert " validation (final) [valid] at iteration 4 | lm loss" in out
    assert " validation (final) [heldout] at iteration 4 | lm loss" in out


@pytest.mark.slow
def test_routing_statistics_at_every_evaluation(features):
    _, r, _ = features
    routing = [x for x in r["tp2"]["records"] if "routing" in x]
    assert [x["iteration"] for x in routing] == [2, 4, 4]
    receivers = routing[-1]["routing"]["receivers"]
    assert len(receivers) == 8  # 4 layers x (attention, MLP)
    for stats in receivers.values():
        assert stats["tokens"] == 4 * 32  # one validation global batch (GBS 4 x seq 32)
        assert sum(stats["mean_weights"]) == pytest.approx(1.0)
    assert "layer   3: attn N=" in r["tp2"]["out"]


@pytest.mark.slow
def test_payload_lines_for_routed_pp2(features):
    _, r, _ = features
    assert r["pp2"]["code"] == 0
    assert len(r["pp2"]["payload"]) == 1 and "pipeline payload into layer 2 (chunk 1)" in r["pp2"]["payload"][0]


@pytest.mark.slow
def test_run_config_in_every_checkpoint_before_the_tracker(features):
    from megatron_delta.checkpoint.run_config import RECORDED_FLAGS

    root, r, _ = features
    ckpt = os.path.join(root, "tp2", "ckpt")
    tracker = os.path.join(ckpt, "latest_checkpointed_iteration.txt")
    assert open(tracker).read().strip() == "4"
    # written before the tracker named iteration 4
    assert os.stat(os.path.join(ckpt, "iter_0000004", "run_config.json")).st_mtime_ns <= os.stat(tracker).st_mtime_ns
    for it, consumed in ((2, 8), (4, 16)):
        rc = json.load(open(os.path.join(ckpt, f"iter_{it:07d}", "run_config.json")))
        assert set(RECORDED_FLAGS) <= set(rc)
        assert rc["iteration"] == it and rc["consumed_samples"] == consumed and rc["has_optimizer"] is True
        assert rc["tensor_model_parallel_size"] == 2 and rc["residual"] == "delta_block"
        assert rc["norm_epsilon"] == 1e-6 and rc["disable_bias_linear"] is True and rc["padded_vocab_size"] == 4096
    # --train-iters 0 --save with the distributed optimizer (DP2): iteration 0, its fresh optimizer saved
    assert r["init_distopt"]["code"] == 0, r["init_distopt"]["err"]
    rc = json.load(open(os.path.join(root, "init-distopt", "iter_0000000", "run_config.json")))
    assert rc["iteration"] == 0 and rc["use_distributed_optimizer"] is True and rc["data_parallel_size"] == 2


@pytest.mark.slow
def test_tools_load_a_tp2_checkpoint_of_the_new_trainer(features):
    """checkpoint/store.py load_checkpoint (model only) into one process, as the tools do: the same held-out loss."""
    _, r, one = features
    heldout = [x for x in r["tp2"]["records"] if x.get("split") == "heldout"]
    assert one["iteration"] == 4
    assert one["heldout_loss"] == pytest.approx(heldout[-1]["lm_loss"], abs=1e-4)


@pytest.mark.slow
def test_errors_after_start_up_are_one_line(tmp_path):
    r = run_distributed(rank_errors, 1, str(tmp_path), timeout=600, torchrun_env=False)[0]
    expected = {"missing_data": ("--data-path", "missing/corpus_text_document"),
                "truncated_idx": ("--data-path", "trunc_text_document.idx"),
                "missing_heldout": ("--delta-heldout-data-path", "missing/corpus_text_document"),
                "missing_tokenizer": ("--tokenizer-model", "nope.model"),
                "other_model": ("--ffn-hidden-size", "checkpoint 192, flags 128"),
                "other_mode": ("--residual", "checkpoint 'delta_block', flags 'attnres'")}
    assert r["save"]["code"] == 0
    for name, words in expected.items():
        v = r[name]
        lines = [line for line in v["err"].splitlines() if line.strip()]
        # a missing held-out set is found by the start-up path checks (exit 2); the rest after start-up (exit 1)
        assert v["code"] == (2 if name == "missing_heldout" else 1), (name, v)
        assert "Traceback" not in v["err"], (name, v["err"])
        assert lines[-1].startswith("pretrain_gpt.py: error: "), (name, lines)
        for w in words:
            assert w in lines[-1], (name, lines[-1])


@pytest.mark.slow
def test_embedded_default_run(tmp_path):
    r = run_distributed(rank_embedded, 1, str(tmp_path), timeout=600, torchrun_env=False)[0]
    assert r["code"] == 0, r["err"]
    # the --save lock file stays (empty) after a clean exit: the next run takes it
    assert r["saved"] == [".megatron-delta.lock", "iter_0000002", "latest_checkpointed_iteration.txt"]
    evals = [(x["iteration"], x["split"]) for x in r["records"] if "split" in x]
    assert evals == [(2, "valid"), (2, "heldout")]
    assert any("routing" in x for x in r["records"])
    assert " validation (final) [valid] at iteration 2" in r["out"] and "layer   3: attn N=" in r["out"]
