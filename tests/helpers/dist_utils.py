"""Run a python function or script with N ranks (one process each) on localhost, torchrun-style.

    results = run_distributed(my_module.fn, 2, arg1, arg2, timeout=120)
    results = run_distributed("path/to/script.py", 2, "--flag", "1")

Each rank is a new process with torchrun's environment (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE,
MASTER_ADDR, MASTER_PORT on a free port), OMP_NUM_THREADS=1 and the repo root on PYTHONPATH: forked from the
session's preloaded fork server (see PRELOAD) where the launch's environment is the server's plus those
variables, else a new ``python`` subprocess. A function must be importable by module and name (defined at
module level); its JSON-serialisable return value comes back per rank. A script may write a JSON result to the
file named by $DIST_RESULT_FILE (else its rank's result is None). If a rank fails or the run times out, the
other ranks are killed and :class:`DistributedRunError` carries each failing rank's exit status and stderr
tail.
"""
from __future__ import annotations

import atexit
import importlib
import json
import multiprocessing
import os
import runpy
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable, List, Optional, Sequence, Union

from megatron_delta.platform.distributed import free_port  # noqa: F401  (tests import it from here too)
from tests.helpers import REPO_ROOT

_TAIL = 6000  # characters of a failing rank's stderr shown in the error

# Why a fork server: a rank spends ~5 CPU-seconds importing torch, Megatron-Core and Megatron-LM before it runs
# anything, and the suite starts a few hundred ranks on 2 cores. The server (multiprocessing's forkserver,
# started once per session) imports them once, as pretrain_gpt.py's ranks would, and forks each rank from there:
# the rank runs the same code on the same modules, without the import. A launch whose environment differs from
# the server's in more than the launch variables (LAUNCH_VARIABLES: e.g. TRITON_INTERPRET, read at import) and
# plain-python launches (``torchrun_env=False``: start-up and import-time behaviour) start a subprocess instead.
PRELOAD = ["tests.helpers.rank_preload"]
LAUNCH_VARIABLES = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                    "DIST_RESULT_FILE", "PYTHONUNBUFFERED", "PYTEST_CURRENT_TEST"}
# Variables code in the test session itself sets or drops as it runs, none read at import: Megatron-LM's argument
# validation sets the NVTE_* attention switches, inductor sets its data-pointer variable, the terminal's size goes.
# A forked rank starts with the launch's whole environment anyway (_forked_rank_main); without this list every
# launch after the first in-process Megatron-LM run would start new interpreters.
RUNTIME_VARIABLES = {"NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN",
                     "_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR", "COLUMNS", "LINES"}
_server: dict = {}  # {"context": the forkserver context, "env": the environment the server started with}


class DistributedRunError(RuntimeError):
    """A rank failed or the run timed out; the message holds the failing ranks' stderr."""

    def __init__(self, message: str, returncodes: Sequence[Optional[int]], stderrs: Sequence[str]):
        super().__init__(message)
        self.returncodes = list(returncodes)
        self.stderrs = list(stderrs)


def _target_of(fn: Callable) -> str:
    module, qualname = fn.__module__, fn.__qualname__
    if "<locals>" in qualname or "<lambda>" in qualname:
        raise ValueError(f"{qualname} is not importable: define it at module level")
    if module == "__main__":
        raise ValueError("a function of __main__ cannot be imported by the ranks")
    return f"{module}:{qualname}"


