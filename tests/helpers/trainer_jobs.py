"""The trainer as a program (python -m megatron_delta.trainer, or under torchrun) launched in a process group of its
own, with its output in files, and what a test reads back: the metrics file's training records and the tracker."""
import json
import os
import signal
import subprocess
import sys

from tests.helpers import REPO_ROOT
from tests.helpers.trainer_driver import COMMON

TRACKER = "latest_checkpointed_iteration.txt"
_DIST_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK",
             "ROLE_RANK", "TORCHELASTIC_RUN_ID")


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in _DIST_ENV}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join([REPO_ROOT] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    return env


class Job:
    """One launch (a process group of its own, so that torchrun's workers go with it), output in files."""

    def __init__(self, cmd: list, log: str):
        self.log = log
        self.out, self.err = open(log + ".out", "w+"), open(log + ".err", "w+")
        self.proc = subprocess.Popen(cmd, env=_env(), cwd=REPO_ROOT, stdout=self.out, stderr=self.err,
                                     start_new_session=True)

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"{self.log}: still running after {timeout:.0f}s\n{self.tail()}")

    def kill(self):
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def stdout(self) -> str:
        self.out.flush()
        with open(self.log + ".out") as f:
            return f.read()

    def stderr(self) -> str:
        self.err.flush()
        with open(self.log + ".err") as f:
            return f.read()

    def tail(self) -> str:
        return f"--- stdout tail ---\n{self.stdout()[-3000:]}\n--- stderr tail ---\n{self.stderr()[-5000:]}"


def trainer_cmd(*flags) -> list:
    return [sys.executable, "-m", "megatron_delta.trainer"] + COMMON + list(flags)


def run_job(cmd: list, log: str, timeout: float = 600) -> Job:
    job = Job(cmd, log)
    job.wait(timeout)
    return job


def training_records(path: str) -> list:
    """The training records of --delta-metrics-file, in the order written (a restart appends)."""
    if not os.path.exists(path):
        return []
    out = []
    with open(path) as f:
        for line in f:
            if line.endswith("\n"):
                r = json.loads(line)
                if "lm_loss" in r and r.get("split") is None:
                    out.append(r)
    return out


def losses_of(records, first: int, last: int) -> list:
    by_iter = {r["iteration"]: r for r in records}
    return [by_iter[i]["lm_loss"] for i in range(first, last + 1)]


def torchrun_cmd(*args) -> list:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"] + list(args)
