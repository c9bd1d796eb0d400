"""megatron_delta/perf/kernel_resources.py and tools/kernel_resources.py: the routers' Triton kernels compiled for
a GPU on this CPU machine, and what their registers, spills and occupancy are.

The occupancy rule is checked against cases worked by hand from the CUDA limits. The capture is checked against
the group router's own structure: one old pass per group, with one compiled variant per group size, and one merge
per router each way. The compile is checked against a kernel that spills and one that does not.
"""
import json
import os
import subprocess
import sys

import pytest

from megatron_delta.core.group_plan import auto_group_sizes, deferring_groups
from megatron_delta.perf import kernel_resources as kr
from tests.helpers import REPO_ROOT as REPO


@pytest.mark.parametrize("registers, warps, shared, expected", [
    (255, 8, 0, 1),      # 256 regs/thread after rounding: 8 warps x 32 x 256 = 65,536, the whole file
    (128, 8, 0, 2),      # 32,768 per program
    (127, 8, 0, 2),      # rounded up to 128 (allocated per warp in units of 256)
    (129, 8, 0, 1),      # rounded up to 136: two programs would need 69,632
    (64, 4, 0, 8),       # 8,192 per program
    (100, 4, 0, 4),      # rounded up to 104: 13,312 per program (unrounded, 12,800 would allow 5)
    (16, 4, 0, 16),      # the registers allow 32; 64 warps / 4 allow 16
    (16, 1, 0, 32),      # 64 warps allow 64; the per-SM cap of 32 programs binds
    (128, 16, 0, 1),
    (64, 16, 1024, 2),   # 32,768 per program; shared: 2,048 bytes each, no limit here
    (32, 4, 100_000, 2),  # shared memory binds: 233,472 // (100,000 + 1,024)
])
def test_programs_per_sm_follows_the_cuda_limits(registers, warps, shared, expected):
    assert kr.programs_per_sm(registers, warps, shared, 90) == expected


def test_tiles_in_flight():
    """STAGES - 1 row tiles where the loop is pipelined and its shared memory holds them; else 1."""
    def config(pipelined, stages, shared):
        return dict(pipelined=pipelined, constants=dict(STAGES=stages), dynamic_shared=shared)

    assert kr.tiles_in_flight(config(True, 3, 8192), 4096) == 2
    assert kr.tiles_in_flight(config(True, 3, 4096), 4096) == 1   # only one row staged (or the pointer table only)
    assert kr.tiles_in_flight(config(False, 3, 8192), 4096) == 1  # no cp.async: the loop waits for each load
    assert kr.tiles_in_flight(dict(pipelined=False, constants={}, dynamic_shared=0), 4096) == 1


def test_ceiling_is_littles_law():
    # 4 KiB in flight on each of 132 SMs at 800 ns
    assert kr.ceiling(4096, 132, 800.0) == pytest.approx(4096 * 132 / 800e-9)


def test_delta_stream_compiled_for_hopper():
    """delta on the group router (auto) over 4 layers: 8 routers in groups of auto_group_sizes(8, 1), each group one
    old pass, every router but each group's first (its u is the old pass's) one merge forward and one backward; every
    launch compiled for sm_90 with registers read from the binary, and the derived columns follow from them."""
    layers, hidden = 4, 256
    rows = kr.kernel_resources("delta", layers, hidden, "H100", "auto")
    sizes = auto_group_sizes(2 * layers, 1)
    by_kernel = {}
    for r in rows:
        by_kernel.setdefault(r["kernel"], []).append(r)
    for kernel in ("_old_forward", "_old_backward"):
        assert {r["constants"]["S"] for r in by_kernel[kernel]} == set(sizes)
        assert sum(r["launches"] for r in by_kernel[kernel]) == len(sizes)
    # the old passes that add the next group's deferred share (group_router.OldShare) compile their own variant
    assert (sum(r["launches"] for r in by_kernel["_old_backward"] if r["constants"]["RECEIVED"])
            == sum(deferring_groups(sizes, 1)) > 0)
    for kernel in ("_merge_forward", "_merge_backward"):
        assert sum(r["launches"] for r in by_kernel[kernel]) == 2 * layers - len(sizes)
    assert sum(r["launches"] for r in by_kernel["_final_sum"]) == 1
    for r in rows:
        # compiled as the JIT compiles the launch on a GPU: the hidden size (256) marked divisible by 16
        assert list(r["signature"]).index("d") in r["aligned"]
        assert r["arch"] == 90 and 0 < r["registers"] <= 255 and r["stack"] >= 0
        assert r["shared"] == r["static_shared"] + r["dynamic_shared"]
        assert r["programs_per_sm"] == kr.programs_per_sm(r["registers"], r["warps"], r["shared"], 90) >= 1
        assert r["in_flight_per_sm"] == (r["programs_per_sm"] * r["tiles_in_flight"] * r["constants"].get("BT", 1)
                                         * hidden * 2)
        assert r["of_modelled_rate"] == pytest.approx(
            kr.ceiling(r["in_flight_per_sm"], 132) / (0.85 * 3.35e12))
    # the group router's loops over the sources are software-pipelined (cp.async into shared memory)
    from megatron_delta.core.triton_group_kernels import PIPELINE_STAGES
    for kernel in ("_old_forward", "_old_backward", "_merge_forward", "_merge_backward"):
        assert all(r["pipelined"] and r["constants"]["STAGES"] == PIPELINE_STAGES and r["dynamic_shared"] > 0
                   for r in by_kernel[kernel]), kernel


# slow: two compilations at the 8B width; the compile path and the binary's registers stay in the fast set
# (test_delta_stream_compiled_for_hopper)
@pytest.mark.slow
def test_spills_are_read_from_the_binary():
    """One group of 12 routers at the 8B width: the old backward holds [12 -> 16, 4096] fp32 tiles (queries,
    output gradients, query gradients) in the registers of one program, 3 x 64 K values against a register file
    of 64 K, so it must spill; the final sum holds one [BT, 4096] tile and does not."""
    rows = kr.kernel_resources("delta", 6, 4096, "H200", 12)
    by_kernel = {r["kernel"]: r for r in rows}
    assert by_kernel["_old_backward"]["constants"]["S"] == 12
    assert by_kernel["_old_backward"]["stack"] > 0
    assert by_kernel["_final_sum"]["stack"] == 0
    # the alignment the JIT would mark reaches the compiler: without it the final sum compiles to other code
    plain = kr._run("compile", dict(configs=[dict(by_kernel["_final_sum"], aligned=[])], arch=90), interpret=False)
    assert plain[0]["registers"] != by_kernel["_final_sum"]["registers"]


# slow: the tool end to end; its compilation and rows stay in the fast set (test_delta_stream_compiled_for_hopper)
@pytest.mark.slow
def test_tool_prints_one_row_per_kernel_and_json(tmp_path):
    out = tmp_path / "kr.json"
    proc = subprocess.run([sys.executable, os.path.join(REPO, "tools/kernel_resources.py"), "--shape", "1B",
                           "--modes", "delta_block", "--num-layers", "4", "--gpu", "B200", "--output", str(out)],
                          capture_output=True, text=True, cwd=REPO, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    table = [line for line in proc.stdout.splitlines() if line.startswith("| 1B | delta_block |")]
    saved = json.loads(out.read_text())["1B/delta_block"]
    assert sorted(line.split(" | ")[2] for line in table) == sorted({r["kernel"].lstrip("_") for r in saved})
    assert all(r["arch"] == 100 for r in saved)  # B200: sm_100
    assert "configurations spill registers" in proc.stdout