def run_distributed(
    fn_or_script: Union[Callable, str],
    world_size: int,
    *args: Any,
    timeout: float = 180.0,
    env: Optional[dict] = None,
    kwargs: Optional[dict] = None,
    grace: float = 5.0,
    torchrun_env: bool = True,
) -> List[Any]:
    """Run ``fn_or_script`` on ``world_size`` ranks; return the per-rank results (rank order).

    ``args``/``kwargs`` go to the function (JSON-serialisable) or, for a script, ``args`` are its
    command-line arguments.  ``env`` adds environment variables to every rank.  When a rank fails,
    the others get ``grace`` seconds to finish before being killed (they usually block in a
    collective).  ``torchrun_env=False`` (one rank only) leaves out RANK/WORLD_SIZE/MASTER_* so
    the code under test sees a plain ``python`` launch (a new interpreter: the tests of start-up
    and import-time behaviour use it).
    """
    if world_size < 1:
        raise ValueError("world_size must be >= 1")
    tmp = tempfile.mkdtemp(prefix="dist_utils_")
    port = free_port()
    base_env = dict(os.environ)
    base_env.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        OMP_NUM_THREADS=base_env.get("DIST_UTILS_OMP_NUM_THREADS", "1"),
        PYTHONPATH=os.pathsep.join([REPO_ROOT] + [p for p in [base_env.get("PYTHONPATH")] if p]),
        PYTHONUNBUFFERED="1",
    )
    plain_env = dict(base_env)  # the environment the fork server starts with
    if not torchrun_env:
        if world_size != 1:
            raise ValueError("torchrun_env=False needs world_size == 1")
        for key in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "LOCAL_WORLD_SIZE"):
            base_env.pop(key, None)
    if env:
        base_env.update({k: str(v) for k, v in env.items()})

    if callable(fn_or_script):
        spec_file = os.path.join(tmp, "spec.json")
        with open(spec_file, "w") as f:
            json.dump({"target": _target_of(fn_or_script), "args": list(args),
                       "kwargs": kwargs or {}}, f)
        cmd = [sys.executable, "-c",
               "import sys; from tests.helpers.dist_utils import _rank_main; _rank_main(sys.argv[1])",
               spec_file]
        target = ("function", spec_file)
        what = _target_of(fn_or_script)
    else:
        if kwargs:
            raise ValueError("kwargs are for functions; pass a script's arguments in args")
        cmd = [sys.executable, str(fn_or_script)] + [str(a) for a in args]
        target = ("script", cmd[1:])
        what = str(fn_or_script)

    # a plain-python launch (torchrun_env=False) tests start-up itself: always a new interpreter
    forked = torchrun_env and _server_matches(plain_env, base_env)
    procs, outs, errs, result_files = [], [], [], []
    try:
        for rank in range(world_size):
            rank_env = dict(base_env)
            if torchrun_env:
                rank_env.update(RANK=str(rank), LOCAL_RANK=str(rank))
            else:
                rank_env.pop("RANK", None)
                rank_env.pop("LOCAL_RANK", None)
            result_files.append(os.path.join(tmp, f"result_{rank}.json"))
            rank_env["DIST_RESULT_FILE"] = result_files[-1]
            out = open(os.path.join(tmp, f"stdout_{rank}.txt"), "w+")
            err = open(os.path.join(tmp, f"stderr_{rank}.txt"), "w+")
            outs.append(out)
            errs.append(err)
            if forked:
                procs.append(_ForkedRank(target, rank_env, out.name, err.name))
            else:
                procs.append(subprocess.Popen(cmd, env=rank_env, stdout=out, stderr=err, cwd=REPO_ROOT))
        deadline = time.monotonic() + timeout
        failed_at = None
        timed_out = False
        while True:
            codes = [p.poll() for p in procs]
            if all(c is not None for c in codes):
                break
            now = time.monotonic()
            if failed_at is None and any(c not in (None, 0) for c in codes):
                failed_at = now
            if now > deadline or (failed_at is not None and now - failed_at > grace):
                timed_out = now > deadline
                for p in procs:
                    if p.poll() is None:
                        p.kill()
                for p in procs:
                    p.wait()
                break
            time.sleep(0.05)
        codes = [p.returncode for p in procs]
        stderrs = []
        for err in errs:
            err.flush()
            err.seek(0)
            stderrs.append(err.read())
        if timed_out or any(c != 0 for c in codes):
            first_bad = [r for r, c in enumerate(codes) if c not in (0, -9)] or list(range(len(codes)))
            parts = [f"{what} on {world_size} ranks "
                     + (f"timed out after {timeout:.0f}s" if timed_out else "failed")
                     + f"; exit codes per rank: {codes}"]
            for r in first_bad:
                parts.append(f"----- rank {r} (exit {codes[r]}) stderr tail -----\n"
                             + stderrs[r][-_TAIL:])
            raise DistributedRunError("\n".join(parts), codes, stderrs)
        results = []
        for path in result_files:
            if os.path.exists(path):
                with open(path) as f:
                    results.append(json.load(f))
            else:
                results.append(None)
        return results
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for f in outs + errs:
            f.close()
        for name in os.listdir(tmp):
            os.remove(os.path.join(tmp, name))
        os.rmdir(tmp)


