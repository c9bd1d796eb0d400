"""Issue 28 item 3: the router on the project's Triton kernels (megatron_delta/core/triton_router.py), on CPU.

The kernels run under Triton's interpreter, which must be switched on (TRITON_INTERPRET=1) before anything
imports Triton; in a whole-suite pytest process fla's tests import it first, so the interpreter cases
(tests/triton_cases.py: outputs and every gradient against the PyTorch path and the float64 reference, per
router call and for each mode's whole model; the counted traffic against triton_router.call_rows) run in a
fresh pytest process. The start-up check runs here.
"""
import os
import re
import subprocess
import sys

import pytest
import torch

from megatron_delta.core import triton_router
from megatron_delta.core.router import KERNEL_CHOICES, check_kernels

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
INTERPRETER_CASES = 21  # tests/triton_cases.py: 12 router cases, the traffic per call, the formed partial sum,
# 6 models, the fallbacks


def test_interpreter_cases():
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/triton_cases.py"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    summary = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
    passed = re.search(r"(\d+) passed", summary)
    assert passed and int(passed.group(1)) == INTERPRETER_CASES and "skipped" not in summary, summary


def test_check_and_choices(monkeypatch):
    """`triton` is a --delta-router-kernels choice; the start-up check passes under the interpreter and refuses
    in one line, naming the flag, where there is no CUDA device (or Triton does not import)."""
    assert "triton" in KERNEL_CHOICES
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    check_kernels("triton")
    monkeypatch.delenv("TRITON_INTERPRET")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError) as e:
            check_kernels("triton")
        assert str(e.value) == (
            "--delta-router-kernels triton: no CUDA device here, and the Triton kernels run on CUDA tensors only "
            "(or under TRITON_INTERPRET=1); use --delta-router-kernels auto (C kernels on CPU)")
    monkeypatch.setattr(triton_router, "_kernels", None)
    monkeypatch.setattr(triton_router, "_error", "ModuleNotFoundError: No module named 'triton'")
    with pytest.raises(ValueError) as e:
        check_kernels("triton")
    assert str(e.value) == ("--delta-router-kernels triton: triton cannot be imported (ModuleNotFoundError: No "
                            "module named 'triton'); pip install triton; or use --delta-router-kernels auto")
