"""Damaged checkpoints, a full disk and a schedule mismatch on resume: one error line each, naming the file or
flag and what to do, exit code 1, no traceback (megatron_delta/checkpoint/errors.py).

The trainer as a program, on the tiny COMMON model of tests/helpers/trainer_driver.py:
0. `--ckpt-step` of a missing iteration, a binary tracker, an edited run_config.json (a hash mismatch), a garbled
   one read with --no-verify-integrity, a garbled integrity.json: one line each naming the file and the
   checkpoints to resume from; a NaN written into an Adam second moment and loaded with --no-verify-integrity:
   the run stops before saving iteration 5, naming the tensor, and the tracker still names 4; SIGINT while
   training: one line naming the last complete checkpoint, exit status 130, that checkpoint verifies (one process,
   and 2 ranks under megatron_delta.trainer.launch).
1. `.metadata` deleted, `metadata.json` deleted, `--ckpt-step` at a save that did not finish, and a resume
   with a larger `--train-iters` (the weight-decay schedule differs) - four runs in one process (main() runs
   follow each other in-process), then the advice `--override-opt_param-scheduler` resumes.
2. `--save` on a 4 MiB tmpfs (a private mount namespace: `unshare`): the save of iteration 2 fits, that of
   iteration 4 does not. The line says "no space left on device", the free space and that iteration 2 is
   intact, and a resume from it trains on as the uninterrupted run.
"""
from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys

import pytest

from tests.helpers.trainer_driver import COMMON
from tests.helpers.trainer_jobs import TRACKER, Job, losses_of, run_job, trainer_cmd, training_records

# main() for each case in one process: {"name": {"code": int | "raised", "stderr": str}}
_CASES_DRIVER = r"""
import contextlib, io, json, sys, traceback
from megatron_delta.trainer.main import main
cases, out = json.loads(sys.argv[1]), {}
for name, argv in cases:
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except BaseException:
            code = "raised"
            traceback.print_exc()
    out[name] = {"code": code, "stderr": err.getvalue()}
    print(f"case {name}: {code}", flush=True)
with open(sys.argv[2], "w") as f:
    json.dump(out, f)
"""


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """Iterations 1-4 of a --train-iters 6 run, saving 2 and 4 (stopped by --exit-interval 4)."""
    root = str(tmp_path_factory.mktemp("faults_base"))
    ckpt, metrics = os.path.join(root, "ckpt"), os.path.join(root, "m.jsonl")
    job = run_job(trainer_cmd("--train-iters", "6", "--save", ckpt, "--save-interval", "2", "--exit-interval", "4",
                        "--delta-metrics-file", metrics), os.path.join(root, "run"))
    assert job.proc.returncode == 0, job.tail()
    return {"ckpt": ckpt, "records": training_records(metrics)}


def _one_line(stderr: str) -> str:
    """The error line, checked to be the only one of ours, the last line, with no traceback."""
    assert "Traceback" not in stderr, stderr[-3000:]
    ours = [line for line in stderr.splitlines() if line.startswith("pretrain_gpt.py:")]
    assert len(ours) == 1 and stderr.strip().splitlines()[-1] == ours[0], stderr[-3000:]
    assert ours[0].startswith("pretrain_gpt.py: error: ")
    return ours[0]


