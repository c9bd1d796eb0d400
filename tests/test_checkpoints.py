"""Checkpoints: exact resume (issue 2), TP/PP resharding, atomic saves.

Heavy cases are `slow` (they launch training processes through tests/parity_driver.py).
"""
import os

import pytest

from megatron_delta.checkpoint.errors import CheckpointError
from megatron_delta.checkpoint.run_config import TRACKER, resolve_checkpoint_dir
from tests import parity_driver as driver
from tests.dist_utils import run_distributed

TOL = 1e-5
RESHARD_MODES = ["baseline", "delta", "delta_block"]
TP2_PP2 = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]


# ------------------------------------------------------------------------------- atomic saves
def _complete(root, iteration):
    d = os.path.join(root, f"iter_{iteration:07d}")
    os.makedirs(d)
    with open(os.path.join(d, "run_config.json"), "w") as f:
        f.write('{"iteration": %d}' % iteration)
    return d


def test_partial_save_is_never_loaded(tmp_path):
    root = str(tmp_path)
    done = _complete(root, 3)
    with open(os.path.join(root, TRACKER), "w") as f:
        f.write("3")
    # A save of iteration 6 interrupted before its rename: a complete-looking partial directory.
    partial = os.path.join(root, "iter_0000006.partial")
    os.makedirs(partial)
    with open(os.path.join(partial, "run_config.json"), "w") as f:
        f.write('{"iteration": 6}')
    assert resolve_checkpoint_dir(root) == (done, 3)


def test_only_partial_save_is_refused(tmp_path):
    root = str(tmp_path)
    os.makedirs(os.path.join(root, "iter_0000006.partial"))
    with pytest.raises(CheckpointError, match="partial"):
        resolve_checkpoint_dir(root)
    with pytest.raises(CheckpointError, match="does not exist"):
        resolve_checkpoint_dir(os.path.join(root, "iter_0000006"))


def test_tracker_naming_missing_iteration_is_refused(tmp_path):
    root = str(tmp_path)
    os.makedirs(os.path.join(root, "iter_0000006.partial"))
    with open(os.path.join(root, TRACKER), "w") as f:
        f.write("6")
    with pytest.raises(CheckpointError, match="missing"):
        resolve_checkpoint_dir(root)


# ------------------------------------------------------------------------------ exact resume
@pytest.mark.slow
@pytest.mark.parametrize("mode", ["baseline", "delta_block"])
def test_resume_is_exact(tmp_path, mode):
    """20 iterations straight == 10, save, `--load` resume, 10 more: same losses and learning rates
    (data position, optimizer, scheduler and RNG all restored)."""
    r = run_distributed(driver.resume_run, 1, str(tmp_path), mode, timeout=1200)[0]
    assert len(r["straight"]) == 20 and len(r["resumed"]) == 10, r
    assert r["resumed_iterations"] == list(range(11, 21))
    assert r["resumed"] == r["straight"][10:], (r["resumed"], r["straight"][10:])
    assert r["resumed_lr"] == r["straight_lr"][10:]


# -------------------------------------------------------------------------------- resharding
@pytest.mark.slow
def test_resharding_tp2pp2_and_tp1(tmp_path):
    """A TP2+PP2 checkpoint evaluates under TP1 to the same loss, and a TP1 one under TP2+PP2."""
    root = str(tmp_path)
    saved_4 = run_distributed(driver.train_and_save, 4, root, "tp2pp2", TP2_PP2, RESHARD_MODES, timeout=1500)[-1]
    saved_1 = run_distributed(driver.train_and_save, 1, root, "tp1", [], RESHARD_MODES, timeout=1500)[0]
    in_1 = run_distributed(driver.load_and_evaluate, 1, root, "tp2pp2", "tp1", [], RESHARD_MODES, timeout=1500)[0]
    in_4 = run_distributed(driver.load_and_evaluate, 4, root, "tp1", "tp2pp2", TP2_PP2, RESHARD_MODES,
                           timeout=1500)[-1]
    for mode in RESHARD_MODES:
        assert abs(in_1[mode] - saved_4[mode]) <= TOL, (mode, "tp2pp2 -> tp1", in_1[mode], saved_4[mode])
        assert abs(in_4[mode] - saved_1[mode]) <= TOL, (mode, "tp1 -> tp2pp2", in_4[mode], saved_1[mode])
