"""megatron_delta/checkpoint/errors.py on checkpoint directories made on disk, one process, no Megatron
run: each damage describe_load_failure recognises, and a full disk under describe_save_failure, gives its exact
one line; what it does not recognise gives None (the caller re-raises it); main() prints the line and exits 1
instead of raising.

The failures are real: torch.distributed.checkpoint (single-process save/load, as Megatron's torch_dist format
writes it) and torch.load raise them on the damaged files.
"""
from __future__ import annotations

import errno
import io
import json
import os
import shutil
import warnings

import torch
import torch.distributed.checkpoint as dcp

from megatron_delta.checkpoint.errors import TRACKER, clip, describe_load_failure, describe_save_failure

STATE = {"weight": torch.arange(1000.0), "bias": torch.ones(300)}


def _save(root: str, iteration: int) -> str:
    """A torch_dist-like iteration directory: a .distcp shard with its .metadata index and a common.pt."""
    path = os.path.join(root, f"iter_{iteration:07d}")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
        dcp.save(dict(STATE), checkpoint_id=path)
    torch.save({"iteration": iteration}, os.path.join(path, "common.pt"))
    with open(os.path.join(path, "metadata.json"), "w") as f:
        json.dump({"sharded_backend": "torch_dist"}, f)
    return path


def _tracker(root: str, text: str) -> str:
    path = os.path.join(root, TRACKER)
    with open(path, "w") as f:
        f.write(text)
    return path


def _shard(path: str) -> str:
    return os.path.join(path, next(n for n in os.listdir(path) if n.endswith(".distcp")))


def _dcp_load_failure(path: str) -> BaseException:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            dcp.load({k: torch.zeros_like(v) for k, v in STATE.items()}, checkpoint_id=path)
        except BaseException as e:  # CheckpointException is a BaseException
            return e
    raise AssertionError(f"{path} loaded")


def _torch_load_failure(path: str) -> BaseException:
    try:
        torch.load(path, weights_only=True)
    except Exception as e:  # noqa: BLE001
        return e
    raise AssertionError(f"{path} loaded")


