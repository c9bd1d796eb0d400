"""Bad input to pretrain_gpt.py: a non-zero exit and one line naming the flag or file, no traceback.

Argument errors go through pretrain_gpt.py's main (megatron_delta.trainer.main) in-process (cheap: they
fail before the distributed start-up); errors found after it (data, tokenizer, kernels) run
pretrain_gpt.py as a subprocess. Flags are Megatron-LM's (tests/flags.py).
"""
import os
import subprocess
import sys

import pytest

from megatron_delta.trainer.main import main
from tests.flags import tiny

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = tiny(num_layers=2, hidden=32, heads=2, groups=2, seq=16, mbs=2, mock=False, train_iters=1) + [
    "--eval-iters", "1", "--eval-interval", "1000", "--save-interval", "1000"]
MOCK = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "256"]


def _no_traceback(err: str):
    assert "Traceback" not in err, err
    assert "pretrain_gpt.py: error:" in err, err


@pytest.mark.parametrize("argv, world, needle", [
    (["--seq-length", "64", "--max-position-embeddings", "32"], 1,
     "max_position_embeddings (32) must be greater than or equal to seq_length (64)"),
    (["--num-layers", "6", "--residual", "delta_block", "--delta-num-blocks", "4"], 1,
     "--delta-num-blocks 4 must be a positive divisor of --num-layers 6"),
    (["--residual", "attnres", "--delta-gate", "scalar"], 1, "--delta-gate scalar only applies to the additive"),
    (["--residual", "full_attnres", "--delta-gate", "scalar"], 1, "--delta-gate scalar only applies to the additive"),
    (["--delta-router-kernels", "torch"], 1, "--delta-router-kernels needs a routed residual mode"),
    (["--residual", "delta", "--delta-num-blocks", "2"], 1, "--delta-num-blocks applies to --residual delta_block"),
    (["--delta-router-lr-mult", "2"], 1, "--delta-router-lr-mult needs a routed residual mode"),
    (["--residual", "attnres", "--delta-sources", "authors-code"], 1, "--delta-sources authors-code is defined for"),
    (["--delta-null-source"], 1, "--delta-null-source needs a routed residual mode"),
    (["--tensor-model-parallel-size", "2", "--num-query-groups", "1"], 2,
     "--tensor-model-parallel-size 2 must divide --num-query-groups (1): tensor parallelism splits it"),
    (["--tensor-model-parallel-size", "2", "--ffn-hidden-size", "33"], 2,
     "--tensor-model-parallel-size 2 must divide --ffn-hidden-size (33)"),
])
def test_argument_errors(argv, world, needle, monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", str(world))
    rc = main(TINY + MOCK + argv)
    err = capsys.readouterr().err
    assert rc == 2, err
    _no_traceback(err)
    assert needle in err, err
    assert err.strip().splitlines()[-1].startswith("pretrain_gpt.py: error: "), err


def test_train_iters_without_eval_interval(capsys):
    """megatron.training sizes the validation set from --eval-interval and fails with a TypeError without it."""
    argv = [a for a in TINY]
    i = argv.index("--eval-interval")
    del argv[i:i + 2]
    rc = main(argv + MOCK)
    err = capsys.readouterr().err
    assert rc == 2, err
    _no_traceback(err)
    assert "--eval-interval is needed with --train-iters" in err, err


def test_cpu_without_the_cpu_switches(capsys):
    """A Megatron-LM job script as written for GPUs, run without CUDA: one line listing the switches."""
    i = TINY.index("--transformer-impl")  # tests.flags.tiny: the CPU switches come last
    rc = main(TINY[:i] + MOCK + ["--no-rope-fusion"])
    err = capsys.readouterr().err
    assert rc == 2, err
    _no_traceback(err)
    line = err.strip().splitlines()[-1]
    assert line.startswith("pretrain_gpt.py: error: no CUDA device: Megatron-LM's GPU defaults need "
                           "--transformer-impl local --distributed-backend gloo --no-gradient-accumulation-fusion"), line
    assert "--no-rope-fusion on CPU" not in line and "--use-cpu-initialization" in line, line


def _run(argv, tmp_path, **extra_env):
    rc, _, err = _run_full(argv, tmp_path, **extra_env)
    return rc, err


def _run_full(argv, tmp_path, **extra_env):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO, **extra_env)
    malloc = [k for k in env if k.startswith("MALLOC_")]  # a user's malloc choice would switch the allocator line
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", *malloc):
        env.pop(k, None)
    p = subprocess.run([sys.executable, os.path.join(REPO, "pretrain_gpt.py")] + TINY + argv,
                       cwd=str(tmp_path), env=env, capture_output=True, text=True, timeout=300)
    return p.returncode, p.stdout, p.stderr


