"""Bad input to pretrain_gpt.py: a non-zero exit and one line naming the flag or file, no traceback.

Argument errors go through pretrain_gpt.py's main (megatron_delta.trainer.main) in-process (cheap: they
fail before the distributed start-up); errors found after it (data, tokenizer, kernels) run
pretrain_gpt.py as a subprocess. Flags are Megatron-LM's (tests/helpers/flags.py).
"""
import os
import subprocess
import sys

import pytest

from megatron_delta.trainer.main import main
from tests.helpers import REPO_ROOT as REPO
from tests.helpers.flags import CLI_MOCK, CLI_TINY


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
    rc = main(CLI_TINY + CLI_MOCK + argv)
    err = capsys.readouterr().err
    assert rc == 2, err
    _no_traceback(err)
    assert needle in err, err
    assert err.strip().splitlines()[-1].startswith("pretrain_gpt.py: error: "), err


@pytest.mark.parametrize("residual", ["delta_block", "attnres"])
def test_block_mode_without_blocks_that_divide(residual, capsys):
    """A block mode on 30 layers without --delta-num-blocks: the default, 4 blocks, does not divide 30 and no
    other K is chosen silently. One line, before the distributed start-up, naming the flag and every K."""
    rc = main(CLI_TINY + CLI_MOCK + ["--num-layers", "30", "--residual", residual])
    err = capsys.readouterr().err
    assert rc == 2, err
    _no_traceback(err)
    assert err.strip().splitlines()[-1] == (
        f"pretrain_gpt.py: error: --residual {residual} with --num-layers 30 needs --delta-num-blocks K with K "
        f"dividing 30 (1, 2, 3, 5, 6, 10, 15, 30); the default, 4 blocks, does not divide 30")


@pytest.mark.parametrize("layers,blocks", [("8", 4), ("36", 4), ("3", 3)])
def test_the_resolved_number_of_blocks_is_printed(layers, blocks, capsys):
    """Without --delta-num-blocks the resolved K (4, or L for L <= 4) is in the arguments pretrain_gpt.py
    prints at start-up (and so in run_config.json, which records the parsed arguments)."""
    from megatron_delta.trainer.main import parse_args

    args = parse_args(CLI_TINY + CLI_MOCK + ["--num-layers", layers, "--residual", "attnres"])
    assert args.delta_num_blocks == blocks
    printed = [ln.split() for ln in capsys.readouterr().out.splitlines() if ln.split()[:1] == ["delta_num_blocks"]]
    assert len(printed) == 1 and printed[0][-1] == str(blocks), printed


def test_train_iters_without_eval_interval(capsys):
    """megatron.training sizes the validation set from --eval-interval and fails with a TypeError without it."""
    argv = [a for a in CLI_TINY]
    i = argv.index("--eval-interval")
    del argv[i:i + 2]
    rc = main(argv + CLI_MOCK)
    err = capsys.readouterr().err
    assert rc == 2, err
    _no_traceback(err)
    assert "--eval-interval is needed with --train-iters" in err, err


def test_cpu_without_the_cpu_switches(capsys):
    """A Megatron-LM job script as written for GPUs, run without CUDA: one line listing the switches."""
    i = CLI_TINY.index("--transformer-impl")  # tests.helpers.flags.tiny: the CPU switches come last
    rc = main(CLI_TINY[:i] + CLI_MOCK + ["--no-rope-fusion"])
    err = capsys.readouterr().err
    assert rc == 2, err
    _no_traceback(err)
    line = err.strip().splitlines()[-1]
    assert line.startswith("pretrain_gpt.py: error: no CUDA device: Megatron-LM's GPU defaults need "
                           "--transformer-impl local --distributed-backend gloo "
                           "--no-gradient-accumulation-fusion"), line
    assert "--no-rope-fusion on CPU" not in line and "--use-cpu-initialization" in line, line


def _run(argv, tmp_path, **extra_env):
    rc, _, err = _run_full(argv, tmp_path, **extra_env)
    return rc, err