def _detail(exc: BaseException) -> str:
    """What the line quotes of the failure: the first error that is not torch's gathering CheckpointException
    (per-rank failures: {rank: (exception, frames)}), its first line, at most 200 characters."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict):
        exc = next(iter(failures.values()))[0]
    text = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    return clip(text.splitlines()[0].rstrip("."))


def _resume_advice(root: str, damaged: int, previous: int) -> str:
    """The advice when ``previous`` is the only other complete checkpoint and the tracker names ``damaged``."""
    return (f"Complete checkpoints in {root}, newest first: {previous}. "
            f"Delete {os.path.join(root, f'iter_{damaged:07d}')} and write {previous} into "
            f"{os.path.join(root, TRACKER)} to resume from iteration {previous} (the newest), or pass --ckpt-step "
            f"{previous}")


def test_truncated_shard_names_it_and_the_previous_checkpoint(tmp_path):
    root = str(tmp_path)
    _save(root, 9)
    path = _save(root, 10)
    _tracker(root, "10")
    shard = _shard(path)
    size = os.path.getsize(shard)
    os.truncate(shard, size // 2)
    exc = _dcp_load_failure(path)
    assert type(exc).__name__ == "CheckpointException"
    assert describe_load_failure(exc, root) == (
        f"cannot load the checkpoint of iteration 10: {shard} is truncated ({size // 2} of {size} bytes); "
        f"the load failed with {_detail(exc)}. " + _resume_advice(root, 10, 9))


def test_without_an_earlier_complete_checkpoint(tmp_path):
    """The only earlier checkpoint is damaged too: start from scratch or load another directory."""
    root = str(tmp_path)
    os.remove(_shard(_save(root, 5)))
    path = _save(root, 10)
    _tracker(root, "10")
    shard = _shard(path)
    size = os.path.getsize(shard)
    os.truncate(shard, 7)
    exc = _dcp_load_failure(path)
    assert describe_load_failure(exc, root) == (
        f"cannot load the checkpoint of iteration 10: {shard} is truncated (7 of {size} bytes); "
        f"the load failed with {_detail(exc)}. No other complete checkpoint in {root}: delete {path} and "
        f"{os.path.join(root, TRACKER)} to start from scratch, or --load another directory")


def test_missing_shard_and_ckpt_step_over_the_tracker(tmp_path):
    """--ckpt-step names the iteration loaded (not the tracker's); a missing shard is named."""
    root = str(tmp_path)
    _save(root, 3)
    path = _save(root, 6)
    _save(root, 9)
    _tracker(root, "9")
    shard = _shard(path)
    os.remove(shard)
    exc = _dcp_load_failure(path)
    assert describe_load_failure(exc, root, 6) == (
        f"cannot load the checkpoint of iteration 6: {shard} is missing; the load failed with {_detail(exc)}. "
        f"Complete checkpoints in {root}, newest first: 9, 3; {os.path.join(root, TRACKER)} names iteration 9, "
        f"the newest: resume without --ckpt-step, or pass --ckpt-step 9")


def test_corrupt_index_and_more_files(tmp_path):
    """A damaged .metadata is named first, with the count of the other damaged files (common.pt, metadata.json)."""
    root = str(tmp_path)
    _save(root, 1)
    path = _save(root, 2)
    _tracker(root, "2\n")
    index = os.path.join(path, ".metadata")
    with open(index, "wb") as f:
        f.write(b"not a pickle")
    with open(os.path.join(path, "common.pt"), "wb") as f:
        f.write(b"\0" * 64)
    with open(os.path.join(path, "metadata.json"), "w") as f:
        f.write("{")
    exc = _dcp_load_failure(path)
    line = describe_load_failure(exc, root)
    head = f"cannot load the checkpoint of iteration 2: {index} cannot be read ("
    tail = f" (and 2 more file(s)); the load failed with {_detail(exc)}. " + _resume_advice(root, 2, 1)
    assert line.startswith(head) and line.endswith(tail), line
    reader_error = line[len(head):-len(tail)]
    assert reader_error.startswith("UnpicklingError") and reader_error.endswith(")"), reader_error


def test_corrupt_common_pt(tmp_path):
    """A torch.save archive (common.pt) that is not a zip: named, from torch.load's own failure."""
    root = str(tmp_path)
    _save(root, 4)
    path = _save(root, 8)
    _tracker(root, "8")
    common = os.path.join(path, "common.pt")
    with open(common, "wb") as f:
        f.write(b"PK\3\4 cut short")
    exc = _torch_load_failure(common)
    assert describe_load_failure(exc, root) == (
        f"cannot load the checkpoint of iteration 8: {common} is not a readable torch.save archive "
        f"(File is not a zip file); the load failed with {_detail(exc)}. " + _resume_advice(root, 8, 4))


def test_unreadable_metadata_json(tmp_path):
    root = str(tmp_path)
    _save(root, 4)
    path = _save(root, 8)
    _tracker(root, "8")
    meta = os.path.join(path, "metadata.json")
    with open(meta, "w") as f:
        f.write('{"sharded_backend": ')
    with open(os.path.join(path, "common.pt"), "wb") as f:
        f.write(b"")
    exc = _torch_load_failure(os.path.join(path, "common.pt"))
    line = describe_load_failure(exc, root)
    assert line.startswith(f"cannot load the checkpoint of iteration 8: {os.path.join(path, 'common.pt')} "
                           f"is not a readable torch.save archive (File is not a zip file) (and 1 more file(s)); "
                           f"the load failed with {_detail(exc)}. "), line
    os.remove(os.path.join(path, "common.pt"))
    torch.save({"iteration": 8}, os.path.join(path, "common.pt"))
    exc = _torch_load_failure(os.path.join(root, "nope.pt"))  # a load that failed, the JSON is what is damaged
    try:
        json.load(open(meta))
    except ValueError as e:
        why = f"is not readable JSON ({e})"
    assert describe_load_failure(exc, root) == (
        f"cannot load the checkpoint of iteration 8: {meta} {why}; the load failed with {_detail(exc)}. "
        + _resume_advice(root, 8, 4))


def test_integrity_manifest_names_a_missing_file(tmp_path):
    root = str(tmp_path)
    _save(root, 4)
    path = _save(root, 8)
    _tracker(root, "8")
    with open(os.path.join(path, "integrity.json"), "w") as f:
        json.dump({"files": {"common.pt": "0", "extra_state.pt": "0"}}, f)
    exc = _torch_load_failure(os.path.join(path, "extra_state.pt"))
    assert describe_load_failure(exc, root) == (
        f"cannot load the checkpoint of iteration 8: {os.path.join(path, 'extra_state.pt')} is missing; "
        f"the load failed with {_detail(exc)}. " + _resume_advice(root, 8, 4))


def test_not_a_damaged_checkpoint_gives_none(tmp_path):
    """None (the caller re-raises unchanged): no --load, SystemExit, a failure outside checkpoint loading, a
    corrupt or missing tracker without --ckpt-step, and a load failure while every file is whole."""
    root = str(tmp_path)
    path = _save(root, 10)
    _tracker(root, "10")
    os.truncate(_shard(path), 10)
    exc = _dcp_load_failure(path)
    assert describe_load_failure(exc, None) is None
    assert describe_load_failure(SystemExit(1), root) is None
    assert describe_load_failure(KeyboardInterrupt(), root) is None
    try:
        json.loads("{")
    except ValueError as e:
        assert describe_load_failure(e, root) is None  # not raised inside a checkpoint load
    _tracker(root, "ten")
    assert describe_load_failure(exc, root) is None
    assert describe_load_failure(exc, root, 10) is not None  # --ckpt-step names the iteration instead
    os.remove(os.path.join(root, TRACKER))
    assert describe_load_failure(exc, root) is None
    whole = str(tmp_path / "whole")
    _save(whole, 3)
    _tracker(whole, "3")
    assert describe_load_failure(_torch_load_failure(str(tmp_path / "elsewhere.pt")), whole) is None


def test_file_named_by_the_failure_when_every_file_is_whole(tmp_path):
    """Every file of the iteration is whole: the file the failure itself names under --load is the one."""
    root = str(tmp_path)
    _save(root, 3)
    _tracker(root, "3")
    missing = os.path.join(root, "iter_0000003", "optimizer.pt")
    exc = _torch_load_failure(missing)
    assert describe_load_failure(exc, root) == (
        f"cannot load the checkpoint of iteration 3: {missing} cannot be read (FileNotFoundError: No such file "
        f"or directory); the load failed with {_detail(exc)}. No other complete checkpoint in {root}: delete "
        f"{os.path.join(root, 'iter_0000003')} and {os.path.join(root, TRACKER)} to start from scratch, or "
        f"--load another directory")


def test_main_prints_the_line_and_exits_1(tmp_path, monkeypatch, capsys):
    """pretrain_gpt.py's main(): the damaged-checkpoint failure of the run is one stderr line and exit code 1,
    not a traceback (the run itself replaced by the real load failure of a truncated shard)."""
    from megatron_delta.trainer import main as trainer
    from tests.helpers.rank_runner import COMMON

    root = str(tmp_path)
    _save(root, 9)
    path = _save(root, 10)
    _tracker(root, "10")
    shard = _shard(path)
    os.truncate(shard, 100)
    exc = _dcp_load_failure(path)

    def run(args):
        assert args.load == root
        raise exc

    monkeypatch.setattr(trainer, "run", run)
    code = trainer.main(COMMON + ["--residual", "delta", "--train-iters", "1", "--load", root])
    err = capsys.readouterr().err
    assert code == 1
    assert err.strip().splitlines()[-1] == "pretrain_gpt.py: error: " + describe_load_failure(exc, root)
    assert "Traceback" not in err and shard in err


class _FullDisk(io.RawIOBase):
    """A file whose every write fails as on a full filesystem."""

    def writable(self):
        return True

    def write(self, data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def _save_failure(target) -> BaseException:
    try:
        torch.save(dict(STATE), target)
    except Exception as e:  # noqa: BLE001
        return e
    raise AssertionError("saved")


def test_full_disk_during_a_save_is_one_line_and_names_the_intact_checkpoint(tmp_path, monkeypatch):
    """describe_save_failure: an ENOSPC raised inside torch.save is a full --save filesystem; the line gives the
    free space, the size of the last checkpoint, the intact previous checkpoint and the unfinished directory."""
    root = str(tmp_path)
    previous = _save(root, 2)
    _tracker(root, "2")
    os.makedirs(os.path.join(root, "iter_0000004"))
    free = 3 * 2**20
    monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(2**30, 2**30 - free, free))
    needed = sum(os.path.getsize(os.path.join(previous, n)) for n in os.listdir(previous))
    took = f"{needed:.0f} bytes" if needed < 1024 else f"{needed / 1024:.1f} KiB"
    assert describe_save_failure(_save_failure(_FullDisk()), root) == (
        f"cannot save the checkpoint of iteration 4 in {root}: no space left on device (3.0 MiB free, the last "
        f"checkpoint took {took}); the previous checkpoint, iteration 2 ({previous}), is intact and "
        f"{os.path.join(root, TRACKER)} names it. Delete the unfinished {os.path.join(root, 'iter_0000004')} (it is "
        f"never loaded), free space or --save to a larger filesystem, and resume with --load {root}")
    # the same errno raised outside a checkpoint save is not this line, nor is a save that failed otherwise
    assert describe_save_failure(OSError(errno.ENOSPC, "No space left on device"), root) is None
    assert describe_save_failure(_save_failure(str(tmp_path / "missing" / "x.pt")), root) is None
