"""torchrun for preemptible jobs:
``python -m megatron_delta.trainer.launch [torchrun flags] -m megatron_delta.trainer ...``

The flags are torchrun's (torch.distributed.run), unchanged; only SIGTERM is handled differently.

torchrun's agent turns a SIGTERM into ``SignalException``: it sends SIGTERM to the workers, gives them
30 s (``--shutdown_timeout``) before SIGKILL, and exits 1 with a traceback whatever the workers did. A
cluster's preemption or time-limit signal reaches the launcher, so a job whose workers saved their checkpoint
(``--exit-signal-handler``) still ends as failed, a save longer than 30 s is killed midway, and a batch
script under ``set -e`` never reaches its requeue.

Here SIGTERM to the launcher is passed on to the workers (SIGTERM to each, once) and the agent keeps
running: workers started with ``--exit-signal-handler`` finish the iteration, save a checkpoint, and exit 0,
and the launcher then exits 0 like a finished run. The exit status is the agent's: 0 when every worker
exited 0, 1 otherwise (a worker without ``--exit-signal-handler`` dies of the signal, and a job under
``--max-restarts`` then restarts it). SIGINT, SIGHUP and SIGQUIT keep torchrun's handling, and a second
SIGTERM does too (torchrun's shutdown: the workers get SIGTERM again and then SIGKILL).
"""
from __future__ import annotations

import os
import signal
import sys
from typing import List, Optional, Sequence

# The signals torchrun's agent handles itself: the default of torchrun's --signals-to-handle (read from
# PET_SIGNALS_TO_HANDLE, torch/distributed/run.py) without SIGTERM, which is this launcher's. A
# --signals-to-handle given on the command line wins; one naming SIGTERM gives torchrun's handling back.
AGENT_SIGNALS = "SIGINT,SIGHUP,SIGQUIT"


def _children(pid: int) -> List[int]:
    import psutil

    try:
        return [p.pid for p in psutil.Process(pid).children(recursive=False)]
    except psutil.Error:
        return []


def _forward_sigterm(signum, frame) -> None:
    """SIGTERM -> each worker (the agent's child processes); a second SIGTERM is torchrun's own shutdown."""
    from torch.distributed.elastic.multiprocessing.api import _terminate_process_handler

    workers = _children(os.getpid())
    print(f"megatron_delta.trainer.launch: SIGTERM passed on to {len(workers)} worker(s); they save with "
          "--exit-signal-handler and exit (a second SIGTERM stops them now)", file=sys.stderr, flush=True)
    for pid in workers:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    signal.signal(signal.SIGTERM, _terminate_process_handler)


def main(argv: Optional[Sequence[str]] = None) -> int:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun_main

    os.environ["PET_SIGNALS_TO_HANDLE"] = AGENT_SIGNALS
    signal.signal(signal.SIGTERM, _forward_sigterm)
    try:
        torchrun_main(list(sys.argv[1:] if argv is None else argv))
    except ChildFailedError:  # torchrun has printed its summary of the failed workers
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
