"""megatron_delta.trainer (Megatron-LM's own trainer): exact resume with dropout on. 20 iterations
straight (saving at 10) == 10 + save + a resumed run of 10 (losses and learning rates), for baseline
and delta_block, with and without the distributed optimizer (DP2; also in its fully reshardable
checkpoint format, --dist-ckpt-optim-fully-reshardable). Without the every-device entries of megatron_delta.platform.patches (distopt_*) the distributed
optimizer's resume fails or drifts (tests/test_cpu_platform.py shows each fix's failure)."""
from __future__ import annotations

import pytest

from tests.dist_utils import run_distributed
from tests.trainer_driver import rank_resume

MODES = ["baseline", "delta_block"]


def _check(r, modes=MODES):
    for mode in modes:
        straight, resumed = r[mode]["straight"], r[mode]["resumed"]
        assert straight["iterations"] == list(range(1, 21))
        assert resumed["iterations"] == list(range(11, 21)), mode
        assert resumed["losses"] == pytest.approx(straight["losses"][10:], abs=1e-6), mode
        assert resumed["lr"] == pytest.approx(straight["lr"][10:], rel=1e-12), mode


@pytest.mark.slow
def test_exact_resume_with_dropout(tmp_path):
    _check(run_distributed(rank_resume, 1, str(tmp_path), MODES, [], "tp1", timeout=600)[-1])


@pytest.mark.slow
def test_exact_resume_with_dropout_distributed_optimizer(tmp_path):
    _check(run_distributed(rank_resume, 2, str(tmp_path), MODES, ["--use-distributed-optimizer"], "dp2",
                           timeout=900)[-1])


@pytest.mark.slow
def test_exact_resume_distributed_optimizer_fully_reshardable(tmp_path):
    flags = ["--use-distributed-optimizer", "--dist-ckpt-optim-fully-reshardable"]
    _check(run_distributed(rank_resume, 2, str(tmp_path), ["delta_block"], flags, "dp2_full", timeout=900)[-1],
           ["delta_block"])


# ---------------------------------------------------------------- resharding with optimizer state
TP2_PP2 = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]


@pytest.mark.slow
def test_resume_reshards_model_and_optimizer_tp2pp2_and_tp1(tmp_path):
    """A distributed-optimizer checkpoint (--dist-ckpt-optim-fully-reshardable) saved at iteration 10 under
    TP2+PP2 resumes under TP1, and one saved under TP1 resumes under TP2+PP2: iterations 11..20 give the
    losses of the straight run in the other layout within 1e-5 (parity tolerance) - with the Adam moments
    and step restored (the same TP2+PP2 -> TP1 resume with --no-load-optim differs by 0.52 in loss) - and the
    same learning rates."""
    from tests.trainer_driver import rank_resume_in_layout, rank_train_and_save

    root = str(tmp_path)
    mode = "delta_block"
    straight_4 = run_distributed(rank_train_and_save, 4, root, mode, TP2_PP2, "tp2pp2", timeout=900)[-1]
    straight_1 = run_distributed(rank_train_and_save, 1, root, mode, [], "tp1", timeout=600)[0]
    in_1 = run_distributed(rank_resume_in_layout, 1, root, mode, "tp2pp2", [], "tp1", timeout=600)[0]
    in_4 = run_distributed(rank_resume_in_layout, 4, root, mode, "tp1", TP2_PP2, "tp2pp2", timeout=900)[-1]
    for resumed, straight, what in ((in_1, straight_4, "tp2pp2 -> tp1"), (in_4, straight_1, "tp1 -> tp2pp2")):
        assert resumed["iterations"] == list(range(11, 21)), what
        assert resumed["losses"] == pytest.approx(straight["losses"][10:], abs=1e-5), what
        assert resumed["lr"] == pytest.approx(straight["lr"][10:], rel=1e-12), what