def test_missing_data_path(tmp_path):
    rc, err = _run(["--data-path", str(tmp_path / "nope"), "--tokenizer-type", "NullTokenizer",
                    "--vocab-size", "256"], tmp_path)
    assert rc != 0
    _no_traceback(err)
    assert "--data-path" in err and "nope" in err and "not found" in err, err


def test_corrupted_idx(tmp_path):
    prefix = tmp_path / "corpus_text_document"
    (tmp_path / "corpus_text_document.bin").write_bytes(b"\0" * 64)
    (tmp_path / "corpus_text_document.idx").write_bytes(b"this is not an index")
    rc, err = _run(["--data-path", str(prefix), "--tokenizer-type", "NullTokenizer", "--vocab-size", "256"],
                   tmp_path)
    assert rc != 0
    _no_traceback(err)
    assert "corpus_text_document.idx" in err and "corrupted" in err, err


def test_unknown_tokenizer_file(tmp_path):
    rc, err = _run(["--data-path", str(tmp_path / "x"), "--tokenizer-type", "SentencePieceTokenizer",
                    "--tokenizer-model", str(tmp_path / "tok.model")],
                   tmp_path)
    assert rc != 0
    _no_traceback(err)
    assert "--tokenizer-model" in err and "tok.model" in err, err


@pytest.mark.parametrize("argv, needle", [
    (["--tokenizer-type", "NullTokenizer", "--vocab-size", "49151"], "--tokenizer-type --vocab-size needs --data-path"),
    (["--tokenizer-model", "my.model"], "--tokenizer-model needs --data-path"),
])
def test_own_tokenizer_without_data(argv, needle, capsys):
    """No data flags = the embedded run on the bundled corpus, tokenized with its own tokenizer: another
    tokenizer (e.g. an imported model's, when fine-tuning) must bring its own data."""
    rc = main(argv)
    err = capsys.readouterr().err
    assert rc == 2, err
    _no_traceback(err)
    assert needle in err and "bundled corpus" in err, err


def test_router_kernels_c_without_a_compiler(tmp_path):
    """`--delta-router-kernels c` where the C kernels cannot be built: an error at start-up that says
    why and what to do (never a silent switch to PyTorch ops)."""
    rc, err = _run(MOCK + ["--residual", "delta", "--delta-router-kernels", "c"], tmp_path,
                   CC="false", MEGATRON_DELTA_CACHE=str(tmp_path / "kernels"))
    assert rc == 2
    _no_traceback(err)
    assert "--delta-router-kernels c: the fused CPU kernels cannot be built" in err and "false" in err, err
    assert "--delta-router-kernels torch" in err, err
    assert not list((tmp_path / "kernels").glob("*.so*")), "a failed build must leave no library behind"


def test_router_kernels_auto_without_a_compiler_warns(tmp_path):
    """The default `auto` trains on PyTorch ops where no compiler exists, and says so once. (The
    start-up log also says which CPU allocator applies: the default `cache` here.)"""
    rc, out, err = _run_full(MOCK + ["--residual", "delta"], tmp_path, CC="no-such-cc",
                             MEGATRON_DELTA_CACHE=str(tmp_path / "kernels"))
    assert rc == 0, err
    assert "CPU allocator: glibc keeps freed memory for reuse (--delta-cpu-allocator cache)" in out, out
    assert err.count("the fused CPU router kernels cannot be built (no C compiler 'no-such-cc' on PATH") == 1, err
    assert "--delta-router-kernels torch" in err, err
