"""Every residual mode trains (30 iterations of a tiny model on the bundled corpus); the five modes' routers
train in an optimizer group of their own (--delta-router-lr-mult 2: twice the lr, no weight decay).

One subprocess runs pretrain_gpt.py's `megatron_delta.trainer.main.main` for every configuration in turn (one import of
Megatron instead of seven; each run initialises and tears down its own one-rank world). The bundled corpus
and its tokenizer are built once under runs/cache (the embedded default's data). Measured: ~15-25 s per configuration
on a shared 2-core machine, so the whole module is marked slow.
"""

import json
import math
import os
import subprocess
import sys
import textwrap

import pytest

from megatron_delta.core.modes import ROUTED_MODES
from tests.helpers import REPO_ROOT as REPO
from tests.helpers.flags import tiny

ROUTER_LR = ["--delta-router-lr-mult", "2"]
CONFIGS = {
    "baseline": ["--residual", "baseline"],
    **{m: ["--residual", m] + ROUTER_LR for m in ROUTED_MODES},
    "delta_block-authors-code": ["--residual", "delta_block", "--delta-sources", "authors-code"],
    "delta-gate-null": ["--residual", "delta", "--delta-gate", "scalar", "--delta-null-source"],
}
TINY = tiny(num_layers=2, hidden=64, seq=64, mbs=4, mock=False, train_iters=30) + [
    "--eval-interval", "1000", "--eval-iters", "1", "--log-interval", "10", "--save-interval", "1000"]
MARGIN = 0.3  # nats; measured drop (first 3 vs last 5 iterations) ~1.3 for delta


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from megatron_delta.data.corpus import ensure_default_data

    out = tmp_path_factory.mktemp("modes_training")
    paths = ensure_default_data(os.path.join(REPO, "runs", "cache"))
    data = ["--train-data-path", paths["train_data_path"][0], "--valid-data-path", paths["sotu_valid_data_path"],
            "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", paths["tokenizer_model"]]
    jobs = {name: TINY + data + flags + ["--delta-metrics-file", str(out / f"{name}.jsonl"), "--save", str(out / name)]
            for name, flags in CONFIGS.items()}
    driver = textwrap.dedent("""
        import json, sys, traceback
        import torch
        torch.set_num_threads(1)
        from megatron_delta.trainer import main as trainer
        jobs = json.loads(sys.argv[1])
        status, groups = {}, {}
        for name, argv in jobs.items():
            try:
                status[name] = trainer.main(argv)
                # (max_lr, wd_mult, router params, params) of each optimizer param group
                groups[name] = [[g.get("max_lr"), g.get("wd_mult"),
                                 sum(1 for p in g["params"] if getattr(p, "is_delta_router", False)), len(g["params"])]
                                for g in trainer.LAST_RUN.optimizer.param_groups]
            except BaseException as e:  # noqa: BLE001 - reported per configuration
                traceback.print_exc()
                status[name] = repr(e)
        print("STATUS " + json.dumps({"status": status, "groups": groups}, default=str))
    """)
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
               OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", driver, json.dumps(jobs)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=1500)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("STATUS ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-5000:]
    report = json.loads(lines[-1][len("STATUS "):])
    return out, report["status"], report["groups"], proc.stdout + proc.stderr


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CONFIGS))
def test_mode_trains(runs, name):
    out, status, groups, log = runs
    assert status[name] in (0, None), f"{name}: {status[name]}\n{log[-4000:]}"
    routed = [g for g in groups[name] if g[2] > 0]
    if name == "baseline":
        assert not routed, groups[name]
    elif ROUTER_LR[0] in CONFIGS[name]:  # the routers' own group: lr x 2, no weight decay, routers only
        assert len(routed) == 1 and routed[0][0] == pytest.approx(2 * 3e-3) and routed[0][1] == 0.0, groups[name]
        assert routed[0][2] == routed[0][3], groups[name]
    records = [json.loads(line) for line in (out / f"{name}.jsonl").read_text().splitlines()]
    train = [r for r in records if "lm_loss" in r and "split" not in r]
    assert [r["iteration"] for r in train] == list(range(1, 31))
    losses = [r["lm_loss"] for r in train]
    assert all(math.isfinite(x) for x in losses), losses
    assert all(r["grad_norm"] is None or math.isfinite(r["grad_norm"]) for r in train)
    start, end = sum(losses[:3]) / 3, sum(losses[-5:]) / 5
    assert end < start - MARGIN, (name, start, end)
    valid = [r for r in records if r.get("split") == "valid"]
    assert valid and all(math.isfinite(r["lm_loss"]) for r in valid)
    routing = [r for r in records if "routing" in r]
    if CONFIGS[name][1] == "baseline":
        assert routing == []
        return
    assert routing, f"{name}: no routing record in the metrics file"
    rec = routing[-1]
    assert set(rec) == {"iteration", "routing"} and rec["iteration"] == 30
    receivers = rec["routing"]["receivers"]
    assert len(receivers) >= 4  # 2 layers x 2 sublayers (+ the final router of the replacement modes)
    for r in receivers.values():
        assert r["num_sources"] == len(r["mean_weights"]) or r["num_sources"] + 1 == len(r["mean_weights"])
        if r["mean_weights"]:
            assert abs(sum(r["mean_weights"]) - 1) < 1e-4
