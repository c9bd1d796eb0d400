"""megatron_delta.trainer (Megatron-LM's own trainer): exact resume and resharding.

Exact resume with dropout on: 8 iterations straight (saving at 4) == 4 + save + a resumed run of 4 with plain
`--load --ckpt-step 4` (data position, optimizer, scheduler and RNG restored): the same iterations, losses and
learning rates, bitwise, for baseline and delta_block, with and without the distributed optimizer (DP2; also in
its fully reshardable checkpoint format, --dist-ckpt-optim-fully-reshardable). Without the every-device entries of
megatron_delta.platform.patches (distopt_*) the distributed optimizer's resume fails or drifts
(tests/integration/test_cpu_platform.py shows each fix's failure).

Resharding: a distributed-optimizer checkpoint saved under TP2+PP2 resumes under TP1 and one saved under TP1 resumes
under TP2+PP2, model and optimizer, for baseline, delta and delta_block (three launches)."""
from __future__ import annotations

import pytest

from tests.helpers.dist_utils import run_distributed
from tests.helpers.trainer_driver import rank_reshard, rank_resume

MODES = ["baseline", "delta_block"]
# iterations straight, and the one saved and resumed from: the resumed run's first iteration needs the data
# position and RNG restored, the next ones the optimizer's moments and step as well
RESUME = {"iters": 8, "split_at": 4}


def _check(r, modes=MODES):
    iters, split = RESUME["iters"], RESUME["split_at"]
    for mode in modes:
        straight, resumed = r[mode]["straight"], r[mode]["resumed"]
        assert straight["iterations"] == list(range(1, iters + 1))
        assert resumed["iterations"] == list(range(split + 1, iters + 1)), mode
        assert resumed["losses"] == straight["losses"][split:], mode
        assert resumed["lr"] == straight["lr"][split:], mode


@pytest.mark.slow
def test_exact_resume_with_dropout(tmp_path):
    _check(run_distributed(rank_resume, 1, str(tmp_path), MODES, [], "tp1", kwargs=RESUME, timeout=600)[-1])


@pytest.mark.slow
def test_exact_resume_with_dropout_distributed_optimizer(tmp_path):
    _check(run_distributed(rank_resume, 2, str(tmp_path), MODES, ["--use-distributed-optimizer"], "dp2",
                           kwargs=RESUME, timeout=900)[-1])


@pytest.mark.slow
def test_exact_resume_distributed_optimizer_fully_reshardable(tmp_path):
    flags = ["--use-distributed-optimizer", "--dist-ckpt-optim-fully-reshardable"]
    _check(run_distributed(rank_resume, 2, str(tmp_path), ["delta_block"], flags, "dp2_full", kwargs=RESUME,
                           timeout=900)[-1], ["delta_block"])


# ---------------------------------------------------------------- resharding with optimizer state
TP2_PP2 = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]
RESHARD_MODES = ["baseline", "delta", "delta_block"]
ITERS, SPLIT = 4, 2


@pytest.mark.slow
def test_resume_reshards_model_and_optimizer_tp2pp2_and_tp1(tmp_path):
    """A distributed-optimizer checkpoint (--dist-ckpt-optim-fully-reshardable) saved at iteration 2 under TP2+PP2
    resumes under TP1, and one saved under TP1 resumes under TP2+PP2: iterations 3..4 give the losses of the
    straight run in the other layout within 1e-5 (parity tolerance) - the first of them is the loaded weights'
    loss, the second needs the Adam moments and step restored - the same learning rates, and the final
    validation loss of the straight run."""
    root = str(tmp_path)
    kw = {"iters": ITERS, "split_at": SPLIT}
    four = run_distributed(rank_reshard, 4, root, RESHARD_MODES, TP2_PP2, "tp2pp2", kwargs=kw, timeout=900)[-1]
    # one process: TP1's own straight run, then TP2+PP2's checkpoint resumed under TP1
    one = run_distributed(rank_reshard, 1, root, RESHARD_MODES, [], "tp1", True, "tp2pp2", kwargs=kw, timeout=900)[0]
    back = run_distributed(rank_reshard, 4, root, RESHARD_MODES, TP2_PP2, "tp2pp2", False, "tp1", kwargs=kw,
                           timeout=900)[-1]
    for mode in RESHARD_MODES:
        for resumed, straight, what in ((one["resumed"][mode], four["straight"][mode], "tp2pp2 -> tp1"),
                                        (back["resumed"][mode], one["straight"][mode], "tp1 -> tp2pp2")):
            assert straight["iterations"] == list(range(1, ITERS + 1)), (mode, what)
            assert resumed["iterations"] == list(range(SPLIT + 1, ITERS + 1)), (mode, what)
            assert resumed["losses"] == pytest.approx(straight["losses"][SPLIT:], abs=1e-5), (mode, what)
            assert resumed["lr"] == pytest.approx(straight["lr"][SPLIT:], rel=1e-12), (mode, what)
            assert len(resumed["valid"]) == 1 and straight["valid"], (mode, what, resumed["valid"])
            assert resumed["valid"][-1] == pytest.approx(straight["valid"][-1], abs=1e-5), (mode, what)