# ------------------------------------------------------------------------------------------ the fork server
def _server_matches(plain_env: dict, env: dict) -> bool:
    """True when a rank with ``env`` can be forked from the session's server: ``env`` less the launch and runtime
    variables is the server's. Starts the server on first use, with ``plain_env`` (the launch environment of a launch
    that adds no variables)."""
    def essential(e):
        return {k: v for k, v in e.items() if k not in LAUNCH_VARIABLES and k not in RUNTIME_VARIABLES}

    if not _server:
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload(PRELOAD)
        saved = dict(os.environ)
        os.environ.clear()
        os.environ.update(plain_env)  # the server (and so every forked rank) starts with it
        try:
            from multiprocessing import forkserver

            forkserver.ensure_running()
        finally:
            os.environ.clear()
            os.environ.update(saved)
        _server.update(context=context, env=essential(plain_env))
    return essential(env) == _server["env"]


class _ForkedRank:
    """A rank forked from the server, with the subprocess.Popen methods run_distributed uses."""

    def __init__(self, target, env: dict, stdout: str, stderr: str):
        self._process = _server["context"].Process(target=_forked_rank_main, args=(target, env, stdout, stderr),
                                                   name=f"rank{env.get('RANK', '0')}")
        self._process.start()
        self.pid = self._process.pid

    @property
    def returncode(self):
        return self._process.exitcode

    def poll(self):
        return self._process.exitcode

    def wait(self):
        self._process.join()
        return self._process.exitcode

    def kill(self):
        if self._process.exitcode is None:
            self._process.kill()


def _forked_rank_main(target, env: dict, stdout: str, stderr: str) -> None:
    """A forked rank (runs in the child): the subprocess rank's environment, working directory, argv and output
    files, then the function or script; exits with its code, after the atexit handlers a fresh interpreter would
    run (multiprocessing's children skip them)."""
    os.environ.clear()
    os.environ.update(env)
    os.chdir(REPO_ROOT)
    # a forkserver child inherits the forkserver start method; a new interpreter starts with the platform's default
    # (fork on Linux), which the data loader's workers rely on (their worker_init_fn is a local function)
    multiprocessing.set_start_method("fork" if sys.platform == "linux" else "spawn", force=True)
    for fd, path in ((1, stdout), (2, stderr)):
        f = os.open(path, os.O_WRONLY | os.O_APPEND)
        os.dup2(f, fd)
        os.close(f)
    sys.stdout.reconfigure(line_buffering=True)
    sys.stderr.reconfigure(line_buffering=True)
    kind, what = target
    code = 0
    try:
        if kind == "function":
            sys.argv = ["-c", what]
            _rank_main(what)
        else:
            sys.argv = list(what)  # the scripts launched so (pretrain_gpt.py, tools/) import only the package
            runpy.run_path(what[0], run_name="__main__")
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, (int, type(None))):
            print(e.code, file=sys.stderr)
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _rank_main(spec_file: str) -> None:
    """Entry point of one rank for a function target (runs in the subprocess)."""
    with open(spec_file) as f:
        spec = json.load(f)
    module_name, qualname = spec["target"].split(":")
    obj: Any = importlib.import_module(module_name)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    result = obj(*spec["args"], **spec["kwargs"])
    with open(os.environ["DIST_RESULT_FILE"], "w") as f:
        json.dump(result, f)
