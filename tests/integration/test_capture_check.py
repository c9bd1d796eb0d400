"""The capture check (megatron_delta/perf/capture_check.py, tools/host_work.py --capture-check): its launch
signatures catch one changed address, grid, constant or table entry between iterations; its sync counter counts
what reads a value back or makes a tensor from host data; its graph-break count sees a Python branch on a tensor
value; the tool's JSON has exactly the seven figures per mode. The recorder on the real stream, under Triton's
interpreter, is in tests/helpers/triton_cases.py."""
import json
import os
import subprocess
import sys
import tempfile

import pytest
import torch

from megatron_delta.perf import capture_check as C
from tests.helpers import REPO_ROOT as REPO


def _launches(tensors, table, grid=(4,), rows=32, swap=None):
    """A tiny launch sequence of one iteration: three launches over persistent tensors, the second with a table."""
    a, b, c = tensors
    return [C.signature("fwd", grid, {"x": a, "out": b, "rows": rows}, {"BT": 16}),
            C.signature("pass", (2,), {"ptrs": table, "g": c if swap is None else swap, "d": 8}, {"N": 3}),
            C.signature("bwd", (4,), {"g": c, "x": a}, {"BT": 16})]


def test_signature_changes_catch_one_planted_change():
    """Three iterations of a synthetic launch sequence over the same tensors: nothing differs; one changed grid,
    constant, tensor address or table entry (in place: the table's own address unchanged) in the second iteration
    makes one launch differ from the first iteration's and the third's (2 over the pairs), in that part of the
    signature alone; a launch more counts as one that differs in every part."""
    tensors = [torch.zeros(4) for _ in range(3)]
    table = torch.tensor([t.data_ptr() for t in tensors], dtype=torch.int64)
    same = _launches(tensors, table)
    parts = C.SIGNATURE_PARTS + ("beyond_addresses",)
    assert C.signature_changes([same, _launches(tensors, table), _launches(tensors, table)]) == (
        0, dict.fromkeys(parts, 0))
    other = torch.zeros(4)
    table_before = table.clone()
    table[1] = other.data_ptr()  # one address inside the table, the table where it was
    moved = _launches(tensors, table)
    table.copy_(table_before)
    plants = {"grid": _launches(tensors, table, grid=(5,)), "scalars": _launches(tensors, table, rows=33),
              "tensor_addresses": _launches(tensors, table, swap=other), "table_entries": moved}
    for part, planted in plants.items():  # beyond_addresses: a grid or constant, not an address or table entry
        beyond = 2 * (part in ("grid", "scalars"))
        assert C.signature_changes([same, planted, _launches(tensors, table)]) == (
            2, {**{p: 2 * (p == part) for p in C.SIGNATURE_PARTS}, "beyond_addresses": beyond}), part
    assert C.signature_changes([same, same + same[:1]]) == (1, dict.fromkeys(parts, 1))


def test_signature_holds_addresses_and_table_entries():
    """A launch's signature: the kernel, the grid, every argument that is not a tensor by name, each tensor
    argument's data_ptr, and the entries of the int64 ones (the launch tables)."""
    x = torch.zeros(3)
    table = torch.tensor([7, 9], dtype=torch.int64)
    sig = C.signature("k", (3, 1), {"x": x, "tab": table, "n": 5, "eps": 1e-6}, {"BT": 8, "num_warps": 4})
    assert sig == ("k", (3, 1), (("n", 5), ("eps", 1e-6), ("BT", 8), ("num_warps", 4)),
                   (("x", x.data_ptr()), ("tab", table.data_ptr())), (("tab", (7, 9)),))


def test_sync_counter_counts_what_reads_back():
    """counting_syncs: a planted .item(), a Python branch on a tensor, tolist, nonzero and a tensor made from a
    list are each counted once; views, arithmetic and allocations are not; nothing is counted while ignore()."""
    x = torch.randn(6)
    with C.counting_syncs() as counts:
        (x * 2 + 1).sum().view(1).expand(3).clone()
        torch.empty(4).zero_()
    assert not counts, dict(counts)
    with C.counting_syncs() as counts:
        x.sum().item()
    assert dict(counts) == {"_local_scalar_dense": 1}
    with C.counting_syncs() as counts:
        if x.sum() > 100:
            pass
        x.tolist()
        x.nonzero()
        torch.tensor([1, 2, 3])
    assert sum(counts.values()) == 4 and counts["Tensor.tolist"] == 1 and counts["nonzero"] == 1, dict(counts)
    with C.counting_syncs(lambda: True) as counts:
        x.sum().item()
        x.tolist()
    assert not counts


def test_graph_breaks_see_a_branch_on_a_tensor_value():
    """graph_breaks: a Python branch on a tensor's value breaks Dynamo's graph; a plain function has no break."""

    def branching(x):
        y = x * 2
        if y.sum() > 0:
            return y + 1
        return y - 1

    def plain(x):
        return (x * 2 + 1).square().sum()

    x = torch.randn(5)
    assert C.graph_breaks(branching, x) > 0
    assert C.graph_breaks(plain, x) == 0


