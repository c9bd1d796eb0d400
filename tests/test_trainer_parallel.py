"""megatron_delta.trainer (Megatron-LM's own trainer) on CPU + gloo: every mode trains in one process;
TP2+SP, PP2 (routed payload), PP2+VPP2 and DP2 with the distributed optimizer reproduce the
one-process losses from one saved initial checkpoint (`--train-iters 0 --save`, loaded with --finetune)."""
from __future__ import annotations

import math

import pytest

from tests.dist_utils import run_distributed
from tests.trainer_driver import LAYOUTS, MODES, rank_all_modes, rank_layouts, rank_reference

PARITY_MODES = ["baseline", "delta_block", "full_attnres"]
ITERS = 4


@pytest.mark.slow
def test_one_process_trains_every_mode(tmp_path):
    r = run_distributed(rank_all_modes, 1, str(tmp_path), 6, timeout=500, torchrun_env=False)[0]
    for mode in MODES:
        losses = r[mode]["losses"]
        assert len(losses) == 6 and all(math.isfinite(x) for x in losses), (mode, losses)
        assert losses[-1] < losses[0] - 0.2, (mode, losses)
        groups = r[mode]["groups"]
        routed = [g for g in groups if g[2] > 0]
        if mode == "baseline":
            assert not routed
        else:  # the routers' own group: lr x 2 (--delta-router-lr-mult 2), no weight decay, routers only
            assert len(routed) == 1 and routed[0][0] == pytest.approx(2e-2) and routed[0][1] == 0.0, groups
            assert routed[0][2] == routed[0][3]


@pytest.fixture(scope="module")
def parity(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("trainer_parity"))
    ref = run_distributed(rank_reference, 1, root, PARITY_MODES, ITERS, timeout=500)[0]
    ranks = run_distributed(rank_layouts, 2, root, list(LAYOUTS), PARITY_MODES, ITERS, timeout=1200)
    return ref, ranks[-1]


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_parallel_layouts_match_one_process(parity, layout):
    ref, last_rank = parity
    for mode in PARITY_MODES:
        expected = ref[mode]["losses"]
        assert len(expected) == ITERS and expected[-1] < expected[0]
        assert last_rank[layout][mode]["losses"] == pytest.approx(expected, abs=1e-5), (layout, mode)
        assert last_rank[layout][mode]["lr"] == pytest.approx(ref[mode]["lr"], rel=1e-12)
