"""torchrun for preemptible jobs:
``python -m megatron_delta.trainer.launch [torchrun flags] -m megatron_delta.trainer ...``

The flags are torchrun's (torch.distributed.run), unchanged; only SIGTERM and SIGINT are handled differently.

torchrun's agent turns a SIGTERM or SIGINT into ``SignalException``: it sends SIGTERM to the workers, gives
them 30 s (``--shutdown_timeout``) before SIGKILL, and exits 1 with a traceback whatever the workers did. A
cluster's preemption or time-limit signal reaches the launcher, so a job whose workers saved their checkpoint
(``--exit-signal-handler``) still ends as failed, a save longer than 30 s is killed midway, and a batch
script under ``set -e`` never reaches its requeue; a Ctrl-C (which reaches only the launcher: each worker runs
in a session of its own) ends the workers without a line.

Here SIGTERM and SIGINT to the launcher are passed on to the workers (the same signal to each, once) and the
agent keeps running. On SIGTERM, workers started with ``--exit-signal-handler`` finish the iteration, save a
checkpoint, and exit 0, and the launcher then exits 0 like a finished run; the exit status is the agent's: 0
when every worker exited 0, 1 otherwise (a worker without ``--exit-signal-handler`` dies of the signal, and a
job under ``--max-restarts`` then restarts it). On SIGINT each worker finishes a save under way, global rank 0
prints one line naming the last complete checkpoint (trainer/main.py), the workers exit 0 (a non-zero one would
make the agent SIGTERM the others at once, midway through a save or before the line) and the launcher exits 130.
SIGHUP and SIGQUIT keep torchrun's handling, and a second SIGTERM or SIGINT does too (torchrun's shutdown: the
workers get SIGTERM and then SIGKILL).
"""
from __future__ import annotations

import os
import signal
import sys
from typing import List, Optional, Sequence

# The signals torchrun's agent handles itself: the default of torchrun's --signals-to-handle (read from
# PET_SIGNALS_TO_HANDLE, torch/distributed/run.py) without SIGTERM and SIGINT, which are this launcher's. A
# --signals-to-handle given on the command line wins; one naming SIGTERM gives torchrun's handling back.
AGENT_SIGNALS = "SIGHUP,SIGQUIT"
_RECEIVED: List[int] = []  # the signals passed on to the workers


def _children(pid: int) -> List[int]:
    import psutil

    try:
        return [p.pid for p in psutil.Process(pid).children(recursive=False)]
    except psutil.Error:
        return []


def _forward(signum, frame) -> None:
    """SIGTERM / SIGINT -> each worker (the agent's child processes, each in a session of its own, so a Ctrl-C in
    the terminal reaches only this process); a second one is torchrun's own shutdown."""
    from torch.distributed.elastic.multiprocessing.api import _terminate_process_handler

    workers = _children(os.getpid())
    _RECEIVED.append(signum)
    if signum == signal.SIGTERM:
        print(f"megatron_delta.trainer.launch: SIGTERM passed on to {len(workers)} worker(s); they save with "
              "--exit-signal-handler and exit (a second SIGTERM stops them now)", file=sys.stderr, flush=True)
    for pid in workers:
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass
    signal.signal(signum, _terminate_process_handler)


def main(argv: Optional[Sequence[str]] = None) -> int:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun_main

    os.environ["PET_SIGNALS_TO_HANDLE"] = AGENT_SIGNALS
    os.environ["MEGATRON_DELTA_LAUNCH"] = "1"  # trainer/main.py LAUNCHED_BY: on SIGINT a worker exits 0, not 130
    signal.signal(signal.SIGTERM, _forward)
    signal.signal(signal.SIGINT, _forward)
    try:
        torchrun_main(list(sys.argv[1:] if argv is None else argv))
    except ChildFailedError:  # torchrun has printed its summary of the failed workers
        return 130 if signal.SIGINT in _RECEIVED else 1
    return 130 if signal.SIGINT in _RECEIVED else 0


if __name__ == "__main__":
    sys.exit(main())
