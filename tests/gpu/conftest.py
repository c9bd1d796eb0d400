"""The ``cuda`` marker's skip where no CUDA device is visible (reported as skipped, with the reason), and each
test's outcome written to $GPU_TEST_RESULTS (JSON, rewritten after every test: a run cut short keeps what ran),
which tools/gpu_acceptance.sh folds into its table."""
import json
import os

import pytest

NO_CUDA = ("needs a CUDA device (torch.cuda.is_available() is False): run tools/gpu_acceptance.sh on a GPU; "
           "tests/helpers/gpu_interpreter_cases.py runs these checks on CPU")


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(pytest.mark.skip(reason=NO_CUDA))


_outcomes = {}


def pytest_runtest_logreport(report):
    path = os.environ.get("GPU_TEST_RESULTS")
    if not path or "tests/gpu/" not in report.nodeid.replace(os.sep, "/"):
        return
    if report.when == "call" or report.outcome != "passed":  # a set-up failure or skip has no call phase
        entry = {"outcome": report.outcome, "seconds": round(report.duration, 2)}
        if report.skipped and isinstance(report.longrepr, tuple):
            entry["reason"] = report.longrepr[2]
        elif report.failed:
            entry["error"] = str(report.longrepr).strip().splitlines()[-1][:500]
        _outcomes.setdefault(report.nodeid, entry)
        with open(path, "w") as f:
            json.dump(_outcomes, f, indent=1)
