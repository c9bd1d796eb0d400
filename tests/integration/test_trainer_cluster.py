"""What a cluster job meets, through Megatron-LM's own mechanisms (megatron.training 0.19.2), one test each.

Every run is the trainer as a program (`python -m megatron_delta.trainer`, or under `torchrun`), on the
tiny COMMON model of tests/helpers/trainer_driver.py, as a job script would start it:

1. SIGTERM with --exit-signal-handler: the job saves the iteration reached, exits 0, and a resume from
   that checkpoint continues as the uninterrupted run.
2. --exit-interval / --exit-duration-in-mins: training stops with a checkpoint of the iteration reached (the
   duration job's minute passes while it is stopped and the other tests run: the fixture duration_job).
3. A rank SIGKILLed under `torchrun --max-restarts 1` (DP2): the restarted ranks load the last complete
   checkpoint and train on exactly as an uninterrupted run, and no process of the killed rank survives;
   then SIGTERM to the launcher (megatron_delta.trainer.launch): the workers save, it exits 0, and a
   resume from that checkpoint ends as the uninterrupted run.
4. A save killed midway (SIGKILL while iteration 4's checkpoint is written) is never loaded: the tracker
   still names iteration 2, --load resumes from 2 exactly, and the next save of 4 overwrites the leftover.
5. A truncated .distcp shard: one error line naming the file and what to do, exit code 1, no traceback.

Every single-process run has --train-iters 50 (the mock data's sample order depends on it), so runs stopped
and resumed at different iterations are compared with one uninterrupted run (the fixture `straight`).
"""
from __future__ import annotations

import os
import re
import shutil
import signal
import sys
import time
from datetime import datetime

import pytest

from tests.helpers.trainer_driver import COMMON
from tests.helpers.trainer_jobs import TRACKER, Job, losses_of, run_job, torchrun_cmd, trainer_cmd, training_records

ITERS = ["--train-iters", "50"]


# ------------------------------------------------------------------------------------------- helpers
def _tracker(ckpt: str):
    try:
        with open(os.path.join(ckpt, TRACKER)) as f:
            return int(f.read().strip())
    except FileNotFoundError:
        return None


def _iter_dirs(ckpt: str) -> list:
    return sorted(int(n[5:]) for n in os.listdir(ckpt) if re.fullmatch(r"iter_\d{7}", n))


def _wait_until(cond, job: Job, timeout: float, poll: float = 0.02):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        if job.proc.poll() is not None:
            raise AssertionError(f"{job.log}: exited ({job.proc.returncode}) before the condition\n{job.tail()}")
        time.sleep(poll)
    job.kill()
    raise AssertionError(f"{job.log}: condition not met within {timeout:.0f}s\n{job.tail()}")


def _last_iteration(path: str) -> int:
    records = training_records(path)
    return records[-1]["iteration"] if records else 0


def _lrs(records, first: int, last: int) -> list:
    by_iter = {r["iteration"]: r for r in records}
    return [by_iter[i]["lr"] for i in range(first, last + 1)]


# ------------------------------------------------------------------------- the uninterrupted run
@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """10 iterations uninterrupted: saves 3, 6, 9 (--save-interval 3); --exit-interval 10 saves 10 and exits."""
    root = str(tmp_path_factory.mktemp("cluster_straight"))
    ckpt, metrics = os.path.join(root, "ckpt"), os.path.join(root, "m.jsonl")
    job = run_job(trainer_cmd(*ITERS, "--save", ckpt, "--save-interval", "3", "--exit-interval", "10",
                        "--delta-metrics-file", metrics), os.path.join(root, "run"))
    return {"job": job, "code": job.proc.returncode, "ckpt": ckpt, "records": training_records(metrics)}


