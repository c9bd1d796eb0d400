"""Rank functions for tests/integration/test_trainer_*.py: runs of megatron_delta.trainer.main (Megatron-LM's
trainer) in one launch, one after another in the same process, through tests/helpers/rank_runner.py's runner (train)
and metrics reader.

COMMON is tests/helpers/flags.py's tiny MODEL (4 layers, hidden 64, 4 heads in 2 query groups, seq 32, MBS 2, GBS 8,
NullTokenizer 256 tokens, mock data, the Qwen3-style defaults and the CPU switches) logging every iteration and
without a save interval (the tests give theirs).
"""
from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

from tests.helpers import REPO_ROOT
from tests.helpers.flags import CPU, MODEL, mode_flags  # noqa: E402
from tests.helpers.rank_runner import data_cache, is_last_rank, read_metrics, read_records, train  # noqa: E402,F401

COMMON = MODEL + ["--log-interval", "1"]
LAYOUTS = {
    "tp2": ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
    "pp2": ["--pipeline-model-parallel-size", "2"],
}


def rank_resume(root: str, modes: list[str], layout: list[str], tag: str, iters: int = 20, split_at: int = 10) -> dict:
    """`iters` iterations straight (saving at `split_at`), then `split_at` + save + a resumed run
    (plain --load: iteration, optimizer, scheduler, RNG) to `iters`; dropout on."""
    out = {}
    for mode in modes:
        flags = COMMON + mode_flags(mode) + layout + data_cache(root) + ["--hidden-dropout", "0.1",
                                                                          "--train-iters", str(iters)]
        ckpt = os.path.join(root, f"resume-{tag}-{mode}")
        straight = train(flags + ["--save", ckpt, "--save-interval", str(split_at)],
                         os.path.join(root, f"straight-{tag}-{mode}.jsonl"))
        resumed = train(flags + ["--load", ckpt, "--ckpt-step", str(split_at)],
                        os.path.join(root, f"resumed-{tag}-{mode}.jsonl"))
        out[mode] = {"straight": straight, "resumed": resumed}
    return out


# Megatron-LM's examples/gpt3/train_gpt3_175b_distributed.sh (core_v0.19.0), array by array, scaled to the
# tiny model; data: mock data and NullTokenizer instead of the GPT-2 BPE files; TP8 x PP16 -> TP1 x PP1;
# --fp16 dropped (a GPU loss-scaling path); --step-batch-size-schedule dropped (its billions of tokens
# do not scale to 3 iterations); the CPU switches added. Nothing else changed.
def gpt3_example_flags(ckpt: str, tb: str) -> list[str]:
    gpt_model_args = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
                      "--seq-length", "32", "--max-position-embeddings", "32", "--attention-backend", "auto"]
    training_args = ["--micro-batch-size", "1", "--global-batch-size", "8", "--train-iters", "3",
                     "--weight-decay", "0.1", "--adam-beta1", "0.9", "--adam-beta2", "0.95",
                     "--init-method-std", "0.006", "--clip-grad", "1.0", "--lr", "6.0e-5",
                     "--lr-decay-style", "cosine", "--min-lr", "6.0e-6", "--lr-warmup-fraction", ".001",
                     "--lr-decay-iters", "430000"]
    model_parallel_args = ["--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1"]
    data_args = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "256", "--split", "949,50,1"]
    eval_and_logging_args = ["--log-interval", "1", "--save-interval", "10000", "--eval-interval", "1000",
                             "--save", ckpt, "--load", ckpt, "--eval-iters", "1", "--tensorboard-dir", tb]
    return gpt_model_args + training_args + model_parallel_args + data_args + eval_and_logging_args + CPU


def rank_cli(root: str) -> dict:
    """--help, argument errors, and the GPT-3 example script's flags with --residual delta_block."""
    import contextlib
    import io

    from megatron_delta.trainer.main import main

    out = {}
    buf, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(err):
        out["help_code"] = main(["--help"])
    out["help"] = buf.getvalue()
    out["help_err"] = err.getvalue()[-2000:]
    errors = {}
    for name, argv in {
        "blocks_on_baseline": COMMON + ["--residual", "baseline", "--delta-num-blocks", "2", "--train-iters", "1"],
        "blocks_not_dividing": COMMON + ["--residual", "delta_block", "--delta-num-blocks", "3", "--train-iters", "1"],
        "gate_on_replacement": COMMON + ["--residual", "attnres", "--delta-gate", "scalar", "--train-iters", "1"],
        "bad_mode": COMMON + ["--residual", "nope", "--train-iters", "1"],
        "save_without_interval": COMMON + ["--train-iters", "1", "--save", os.path.join(root, "x")],
    }.items():
        err = io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            code = main(argv)
        errors[name] = {"code": code, "stderr": err.getvalue()}
    out["errors"] = errors
    out["gpt3"] = train(gpt3_example_flags(os.path.join(root, "gpt3-ckpt"), os.path.join(root, "tb")) +
                        ["--residual", "delta_block"], os.path.join(root, "gpt3.jsonl"))
    out["gpt3_saved"] = sorted(os.listdir(os.path.join(root, "gpt3-ckpt")))
    return out


