"""Shared pytest setup: the scheduling of the suite on xdist workers, and the session's fixtures. pytest imports the
test modules as the packages tests.unit, tests.integration and tests.gpu from the repository root, its rootdir;
what they share is tests.helpers."""
import sys

import pytest

# ------------------------------------------------------------------------------ two workers (make test)
# make test runs the suite on two pytest-xdist workers. A fixture is built once per worker that needs it, so a
# module's tests stay on one worker (its module-scoped fixtures are built once), and the modules of the session's
# 4-rank launch (four_rank_runs) share one worker. The session's TP1 reference is lazy per configuration
# (TP1Reference), so modules that share only a few of its runs may run apart: each worker runs those it needs.
FOUR_RANK_MODULES = ("tests/integration/test_bf16.py", "tests/integration/test_parallel_parity.py")
FOUR_RANK_GROUP = "four_rank_runs"
# Work units handed out first, longest first (the order of their pytest times on 2 cores), so that no long one
# starts last while the other worker idles; the rest follow in collection order.
LONGEST_FIRST = (FOUR_RANK_GROUP, "tests/integration/test_moe.py", "tests/integration/test_source_cache.py",
                 "tests/integration/test_trainer_cluster.py", "tests/integration/test_conversion.py",
                 "tests/integration/test_trainer_resume.py", "tests/unit/test_traffic.py",
                 "tests/integration/test_checkpoint_faults.py", "tests/integration/test_triton_router.py",
                 "tests/integration/test_run_safety.py", "tests/integration/test_cli_errors.py",
                 "tests/integration/test_evaluation.py", "tests/integration/test_tools_analysis.py")
_ORDER = {unit: i for i, unit in enumerate(LONGEST_FIRST)}  # units not listed come after, in collection order


def work_unit(nodeid: str) -> str:
    """The xdist work unit of a test: its module, or FOUR_RANK_GROUP."""
    module = nodeid.split("::", 1)[0]
    return FOUR_RANK_GROUP if module in FOUR_RANK_MODULES else module


def pytest_collection_modifyitems(config, items):
    """A test on four_rank_runs outside FOUR_RANK_MODULES would rebuild the 4-rank launch on the other worker."""
    stray = sorted({work_unit(item.nodeid) for item in items if "four_rank_runs" in item.fixturenames} -
                   {FOUR_RANK_GROUP})
    if stray:
        raise pytest.UsageError(f"{stray} use the four_rank_runs fixture: add them to FOUR_RANK_MODULES in "
                                f"tests/conftest.py")


@pytest.hookimpl(optionalhook=True, tryfirst=True)  # before xdist's own (--dist)
def pytest_xdist_make_scheduler(config, log):
    from xdist.scheduler import LoadScopeScheduling

    class ModuleScheduling(LoadScopeScheduling):
        """xdist's loadscope with work units of work_unit(), handed out LONGEST_FIRST."""

        def _split_scope(self, nodeid: str) -> str:  # replaces LoadScopeScheduling's: module, class -> work_unit
            return work_unit(nodeid)

        def _assign_work_unit(self, node) -> None:  # the parent's, after moving the next unit of LONGEST_FIRST up
            self.workqueue.move_to_end(min(self.workqueue, key=lambda u: _ORDER.get(u, len(_ORDER))), last=False)
            super()._assign_work_unit(node)

    return ModuleScheduling(config, log)


@pytest.fixture
def offline_single_thread(monkeypatch):
    """No hub access, one intra-op thread: tiny models only add contention on a shared 2-core machine."""
    import torch

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module", autouse=True)
def fresh_moe_metrics():
    """Megatron's MoE state is process-global: its metrics tracker sizes each metric by the layers of the first model
    that records it, and MoEAuxLossAutoScaler keeps the first loss scale's tensor, whose shape a later set must
    match (an MoE backward outside a schedule leaves its 0-dim default, then initialize_megatron sets [1]:
    RuntimeError). A module's in-process MoE runs must not leave either to the next module's."""
    yield
    moe_logging = sys.modules.get("megatron.core.transformer.moe.moe_logging")
    if moe_logging is not None:
        moe_logging.destroy_moe_metrics_tracker()
    moe_utils = sys.modules.get("megatron.core.transformer.moe.moe_utils")
    if moe_utils is not None:
        moe_utils.MoEAuxLossAutoScaler.main_loss_backward_scale = None


