#!/usr/bin/env python
"""Does `make test-fast` catch a bug? Plants one-line bugs, one at a time, and runs the fast set on each.

    python tools/planted_bugs.py [--only NAME ...] [--workers 2] [--list] [-- PYTEST_ARGS ...]

For each planted bug (PLANTS: the math of each residual mode, the router, the group router, a conversion table
entry and a checkpoint-contract rule) it replaces one line of the package, runs
`pytest -q -x -n WORKERS -m "not slow" tests` (stops at the first failure) and restores the file, whatever
happens; it prints one table row per bug: the first failing test, or NOT CAUGHT. Exit status 1 if any bug was not
caught. PYTEST_ARGS go to each run (say --ignore FILE: is the bug caught without it?). Each run is a part of the
fast set (all of it where a bug is not caught): run it on a quiet machine. No .pyc is written while a bug is
planted (PYTHONDONTWRITEBYTECODE), so none outlives its run.
"""
import argparse
import os
import re
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# (name, file, the line's text as it is, the line planted); each text occurs exactly once in its file
PLANTS = [
    ("baseline: the local RMSNorm drops its weight", "megatron_delta/core/norms.py",
     "y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight.float()",
     "y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)"),
    ("delta: a router does not read the newest output", "megatron_delta/core/modes.py",
     'return ["h0"] + _names("v", j)',
     'return ["h0"] + _names("v", max(j - 1, 0))'),
    ("delta_block: the partial sum keeps the last output only", "megatron_delta/core/modes.py",
     'buf.hold_sum(f"P{b}", partial, out)',
     'buf.hold(f"P{b}", out)'),
    ("attnres: inside a block the routers miss its start's completed block", "megatron_delta/core/modes.py",
     'return _names("B", b if self.is_block_start(j) else b + 1) + ["p"]',
     'return _names("B", b) + ["p"]'),
    ("full_attnres: the routers miss the embedding (B0)", "megatron_delta/core/modes.py",
     'return _names("B", j) + ["p"]',
     'return _names("B", j)[1:] + ["p"]'),
    ("router: a source's mean square over d - 1", "megatron_delta/core/router.py",
     "return norm.square_().div_(value.shape[-1]).add_(eps).rsqrt_()",
     "return norm.square_().div_(value.shape[-1] - 1).add_(eps).rsqrt_()"),
    ("group router: the old pass's norm with 10 eps (PyTorch ops)", "megatron_delta/core/group_router.py",
     "inv[i] = _inv_rms(vf, eps, cdt)\n                z[:, i]",
     "inv[i] = _inv_rms(vf, 10 * eps, cdt)\n                z[:, i]"),
    ("conversion: gate and up swapped in the fused MLP table", "megatron_delta/convert/state_dict_adapter.py",
     '("mlp.linear_fc1.weight", ("mlp.gate_proj.weight", "mlp.up_proj.weight")),',
     '("mlp.linear_fc1.weight", ("mlp.up_proj.weight", "mlp.gate_proj.weight")),'),
    ("checkpoint: --delta-router-eps not a model flag", "megatron_delta/checkpoint/run_config.py",
     '"delta_null_source", "delta_gate", "delta_sources", "delta_router_eps",',
     '"delta_null_source", "delta_gate", "delta_sources",'),
]


def run_planted(name, path, old, new, workers, extra=()):
    """The first failing test of the fast set with the bug planted (None: none failed), and the run's seconds."""
    full = os.path.join(REPO, path)
    original = open(full).read()
    if original.count(old) != 1:
        raise SystemExit(f"planted_bugs: {name!r}: its line is not found exactly once in {path}; update PLANTS")
    try:
        with open(full, "w") as f:
            f.write(original.replace(old, new))
        start = time.time()
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-n", str(workers), "-m", "not slow",
                               "-p", "no:cacheprovider", *extra, "tests"], cwd=REPO, capture_output=True, text=True,
                              env=dict(os.environ, PYTHONDONTWRITEBYTECODE="1"))
        seconds = time.time() - start
    finally:
        with open(full, "w") as f:
            f.write(original)
    failed = re.findall(r"^(?:FAILED|ERROR) (\S+)", proc.stdout, re.M)
    if proc.returncode == 0:
        return None, seconds
    if not failed:
        return f"(pytest exit {proc.returncode}: {proc.stdout.strip().splitlines()[-1:]})", seconds
    return failed[0], seconds


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", nargs="*", default=None, help="run the bugs whose name starts with one of these")
    ap.add_argument("--workers", type=int, default=2, help="pytest-xdist workers (-n)")
    ap.add_argument("--list", action="store_true", help="list the planted bugs and exit")
    argv = sys.argv[1:] if argv is None else list(argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    args = ap.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    plants = list(PLANTS)
    if args.only:
        plants = [p for p in plants if any(p[0].startswith(o) for o in args.only)]
    if args.list:
        for name, path, old, new in plants:
            print(f"{name}\n  {path}: {old!r}\n  -> {new!r}")
        return 0
    print("| planted bug | file | first failing test (fast set, -x) | seconds |\n|---|---|---|---|", flush=True)
    missed = 0
    for name, path, old, new in plants:
        first, seconds = run_planted(name, path, old, new, args.workers, extra)
        missed += first is None
        print(f"| {name} | {path} | {first or 'NOT CAUGHT'} | {seconds:.0f} |", flush=True)
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
