"""Installed, not only checked out: a wheel of the checkout, installed into a folder of its own, runs the embedded
default training from another directory and carries its package data (the bundled corpus, the lm-eval task, the
HF remote code).

The wheel is built without build isolation and installed with --no-deps: the dependencies are the test
environment's own (nothing is downloaded). PYTHONPATH names the install folder alone, so no file of the checkout
can be imported; the run's working directory is an empty folder.
"""
import json
import os
import shutil
import subprocess
import sys

import pytest

from tests.helpers import REPO_ROOT

# What the package finds through its own path once installed (relative to the installed megatron_delta/).
PACKAGE_DATA = (
    "data/bundled/sotu.txt.xz", "data/bundled/wiki.txt.xz", "data/bundled/NOTICE.md",
    "evaluation/lm_eval_tasks/delta_cloze/_template_yaml", "evaluation/lm_eval_tasks/delta_cloze/cloze_data.py",
    "evaluation/lm_eval_tasks/delta_cloze/delta_cloze_sotu.yaml",
    "evaluation/lm_eval_tasks/delta_cloze/delta_cloze_wiki.yaml",
    # the HF remote code an export writes beside the weights (megatron_delta/hf/__init__.py's list)
    "hf/configuration_delta.py", "hf/modeling_delta.py", "core/modes.py",
    "core/csrc/router_kernels.c",
)


def _run(cmd, **kw):
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=900, **kw)
    assert p.returncode == 0, f"{' '.join(map(str, cmd))}: exit {p.returncode}\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    return p


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """(install folder, wheel path): the checkout's wheel installed with pip --target."""
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(os.path.join(REPO_ROOT, name), src / name)
    shutil.copytree(os.path.join(REPO_ROOT, "megatron_delta"), src / "megatron_delta",
                    ignore=shutil.ignore_patterns("__pycache__", "*.so", "*.pyc"))
    wheels = tmp_path_factory.mktemp("wheels")
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--quiet",
          "-w", str(wheels), str(src)])
    (wheel,) = wheels.glob("megatron_delta-*.whl")
    target = tmp_path_factory.mktemp("target")
    _run([sys.executable, "-m", "pip", "install", "--no-deps", "--quiet", "--target", str(target), str(wheel)])
    return target, wheel


def _env(target):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(PYTHONPATH=str(target), OMP_NUM_THREADS="1")
    return env


@pytest.mark.slow
def test_the_installed_package_carries_its_data_and_imports_from_the_install(installed, tmp_path):
    target, _ = installed
    missing = [f for f in PACKAGE_DATA if not (target / "megatron_delta" / f).is_file()]
    assert missing == []
    out = _run([sys.executable, "-c",
                "import megatron_delta, megatron_delta.data.corpus as c, megatron_delta.evaluation.cloze as z;"
                "print(megatron_delta.__file__); print(c.BUNDLED_DATA_DIR); print(z.TASKS_DIR)"],
               cwd=tmp_path, env=_env(target)).stdout.split()
    package = str(target / "megatron_delta")
    assert out == [os.path.join(package, "__init__.py"), os.path.join(package, "data", "bundled"),
                   os.path.join(package, "evaluation", "lm_eval_tasks")]
    assert (target / "bin" / "megatron-delta-pretrain").is_file()  # the console script


@pytest.mark.slow
def test_the_installed_trainer_runs_the_embedded_default_from_another_directory(installed, tmp_path):
    """`python -m megatron_delta.trainer` with no data flags: the bundled corpus is found through the package."""
    target, _ = installed
    metrics = tmp_path / "metrics.jsonl"
    _run([sys.executable, "-m", "megatron_delta.trainer", "--residual", "delta_block", "--train-iters", "3",
          "--eval-interval", "3", "--eval-iters", "1", "--micro-batch-size", "2", "--log-interval", "1",
          "--delta-metrics-file", str(metrics)], cwd=tmp_path, env=_env(target))
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["iteration"] for r in records if "lm_loss" in r and "split" not in r] == [1, 2, 3]
    assert any(r.get("split") == "valid" for r in records)
    built = list((tmp_path / "runs" / "cache").glob("default_data-*/manifest.json"))
    assert len(built) == 1 and json.loads(built[0].read_text())["sotu"] == "sotu.txt.xz"