# ------------------------------------------------------------------------------------------- 1
@pytest.mark.slow
def test_sigterm_with_exit_signal_handler_saves_exits_0_and_resumes(straight, tmp_path):
    ckpt, metrics = str(tmp_path / "ckpt"), str(tmp_path / "m.jsonl")
    job = Job(trainer_cmd(*ITERS, "--exit-signal-handler", "--save", ckpt, "--save-interval", "1000",
                       "--delta-metrics-file", metrics), str(tmp_path / "run"))
    _wait_until(lambda: _last_iteration(metrics) >= 2, job, timeout=400)
    job.proc.send_signal(signal.SIGTERM)  # what a scheduler sends before its kill
    code = job.wait(300)
    assert code == 0, job.tail()
    reached = _last_iteration(metrics)
    assert "exiting program after receiving SIGTERM" in job.stdout(), job.tail()
    assert 2 <= reached < 10, reached
    assert _tracker(ckpt) == reached and _iter_dirs(ckpt) == [reached]  # saved at the iteration reached

    resumed_metrics = str(tmp_path / "resumed.jsonl")
    job = run_job(trainer_cmd(*ITERS, "--load", ckpt, "--exit-interval", "10", "--delta-metrics-file", resumed_metrics),
               str(tmp_path / "resumed"))
    assert job.proc.returncode == 0, job.tail()
    assert f"loading distributed checkpoint from {ckpt} at iteration {reached}" in job.stdout()
    resumed = training_records(resumed_metrics)
    assert [r["iteration"] for r in resumed] == list(range(reached + 1, 11))
    assert straight["code"] == 0, straight["job"].tail()
    assert losses_of(resumed, reached + 1, 10) == pytest.approx(losses_of(straight["records"], reached + 1, 10),
                                                                abs=1e-6)
    assert _lrs(resumed, reached + 1, 10) == pytest.approx(_lrs(straight["records"], reached + 1, 10), rel=1e-12)


# ------------------------------------------------------------------------------------------- 2
@pytest.mark.slow
def test_exit_interval_stops_with_a_checkpoint(straight):
    job = straight["job"]
    assert straight["code"] == 0, job.tail()
    assert [r["iteration"] for r in straight["records"]] == list(range(1, 11))
    assert "exiting program at iteration 10" in job.stdout()
    # 3, 6, 9 by --save-interval 3; 10 by --exit-interval 10 (not a multiple of 3), and the tracker names it
    assert _iter_dirs(straight["ckpt"]) == [3, 6, 9, 10] and _tracker(straight["ckpt"]) == 10


def _log_time(stdout: str, iteration: int) -> datetime:
    m = re.search(r"\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d+)\] iteration +%d/" % iteration, stdout)
    return datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S.%f")


# ------------------------------------------------------------------------------------------- 2b
DURATION_TEST = "test_exit_duration_in_mins_stops_with_a_checkpoint"
PAUSE = 62  # seconds the duration job is stopped for: its clock passes the minute meanwhile


@pytest.fixture(scope="module", autouse=True)
def duration_job(request, tmp_path_factory):
    """The --exit-duration-in-mins job of the test at the end of this file, started with the module. Its minute
    (--exit-duration-in-mins is an int: 1 minute at least, counted from the run's start) would keep the suite
    waiting; instead the job is stopped (SIGSTOP, no CPU used) once it has logged iteration 2 and continued
    (SIGCONT) PAUSE seconds later, while the other tests of the module run. Megatron's own clock and check decide
    the exit: its wall clock passes the minute during the pause, and the iteration in progress at SIGCONT is the
    first to end past it."""
    if not any(item.name == DURATION_TEST for item in request.session.items):
        yield None
        return
    import threading

    root = str(tmp_path_factory.mktemp("duration"))
    ckpt, metrics = os.path.join(root, "ckpt"), os.path.join(root, "m.jsonl")
    # --train-iters 5000 would take far longer than the minute
    job = Job(trainer_cmd("--train-iters", "5000", "--exit-duration-in-mins", "1", "--save", ckpt,
                       "--save-interval", "5000", "--delta-metrics-file", metrics), os.path.join(root, "run"))
    paused = {}

    def pause():
        while job.proc.poll() is None and _last_iteration(metrics) < 2:
            time.sleep(0.05)
        if job.proc.poll() is None:
            os.killpg(job.proc.pid, signal.SIGSTOP)
            paused["stopped_after"] = _last_iteration(metrics)
            time.sleep(PAUSE)
            os.killpg(job.proc.pid, signal.SIGCONT)
        paused["done"] = True

    watcher = threading.Thread(target=pause, daemon=True)
    watcher.start()
    yield {"job": job, "ckpt": ckpt, "metrics": metrics, "watcher": watcher, "paused": paused}
    if job.proc.poll() is None:
        os.killpg(job.proc.pid, signal.SIGCONT)
    job.kill()


