"""Shared pytest setup: make the repo root importable (megatron_delta, tests.dist_utils)."""
import os
import sys

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)

import pytest  # noqa: E402


@pytest.fixture
def offline_single_thread(monkeypatch):
    """No hub access, one intra-op thread: tiny models only add contention on a shared 2-core machine."""
    import torch

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def distributed_teardown():
    """Destroy the in-process (gloo) world a module's tests initialised, after the module."""
    yield
    import torch

    if torch.distributed.is_available() and torch.distributed.is_initialized():
        from megatron_delta.platform.distributed import destroy_distributed

        destroy_distributed()
