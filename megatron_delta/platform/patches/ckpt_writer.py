"""megatron-core's checkpoint writer keeps its results queue in a multiprocessing Manager: the implementation of
the ``ckpt_writer_manager_exits_with_rank`` entry of megatron_delta.platform.patches (which names the upstream code and
versions).

``filesystem_async.get_write_results_queue`` (0.19.2, core/dist_checkpointing/strategies/filesystem_async.py:53)
starts ``ctx.Manager()`` at a rank's first torch_dist save and keeps it for the life of the process. The Manager
is a server process (spawned: it re-imports the trainer, ~600 MB) that waits for connections and never looks
at its parent; multiprocessing shuts it down from an atexit finaliser. A rank killed with SIGKILL (the OOM
killer, ``torchrun --max-restarts``' failed worker, a node's cleanup) runs no finaliser, so the Manager and the
resource tracker it holds open are reparented to init and run on forever: every restart leaks them.

The fix starts the same Manager (same context, same ``Queue`` proxy, so the async save paths and
megatron.training.async_utils' ``_results_queue._manager.shutdown()`` work unchanged) with an initializer that
watches its parent: when the process that started it is gone, the Manager exits, and the resource tracker
with it (its last writer closed).
"""
from __future__ import annotations

import os
import threading
import time

from megatron_delta.platform.patches.install import replace

# How often the Manager looks for its parent (a thread sleeping in the Manager process; costs nothing).
PARENT_POLL_S = 0.2


def _exit_with_parent(parent_pid: int) -> None:
    """Runs in the Manager process (module level: the spawn context pickles it by name)."""

    def watch():
        while os.getppid() == parent_pid:
            time.sleep(PARENT_POLL_S)
        os._exit(0)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


def fix_results_queue_manager() -> None:
    from multiprocessing.managers import SyncManager

    from megatron.core.dist_checkpointing.strategies import filesystem_async
    from torch import multiprocessing as mp

    def get_write_results_queue(mp_mode: str = "spawn"):
        """Upstream's function (a process-wide Manager().Queue() in context ``mp_mode``) with a Manager
        that exits when this process dies."""
        if filesystem_async._results_queue is None:
            manager = SyncManager(ctx=mp.get_context(mp_mode))
            manager.start(_exit_with_parent, (os.getpid(),))
            filesystem_async._results_queue = manager.Queue()
        return filesystem_async._results_queue

    get_write_results_queue.__doc__ = (filesystem_async.get_write_results_queue.__doc__ or "").strip() + (
        "\n\n(megatron_delta.platform.patches ckpt_writer_manager_exits_with_rank: the Manager exits with its parent.)")
    replace(filesystem_async, "get_write_results_queue", get_write_results_queue)