@pytest.fixture(scope="module")
def distributed_teardown():
    """Destroy the in-process (gloo) world a module's tests initialised, after the module."""
    yield
    import torch

    if torch.distributed.is_available() and torch.distributed.is_initialized():
        from megatron_delta.platform.distributed import destroy_distributed

        destroy_distributed()


# ------------------------------------------------------------------------------ the session's TP1 reference
class TP1Reference:
    """TP1 (one process) runs of tests/helpers/rank_runner.py's configurations, launched when first asked for and kept
    for the session: the parity, bf16 and source-cache tests compare their layouts with the same runs, and every
    layout trains from the initial models these runs save (ROOT/init-SPEC)."""

    def __init__(self, root: str):
        self.root = root
        self._runs: dict = {}  # (spec, variant) -> entry

    def runs(self, specs, variants=("fp32",)) -> dict:
        """{spec: {variant: entry}} (rank_runner.run_specs' entries, routers and dtypes collected)."""
        from tests.helpers import rank_runner
        from tests.helpers.dist_utils import run_distributed

        missing = [[s, v] for s in specs for v in variants if (s, v) not in self._runs]
        if missing:
            got = run_distributed(rank_runner.run_specs, 1, self.root, "tp1", [], missing,
                                  kwargs={"collect": ["routers", "dtypes"]}, timeout=1800)[0]
            for spec, by_variant in got.items():
                for variant, entry in by_variant.items():
                    assert len(entry["losses"]) == rank_runner.ITERS, (spec, variant, entry)
                    self._runs[(spec, variant)] = entry
        return {s: {v: self._runs[(s, v)] for v in variants} for s in specs}


@pytest.fixture(scope="session")
def tp1_reference(tmp_path_factory):
    return TP1Reference(str(tmp_path_factory.mktemp("tp1-reference")))


@pytest.fixture(scope="session")
def four_rank_runs(tp1_reference):
    """The session's one 4-rank launch of every mode from the TP1 reference's initial models (rank_runner.run_layouts):
    TP2+PP2+SP in fp32 (tests/integration/test_parallel_parity.py's tp2_pp2_sp layout) and with the routers at 10x the
    lr in bf16 (saving the trained model) and fp32 (tests/integration/test_bf16.py); PP4 in fp32 (test_parallel_parity's
    pp4 layout). Returns (root, per-rank {"tp2pp2sp" | "pp4": results})."""
    from megatron_delta.core.modes import RESIDUAL_MODES
    from tests.helpers import rank_runner
    from tests.helpers.dist_utils import run_distributed
    from tests.helpers.flags import PP4, TP2_PP2_SP

    tp1_reference.runs(RESIDUAL_MODES)  # the initial models
    launches = [["tp2pp2sp", TP2_PP2_SP, [[m, v] for m in RESIDUAL_MODES for v in ("fp32", "bf16_r10", "fp32_r10")]],
                ["pp4", PP4, [[m, "fp32"] for m in RESIDUAL_MODES]]]
    ranks = run_distributed(rank_runner.run_layouts, 4, tp1_reference.root, launches,
                            kwargs={"collect": ["dtypes"], "save": ["bf16_r10"]}, timeout=2400)
    return tp1_reference.root, ranks


@pytest.fixture(scope="session")
def tp2_pp2_sp_runs(four_rank_runs):
    """The TP2+PP2+SP part of four_rank_runs: (root, per-rank results)."""
    root, ranks = four_rank_runs
    return root, [r["tp2pp2sp"] for r in ranks]
