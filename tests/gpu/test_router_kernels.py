"""The project's Triton router and group kernels on CUDA against the PyTorch path and the float64 reference
(tests/helpers/gpu_cases.py): one router call in fp32 and bf16 with and without null source, gate and x (no stream
synchronisation in the kernels' call), and every routed mode's model in fp32 (delta and full_attnres on the group
router, delta also one router per pass). Skipped, with the reason, without CUDA."""
import pytest
import torch

from tests.helpers import gpu_cases as cases

pytestmark = pytest.mark.cuda


@pytest.fixture(scope="module")
def dist():
    from megatron_delta.platform.distributed import destroy_distributed, initialize_distributed

    initialize_distributed(1, 1, seed=1234)
    yield
    destroy_distributed()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("null,gate,with_x", cases.ROUTER_CASES,
                         ids=[f"null{int(n)}-gate{int(g)}-x{int(x)}" for n, g, x in cases.ROUTER_CASES])
def test_router_call_matches_reference_and_torch_path(dtype, null, gate, with_x):
    """At a width and length the GPU tiles several times over (1024 tokens, hidden 256, 5 sources)."""
    cases.router_case("cuda", dtype, null, gate, with_x, tokens=1024, d=256, no_syncs=True)


@pytest.mark.parametrize("mode,group_size", [("attnres", None), ("full_attnres", "auto"), ("delta", "auto"),
                                             ("delta", 1), ("delta_block", None)])
@pytest.mark.parametrize("null,gate", [(False, False), (True, True)], ids=["plain", "null-gate"])
def test_model_matches_reference_and_torch_path(dist, mode, group_size, null, gate):
    cases.model_case("cuda", mode, null, gate and mode in ("delta", "delta_block"), group_size)
