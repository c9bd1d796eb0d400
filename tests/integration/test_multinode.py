"""Multi-node launch, simulated on one machine: two torchrun agents (examples/torchrun_multinode.sh,
--nnodes 2, --node-rank 0/1, 2 processes each, static rendezvous on 127.0.0.1) train a tiny
delta_block model under TP2 x PP2; the losses must equal a single-node run of the same flags on 4 ranks within
1e-6 (tests/helpers/dist_utils.py's ranks, forked from the session's server: the launcher is what this test is
about)."""
import json
import os
import subprocess
import sys

import pytest

from tests.helpers import REPO_ROOT as REPO
from tests.helpers import rank_runner
from tests.helpers.dist_utils import free_port, run_distributed
from tests.helpers.flags import tiny

LAUNCHER = os.path.join(REPO, "examples", "torchrun_multinode.sh")
FLAGS = ["--residual", "delta_block"] + tiny(num_layers=4, hidden=64, heads=4, groups=2, seq=32, mbs=2, gbs=8,
                                              train_iters=3) + [
    "--log-interval", "1", "--eval-interval", "100", "--eval-iters", "1",
    "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]


def _launch(nnodes, node_rank, nproc, port, metrics):
    env = dict(os.environ, NNODES=str(nnodes), NODE_RANK=str(node_rank), NPROC_PER_NODE=str(nproc),
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), PYTHON=sys.executable, OMP_NUM_THREADS="1",
               PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("CUDA_VISIBLE_DEVICES", None)
    return subprocess.Popen(["bash", LAUNCHER] + FLAGS + ["--delta-metrics-file", metrics], env=env, cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _wait(procs, timeout=600):
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=timeout)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out[-6000:]
    return outs


def _losses(path):
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return {r["iteration"]: r["lm_loss"] for r in rows if "lm_loss" in r and "iteration" in r}


@pytest.mark.slow
def test_two_node_torchrun_matches_single_node(tmp_path):
    single = str(tmp_path / "single.jsonl")
    run_distributed(rank_runner.train, 4, FLAGS, single, timeout=600)
    multi = str(tmp_path / "multi.jsonl")
    port = free_port()
    _wait([_launch(2, 0, 2, port, multi), _launch(2, 1, 2, port, multi)])
    a, b = _losses(single), _losses(multi)
    assert sorted(a) == [1, 2, 3] and sorted(b) == [1, 2, 3], (a, b)
    for it in a:
        assert abs(a[it] - b[it]) <= 1e-6, (it, a[it], b[it])
