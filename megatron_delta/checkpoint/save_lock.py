"""One writer per checkpoint directory: the lock file ``<--save>/.megatron-delta.lock``.

Global rank 0 takes it at start-up, after the distributed start-up and before the model is built (main.py's
``_Run`` hook of setup_model_and_optimizer); the other ranks learn rank 0's answer by a broadcast, so a refused
run ends on every rank with one line (rank 0's) instead of two runs overwriting each other's checkpoints.

The lock is a POSIX record lock (``fcntl.lockf``), not ``flock``: a forked child (data-loader workers, the
async checkpoint writer's helpers) does not inherit a record lock, so a killed rank 0 never leaves its lock
held by an orphan. The file holds the holder's host, pid and start time as JSON; a clean exit empties it.
A lock that is free but still names a run is that run's, killed: the next run takes it over and says so.

On NFS (v3 through lockd, v4 natively) record locks hold across hosts. Lustre honours them when mounted with
``-o flock`` (``localflock`` makes them node-local; ``noflock`` refuses them). Where a filesystem refuses locks
(ENOLCK, EOPNOTSUPP, ENOSYS) the recorded pid is checked instead, on the same host only (docs/usage.md).
"""
from __future__ import annotations

import datetime
import errno
import fcntl
import json
import os
import socket
from typing import Optional

LOCK_NAME = ".megatron-delta.lock"
_NO_LOCKS = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS}


class SaveDirInUse(RuntimeError):
    """Another live run holds the lock of this --save directory; the message names it."""


def _holder_text(holder: dict) -> str:
    return (f"host {holder.get('host', '?')}, pid {holder.get('pid', '?')}, "
            f"started {holder.get('started', '?')}")


def _read(fd: int) -> Optional[dict]:
    os.lseek(fd, 0, os.SEEK_SET)
    raw = b""
    while True:
        chunk = os.read(fd, 65536)
        if not chunk:
            break
        raw += chunk
    if not raw.strip():
        return None
    try:
        holder = json.loads(raw)
    except ValueError:
        return {"host": "?", "pid": "?", "started": f"unreadable lock file ({raw[:40]!r})"}
    return holder if isinstance(holder, dict) else None


def _alive_here(holder: dict) -> bool:
    """The recorded pid still runs on this host (a holder on another host counts as alive)."""
    if holder.get("host") != socket.gethostname():
        return True
    try:
        pid = int(holder.get("pid"))
    except (TypeError, ValueError):
        return False
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _in_use(save_dir: str, path: str, holder: dict) -> SaveDirInUse:
    return SaveDirInUse(
        f"--save {save_dir} is in use by another run ({_holder_text(holder)}; lock file {path}): two runs "
        f"saving into one directory overwrite each other's checkpoints. Wait for that run to end or stop it, "
        f"or give this run another --save directory")


class SaveDirLock:
    """The lock of one --save directory held by this process; ``message`` says what taking it found."""

    def __init__(self, save_dir: str):
        self.save_dir = save_dir
        self.path = os.path.join(save_dir, LOCK_NAME)
        self.message: Optional[str] = None
        self._fd: Optional[int] = None

    def acquire(self) -> "SaveDirLock":
        os.makedirs(self.save_dir, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            try:
                fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                locks = True
            except OSError as e:
                if e.errno in (errno.EACCES, errno.EAGAIN):
                    raise _in_use(self.save_dir, self.path, _read(fd) or {}) from None
                if e.errno not in _NO_LOCKS:
                    raise
                locks = False
            previous = _read(fd)
            if not locks:
                if previous is not None and _alive_here(previous):
                    raise _in_use(self.save_dir, self.path, previous)
                self.message = (f"warning: the filesystem of --save {self.save_dir} refuses file locks: "
                                f"another run on this host is detected by its pid only, a run on another host "
                                f"not at all (docs/usage.md, 'One writer per --save directory')")
            elif previous is not None:
                self.message = (f"took over the lock of --save {self.save_dir} from a run that ended without "
                                f"releasing it ({_holder_text(previous)}): its checkpoints stay as they are")
            me = {"host": socket.gethostname(), "pid": os.getpid(),
                  "started": datetime.datetime.now().astimezone().isoformat(timespec="seconds")}
            os.ftruncate(fd, 0)
            os.lseek(fd, 0, os.SEEK_SET)
            os.write(fd, (json.dumps(me) + "\n").encode())
            os.fsync(fd)
        except BaseException:
            os.close(fd)  # also drops the record lock, if taken
            raise
        self._fd = fd
        return self

    def release(self) -> None:
        """Empty the file (a clean exit), then drop the lock by closing it."""
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        try:
            os.ftruncate(fd, 0)
        except OSError:
            pass
        finally:
            os.close(fd)


def acquire_on_rank0(save_dir: str) -> Optional[SaveDirLock]:
    """Every rank calls it: rank 0 takes the lock, every rank raises SaveDirInUse if rank 0 was refused."""
    import torch

    dist = torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    lock, refusal = None, None
    if rank == 0:
        try:
            lock = SaveDirLock(save_dir).acquire()
        except SaveDirInUse as e:
            refusal = str(e)
        except OSError as e:  # e.g. the directory became unwritable since the start-up check
            refusal = f"--save {save_dir}: cannot create the lock file ({e.strerror or e})"
    if dist:
        box = [refusal]
        torch.distributed.broadcast_object_list(box, src=0)
        refusal = box[0]
    if refusal is not None:
        raise SaveDirInUse(refusal)
    return lock


__all__ = ["LOCK_NAME", "SaveDirInUse", "SaveDirLock", "acquire_on_rank0"]
