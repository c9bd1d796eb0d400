"""Router parameters of a model built with sequence parallelism are marked `sequence_parallel` (so Megatron's
finalize step sums their partial gradients over the TP group, as for norm weights) and are not
tensor-parallel: without the mark they drift silently under SP. A fast check of what the slow TP2+SP
parity run would only notice as a loss difference."""
import pytest

from tests.helpers.dist_utils import run_distributed
from tests.helpers.sp_marking_driver import router_param_marks


@pytest.mark.parametrize("mode", ["delta_block", "full_attnres"])
def test_router_parameters_marked_sequence_parallel(mode):
    ranks = run_distributed(router_param_marks, 2, mode, timeout=300)
    for marks in ranks:
        kinds = {name.rsplit(".", 1)[-1] for name in marks}
        expected = {"query", "key_norm_weight", "null_source"} | ({"gate"} if mode == "delta_block" else set())
        assert kinds == expected, kinds
        bad = {name: m for name, m in marks.items() if m != [True, False]}
        assert not bad, f"{mode}: router parameters not marked sequence_parallel (or marked tensor-parallel): {bad}"
