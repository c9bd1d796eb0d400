"""The routed stream at the 1B depth on CUDA (28 layers, hidden 2048, 256 tokens, bf16; perf/routed_stream.py:
the project's SourceBuffer and routers over identity sublayers) for each routed mode as perf/capture_check.RUNS
runs it (attnres, full_attnres and delta on the group router, delta with group size 1, delta_block): on the
Triton kernels against the PyTorch path, and captured with torch.cuda.graph then replayed on new contents of its
static inputs, bitwise equal to an eager run (tests/helpers/gpu_cases.py). The replay copies the launch tables the
capture recorded (triton_router.device_tables: pinned, non-blocking). Skipped, with the reason, without CUDA. Each
mode's stream test runs before its capture test, so that the capture finds its kernels compiled; delta with group
size 1 compiles a kernel per source count (2 x 56), so it runs last."""
import pytest
import torch

from megatron_delta.perf.capture_check import RUNS
from megatron_delta.perf.shapes import SHAPES
from tests.helpers import gpu_cases as cases

pytestmark = pytest.mark.cuda

LAYERS, HIDDEN, SEQ = SHAPES["1B"]["num_layers"], SHAPES["1B"]["hidden_size"], 256
ORDER = [(check, *run) for run in sorted(RUNS, key=lambda run: run[0] == "delta S=1")
         for check in ("stream", "capture")]


@pytest.mark.parametrize("check,label,mode,group_size", ORDER,
                         ids=[f"{c}-{r.replace(' ', '-')}" for c, r, _, _ in ORDER])
def test_routed_stream_at_1b_depth(check, label, mode, group_size):
    if check == "stream":
        cases.stream_case("cuda", torch.bfloat16, mode, group_size, LAYERS, SEQ, HIDDEN)
    else:
        assert cases.capture_case("cuda", torch.bfloat16, mode, group_size, LAYERS, SEQ, HIDDEN) > 2 * LAYERS
