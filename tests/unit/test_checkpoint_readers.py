"""Every reader of a checkpoint is as careful as the trainer, advice comes from what is on disk, and no bad state is
saved: checkpoint/reader.py, integrity.py, errors.resume_advice, finite.py, and the trainer hooks' parts of them
that run without a Megatron-LM run (tests/integration/test_checkpoint_faults.py runs the trainer on the same faults).

- the tools (convert_checkpoint export, evaluate, perplexity, routing_report), run in this process on a checkpoint
  whose weight bytes were flipped on disk: one line naming the shard and the checkpoint that verifies, exit status
  != 0, no output written; with --no-verify-integrity the export goes on, saying once that it is unverified;
- run_config.json is in integrity.json: an edited value fails verification naming the file; a manifest without it
  (an older save) loads with a line;
- a tracker, run_config.json or integrity.json that cannot be read: one line naming the file and what to do;
- advice: --ckpt-step 7 with checkpoints at 5/10/15/20 lists them and keeps the tracker at 20; a tracker naming a
  missing 7 beside 6 and 8 advises 8 and deletes nothing; "the newest that verifies" skips a checkpoint whose
  damaged file is not its first;
- a NaN / inf parameter is named before a save (finite.py); SIGINT during a save is held until it ends; main()
  turns SIGINT into one line and exit status 130; torch's loader warnings print no traceback; a long upstream
  message is cut at a word;
- the lock of --save refuses a second 2-rank run on every rank with rank 0's line; the STARTS FROM SCRATCH line.
"""
from __future__ import annotations

import importlib.util
import io
import json
import logging
import os
import shutil
import signal
import types
import warnings

import pytest
import torch

from megatron_delta.checkpoint.errors import CheckpointError, clip
from megatron_delta.checkpoint.layout import TRACKER
from tests.helpers import REPO_ROOT as REPO
from tests.helpers.checkpoint_damage import flip_tensor_bytes

O_PROJ = "decoder.layers.self_attention.linear_proj.weight"

pytestmark = pytest.mark.usefixtures("offline_single_thread", "distributed_teardown")