@pytest.mark.slow
def test_missing_metadata_partial_save_and_schedule_mismatch(base, tmp_path):
    def copy(name):
        return shutil.copytree(base["ckpt"], str(tmp_path / name))

    no_index, no_json, partial = copy("no_index"), copy("no_json"), copy("partial")
    os.remove(os.path.join(no_index, "iter_0000004", ".metadata"))
    os.remove(os.path.join(no_json, "iter_0000004", "metadata.json"))
    # a save killed after its first shard: iteration 6's directory holds a shard and nothing else
    os.makedirs(os.path.join(partial, "iter_0000006"))
    shutil.copy(os.path.join(partial, "iter_0000004", "__0_0.distcp"), os.path.join(partial, "iter_0000006"))
    metrics = str(tmp_path / "override.jsonl")
    run = ["--train-iters", "6", "--exit-interval", "5"]
    cases = [
        ("no_index", COMMON + run + ["--load", no_index]),
        ("no_json", COMMON + run + ["--load", no_json]),
        ("partial", COMMON + run + ["--load", partial, "--ckpt-step", "6"]),
        ("schedule", COMMON + ["--train-iters", "8", "--exit-interval", "5", "--load", base["ckpt"]]),
        ("override", COMMON + ["--train-iters", "8", "--exit-interval", "5", "--load", base["ckpt"],
                               "--override-opt_param-scheduler", "--delta-metrics-file", metrics]),
    ]
    results = str(tmp_path / "results.json")
    job = run_job([sys.executable, "-c", _CASES_DRIVER, json.dumps(cases), results], str(tmp_path / "cases"))
    assert job.proc.returncode == 0, job.tail()
    with open(results) as f:
        r = json.load(f)

    for name, ckpt in (("no_index", no_index), ("no_json", no_json)):
        assert r[name]["code"] == 1, (name, r[name]["stderr"][-3000:])
        missing = os.path.join(ckpt, "iter_0000004", ".metadata" if name == "no_index" else "metadata.json")
        # found missing by the integrity check, before torch's loader reads anything
        assert _one_line(r[name]["stderr"]) == (
            f"pretrain_gpt.py: error: cannot load the checkpoint of iteration 4: {missing} is missing. Complete "
            f"checkpoints in {ckpt}, newest first: 2. Delete {os.path.join(ckpt, 'iter_0000004')} and write 2 into "
            f"{os.path.join(ckpt, TRACKER)} to resume from iteration 2 (the newest that verifies), or pass "
            f"--ckpt-step 2")

    assert r["partial"]["code"] == 1, r["partial"]["stderr"][-3000:]
    line = _one_line(r["partial"]["stderr"])
    assert line.startswith(
        f"pretrain_gpt.py: error: cannot load the checkpoint of iteration 6: "
        f"{os.path.join(partial, 'iter_0000006', 'metadata.json')} is missing (and 1 more file(s)) (a save that "
        f"did not finish: {os.path.join(partial, TRACKER)} names iteration 4); "), line
    assert line.endswith(f"Complete checkpoints in {partial}, newest first: 4, 2; {os.path.join(partial, TRACKER)} "
                         f"names iteration 4, the newest: resume without --ckpt-step, or pass --ckpt-step 4"), line

    assert r["schedule"]["code"] == 1, r["schedule"]["stderr"][-3000:]
    line = _one_line(r["schedule"]["stderr"])
    assert line.startswith(
        f"pretrain_gpt.py: error: the checkpoint in {base['ckpt']} was trained with another schedule: total "
        "number of weight decay iterations (--train-iters) is 8 iterations in this run but 6 iterations in the "
        "checkpoint. Resume with the checkpoint's value, or add --override-opt_param-scheduler to continue with "
        "this run's schedule flags"), line
    assert "--use-checkpoint-opt_param-scheduler" in line

    # The advice works: --override-opt_param-scheduler resumes from iteration 4.
    assert r["override"]["code"] == 0, r["override"]["stderr"][-3000:]
    assert [m["iteration"] for m in training_records(metrics)] == [5]