# ------------------------------------------------------------------------------ trainer features
# The bundled corpus (SentencePiece BPE 4096): real text for --valid-data-path / --delta-heldout-data-path.
def bundled_data() -> dict:
    from megatron_delta.data.corpus import ensure_default_data

    return ensure_default_data(os.path.join(REPO_ROOT, "runs", "cache"))


def bundled_flags(heldout: bool = True) -> list[str]:
    p = bundled_data()
    flags = ["--train-data-path", *p["train_data_path"], "--valid-data-path", p["sotu_valid_data_path"],
             "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", p["tokenizer_model"]]
    return flags + (["--delta-heldout-data-path", p["heldout_data_path"]] if heldout else [])


def _no_data(argv: list[str]) -> list[str]:
    """COMMON without its data/tokenizer flags."""
    out, skip = [], 0
    for i, a in enumerate(argv):
        if skip:
            skip -= 1
            continue
        if a == "--mock-data":
            continue
        if a in ("--tokenizer-type", "--vocab-size"):
            skip = 1
            continue
        out.append(a)
    return out


NO_DATA = _no_data(COMMON)


def captured_main(argv: list[str]) -> dict:
    """main(argv) with stdout/stderr captured: {"code", "out", "err"}."""
    import contextlib
    import io

    from megatron_delta.trainer.main import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    return {"code": code, "out": out.getvalue(), "err": err.getvalue()}


def rank_features(root: str) -> dict:
    """2 ranks, one launch: TP2 + SP delta_block on the bundled corpus (metrics, held-out set, routing at every
    evaluation, run_config.json), PP2 delta_block (payload lines), DP2 --use-distributed-optimizer
    `--train-iters 0 --save` (the fresh optimizer's save, run_config.json at iteration 0)."""
    out = {}
    tp2 = os.path.join(root, "tp2")
    r = captured_main(NO_DATA + mode_flags("delta_block") + bundled_flags() + LAYOUTS["tp2"] + [
        "--train-iters", "4", "--eval-interval", "2", "--micro-batch-size", "2", "--global-batch-size", "4",
        "--delta-metrics-file", os.path.join(tp2, "metrics.jsonl"), "--save", os.path.join(tp2, "ckpt"),
        "--save-interval", "2"])
    out["tp2"] = {"code": r["code"], "out": r["out"][-20000:],
                  "records": read_records(os.path.join(tp2, "metrics.jsonl"))}
    pp2 = os.path.join(root, "pp2")
    r = captured_main(COMMON + mode_flags("delta_block") + LAYOUTS["pp2"] + [
        "--train-iters", "1", "--delta-metrics-file", os.path.join(pp2, "metrics.jsonl")])
    out["pp2"] = {"code": r["code"], "payload": [line for line in r["out"].splitlines() if "pipeline payload" in line]}
    init = os.path.join(root, "init-distopt")
    r = captured_main(COMMON + mode_flags("full_attnres") + ["--use-distributed-optimizer", "--train-iters", "0",
                                                             "--save", init, "--save-interval", "1000"])
    out["init_distopt"] = {"code": r["code"], "err": r["err"][-3000:]}
    return out


def rank_load_one_process(ckpt_root: str, eval_samples: int) -> dict:
    """The tools' path (megatron_delta.evaluation.loaders.load_megatron -> checkpoint/store.py load_checkpoint, model
    only) on a checkpoint written by the new trainer: its held-out loss over the first `eval_samples` samples."""
    import torch

    from megatron_delta.checkpoint.run_config import read_run_config, resolve_checkpoint_dir
    from megatron_delta.data.datasets import build_gpt_datasets
    from megatron_delta.data.tokenizers import build_tokenizer
    from megatron_delta.evaluation.loaders import load_megatron, megatron_logits

    ckpt, iteration = resolve_checkpoint_dir(ckpt_root)
    rc = read_run_config(ckpt)
    model, args, _ = load_megatron(ckpt_root)
    tokenizer = build_tokenizer(rc["tokenizer_type"], rc["tokenizer_model"], rc["vocab_size"])
    ds, _, _ = build_gpt_datasets([bundled_data()["heldout_data_path"]], "100,0,0", rc["seq_length"], rc["seed"],
                                  (eval_samples, 0, 0), tokenizer)
    total, count = 0.0, 0.0
    for i in range(eval_samples):
        s = ds[i]
        logits = megatron_logits(model, torch.as_tensor(s["tokens"]).unsqueeze(0))[0]
        nll = torch.nn.functional.cross_entropy(logits, torch.as_tensor(s["labels"]), reduction="none")
        mask = torch.as_tensor(s["loss_mask"]).float()
        total += float((nll * mask).sum())
        count += float(mask.sum())
    from megatron_delta.platform.distributed import destroy_distributed

    destroy_distributed()
    return {"iteration": iteration, "heldout_loss": total / count, "run_config": rc}


