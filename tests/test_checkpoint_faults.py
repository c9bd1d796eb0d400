"""Damaged checkpoints, a full disk and a schedule mismatch on resume: one error line each, naming the file or
flag and what to do, exit code 1, no traceback (megatron_delta/checkpoint/errors.py).

The trainer as a program, on the tiny COMMON model of tests/trainer_driver.py:
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

from tests.test_trainer_cluster import TRACKER, _losses, _metrics, _run, _trainer
from tests.trainer_driver import COMMON

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
    job = _run(_trainer("--train-iters", "6", "--save", ckpt, "--save-interval", "2", "--exit-interval", "4",
                        "--delta-metrics-file", metrics), os.path.join(root, "run"))
    assert job.proc.returncode == 0, job.tail()
    return {"ckpt": ckpt, "records": _metrics(metrics)}


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
    job = _run([sys.executable, "-c", _CASES_DRIVER, json.dumps(cases), results], str(tmp_path / "cases"))
    assert job.proc.returncode == 0, job.tail()
    with open(results) as f:
        r = json.load(f)

    for name, ckpt in (("no_index", no_index), ("no_json", no_json)):
        assert r[name]["code"] == 1, (name, r[name]["stderr"][-3000:])
        missing = os.path.join(ckpt, "iter_0000004", ".metadata" if name == "no_index" else "metadata.json")
        line = _one_line(r[name]["stderr"])
        assert line.startswith(f"pretrain_gpt.py: error: cannot load the checkpoint of iteration 4: {missing} "
                               "is missing; the load failed with "), line
        assert line.endswith(f"Delete {os.path.join(ckpt, 'iter_0000004')} and write 2 into "
                             f"{os.path.join(ckpt, TRACKER)} to resume from iteration 2, or pass --ckpt-step 2"), line

    assert r["partial"]["code"] == 1, r["partial"]["stderr"][-3000:]
    line = _one_line(r["partial"]["stderr"])
    assert line.startswith(
        f"pretrain_gpt.py: error: cannot load the checkpoint of iteration 6: "
        f"{os.path.join(partial, 'iter_0000006', 'metadata.json')} is missing (and 1 more file(s)) (a save that "
        f"did not finish: {os.path.join(partial, TRACKER)} names iteration 4); "), line
    assert line.endswith("or pass --ckpt-step 4"), line

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
    assert [m["iteration"] for m in _metrics(metrics)] == [5]


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
    full = shlex.join(_trainer("--train-iters", "6", "--save", ckpt, "--save-interval", "2"))
    resume = shlex.join(_trainer("--train-iters", "6", "--load", ckpt, "--exit-interval", "3",
                                 "--delta-metrics-file", metrics))
    out = str(tmp_path)
    # One checkpoint of the tiny model is 2.8 MiB: iteration 2's fits in 4 MiB, iteration 4's does not.
    script = (f"mount -t tmpfs -o size=4m tmpfs {shlex.quote(mnt)} && "
              f"{{ {full} > {out}/full.out 2> {out}/full.err; echo $? > {out}/full.rc; "
              f"ls -a {shlex.quote(ckpt)} {shlex.quote(ckpt)}/* > {out}/listing; "
              f"{resume} > {out}/resume.out 2> {out}/resume.err; echo $? > {out}/resume.rc; }}")
    job = _run(_namespace() + ["sh", "-c", script], str(tmp_path / "namespace"))
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
    resumed = _metrics(metrics)
    assert [m["iteration"] for m in resumed] == [3]
    assert _losses(resumed, 3, 3) == pytest.approx(_losses(base["records"], 3, 3), abs=1e-6)