def _nan(ckpt_dir: str, fqn_prefix: str) -> None:
    """Overwrite 16 bytes in the middle of the first tensor whose name starts with fqn_prefix with 0xFF (NaN)."""
    from torch.distributed.checkpoint import FileSystemReader

    storage = FileSystemReader(ckpt_dir).read_metadata().storage_data
    info = next(v for k, v in storage.items() if k.fqn.startswith(fqn_prefix))
    with open(os.path.join(ckpt_dir, info.relative_path), "r+b") as f:
        f.seek(info.offset + info.length // 2)
        f.write(b"\xff" * 16)


@pytest.mark.slow
def test_unreadable_files_advice_from_disk_and_no_non_finite_save(base, tmp_path):
    def copy(name):
        return shutil.copytree(base["ckpt"], str(tmp_path / name))

    tracked = {name: copy(name) for name in ("step", "tracker", "edited", "garbled", "manifest", "nan")}
    it4 = {name: os.path.join(d, "iter_0000004") for name, d in tracked.items()}
    with open(os.path.join(tracked["tracker"], TRACKER), "wb") as f:
        f.write(b"\x89PNG\r\n\x1a\n")
    rc = os.path.join(it4["edited"], "run_config.json")
    with open(rc) as f:
        text = f.read()
    with open(rc, "w") as f:
        f.write(text.replace('"hidden_size": 64', '"hidden_size": 96'))
    with open(os.path.join(it4["garbled"], "run_config.json"), "w") as f:
        f.write("{bad: json")
    with open(os.path.join(it4["manifest"], "integrity.json"), "w") as f:
        f.write('{"files": ')
    _nan(it4["nan"], "optimizer.state.exp_avg_sq.decoder.layers.mlp.linear_fc1.weight")
    run = ["--train-iters", "6", "--exit-interval", "5"]
    cases = [(name, COMMON + run + ["--load", tracked[name]]) for name in ("tracker", "edited", "manifest")]
    cases += [("garbled", COMMON + run + ["--load", tracked["garbled"], "--no-verify-integrity"]),
              ("step", COMMON + run + ["--load", tracked["step"], "--ckpt-step", "3"]),
              ("nan", COMMON + ["--train-iters", "6", "--save-interval", "1", "--load", tracked["nan"], "--save",
                                tracked["nan"], "--no-verify-integrity"])]
    results = str(tmp_path / "results.json")
    job = run_job([sys.executable, "-c", _CASES_DRIVER, json.dumps(cases), results], str(tmp_path / "cases"))
    assert job.proc.returncode == 0, job.tail()
    with open(results) as f:
        r = json.load(f)
    lines = {}
    for name in tracked:
        assert r[name]["code"] == 1, (name, r[name]["stderr"][-3000:])
        lines[name] = _one_line(r[name]["stderr"])[len("pretrain_gpt.py: error: "):]

    def tracker(name):
        return os.path.join(tracked[name], TRACKER)

    assert lines["step"] == (
        f"cannot load the checkpoint of iteration 3: {os.path.join(tracked['step'], 'iter_0000003')} does not exist "
        f"(--ckpt-step names it). Complete checkpoints in {tracked['step']}, newest first: 4, 2; {tracker('step')} "
        f"names iteration 4, the newest: resume without --ckpt-step, or pass --ckpt-step 4")
    assert lines["tracker"] == (
        f"--load: {tracker('tracker')} is corrupt (not text: it starts with b'\\x89PNG\\r\\n\\x1a\\n'); it names "
        f"the checkpoint to resume from. Complete checkpoints in {tracked['tracker']}, newest first: 4, 2. Write 4 "
        f"into {tracker('tracker')} to resume from iteration 4 (the newest), or pass --ckpt-step 4")
    assert lines["edited"] == (
        f"cannot load the checkpoint of iteration 4: {rc} differs from its hash in integrity.json (bytes changed "
        f"since the save). Complete checkpoints in {tracked['edited']}, newest first: 2. Delete {it4['edited']} and "
        f"write 2 into {tracker('edited')} to resume from iteration 2 (the newest that verifies), or pass "
        f"--ckpt-step 2")
    assert lines["garbled"] == (
        f"{os.path.join(it4['garbled'], 'run_config.json')} is corrupt (not JSON: Expecting property name enclosed "
        f"in double quotes: line 1 column 2 (char 1)); it records the checkpoint's model flags. Restore it from a "
        f"copy of the checkpoint, or load another checkpoint of {tracked['garbled']}")
    assert lines["manifest"] == (
        f"{os.path.join(it4['manifest'], 'integrity.json')} is corrupt (not JSON: Expecting value: line 1 column 11 "
        f"(char 10)): the files of {it4['manifest']} cannot be verified. Restore it from a copy of the checkpoint, "
        f"or load the checkpoint unverified with --no-verify-integrity")
    unverified = (f" note: --no-verify-integrity: {it4['nan']} is loaded without verifying its files against its "
                  f"integrity.json")
    assert job.stdout().count(unverified) == 1, job.stdout()[-3000:]
    prefix, _, rest = lines["nan"].partition(" holds NaN or inf values, so this state is not saved; ")
    assert prefix.startswith("iteration 5: decoder.layers.") and prefix.endswith(".mlp.linear_fc1.weight"), prefix
    assert rest == (f"the last good checkpoint is iteration 4 ({it4['nan']}), which {tracker('nan')} still names: "
                    f"resume from it with --load {tracked['nan']} (with a lower --lr, or --clip-grad, if the loss "
                    f"diverged)")
    with open(tracker("nan")) as f:
        assert f.read().strip() == "4"
    assert not os.path.exists(os.path.join(tracked["nan"], "iter_0000005"))


@pytest.mark.slow
def test_sigint_while_training_is_one_line_and_130(tmp_path):
    import signal
    import time

    from megatron_delta.checkpoint.integrity import verifies

    ckpt = str(tmp_path / "ckpt")
    job = Job(trainer_cmd("--train-iters", "400", "--save", ckpt, "--save-interval", "3"), str(tmp_path / "run"))
    try:
        deadline = time.time() + 300
        while not os.path.exists(os.path.join(ckpt, TRACKER)) and time.time() < deadline and job.proc.poll() is None:
            time.sleep(0.5)
        time.sleep(2)
        os.killpg(job.proc.pid, signal.SIGINT)  # as Ctrl-C in a terminal: the whole process group
        code = job.wait(120)
    finally:
        job.kill()
    assert code == 130, job.tail()
    with open(os.path.join(ckpt, TRACKER)) as f:
        last = int(f.read())
    last_dir = os.path.join(ckpt, f"iter_{last:07d}")
    assert _one_line(job.stderr()) == (
        f"pretrain_gpt.py: error: interrupted (SIGINT): the last complete checkpoint is iteration {last} ({last_dir}), "
        f"which {os.path.join(ckpt, TRACKER)} names; resume with --load {ckpt}")
    assert verifies(last_dir)


@pytest.mark.slow
def test_sigint_under_the_launcher_is_one_line_and_130(tmp_path):
    """2 ranks under `python -m megatron_delta.trainer.launch`: a Ctrl-C reaches the launcher only (torchrun starts
    each worker in a session of its own); it passes SIGINT on, global rank 0 prints the one line, the launcher
    exits 130."""
    import signal
    import time

    from megatron_delta.checkpoint.integrity import verifies

    ckpt = str(tmp_path / "ckpt")
    launch = [sys.executable, "-m", "megatron_delta.trainer.launch", "--standalone", "--nproc-per-node", "2",
              "-m", "megatron_delta.trainer"]
    job = Job(launch + COMMON + ["--train-iters", "400", "--save", ckpt, "--save-interval", "3"],
              str(tmp_path / "run"))
    try:
        deadline = time.time() + 300
        while not os.path.exists(os.path.join(ckpt, TRACKER)) and time.time() < deadline and job.proc.poll() is None:
            time.sleep(0.5)
        os.kill(job.proc.pid, signal.SIGINT)
        code = job.wait(180)
    finally:
        job.kill()
    assert code == 130, job.tail()
    with open(os.path.join(ckpt, TRACKER)) as f:
        last = int(f.read())
    assert "Traceback" not in job.stderr() + job.stdout(), job.tail()
    ours = [line for line in job.stderr().splitlines() if line.startswith("pretrain_gpt.py:")]
    assert ours == [f"pretrain_gpt.py: error: interrupted (SIGINT): the last complete checkpoint is iteration {last} "
                    f"({os.path.join(ckpt, f'iter_{last:07d}')}), which {os.path.join(ckpt, TRACKER)} names; resume "
                    f"with --load {ckpt}"], job.tail()
    assert verifies(os.path.join(ckpt, f"iter_{last:07d}"))


def _namespace() -> list:
    """A private mount namespace in which a tmpfs can be mounted: unprivileged (a user namespace) or as root."""
    for cmd in (["unshare", "--user", "--map-root-user", "--mount"], ["unshare", "--mount"]):
        if shutil.which(cmd[0]) and subprocess.run(cmd + ["true"], capture_output=True).returncode == 0:
            return cmd
    pytest.fail("this test mounts a small tmpfs in a private mount namespace: it needs `unshare` with user "
                "namespaces enabled, or root")


@pytest.mark.slow
def test_disk_full_during_a_save_is_one_line_and_the_previous_checkpoint_loads(base, tmp_path):
    mnt = str(tmp_path / "small")
    os.makedirs(mnt)
    ckpt, metrics = os.path.join(mnt, "ckpt"), str(tmp_path / "resumed.jsonl")
    full = shlex.join(trainer_cmd("--train-iters", "6", "--save", ckpt, "--save-interval", "2"))
    resume = shlex.join(trainer_cmd("--train-iters", "6", "--load", ckpt, "--exit-interval", "3",
                                 "--delta-metrics-file", metrics))
    out = str(tmp_path)
    # One checkpoint of the tiny model is 2.8 MiB: iteration 2's fits in 4 MiB, iteration 4's does not.
    script = (f"mount -t tmpfs -o size=4m tmpfs {shlex.quote(mnt)} && "
              f"{{ {full} > {out}/full.out 2> {out}/full.err; echo $? > {out}/full.rc; "
              f"ls -a {shlex.quote(ckpt)} {shlex.quote(ckpt)}/* > {out}/listing; "
              f"{resume} > {out}/resume.out 2> {out}/resume.err; echo $? > {out}/resume.rc; }}")
    job = run_job(_namespace() + ["sh", "-c", script], str(tmp_path / "namespace"))
    assert job.proc.returncode == 0, job.tail()

    def read(name):
        with open(os.path.join(out, name)) as f:
            return f.read()

    assert read("full.rc").strip() == "1", read("full.err")[-3000:]
    line = _one_line(read("full.err"))
    previous = os.path.join(ckpt, "iter_0000002")
    assert line.startswith(f"pretrain_gpt.py: error: cannot save the checkpoint of iteration 4 in {ckpt}: "
                           "no space left on device ("), line
    assert " free, the last checkpoint took 2.7 MiB); " in line, line
    assert (f"the previous checkpoint, iteration 2 ({previous}), is intact and {os.path.join(ckpt, TRACKER)} "
            f"names it. Delete the unfinished {os.path.join(ckpt, 'iter_0000004')} (it is never loaded), free space "
            f"or --save to a larger filesystem, and resume with --load {ckpt}") in line, line

    # The previous checkpoint is intact: the resume loads it and trains iteration 3 as the uninterrupted run.
    assert read("resume.rc").strip() == "0", read("resume.err")[-3000:]
    assert f"loading distributed checkpoint from {ckpt} at iteration 2" in read("resume.out")
    resumed = training_records(metrics)
    assert [m["iteration"] for m in resumed] == [3]
    assert losses_of(resumed, 3, 3) == pytest.approx(losses_of(base["records"], 3, 3), abs=1e-6)
