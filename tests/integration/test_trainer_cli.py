"""megatron_delta.trainer (Megatron-LM's own trainer): --help, argument errors, and the flags of one of
Megatron-LM's GPT example scripts with `--residual delta_block` added. One process for all of it."""
from __future__ import annotations

import math

import pytest

from tests.helpers.dist_utils import run_distributed
from tests.helpers.trainer_driver import rank_cli


@pytest.fixture(scope="module")
def cli(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("trainer_cli"))
    return run_distributed(rank_cli, 1, root, timeout=400, torchrun_env=False)[0]


@pytest.mark.slow
def test_help_lists_megatron_and_delta_flags(cli):
    assert cli["help_code"] == 0, cli["help_err"]
    text = cli["help"]
    assert text.startswith("usage: pretrain_gpt.py")
    for flag in ("--tensor-model-parallel-size", "--use-distributed-optimizer", "--residual", "--delta-num-blocks",
                 "--delta-router-lr-mult", "--delta-metrics-file", "--delta-heldout-data-path"):
        assert flag in text, flag


@pytest.mark.slow
@pytest.mark.parametrize("name, flag", [
    ("blocks_on_baseline", "--delta-num-blocks"),
    ("blocks_not_dividing", "--delta-num-blocks 3"),
    ("gate_on_replacement", "--delta-gate scalar"),
    ("bad_mode", "--residual"),
    ("save_without_interval", "--save needs --save-interval"),
])
def test_errors_are_one_line_naming_the_flag(cli, name, flag):
    r = cli["errors"][name]
    assert r["code"] == 2, r
    lines = [line for line in r["stderr"].splitlines() if line.strip()]
    assert "Traceback" not in r["stderr"], r["stderr"]
    assert lines[-1].startswith("pretrain_gpt.py: error: ") and flag in lines[-1], lines


@pytest.mark.slow
def test_megatron_gpt3_example_flags_train_delta_block(cli):
    r = cli["gpt3"]
    assert r["iterations"] == [1, 2, 3]
    assert all(math.isfinite(x) for x in r["losses"]), r
    assert "latest_checkpointed_iteration.txt" in cli["gpt3_saved"] and "iter_0000003" in cli["gpt3_saved"]