def _tool(name: str):
    """tools/<name>.py as a module (its main(argv) runs in this process)."""
    spec = importlib.util.spec_from_file_location(f"tool_{name}", os.path.join(REPO, "tools", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A tiny delta model (2 layers, NullTokenizer vocabulary 300) saved by checkpoint/store.py at iterations 0
    and 1 (integrity.json with run_config.json in it)."""
    from transformers import Qwen3Config

    from megatron_delta.checkpoint.model_config import padded_vocab_size
    from megatron_delta.checkpoint.store import save_checkpoint
    from megatron_delta.convert import hf_checkpoint
    from megatron_delta.evaluation import loaders

    cfg = Qwen3Config(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=2, head_dim=16, max_position_embeddings=64)
    cfg.architectures = ["Qwen3ForCausalLM"]
    rc = hf_checkpoint.model_config_from_hf(cfg, "delta")
    model, args = loaders.build_megatron_model(rc, padded_vocab_size(300))
    args.vocab_size, args.tokenizer_type = 300, "NullTokenizer"
    root = str(tmp_path_factory.mktemp("saved") / "run")
    for iteration in (0, 1):
        save_checkpoint(root, iteration, [model], None, None, 0, args, save_optim=False)
    return root


@pytest.fixture
def run(saved, tmp_path):
    """A copy of the saved run to damage."""
    root = str(tmp_path / "run")
    shutil.copytree(saved, root)
    return root


def _it(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


# ------------------------------------------------------------------------------ one reader for every tool
def _flipped_line(root: str, shard: str) -> str:
    return (f"cannot load the checkpoint of iteration 1: {shard} differs from its hash in integrity.json (bytes "
            f"changed since the save). Complete checkpoints in {root}, newest first: 0; load the newest that "
            f"verifies, iteration 0, with --load {_it(root, 0)}")


TOOLS = {  # tool -> (argv after --load, its error prefix, its exit status, what it would write)
    "convert_checkpoint": (["export", "--load", "{load}", "--output", "{out}/hf"], "convert_checkpoint.py export",
                           2, "hf"),
    "evaluate": (["--load", "{load}", "--tokens-file", "{out}/tokens.json", "--output", "{out}/nll.json"],
                 "evaluate.py", 2, "nll.json"),
    "perplexity": (["--load", "{load}", "--output", "{out}/ppl.json", "--data-path", "{out}/none"],
                   "perplexity.py", 2, "ppl.json"),
    "routing_report": (["--load", "{load}", "--output", "{out}/routing", "--mock-data"], "routing_report.py", 1,
                       "routing"),
}


@pytest.mark.parametrize("tool", sorted(TOOLS))
def test_every_tool_refuses_flipped_weights_before_writing(run, tmp_path, tool, capsys):
    shard = flip_tensor_bytes(_it(run, 1), O_PROJ)
    out = tmp_path / "out"
    out.mkdir()
    (out / "tokens.json").write_text(json.dumps([[1, 2, 3, 4]]))
    argv, prog, status, written = TOOLS[tool]
    code = _tool(tool).main([a.format(load=run, out=out) for a in argv])
    err = capsys.readouterr().err
    assert code == status, err
    assert [ln for ln in err.splitlines() if "error:" in ln] == [f"{prog}: error: {_flipped_line(run, shard)}"], err
    assert "Traceback" not in err
    assert not (out / written).exists()


def test_export_without_verification_says_so_once(run, tmp_path, capsys):
    """--no-verify-integrity: the export reads the flipped weights (it exits 0), and says once that the
    checkpoint was not verified although it has integrity.json."""
    flip_tensor_bytes(_it(run, 1), O_PROJ)
    code = _tool("convert_checkpoint").main(["export", "--load", run, "--output", str(tmp_path / "hf"),
                                             "--no-verify-integrity"])
    err = capsys.readouterr().err
    assert code == 0, err
    note = (f"note: --no-verify-integrity: {_it(run, 1)} is loaded without verifying its files against its "
            f"integrity.json")
    assert err.count(note) == 1, err
    assert os.path.isfile(tmp_path / "hf" / "config.json")


def test_run_config_json_is_verified_and_an_older_manifest_loads_with_a_line(run):
    from megatron_delta.checkpoint.reader import open_checkpoint

    ckpt = _it(run, 1)
    manifest = json.load(open(os.path.join(ckpt, "integrity.json")))
    assert set(manifest["files"]) == {".metadata", "__0_0.distcp", "metadata.json", "run_config.json"}
    rc_path = os.path.join(ckpt, "run_config.json")
    text = open(rc_path).read()
    open(rc_path, "w").write(text.replace('"hidden_size": 32', '"hidden_size": 48'))
    with pytest.raises(CheckpointError) as refused:
        open_checkpoint(run)
    assert str(refused.value) == (
        f"cannot load the checkpoint of iteration 1: {rc_path} differs from its hash in integrity.json (bytes changed "
        f"since the save). Complete checkpoints in {run}, newest first: 0; load the newest that verifies, iteration "
        f"0, with --load {_it(run, 0)}")
    open(rc_path, "w").write(text)
    del manifest["files"]["run_config.json"]  # as an older version saved it
    json.dump(manifest, open(os.path.join(ckpt, "integrity.json"), "w"))
    lines = []
    opened = open_checkpoint(run, log=lines.append)
    assert (opened.ckpt_dir, opened.iteration, opened.run_config["hidden_size"]) == (ckpt, 1, 32)
    assert lines == [f"note: the integrity.json of {ckpt} does not list run_config.json (saved by an older "
                     f"version): its other files are verified, run_config.json is not"]
    assert open_checkpoint(run, log=lines.append) == opened and len(lines) == 1  # once per process


# ------------------------------------------------------------------------------ every unreadable file named
def test_unreadable_tracker_run_config_and_manifest_are_named(run):
    from megatron_delta.checkpoint.integrity import verify_before_load
    from megatron_delta.checkpoint.reader import open_checkpoint

    tracker = os.path.join(run, TRACKER)
    open(tracker, "wb").write(b"\x89PNG\r\n\x1a\n")
    with pytest.raises(CheckpointError) as e:
        open_checkpoint(run)
    assert str(e.value) == (
        f"--load: {tracker} is corrupt (not text: it starts with b'\\x89PNG\\r\\n\\x1a\\n'); it names the checkpoint "
        f"to resume from. Complete checkpoints in {run}, newest first: 1, 0; load the newest, iteration 1, with "
        f"--load {_it(run, 1)}")
    hooks = _hooks(load=run)
    with pytest.raises(CheckpointError) as e:
        hooks.checkpoint_to_load()
    assert str(e.value) == (
        f"--load: {tracker} is corrupt (not text: it starts with b'\\x89PNG\\r\\n\\x1a\\n'); it names the checkpoint "
        f"to resume from. Complete checkpoints in {run}, newest first: 1, 0. Write 1 into {tracker} to resume "
        f"from iteration 1 (the newest), or pass --ckpt-step 1")
    open(tracker, "w").write("1")

    rc_path = os.path.join(_it(run, 1), "run_config.json")
    open(rc_path, "w").write("{bad: json")
    from megatron_delta.checkpoint.run_config import read_run_config

    with pytest.raises(CheckpointError) as e:
        read_run_config(_it(run, 1))
    assert str(e.value) == (
        f"{rc_path} is corrupt (not JSON: Expecting property name enclosed in double quotes: line 1 column 2 "
        f"(char 1)); it records the checkpoint's model flags. Restore it from a copy of the checkpoint, or load "
        f"another checkpoint of {run}")

    manifest = os.path.join(_it(run, 1), "integrity.json")
    open(manifest, "w").write('{"files": ')
    with pytest.raises(CheckpointError) as e:
        verify_before_load(_it(run, 1), True)
    assert str(e.value) == (
        f"{manifest} is corrupt (not JSON: Expecting value: line 1 column 11 (char 10)): the files of "
        f"{_it(run, 1)} cannot be verified. Restore it from a copy of the checkpoint, or load the checkpoint "
        f"unverified with --no-verify-integrity")


# ------------------------------------------------------------------------------ advice from what is on disk
def _hooks(**args):
    from megatron_delta.trainer.hooks import RunHooks

    base = dict(load=None, ckpt_step=None, rank=0, world_size=1, delta_metrics_file=None, save=None)
    base.update(args)
    return RunHooks(types.SimpleNamespace(**base))


def _dcp_dir(root: str, iteration: int) -> str:
    """A torch_dist-like iteration directory (a .distcp shard, its .metadata, metadata.json, run_config.json) with
    its integrity.json."""
    import torch.distributed.checkpoint as dcp
    from megatron.core.dist_checkpointing.validation import save_integrity_manifest

    path = _it(root, iteration)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
        dcp.save({"weight": torch.arange(1000.0) + iteration}, checkpoint_id=path)
    json.dump({"sharded_backend": "torch_dist"}, open(os.path.join(path, "metadata.json"), "w"))
    json.dump({"iteration": iteration}, open(os.path.join(path, "run_config.json"), "w"))
    save_integrity_manifest(path)
    return path


def test_ckpt_step_of_a_missing_iteration_lists_the_checkpoints_and_keeps_the_tracker(tmp_path):
    root = str(tmp_path)
    for it in (5, 10, 15, 20):
        _dcp_dir(root, it)
    open(os.path.join(root, TRACKER), "w").write("20")
    with pytest.raises(CheckpointError) as e:
        _hooks(load=root, ckpt_step=7).checkpoint_to_load()
    assert str(e.value) == (
        f"cannot load the checkpoint of iteration 7: {_it(root, 7)} does not exist (--ckpt-step names it). "
        f"Complete checkpoints in {root}, newest first: 20, 15, 10, 5; {os.path.join(root, TRACKER)} names "
        f"iteration 20, the newest: resume without --ckpt-step, or pass --ckpt-step 20")
    assert _hooks(load=root, ckpt_step=10).checkpoint_to_load() == _it(root, 10)


def test_a_tracker_naming_a_missing_iteration_is_told_the_newest_and_deletes_nothing(tmp_path):
    """A tracker naming a missing 7 beside 6 and 8 is told 8 (not 6); naming a missing 9, it is not told to delete
    iter_0000009."""
    root = str(tmp_path)
    for it in (6, 8):
        _dcp_dir(root, it)
    tracker = os.path.join(root, TRACKER)
    open(tracker, "w").write("7")
    with pytest.raises(CheckpointError) as e:
        _hooks(load=root).checkpoint_to_load()
    assert str(e.value) == (
        f"cannot load the checkpoint of iteration 7: {_it(root, 7)} does not exist ({tracker} names it). "
        f"Complete checkpoints in {root}, newest first: 8, 6. Write 8 into {tracker} to resume from iteration 8 "
        f"(the newest), or pass --ckpt-step 8")
    open(tracker, "w").write("9")  # a missing iteration above the complete ones: nothing there to delete
    with pytest.raises(CheckpointError) as e:
        _hooks(load=root).checkpoint_to_load()
    assert str(e.value) == (
        f"cannot load the checkpoint of iteration 9: {_it(root, 9)} does not exist ({tracker} names it). "
        f"Complete checkpoints in {root}, newest first: 8, 6. Write 8 into {tracker} to resume from iteration 8 "
        f"(the newest), or pass --ckpt-step 8")


def test_the_newest_that_verifies_skips_a_checkpoint_whose_damaged_file_is_not_its_first(tmp_path):
    """Iteration 8 fails its hash; iteration 5's first listed file (.metadata) is whole but its last
    (run_config.json) was changed: the checkpoint to resume from is 3, not 5."""
    from megatron.core.dist_checkpointing.validation import _verify_integrity_manifest_impl

    from megatron_delta.checkpoint.integrity import describe_mismatch

    root = str(tmp_path)
    for it in (3, 5, 8):
        _dcp_dir(root, it)
    tracker = os.path.join(root, TRACKER)
    open(tracker, "w").write("8")
    listed = list(json.load(open(os.path.join(_it(root, 5), "integrity.json")))["files"])
    assert listed[0] == ".metadata" and listed[-1] == "run_config.json"
    json.dump({"iteration": 5, "edited": True}, open(os.path.join(_it(root, 5), "run_config.json"), "w"))
    shard = os.path.join(_it(root, 8), "__0_0.distcp")
    with open(shard, "r+b") as f:
        f.seek(os.path.getsize(shard) // 2)
        f.write(b"\xff" * 8)
    try:
        _verify_integrity_manifest_impl(_it(root, 8))
    except Exception as exc:  # noqa: BLE001 - upstream's CheckpointingException
        line = describe_mismatch(exc, root, None)
    assert line == (
        f"cannot load the checkpoint of iteration 8: {shard} differs from its hash in integrity.json (bytes changed "
        f"since the save). Complete checkpoints in {root}, newest first: 5, 3. Delete {_it(root, 8)} and write 3 "
        f"into {tracker} to resume from iteration 3 (the newest that verifies), or pass --ckpt-step 3")


# ------------------------------------------------------------------------------ no non-finite state saved
class _Two(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.first = torch.nn.Linear(4, 4)
        self.second = torch.nn.Linear(4, 4)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_a_non_finite_parameter_is_named_and_not_saved(tmp_path, bad):
    from megatron_delta.checkpoint.finite import NonFiniteState, check_before_save, first_non_finite, named_parameters

    model = _Two()
    with torch.no_grad():
        model.first.weight.fill_(3e38)  # large but finite: not flagged
    assert first_non_finite(named_parameters([model])) is None
    check_before_save(9, [model], str(tmp_path))  # all finite: nothing raised
    with torch.no_grad():
        model.second.bias[2] = bad
    assert first_non_finite(named_parameters([model])) == "second.bias"
    assert first_non_finite(named_parameters([model, _Two()])) == "model chunk 0: second.bias"
    os.makedirs(_it(str(tmp_path), 8))
    open(os.path.join(tmp_path, TRACKER), "w").write("8")
    with pytest.raises(NonFiniteState) as e:
        check_before_save(9, [model], str(tmp_path))
    assert str(e.value) == (
        f"iteration 9: second.bias holds NaN or inf values, so this state is not saved; the last good checkpoint "
        f"is iteration 8 ({_it(str(tmp_path), 8)}), which {os.path.join(tmp_path, TRACKER)} still names: resume "
        f"from it with --load {tmp_path} (with a lower --lr, or --clip-grad, if the loss diverged)")


# ------------------------------------------------------------------------------ SIGINT, warnings, cut lines
def test_sigint_during_a_save_waits_for_its_end():
    from megatron_delta.trainer.hooks import sigint_deferred

    finished = []
    with pytest.raises(KeyboardInterrupt):
        with sigint_deferred(4):
            os.kill(os.getpid(), signal.SIGINT)
            finished.append("the save")  # not interrupted
    assert finished == ["the save"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_main_turns_sigint_into_one_line_and_130(tmp_path, monkeypatch, capsys):
    from megatron_delta.trainer import main as trainer
    from tests.helpers.rank_runner import COMMON

    save = str(tmp_path / "run")
    os.makedirs(_it(save, 4))
    open(os.path.join(save, TRACKER), "w").write("4")

    def run(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(trainer, "run", run)
    code = trainer.main(COMMON + ["--train-iters", "10", "--save", save, "--save-interval", "2"])
    err = capsys.readouterr().err
    assert code == 130
    assert err.strip().splitlines() == [
        f"pretrain_gpt.py: error: interrupted (SIGINT): the last complete checkpoint is iteration 4 "
        f"({_it(save, 4)}), which {os.path.join(save, TRACKER)} names; resume with --load {save}"]


def test_torch_loader_warnings_print_no_traceback(tmp_path):
    """A checkpoint without .metadata: torch's loader logs two warnings with their tracebacks (on the root logger)
    before it fails; inside known_warnings_quieted they are dropped, the failure itself is not."""
    import torch.distributed.checkpoint as dcp

    from megatron_delta.platform.patches import known_warnings_quieted

    path = _dcp_dir(str(tmp_path), 1)
    os.remove(os.path.join(path, ".metadata"))
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    logging.getLogger().addHandler(handler)
    try:
        for quiet in (False, True):
            with (known_warnings_quieted() if quiet else warnings.catch_warnings()):
                warnings.simplefilter("ignore")
                with pytest.raises(BaseException):  # CheckpointException is a BaseException
                    dcp.load({"weight": torch.zeros(1000)}, checkpoint_id=path)
            if not quiet:
                assert stream.getvalue().count("Traceback") == 2, stream.getvalue()
                stream.truncate(0)
                stream.seek(0)
    finally:
        logging.getLogger().removeHandler(handler)
    assert stream.getvalue() == ""


def test_a_long_message_is_cut_at_a_word():
    text = "metadata is None; global metadata read failed: " + " ".join(f"word{i}" for i in range(60))
    words = text.split(" ")
    for limit in range(60, 200):
        cut = clip(text, limit)
        assert len(cut) <= limit and cut.endswith(" ..."), (limit, cut)
        kept = cut[:-len(" ...")].split(" ")
        assert kept == words[:len(kept)], (limit, cut)  # whole words only
    assert clip("short line.\nsecond") == "short line."


# ------------------------------------------------------------------------------ lock and fresh start (fast)
def _take_lock_in_two_ranks(save_dir):
    import torch.distributed as dist

    from megatron_delta.checkpoint.save_lock import SaveDirInUse, acquire_on_rank0

    dist.init_process_group("gloo")
    try:
        acquire_on_rank0(save_dir)
        return "taken"
    except SaveDirInUse as e:
        return str(e)
    finally:
        dist.destroy_process_group()


# slow: a two-rank launch; the lock's refusal in one process stays in the fast set (tests/test_save_lock.py)
@pytest.mark.slow
def test_the_lock_refuses_a_second_two_rank_run_on_every_rank(tmp_path):
    from megatron_delta.checkpoint.save_lock import LOCK_NAME, SaveDirLock
    from tests.helpers.dist_utils import run_distributed

    save = str(tmp_path / "run")
    held = SaveDirLock(save).acquire()  # this process is the first run
    try:
        # read through the holder's own descriptor: closing another descriptor of the file would drop this
        # process's record lock (POSIX)
        record = json.loads(os.pread(held._fd, 4096, 0))
        answers = run_distributed(_take_lock_in_two_ranks, 2, save, timeout=120)
    finally:
        held.release()
    line = (f"--save {save} is in use by another run (host {record['host']}, pid {os.getpid()}, started "
            f"{record['started']}; lock file {os.path.join(save, LOCK_NAME)}): two runs saving into one directory "
            f"overwrite each other's checkpoints. Wait for that run to end or stop it, or give this run another "
            f"--save directory")
    assert answers == [line, line]
    assert run_distributed(_take_lock_in_two_ranks, 2, save, timeout=120) == ["taken", "taken"]


def test_a_load_with_nothing_to_load_starts_from_scratch_with_a_line(tmp_path, capsys):
    missing = str(tmp_path / "missing")
    _hooks(load=missing).announce_fresh_start()
    empty = str(tmp_path / "empty")
    os.makedirs(empty)
    _hooks(load=empty).announce_fresh_start()
    assert capsys.readouterr().err.splitlines() == [
        f"pretrain_gpt.py: warning: --load {missing} does not exist: this run STARTS FROM SCRATCH (random weights, "
        f"iteration 0)",
        f"pretrain_gpt.py: warning: --load {empty} holds no checkpoint (no {TRACKER}): this run STARTS FROM SCRATCH "
        f"(random weights, iteration 0)"]
    open(os.path.join(empty, TRACKER), "w").write("3")
    _hooks(load=empty).announce_fresh_start()
    _hooks(load=missing, ckpt_step=3).announce_fresh_start()
    assert capsys.readouterr().err == ""
