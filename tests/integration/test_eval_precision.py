"""The evaluation tools' precision (--dtype, megatron_delta/evaluation/precision.py): one set of choices that
tools/evaluate.py, perplexity.py and routing_report.py all refuse the same way, read before any slow import,
and the rule that picks bf16 or fp32 for a checkpoint."""
import os
import subprocess
import sys

import pytest

from megatron_delta.checkpoint.errors import ConversionError
from megatron_delta.evaluation.precision import EVAL_DTYPES, eval_in_bf16
from tests.helpers import REPO_ROOT


@pytest.mark.parametrize("rc, dtype, bf16", [
    ({"bf16": True}, "auto", True), ({"bf16": False}, "auto", False), ({}, "auto", False),
    ({"bf16": True}, "fp32", False), ({"bf16": False}, "bf16", True), ({"bf16": True}, "bf16", True),
])
def test_auto_computes_as_trained_and_the_others_as_asked(rc, dtype, bf16):
    assert eval_in_bf16(rc, dtype) is bf16


def test_an_unknown_precision_is_refused_naming_the_flag():
    with pytest.raises(ConversionError) as err:
        eval_in_bf16({"bf16": True}, "fp16", flag="--dtype")
    assert str(err.value) == "--dtype must be one of auto, fp32, bf16, got 'fp16'"


@pytest.mark.parametrize("tool, required", [
    ("evaluate.py", ["--load", "x", "--tokens-file", "y", "--output", "z"]),
    ("perplexity.py", ["--load", "x"]),
    ("routing_report.py", ["--load", "x", "--output", "y"]),
])
def test_every_tool_offers_the_same_choices(tmp_path, tool, required):
    """Run from another directory, as an installed package is: the flag is parsed before torch is imported."""
    env = dict(os.environ, PYTHONPATH=REPO_ROOT)
    p = subprocess.run([sys.executable, "-X", "importtime", os.path.join(REPO_ROOT, "tools", tool), *required,
                        "--dtype", "fp16"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    choices = ", ".join(repr(d) for d in EVAL_DTYPES)
    assert p.returncode == 2
    refusal = f"{tool}: error: argument --dtype: invalid choice: 'fp16' (choose from {choices})"
    assert p.stderr.splitlines()[-1] == refusal
    assert not [line for line in p.stderr.splitlines() if line.rstrip().endswith("| torch")]
