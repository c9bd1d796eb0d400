"""megatron_delta/checkpoint/save_lock.py in one test process and one holder process, no Megatron run: a --save
directory held by a live run is refused with the holder named; a lock left by a run that died is taken over with
a line; a clean release leaves nothing to take over. (tests/integration/test_run_safety.py shows the same through
pretrain_gpt.py under torchrun.)"""
import json
import os
import socket
import subprocess
import sys

import pytest

from megatron_delta.checkpoint.save_lock import LOCK_NAME, SaveDirInUse, SaveDirLock
from tests.helpers import REPO_ROOT as REPO

HOLD = ("import sys\nfrom megatron_delta.checkpoint.save_lock import SaveDirLock\n"
        "SaveDirLock(sys.argv[1]).acquire()\nprint('held', flush=True)\nsys.stdin.read()\n")


def test_a_held_directory_is_refused_then_taken_over_when_its_holder_dies(tmp_path):
    save = str(tmp_path / "ckpt")
    holder = subprocess.Popen([sys.executable, "-c", HOLD, save], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True, env=dict(os.environ, PYTHONPATH=REPO))
    try:
        assert holder.stdout.readline().strip() == "held"
        record = json.load(open(os.path.join(save, LOCK_NAME)))
        assert (record["host"], record["pid"]) == (socket.gethostname(), holder.pid)
        with pytest.raises(SaveDirInUse) as refused:
            SaveDirLock(save).acquire()
        path = os.path.join(save, LOCK_NAME)
        assert str(refused.value) == (
            f"--save {save} is in use by another run (host {record['host']}, pid {holder.pid}, started "
            f"{record['started']}; lock file {path}): two runs saving into one directory overwrite each other's "
            f"checkpoints. Wait for that run to end or stop it, or give this run another --save directory")
    finally:
        holder.stdin.close()  # the holder exits without releasing: its record stays, its lock goes
        holder.wait(timeout=60)
    lock = SaveDirLock(save).acquire()
    assert lock.message == (f"took over the lock of --save {save} from a run that ended without releasing it "
                            f"(host {record['host']}, pid {holder.pid}, started {record['started']}): its "
                            f"checkpoints stay as they are")
    assert json.load(open(path))["pid"] == os.getpid()
    lock.release()
    assert open(path).read() == ""  # a clean exit leaves nothing to take over
    again = SaveDirLock(save).acquire()
    assert again.message is None
    again.release()
