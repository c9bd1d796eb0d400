"""megatron_delta/perf/ is a library: its modules import without sys.path edits and without the trainer, and the
three tools in front of it (tools/memory_plan.py, benchmark.py, gpu_check.py) run from any working directory.
PYTHONPATH = the repository root stands in for the installed package, as it does for every subprocess here."""
import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

from megatron_delta.perf import memory_model
from tests.helpers import REPO_ROOT
from tests.helpers.import_scan import violations

REPO = pathlib.Path(REPO_ROOT)
PERF = REPO / "megatron_delta" / "perf"
TOOLS = ("memory_plan", "benchmark", "gpu_check")


def _python(code_or_argv, cwd):
    argv = ["-c", code_or_argv] if isinstance(code_or_argv, str) else code_or_argv
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    return subprocess.run([sys.executable, *argv], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def _listed_modules():
    """The modules perf/__init__.py's docstring lists ("  name  - what")."""
    import megatron_delta.perf

    return re.findall(r"^  (\w+)\s+- ", megatron_delta.perf.__doc__, flags=re.M)


def test_init_lists_every_module():
    assert sorted(_listed_modules()) == sorted(p.stem for p in PERF.glob("*.py") if p.stem != "__init__")


def test_modules_import_in_a_fresh_interpreter_without_the_trainer(tmp_path):
    """From another directory: the package imports none of its modules; gpu_check and the models import no
    torch (the GPU check refuses a machine at once); all of them together import neither megatron_delta.trainer
    nor megatron.training."""
    code = f"""
import json, sys
import megatron_delta.perf
first = sorted(m for m in sys.modules if m.startswith("megatron_delta.perf."))
import megatron_delta.perf.gpu_check, megatron_delta.perf.memory_model, megatron_delta.perf.cost_model
light = "torch" in sys.modules
for name in {_listed_modules()!r}:
    __import__("megatron_delta.perf." + name)
heavy = sorted(m for m in sys.modules if m.split(".")[0] == "megatron_delta" and ".trainer" in m
               or m == "megatron.training" or m.startswith("megatron.training."))
print(json.dumps([first, light, heavy, megatron_delta.perf.__file__]))
"""
    p = _python(code, tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    first, torch_imported, trainer_modules, where = json.loads(p.stdout.strip().splitlines()[-1])
    assert first == [] and not torch_imported and trainer_modules == []
    assert pathlib.Path(where).resolve() == PERF / "__init__.py"


def test_perf_imports_no_trainer_anywhere():
    """Function-level imports too (the check above sees only what importing runs)."""
    def may_import(mod):
        return not any(mod == top or mod.startswith(top + ".")
                       for top in ("megatron_delta.trainer", "megatron.training"))

    assert violations("perf", may_import) == []


@pytest.mark.parametrize("tool", TOOLS)
def test_tool_help_runs_from_another_directory(tmp_path, tool):
    path = REPO / "tools" / f"{tool}.py"
    assert "sys.path" not in path.read_text(), f"tools/{tool}.py edits sys.path"
    p = _python([str(path), "--help"], tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.startswith(f"usage: {tool}.py ") and "--help" in p.stdout


def test_plan_config_is_the_flags_plan():
    """memory_model.plan_config(**fields) gives the plan tools/memory_plan.py gives for the same flags; a layout
    that does not divide is refused naming the flags, an unknown field by name."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("_memory_plan_tool", REPO / "tools" / "memory_plan.py")
    cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cli)
    flags = ["--num-layers", "8", "--hidden-size", "256", "--seq-length", "256", "--pipeline-model-parallel-size", "2",
             "--world-size", "4", "--global-batch-size", "8", "--bf16", "--residual", "delta_block"]
    fields = dict(num_layers=8, hidden_size=256, seq_length=256, pipeline_model_parallel_size=2, world_size=4,
                  global_batch_size=8, bf16=True, residual="delta_block")
    from_flags = memory_model.memory_plan(cli.parse(flags))
    from_fields = memory_model.memory_plan(memory_model.plan_config(**fields))
    for key in ("preset", "router_share", "format"):  # the tool's own flags
        del from_flags["config"][key]
    assert from_fields == from_flags
    assert from_fields["config"]["delta_num_blocks"] == 4 and len(from_fields["stages"]) == 2
    with pytest.raises(memory_model.PlanError, match=r"^world size must be a multiple of TP x PP, and PP must "
                                                     r"divide --num-layers$"):
        memory_model.plan_config(num_layers=6, pipeline_model_parallel_size=4)
    with pytest.raises(TypeError, match=r"unknown fields \['num_layer'\]"):
        memory_model.plan_config(num_layer=6)
