"""Checkpoints: atomic saves. (Exact resume and TP/PP resharding train through pretrain_gpt.py:
tests/integration/test_trainer_resume.py.)
"""
import os

import pytest

from megatron_delta.checkpoint.errors import CheckpointError
from megatron_delta.checkpoint.run_config import TRACKER, resolve_checkpoint_dir


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