def _run_full(argv, tmp_path, **extra_env):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO, **extra_env)
    malloc = [k for k in env if k.startswith("MALLOC_")]  # a user's malloc choice would switch the allocator line
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", *malloc):
        env.pop(k, None)
    p = subprocess.run([sys.executable, os.path.join(REPO, "pretrain_gpt.py")] + CLI_TINY + argv,
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
    rc, err = _run(CLI_MOCK + ["--residual", "delta", "--delta-router-kernels", "c"], tmp_path,
                   CC="false", MEGATRON_DELTA_CACHE=str(tmp_path / "kernels"))
    assert rc == 2
    _no_traceback(err)
    assert "--delta-router-kernels c: the fused CPU kernels cannot be built" in err and "false" in err, err
    assert "--delta-router-kernels torch" in err, err
    assert not list((tmp_path / "kernels").glob("*.so*")), "a failed build must leave no library behind"


def test_router_kernels_auto_without_a_compiler_warns(tmp_path):
    """The default `auto` trains on PyTorch ops where no compiler exists, and says so once. (The
    start-up log also says which CPU allocator applies: the default `cache` here.)"""
    rc, out, err = _run_full(CLI_MOCK + ["--residual", "delta"], tmp_path, CC="no-such-cc",
                             MEGATRON_DELTA_CACHE=str(tmp_path / "kernels"))
    assert rc == 0, err
    assert "CPU allocator: glibc keeps freed memory for reuse (--delta-cpu-allocator cache)" in out, out
    assert err.count("the fused CPU router kernels cannot be built (no C compiler 'no-such-cc' on PATH") == 1, err
    assert "--delta-router-kernels torch" in err, err


def test_one_process_launch_binds_no_port(tmp_path):
    """A plain `python pretrain_gpt.py` (no launcher) is a one-process world that meets in memory: it binds no port,
    so a port that another process takes after it was found free does no harm (a TCP store on it failed with
    EADDRINUSE)."""
    code = ("import runpy, socket, sys\n"
            "import megatron_delta.platform.distributed as d\n"
            "taken = socket.socket()\n"
            "taken.bind(('127.0.0.1', 0))\n"
            "taken.listen()\n"
            "d.free_port = lambda: taken.getsockname()[1]  # found free, then taken\n"
            f"sys.argv = ['pretrain_gpt.py'] + {CLI_TINY + CLI_MOCK!r}\n"
            f"runpy.run_path({os.path.join(REPO, 'pretrain_gpt.py')!r}, run_name='__main__')\n")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO)
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        env.pop(k, None)
    p = subprocess.run([sys.executable, "-c", code], cwd=str(tmp_path), env=env, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "[after training is done]" in p.stdout, p.stdout[-2000:]


# ---------------------------------------------------------------- start-up checks of paths and argparse errors
def test_argparse_error_without_megatron_usage(capsys):
    """argparse's own error (a bad choice): a short usage and the error line, not the usage of ~850 flags."""
    rc = main(CLI_TINY + CLI_MOCK + ["--residual", "bogus"])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert err.splitlines() == [
        "usage: pretrain_gpt.py [FLAGS ...]   (pretrain_gpt.py --help lists Megatron-LM's flags and the project's)",
        "pretrain_gpt.py: error: argument --residual: invalid choice: 'bogus' (choose from 'baseline', 'attnres', "
        "'full_attnres', 'delta', 'delta_block')"], err


@pytest.mark.parametrize("env", [{"LOCAL_RANK": "1"}, {"RANK": "2", "LOCAL_RANK": "0"}], ids=["local1", "node2"])
def test_argument_error_printed_by_the_first_rank_only(monkeypatch, capsys, env):
    """Every rank of a launch parses the same flags: global rank 0 says it once (not the first process of every
    node); the others say nothing and exit with the status after a wait, so that under torchrun (which stops every
    rank once one exits) rank 0 has printed first."""
    from megatron_delta.trainer import main as trainer_main

    waits = []
    monkeypatch.setattr(trainer_main.time, "sleep", waits.append)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert main(CLI_TINY + CLI_MOCK + ["--residual", "bogus"]) == 2
    assert main(CLI_TINY + CLI_MOCK + ["--load", "run/iter_0000020"]) == 2
    assert capsys.readouterr().err == ""
    assert waits == [trainer_main.SILENT_RANK_EXIT_DELAY_S] * 2


def _refused(argv, capsys, base=CLI_TINY) -> str:
    rc = main(base + CLI_MOCK + argv)
    err = capsys.readouterr().err
    assert rc == 2, err
    _no_traceback(err)
    return err.strip().splitlines()[-1]


def test_load_of_an_iteration_directory(tmp_path, capsys):
    ckpt = tmp_path / "run" / "iter_0000020"
    ckpt.mkdir(parents=True)
    assert _refused(["--load", str(ckpt)], capsys) == (
        f"pretrain_gpt.py: error: --load {ckpt} is one iteration's directory; --load takes the run's directory and "
        f"--ckpt-step the iteration: --load {tmp_path / 'run'} --ckpt-step 20")


def test_save_is_a_file(tmp_path, capsys):
    f = tmp_path / "save"
    f.write_text("")
    assert _refused(["--save", str(f), "--save-interval", "1"], capsys) == (
        f"pretrain_gpt.py: error: --save {f} is a file, not a directory; pass a directory")


@pytest.fixture
def read_only_dir(tmp_path):
    """A directory nobody can write in: chmod for a user, a read-only bind mount for root (whom chmod does
    not stop)."""
    d = tmp_path / "ro"
    d.mkdir()
    if os.geteuid() != 0:
        d.chmod(0o555)
        yield d
        d.chmod(0o755)
        return
    p = subprocess.run(["mount", "--bind", "-o", "ro", str(d), str(d)], capture_output=True, text=True)
    if p.returncode != 0:
        pytest.skip(f"root without a read-only bind mount ({p.stderr.strip()}): no read-only directory to test")
    try:
        yield d
    finally:
        subprocess.run(["umount", str(d)], check=True)


def test_save_not_writable(read_only_dir, capsys):
    """Found at start-up, not at the first save after training up to it."""
    save = read_only_dir / "ckpt"
    line = _refused(["--save", str(save), "--save-interval", "1"], capsys)
    assert line.startswith(f"pretrain_gpt.py: error: --save {save}: cannot write into {save} ("), line
    assert line.endswith("); pass a writable directory"), line


def test_path_flags_checked_at_start_up(tmp_path, capsys):
    assert _refused(["--delta-metrics-file", str(tmp_path)], capsys) == (
        f"pretrain_gpt.py: error: --delta-metrics-file {tmp_path} is a directory; pass a file name (JSON lines are "
        f"appended to it)")
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert _refused(["--delta-metrics-file", str(blocker / "m.jsonl")], capsys) == (
        f"pretrain_gpt.py: error: --delta-metrics-file {blocker / 'm.jsonl'}: {blocker} is a file, not a directory; "
        f"pass a directory")
    line = _refused(["--delta-heldout-data-path", str(tmp_path / "wiki")], capsys)
    assert line.startswith(f"pretrain_gpt.py: error: --delta-heldout-data-path: {tmp_path / 'wiki'}.bin/.idx not "
                           f"found"), line


def test_save_interval(tmp_path, capsys):
    """--train-iters 0 --save DIR saves the initial model: no --save-interval needed. Training without one
    is refused with the flag named (upstream: `assert args.save_interval is not None`)."""
    from megatron_delta.trainer.main import parse_args

    argv = CLI_TINY[:-2]  # without --save-interval
    assert argv[-2:] == ["--eval-interval", "1000"]
    args = parse_args(argv + CLI_MOCK + ["--train-iters", "0", "--save", str(tmp_path / "b")])
    assert args.save == str(tmp_path / "b") and args.skip_train
    assert _refused(["--save", str(tmp_path / "c")], capsys, base=argv) == (
        "pretrain_gpt.py: error: --save needs --save-interval N (a checkpoint every N iterations; N = --train-iters "
        "1 saves at the end only)")


def test_verify_integrity_by_default():
    from megatron_delta.trainer.arguments import TrainerArgumentError
    from megatron_delta.trainer.main import parse_args

    assert parse_args(CLI_TINY + CLI_MOCK).verify_integrity is True
    assert parse_args(CLI_TINY + CLI_MOCK + ["--no-verify-integrity"]).verify_integrity is False
    assert parse_args(CLI_TINY + CLI_MOCK + ["--ckpt-format", "torch"]).verify_integrity is False
    with pytest.raises(TrainerArgumentError, match="--verify-integrity needs --ckpt-format torch_dist"):
        parse_args(CLI_TINY + CLI_MOCK + ["--ckpt-format", "torch", "--verify-integrity"])
