"""The CUDA tests' checks (tests/helpers/gpu_cases.py) run on CPU, fp32, the Triton kernels under Triton's interpreter:
how we know those tests are right before a GPU runs them. Run by tests/unit/test_gpu_prep.py in a fresh process with
TRITON_INTERPRET=1 (Triton reads it at its import). The capture itself needs CUDA: here a stand-in capture
(eager_capture: the replay runs the step again and writes its results into the static outputs) takes its place,
and a replay that ignores the new inputs (stale_capture) must fail the comparison."""
import pytest
import torch

from megatron_delta.core import triton_router
from megatron_delta.perf.capture_check import RUNS
from tests.helpers import gpu_cases as cases

LAYERS, SEQ, HIDDEN = 8, 8, 16  # the CUDA tests' stream at a depth and width the interpreter runs in seconds


@pytest.fixture(scope="module", autouse=True)
def interpreter():
    if not triton_router.interpreting():
        pytest.fail("run through tests/unit/test_gpu_prep.py (it sets TRITON_INTERPRET=1 before Triton is imported)")


@pytest.fixture(scope="module")
def dist():
    from megatron_delta.platform.distributed import destroy_distributed, initialize_distributed

    initialize_distributed(1, 1, seed=1234)
    yield
    destroy_distributed()


def eager_capture(step):
    static = [t.clone() for t in step()]

    def replay():
        for s, t in zip(static, step(), strict=True):
            s.copy_(t)
    return static, replay


def stale_capture(step):
    """A replay that recomputes nothing: what a graph whose launches read stale inputs (or stale tables) returns."""
    return [t.clone() for t in step()], lambda: None


@pytest.mark.parametrize("null,gate,with_x", cases.ROUTER_CASES)
def test_router_case(null, gate, with_x):
    errors = cases.router_case("cpu", torch.float32, null, gate, with_x)
    assert {"out", "s0", "s4", "query", "key_norm_weight"} <= set(errors)
    assert ("null_source" in errors) == null and ("gate" in errors) == gate and ("x" in errors) == with_x


@pytest.mark.parametrize("mode,group_size,null,gate", [("delta", "auto", True, True), ("delta", 1, False, False),
                                                       ("delta_block", None, True, True)])
def test_model_case(dist, mode, group_size, null, gate):
    cases.model_case("cpu", mode, null, gate, group_size)


@pytest.mark.parametrize("label,mode,group_size", RUNS)
def test_stream_and_capture_cases(label, mode, group_size):
    errors = cases.stream_case("cpu", torch.float32, mode, group_size, LAYERS, SEQ, HIDDEN)
    assert len(errors) > 2 * LAYERS and max(errors) > 0  # the kernels ran: round-off differs from the PyTorch path's
    assert cases.capture_case("cpu", torch.float32, mode, group_size, LAYERS, SEQ, HIDDEN,
                              capture=eager_capture) == len(errors)


def test_stream_case_at_1b_depth():
    """The 1B depth (28 layers) as the CUDA test runs it, at a small width."""
    cases.stream_case("cpu", torch.float32, "delta", "auto", 28, SEQ, HIDDEN)


def test_capture_case_fails_a_stale_replay():
    with pytest.raises(AssertionError, match=r"replay != eager for tensors \[0, 1, 4, 5, "):
        cases.capture_case("cpu", torch.float32, "delta_block", 1, LAYERS, SEQ, HIDDEN, capture=stale_capture)