# ------------------------------------------------------------------------------------------- 3
def _children(pid: int) -> list:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            if ppid == pid:
                out.append(int(entry))
    return out


def _worker_with_rank(agent_pid: int, rank: int):
    for pid in _children(agent_pid):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
        except OSError:
            continue
        if env.get(b"RANK") == str(rank).encode():
            return pid
    return None


def _launcher(*args) -> list:
    """megatron_delta.trainer.launch: torchrun whose SIGTERM goes to the workers (examples/torchrun_multinode.sh)."""
    return [sys.executable, "-m", "megatron_delta.trainer.launch", "--standalone", "--nproc-per-node", "2"] + list(args)


def _split_at_restart(records: list):
    """(records of the first attempt, records of the restarted one): a restart logs a lower iteration again."""
    iterations = [r["iteration"] for r in records]
    restart = next((i for i in range(1, len(iterations)) if iterations[i] <= iterations[i - 1]), len(records))
    return records[:restart], records[restart:]


def _processes_with(marker: str) -> list:
    """The processes whose environment holds marker (a variable set only in one job's environment)."""
    import psutil

    found = []
    for p in psutil.process_iter(["pid"]):
        try:
            if p.environ().get("MEGATRON_DELTA_TEST_JOB") == marker:
                found.append((p.pid, " ".join(p.cmdline())[:160], p.memory_info().rss // 2**20))
        except (psutil.Error, OSError):
            continue
    return found


@pytest.mark.slow
def test_rank_killed_then_launcher_sigterm(tmp_path):
    """One launch through megatron_delta.trainer.launch under --max-restarts 1 with --exit-signal-handler:
    (a) rank 0 SIGKILLed after the save of iteration 3: the restarted ranks load it and train on exactly as an
    uninterrupted run; (b) no process of the killed ranks survives (megatron-core's checkpoint writer's
    Manager, patch ckpt_writer_manager_exits_with_rank); (c) SIGTERM to the launcher, as a cluster sends it:
    the workers save the iteration reached and the launcher exits 0; (d) a resume from that checkpoint ends
    as the uninterrupted run, and no process of the job is left."""
    import uuid

    flags = COMMON + ["--train-iters", "10", "--save-interval", "3", "--hidden-dropout", "0.1"]
    ref_metrics = str(tmp_path / "ref.jsonl")
    ref = run_job(torchrun_cmd("-m", "megatron_delta.trainer", *flags, "--save", str(tmp_path / "ref-ckpt"),
                         "--delta-metrics-file", ref_metrics), str(tmp_path / "ref"), timeout=600)
    assert ref.proc.returncode == 0, ref.tail()
    reference = training_records(ref_metrics)
    assert [r["iteration"] for r in reference] == list(range(1, 11))

    ckpt, metrics = str(tmp_path / "ckpt"), str(tmp_path / "m.jsonl")
    marker = uuid.uuid4().hex
    os.environ["MEGATRON_DELTA_TEST_JOB"] = marker  # inherited by the job's processes only (Job copies os.environ)
    try:
        # Each restart attempt gets a rendezvous store of its own (megatron_delta.trainer.main._elastic_attempt_store).
        job = Job(_launcher("--max-restarts", "1", "-m", "megatron_delta.trainer", *flags, "--exit-signal-handler",
                            "--save", ckpt, "--load", ckpt, "--delta-metrics-file", metrics), str(tmp_path / "run"))
    finally:
        del os.environ["MEGATRON_DELTA_TEST_JOB"]
    # Rank 1 writes the metrics; iteration 4 logged means iteration 3's checkpoint is complete.
    _wait_until(lambda: _last_iteration(metrics) >= 4, job, timeout=500, poll=0.01)
    victim = _worker_with_rank(job.proc.pid, 0)
    assert victim is not None, job.tail()
    os.kill(victim, signal.SIGKILL)
    killed_after = _last_iteration(metrics)
    complete = _tracker(ckpt)  # the last complete checkpoint when the rank died
    assert complete is not None and complete % 3 == 0 and complete <= killed_after, (complete, killed_after)
    # The restarted attempt has trained an iteration: SIGTERM to the launcher.
    _wait_until(lambda: _split_at_restart(training_records(metrics))[1], job, timeout=500, poll=0.01)
    job.proc.send_signal(signal.SIGTERM)
    code = job.wait(600)
    assert code == 0, job.tail()
    assert "SIGTERM passed on to 2 worker(s)" in job.stderr(), job.tail()
    assert "exiting program after receiving SIGTERM" in job.stdout(), job.tail()
    before, after = _split_at_restart(training_records(metrics))
    reached = after[-1]["iteration"]
    assert [r["iteration"] for r in before] == list(range(1, len(before) + 1)) and len(before) >= killed_after
    assert [r["iteration"] for r in after] == list(range(complete + 1, reached + 1)) and reached < 10, after
    assert _tracker(ckpt) == reached  # saved at the iteration reached
    assert losses_of(before, 1, len(before)) == pytest.approx(losses_of(reference, 1, len(before)), abs=1e-6)
    assert losses_of(after, complete + 1, reached) == pytest.approx(losses_of(reference, complete + 1, reached),
                                                                    abs=1e-6)
    # Nothing of the job is left: not the killed rank's checkpoint writer (its Manager, ~600 MB, and resource
    # tracker were reparented to init before the patch), nor anything of the restarted attempt.
    deadline = time.monotonic() + 30
    while _processes_with(marker) and time.monotonic() < deadline:
        time.sleep(0.2)  # the Manager looks for its parent every 0.2 s
    assert _processes_with(marker) == [], _processes_with(marker)

    resumed_metrics = str(tmp_path / "resumed.jsonl")
    job = run_job(torchrun_cmd("-m", "megatron_delta.trainer", *flags, "--load", ckpt, "--save", ckpt,
                         "--delta-metrics-file", resumed_metrics), str(tmp_path / "resumed"))
    assert job.proc.returncode == 0, job.tail()
    resumed = training_records(resumed_metrics)
    assert [r["iteration"] for r in resumed] == list(range(reached + 1, 11))
    assert losses_of(resumed, reached + 1, 10) == pytest.approx(losses_of(reference, reached + 1, 10), abs=1e-6)
    assert _lrs(resumed, reached + 1, 10) == pytest.approx(_lrs(reference, reached + 1, 10), rel=1e-12)
    assert _tracker(ckpt) == 10  # and the end of training saved iteration 10


# ------------------------------------------------------------------------------------------- 4
@pytest.mark.slow
def test_a_save_killed_midway_is_never_loaded(straight, tmp_path):
    ckpt, metrics = str(tmp_path / "ckpt"), str(tmp_path / "m.jsonl")
    job = Job(trainer_cmd(*ITERS, "--save", ckpt, "--save-interval", "2", "--delta-metrics-file", metrics),
              str(tmp_path / "run"))
    # Stop the job as soon as a save has written its first file, then look: while the tracker still names
    # the previous iteration, that save is incomplete -> SIGKILL there. (A save that finished before the stop
    # was seen too late: let the job go on to the next save.)
    caught = None
    for target in (4, 6, 8):
        partial = os.path.join(ckpt, f"iter_{target:07d}")
        _wait_until(lambda: os.path.isdir(partial) and os.listdir(partial), job, timeout=500, poll=0.001)
        os.killpg(job.proc.pid, signal.SIGSTOP)
        if _tracker(ckpt) == target - 2:
            caught = target
            break
        os.killpg(job.proc.pid, signal.SIGCONT)
    job.kill()  # SIGKILL, mid-save
    assert caught is not None, "every save finished before the job could be stopped"
    previous = caught - 2
    assert _tracker(ckpt) == previous and _iter_dirs(ckpt) == list(range(2, caught + 1, 2))
    leftover = sorted(os.listdir(os.path.join(ckpt, f"iter_{caught:07d}")))

    resumed_metrics = str(tmp_path / "resumed.jsonl")
    job = run_job(trainer_cmd(*ITERS, "--load", ckpt, "--save", ckpt, "--save-interval", "2", "--exit-interval", "10",
                        "--delta-metrics-file", resumed_metrics), str(tmp_path / "resumed"))
    assert job.proc.returncode == 0, job.tail()
    assert f"loading distributed checkpoint from {ckpt} at iteration {previous}" in job.stdout(), (leftover, job.tail())
    resumed = training_records(resumed_metrics)
    assert [r["iteration"] for r in resumed] == list(range(previous + 1, 11))
    assert straight["code"] == 0, straight["job"].tail()
    assert losses_of(resumed, previous + 1, 10) == pytest.approx(losses_of(straight["records"], previous + 1, 10),
                                                                 abs=1e-6)
    # the leftover is overwritten by the next save of that iteration (dist_checkpointing.save warns)
    assert "Overwriting old incomplete / corrupted checkpoint" in job.stdout() + job.stderr(), leftover
    assert _tracker(ckpt) == 10 and _iter_dirs(ckpt) == [2, 4, 6, 8, 10]


# ------------------------------------------------------------------------------------------- 5
@pytest.mark.slow
def test_truncated_shard_is_one_error_line(straight, tmp_path):
    assert straight["code"] == 0, straight["job"].tail()
    ckpt = str(tmp_path / "ckpt")
    shutil.copytree(straight["ckpt"], ckpt)
    shards = sorted(n for n in os.listdir(os.path.join(ckpt, "iter_0000010")) if n.endswith(".distcp"))
    shard = os.path.join(ckpt, "iter_0000010", shards[0])
    os.truncate(shard, os.path.getsize(shard) // 2)  # a copy or a write cut short

    # main() translates the failure with megatron_delta/checkpoint/errors.describe_load_failure
    job = run_job(trainer_cmd(*ITERS, "--load", ckpt, "--exit-interval", "11"), str(tmp_path / "run"))
    err, out = job.stderr(), job.stdout()
    assert job.proc.returncode == 1, job.tail()
    assert "Traceback" not in err and "Traceback" not in out, job.tail()
    ours = [line for line in err.splitlines() if line.startswith("pretrain_gpt.py:")]
    assert len(ours) == 1 and err.strip().splitlines()[-1] == ours[0], job.tail()
    line = ours[0]
    assert line.startswith("pretrain_gpt.py: error: cannot load the checkpoint of iteration 10: "), line
    assert shard in line and "truncated" in line, line
    assert "--ckpt-step 9" in line and os.path.join(ckpt, TRACKER) in line, line

    # The advice works: --ckpt-step 9 resumes from iteration 9 as the uninterrupted run.
    metrics = str(tmp_path / "m.jsonl")
    job = run_job(trainer_cmd(*ITERS, "--load", ckpt, "--ckpt-step", "9", "--exit-interval", "10",
                        "--delta-metrics-file", metrics),
               str(tmp_path / "advice"))
    assert job.proc.returncode == 0, job.tail()
    resumed = training_records(metrics)
    assert [r["iteration"] for r in resumed] == [10]
    assert losses_of(resumed, 10, 10) == pytest.approx(losses_of(straight["records"], 10, 10), abs=1e-6)


# ------------------------------------------------------------------------------------- 2b (last: see duration_job)
@pytest.mark.slow
def test_exit_duration_in_mins_stops_with_a_checkpoint(duration_job):
    job, ckpt, metrics = duration_job["job"], duration_job["ckpt"], duration_job["metrics"]
    duration_job["watcher"].join(timeout=600)
    code = job.wait(300)
    assert code == 0, (duration_job["paused"], job.tail())
    out = job.stdout()
    m = re.search(r"\[exiting program after ([0-9.]+) minutes\]", out)
    assert m, job.tail()
    minutes = float(m.group(1))
    reached = _last_iteration(metrics)
    assert minutes > 1.0 and 1 <= reached < 5000, duration_job["paused"]
    assert _tracker(ckpt) == reached and _iter_dirs(ckpt) == [reached]
    # The right iteration: the first whose end is past the minute. The clock started at
    # log(reached) - minutes (the check follows the iteration's log line within milliseconds).
    if reached > 1:
        start = _log_time(out, reached).timestamp() - 60 * minutes
        assert _log_time(out, reached - 1).timestamp() - start < 60 + 1.0