def rank_errors(root: str) -> dict:
    """Data / tokenizer / checkpoint errors after start-up: one line, exit code 1 (one process)."""
    import shutil

    p = bundled_data()
    out = {}
    tiny = NO_DATA + ["--train-iters", "1"]
    null_tok = ["--tokenizer-type", "NullTokenizer", "--vocab-size", "4096"]
    missing = os.path.join(root, "missing", "corpus_text_document")
    out["missing_data"] = captured_main(tiny + null_tok + ["--data-path", missing])
    trunc = os.path.join(root, "trunc_text_document")
    src = p["sotu_valid_data_path"]
    shutil.copyfile(src + ".bin", trunc + ".bin")
    with open(src + ".idx", "rb") as f:
        data = f.read()
    with open(trunc + ".idx", "wb") as f:
        f.write(data[: len(data) // 2])
    out["truncated_idx"] = captured_main(tiny + null_tok + ["--data-path", trunc])
    out["missing_heldout"] = captured_main(tiny + bundled_flags(heldout=False) + ["--delta-heldout-data-path", missing])
    flags = bundled_flags()
    i = flags.index("--tokenizer-model")
    flags[i + 1] = os.path.join(root, "nope.model")
    out["missing_tokenizer"] = captured_main(tiny + flags)
    ckpt = os.path.join(root, "ckpt")
    out["save"] = captured_main(COMMON + mode_flags("delta_block") + ["--train-iters", "0", "--save", ckpt,
                                                                      "--save-interval", "1000"])
    out["other_model"] = captured_main(COMMON + mode_flags("delta_block") + [
        "--train-iters", "1", "--load", ckpt, "--ffn-hidden-size", "128"])
    out["other_mode"] = captured_main(COMMON + mode_flags("attnres") + ["--train-iters", "1", "--load", ckpt])
    for v in out.values():
        v["out"] = v["out"][-3000:]
        v["err"] = v["err"][-3000:]
    return out


def rank_embedded(root: str) -> dict:
    """main(["--residual", "delta_block", ...]) without data flags: the embedded default run, shortened."""
    from megatron_delta.trainer.embedded import embedded_argv

    argv = ["--residual", "delta_block", "--train-iters", "2", "--eval-iters", "1", "--save", os.path.join(root, "emb"),
            "--delta-metrics-file", os.path.join(root, "emb.jsonl")]
    full = embedded_argv(argv)
    r = captured_main(argv)
    return {"argv": full, "code": r["code"], "out": r["out"][-20000:], "err": r["err"][-3000:],
            "records": read_records(os.path.join(root, "emb.jsonl")),
            "saved": sorted(os.listdir(os.path.join(root, "emb")))}


# ------------------------------------------------------------------- resharding with optimizer state
RESHARD_FLAGS = ["--use-distributed-optimizer", "--dist-ckpt-optim-fully-reshardable", "--hidden-dropout", "0"]


def rank_reshard(root: str, modes: list[str], layout: list[str], tag: str, straight: bool = True,
                 resume_from: str | None = None, iters: int = 12, split_at: int = 6) -> dict:
    """Under `layout` with the distributed optimizer, per mode: (straight) `iters` iterations saving (fully
    reshardable) ROOT/reshard-TAG-MODE at `split_at`; (resume_from) RESUME_FROM's iteration-`split_at`
    checkpoint (model, optimizer, scheduler) resumed to `iters`. {"straight"|"resumed": {mode: metrics}}."""
    out = {"straight": {}, "resumed": {}}
    for mode in modes:
        flags = COMMON + mode_flags(mode) + layout + RESHARD_FLAGS + data_cache(root) + ["--train-iters", str(iters)]
        if straight:
            out["straight"][mode] = train(flags + ["--save", os.path.join(root, f"reshard-{tag}-{mode}"),
                                                   "--save-interval", str(split_at)],
                                          os.path.join(root, f"reshard-straight-{tag}-{mode}.jsonl"))
        if resume_from:
            out["resumed"][mode] = train(flags + ["--load", os.path.join(root, f"reshard-{resume_from}-{mode}"),
                                                  "--ckpt-step", str(split_at), "--no-load-rng"],
                                         os.path.join(root, f"reshard-resumed-{resume_from}-in-{tag}-{mode}.jsonl"))
    return out