def test_targets_and_met():
    """Each figure's target: launches fixed, no signature change, copy, sync or break, at most 8 ops per call, the
    step ratio at most 1.15 (fine-grained modes) or 1.10 (block modes); None where a figure was not measured."""
    assert C.met("delta", "step_host_ratio", 1.15) and not C.met("delta_block", "step_host_ratio", 1.11)
    assert C.met("delta", "ops_per_call", 8) and not C.met("delta", "ops_per_call", 8.5)
    assert C.met("attnres", "syncs", 0) and not C.met("attnres", "table_copies_after_first", 1)
    assert not C.met("delta", "launches_per_step", {"cases": {}, "fixed": False})
    assert C.met("delta", "step_host_ratio", None) is None


# slow: the markdown test below runs the same tool (and its JSON --output) in the fast set
@pytest.mark.slow
def test_capture_check_tool_json():
    """tools/host_work.py --capture-check --format json (two modes, two iterations, step skipped): stdout is the
    JSON alone; every mode has exactly the seven figures, each case's launches per iteration, its targets and
    whether each is met; the totals are the sums of the per-case detail; the readable table names every figure."""
    pytest.importorskip("triton")
    proc = subprocess.run([sys.executable, os.path.join(REPO, "tools/host_work.py"), "--capture-check", "--format",
                           "json", "--skip-step", "--modes", "delta_block,full_attnres", "--capture-iters", "2"],
                          cwd=REPO, capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", "")))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    assert list(result["modes"]) == ["full_attnres", "delta_block"]
    for label, figures in result["modes"].items():
        assert list(figures) == list(C.FIELDS), label
        launches = figures["launches_per_step"]
        assert set(launches) == {"cases", "fixed"} and list(launches["cases"]) == list(C.CASES)
        assert all(len(n) == 2 and min(n) > 0 for n in launches["cases"].values())
        detail = result["detail"][label]
        assert figures["table_copies_after_first"] == sum(sum(d["table_copies"][1:]) for d in detail.values())
        assert figures["launch_signatures_differ"] == sum(d["signatures_differ"] for d in detail.values())
        assert figures["syncs"] == sum(sum(d["syncs"].values()) for d in detail.values())
        assert isinstance(figures["compile_graph_breaks"], int) and figures["ops_per_call"] > 0
        assert figures["step_host_ratio"] is None
        assert list(result["targets"][label]) == list(C.FIELDS)
        assert result["met"][label] == {f: C.met(label, f, figures[f]) for f in C.FIELDS}
    table = C.format_table(result)
    assert all(f in table for f in C.FIELDS) and "skipped" in table


def markdown_rows(text):
    """{first cell: [the other cells]} of a Markdown table's body rows."""
    rows = [line.strip("|").split(" | ") for line in text.splitlines() if line.startswith("| ")]
    return {cells[0].strip(): [c.strip() for c in cells[1:]] for cells in rows[1:]}


def test_capture_check_tool_markdown():
    """tools/host_work.py --capture-check --format markdown (one mode, two iterations, step skipped): stdout holds a
    Markdown table with a column per figure; the mode's row gives each figure's value with ": yes" / ": NO" as the
    JSON written by --output says it is met (nothing where not measured), and a target row names the mode with its
    targets."""
    pytest.importorskip("triton")
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "capture.json")
        proc = subprocess.run([sys.executable, os.path.join(REPO, "tools/host_work.py"), "--capture-check", "--format",
                               "markdown", "--skip-step", "--modes", "delta_block", "--capture-iters", "2",
                               "--output", out],
                              cwd=REPO, capture_output=True, text=True, timeout=600,
                              env=dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", "")))
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        result = json.load(open(out))
    header = next(line for line in proc.stdout.splitlines() if line.startswith("| mode |"))
    assert header == "| mode | " + " | ".join(f"`{f}`" for f in C.FIELDS) + " | `full_iteration` replay |"
    rows = markdown_rows(proc.stdout)
    assert list(rows) == ["delta_block", "target (delta_block)"]
    figures, met = result["modes"]["delta_block"], result["met"]["delta_block"]
    replay = result["full_iteration"]["delta_block"]
    assert rows["delta_block"][-1] == ("ready" if replay["ready"] else
                                       f"NO ({replay['differ_beyond_addresses']} beyond addresses)")
    assert replay == C.full_iteration_replay(figures, result["detail"]["delta_block"])
    for f, cell in zip(C.FIELDS, rows["delta_block"]):
        value, _, mark = cell.partition(": ")
        assert mark == {None: "", True: "yes", False: "NO"}[met[f]], f
        if f == "launches_per_step":
            launches = figures[f]
            counts = sorted({n for ns in launches["cases"].values() for n in ns})
            assert value == f"{'fixed' if launches['fixed'] else 'varies'} ({'/'.join(map(str, counts))})"
        else:
            assert value == ("skipped" if figures[f] is None else str(figures[f])), f
    assert rows["target (delta_block)"] == [result["targets"]["delta_block"][f] for f in C.FIELDS] + ["ready"]


def test_format_json_needs_the_capture_check():
    """--format json without --capture-check: one line naming the flag, exit 2 (argparse's)."""
    proc = subprocess.run([sys.executable, os.path.join(REPO, "tools/host_work.py"), "--format", "json"],
                          cwd=REPO, capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", "")))
    assert proc.returncode == 2 and "--format json: only with --capture-check" in proc.stderr.strip().splitlines()[-1]
