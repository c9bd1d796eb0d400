"""One writer per --save directory, integrity checked by default, loud fresh starts, errors once per launch.

Runs of pretrain_gpt.py as programs (a lock holder must be another process; torchrun for the 2-rank cases):
- test_lock_integrity_and_fresh_start: a holder process takes the lock of DIR; `torchrun --nproc-per-node 2`
  on DIR is refused with one line naming it (no training, no hang); the holder is SIGKILLed; then one
  process runs the trainer four times: `--train-iters 0 --save DIR --load DIR` without --save-interval
  (the stale lock taken over with a line, the fresh start announced with the path, the initial model
  saved), a run from it to iteration 2 (--finetune: the initial model has no optimizer state), and loads of two
  copies of DIR whose iteration-2 shard has bytes flipped inside a model tensor and inside an Adam state tensor: each
  one line naming the shard, the iteration and the newest checkpoint that verifies (iteration 0); a copy without
  integrity.json loads with a line.
- test_argument_error_once_under_torchrun: a bad flag under 2 ranks is printed once, without the usage of
  Megatron-LM's flags.
"""
import json
import os
import shutil
import signal
import subprocess
import sys

import pytest

from tests.helpers import REPO_ROOT as REPO
from tests.helpers.checkpoint_damage import flip_tensor_bytes
from tests.helpers.flags import tiny

FLAGS = tiny(num_layers=2, hidden=32, heads=2, groups=2, seq=16, mbs=2) + ["--eval-iters", "0", "--eval-interval",
                                                                             "1000"]
_DIST_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK",
             "ROLE_RANK", "TORCHELASTIC_RUN_ID")
ERROR = "pretrain_gpt.py: error: "


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in _DIST_ENV and not k.startswith("MALLOC_")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONPATH=REPO)
    return env


def _run(cmd, cwd, timeout=600):
    return subprocess.run(cmd, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=timeout)


def _torchrun(*args):
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
            os.path.join(REPO, "pretrain_gpt.py")] + list(args)


_HOLDER = """
import sys, time
from megatron_delta.checkpoint.save_lock import SaveDirLock
lock = SaveDirLock(sys.argv[1]).acquire()
print("held", flush=True)
time.sleep(600)
"""

# Four runs of the trainer in one process; each run's exit status on stdout as "RC <n>".
_DRIVER = """
import json, sys
from megatron_delta.trainer.main import main
for argv in json.loads(sys.argv[1]):
    print("RC", main(argv), flush=True)
"""


@pytest.mark.slow
def test_lock_integrity_and_fresh_start(tmp_path):
    run = str(tmp_path / "run")
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER, run], env=_env(), stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        refused = _run(_torchrun(*FLAGS, "--global-batch-size", "4", "--train-iters", "2", "--save-interval", "1",
                                 "--save", run, "--load", run), tmp_path, timeout=300)
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    out = refused.stdout + refused.stderr
    assert refused.returncode != 0, out
    lines = [ln for ln in out.splitlines() if ln.startswith(ERROR)]
    assert lines == [f"{ERROR}--save {run} is in use by another run (host {os.uname().nodename}, pid {holder.pid}, "
                     f"started {json.load(open(os.path.join(run, '.megatron-delta.lock')))['started']}; lock file "
                     f"{run}/.megatron-delta.lock): two runs saving into one directory overwrite each other's "
                     f"checkpoints. Wait for that run to end or stop it, or give this run another --save "
                     f"directory"], out
    assert " iteration        1/" not in out and not os.path.exists(os.path.join(run, "iter_0000001")), out

    # The holder is gone (SIGKILL): its lock file still names it
    flipped = {"model": str(tmp_path / "flip-model"), "optimizer": str(tmp_path / "flip-optimizer")}
    runs = [FLAGS + ["--train-iters", "0", "--save", run, "--load", run],
            FLAGS + ["--train-iters", "2", "--save-interval", "2", "--save", run, "--load", run, "--finetune"]]
    runs += [FLAGS + ["--train-iters", "4", "--save-interval", "2", "--load", d]
             for d in flipped.values()]
    unhashed = str(tmp_path / "unhashed")  # iteration 2 without integrity.json: loads, unverified, with a line
    runs.append(FLAGS + ["--train-iters", "2", "--load", unhashed])
    # the loads of the damaged copies run after the copies are made: the driver is started twice
    first = _run([sys.executable, "-c", _DRIVER, json.dumps(runs[:2])], tmp_path)
    assert first.stdout.count("RC 0") == 2, first.stdout[-3000:] + first.stderr[-5000:]
    assert (f" took over the lock of --save {run} from a run that ended without releasing it (host "
            f"{os.uname().nodename}, pid {holder.pid}, started ") in first.stdout, first.stdout[-3000:]
    assert first.stderr.count(f"pretrain_gpt.py: warning: --load {run} ") == 1, first.stderr
    assert (f"pretrain_gpt.py: warning: --load {run} holds no checkpoint (no latest_checkpointed_iteration.txt): "
            f"this run STARTS FROM SCRATCH (random weights, iteration 0)") in first.stderr, first.stderr
    for it in (0, 2):
        assert os.path.exists(os.path.join(run, f"iter_{it:07d}", "integrity.json")), os.listdir(run)
    assert open(os.path.join(run, ".megatron-delta.lock")).read() == "", "a clean exit empties the lock file"

    shards = {}
    for what, d in flipped.items():
        shutil.copytree(run, d)
        it = os.path.join(d, "iter_0000002")
        shards[what] = os.path.relpath(flip_tensor_bytes(
            it, "decoder.layers.mlp.linear_fc1.weight" if what == "model" else "optimizer.state.exp_avg."), it)
    shutil.copytree(run, unhashed)
    os.remove(os.path.join(unhashed, "iter_0000002", "integrity.json"))
    second = _run([sys.executable, "-c", _DRIVER, json.dumps(runs[2:])], tmp_path)
    assert [ln for ln in second.stdout.splitlines() if ln.startswith("RC ")] == ["RC 1", "RC 1", "RC 0"], (
        second.stdout[-3000:] + second.stderr[-5000:])
    assert (f" note: {unhashed}/iter_0000002 has no integrity.json (saved with --no-verify-integrity or by another "
            f"tool): loaded without verifying its files") in second.stdout, second.stdout[-3000:]
    errors = [ln for ln in second.stderr.splitlines() if ln.startswith(ERROR)]
    assert errors == [
        f"{ERROR}cannot load the checkpoint of iteration 2: {d}/iter_0000002/{shards[what]} differs from its hash "
        f"in integrity.json (bytes changed since the save). Complete checkpoints in {d}, newest first: 0. Delete "
        f"{d}/iter_0000002 and write 0 into {d}/latest_checkpointed_iteration.txt to resume from iteration 0 (the "
        f"newest that verifies), or pass --ckpt-step 0"
        for what, d in flipped.items()], second.stderr[-5000:]
    assert "Traceback" not in second.stderr


@pytest.mark.slow
def test_argument_error_once_under_torchrun(tmp_path):
    p = _run(_torchrun(*FLAGS, "--train-iters", "1", "--residual", "bogus"), tmp_path, timeout=300)
    out = p.stdout + p.stderr
    assert p.returncode != 0
    assert out.count("pretrain_gpt.py: error: argument --residual: invalid choice: 'bogus'") == 1, out
    assert out.count("usage: pretrain_gpt.py [FLAGS ...]") == 1, out
    assert "--tensor-model-parallel-size" not in out, "Megatron-LM's usage of all its flags is not printed"
