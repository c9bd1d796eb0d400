"""The checkpoint errors: :class:`CheckpointError` (a checkpoint that cannot be used with these flags),
:class:`ConversionError` (a run_config or model that cannot be converted or rebuilt), and
:func:`describe_load_failure`: a checkpoint that fails to load because a file of it is damaged gets one line
naming the file and what to do.

Megatron-LM's ``load_checkpoint`` reads a torch_dist checkpoint with torch.distributed.checkpoint. A truncated
``__R_F.distcp`` shard ends there in ``CheckpointException`` (the ranks' failures gathered: an
``EOFError`` / ``UnpicklingError`` / ``RuntimeError`` from torch's reader, a screenful of traceback) that
names no file. :func:`describe_load_failure` recognises such a failure (it came out of checkpoint
loading), finds the damaged file by checking the iteration directory against its own index (the
``.metadata`` of torch.distributed.checkpoint records every item's file, offset and length; ``.pt``
files are zip archives; ``metadata.json`` is JSON; files listed in a ``--verify-integrity`` manifest
must exist) and returns one line: the file, the iteration, the previous complete checkpoint and the
two ways to resume from it (point the tracker at it, or ``--ckpt-step N``). A torch_dist iteration directory
without its ``metadata.json`` or ``.metadata`` (written last) is a save that did not finish, or lost files.
Failures that are not a damaged checkpoint file give None: the caller re-raises them unchanged.

Two more failures get one line here: :func:`describe_save_failure` (the ``--save`` filesystem is full: the free
space, and the previous checkpoint, which stays intact) and :func:`describe_schedule_mismatch` (a resume whose
learning-rate / weight-decay schedule flags differ from the checkpoint's: which value, and
``--override-opt_param-scheduler`` / ``--use-checkpoint-opt_param-scheduler``).

    try:
        run(args)
    except BaseException as e:  # CheckpointException (torch.distributed.checkpoint) is a BaseException
        message = describe_load_failure(e, args.load, args.ckpt_step)
        if message is None:
            raise
        return _error(message, 1)
"""
from __future__ import annotations

import errno
import json
import os
import re
import zipfile
from typing import Callable, Iterator, List, Optional, Tuple

from megatron_delta.checkpoint.layout import TRACKER, iteration_dir


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used with these flags; the message says why and what to do."""


class ConversionError(ValueError):
    """A checkpoint or model that cannot be converted; the message says why."""


_ITER_DIR = re.compile(r"^iter_(\d{7})$")
# Frames that mean "this exception came out of loading a checkpoint".
_LOAD_FUNCTIONS = {
    ("megatron/training/checkpointing.py", "load_checkpoint"),
    ("megatron/training/checkpointing.py", "_load_base_checkpoint"),
    ("megatron/training/checkpointing.py", "_load_global_dist_base_checkpoint"),
    ("megatron/training/checkpointing.py", "load_args_from_checkpoint"),
    ("megatron/core/dist_checkpointing/serialization.py", "load"),
    ("torch/distributed/checkpoint/state_dict_loader.py", "load"),
    ("torch/serialization.py", "load"),
}


def exception_chain(exc: BaseException) -> Iterator[BaseException]:
    """exc, its causes and contexts, and the per-rank failures a CheckpointException gathers."""
    seen, stack = set(), [exc]
    while stack:
        e = stack.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        stack += [e.__cause__, e.__context__]
        failures = getattr(e, "failures", None)  # torch.distributed.checkpoint.api.CheckpointException
        if isinstance(failures, dict):
            for failure in failures.values():
                if isinstance(failure, tuple) and failure and isinstance(failure[0], BaseException):
                    stack.append(failure[0])
                elif isinstance(failure, BaseException):
                    stack.append(failure)


def _frames(exc: BaseException) -> Iterator[Tuple[str, str]]:
    """(filename, function) of every frame in exc's traceback and in the gathered failures' frames."""
    tb = exc.__traceback__
    while tb is not None:
        yield tb.tb_frame.f_code.co_filename.replace(os.sep, "/"), tb.tb_frame.f_code.co_name
        tb = tb.tb_next
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict):
        for failure in failures.values():
            if isinstance(failure, tuple) and len(failure) > 1 and isinstance(failure[1], list):
                for fs in failure[1]:  # traceback.FrameSummary
                    yield str(getattr(fs, "filename", "")).replace(os.sep, "/"), str(getattr(fs, "name", ""))


def _raised_in(exc: BaseException, functions) -> bool:
    """Whether a frame of exc's chain is one of ``functions`` ((file suffix, function name) pairs)."""
    return any(filename.endswith(f) and function == fn
               for e in exception_chain(exc) for filename, function in _frames(e) for f, fn in functions)


def _iterations(load_dir: str) -> List[int]:
    try:
        names = os.listdir(load_dir)
    except OSError:
        return []
    return sorted(int(m.group(1)) for m in map(_ITER_DIR.match, names) if m)


def tracker_iteration(load_dir: str) -> Optional[int]:
    try:
        with open(os.path.join(load_dir, TRACKER)) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


def damaged_files(ckpt_dir: str) -> List[Tuple[str, str]]:
    """(path, what is wrong) for each file of one iteration directory that cannot be read whole."""
    if not os.path.isdir(ckpt_dir):
        return [(ckpt_dir, "is missing")]
    found: List[Tuple[str, str]] = []
    dcp_index = os.path.join(ckpt_dir, ".metadata")
    names = os.listdir(ckpt_dir)
    if not any(n.startswith("mp_rank_") for n in names):  # not the legacy torch format: a torch_dist save
        # dist_checkpointing writes metadata.json and torch.distributed.checkpoint's .metadata (the index of
        # the .distcp shards) last: without them the directory is a save that did not finish, or lost files.
        for name in ("metadata.json", ".metadata"):
            if name not in names:
                found.append((os.path.join(ckpt_dir, name), "is missing"))
    if os.path.exists(dcp_index):  # torch_dist / torch.distributed.checkpoint
        try:
            from torch.distributed.checkpoint import FileSystemReader

            storage = FileSystemReader(ckpt_dir).read_metadata().storage_data or {}
        except Exception as e:  # noqa: BLE001 - any failure to read the index means it is damaged
            found.append((dcp_index, f"cannot be read ({type(e).__name__}: {e})" if str(e) else
                          f"cannot be read ({type(e).__name__})"))
            storage = {}
        needed = {}
        for info in storage.values():
            end = int(info.offset) + int(info.length)
            needed[info.relative_path] = max(needed.get(info.relative_path, 0), end)
        for rel, end in sorted(needed.items()):
            path = os.path.join(ckpt_dir, rel)
            if not os.path.exists(path):
                found.append((path, "is missing"))
            elif os.path.getsize(path) < end:
                found.append((path, f"is truncated ({os.path.getsize(path)} of {end} bytes)"))
    for name in sorted(os.listdir(ckpt_dir)):
        path = os.path.join(ckpt_dir, name)
        if name.endswith(".pt") and os.path.isfile(path):  # torch.save archives (common.pt, legacy format)
            try:
                with zipfile.ZipFile(path) as z:
                    bad = z.testzip()
                if bad is not None:
                    found.append((path, f"is corrupted (entry {bad} fails its CRC)"))
            except (zipfile.BadZipFile, OSError, EOFError) as e:
                found.append((path, f"is not a readable torch.save archive ({e})"))
        elif name == "metadata.json":
            try:
                with open(path) as f:
                    json.load(f)
            except (OSError, ValueError) as e:
                found.append((path, f"is not readable JSON ({e})"))
        elif os.path.isdir(path):  # legacy format: mp_rank_XX/model_optim_rng.pt
            for sub in sorted(os.listdir(path)):
                if sub.endswith(".pt"):
                    p = os.path.join(path, sub)
                    try:
                        with zipfile.ZipFile(p) as z:
                            z.testzip()
                    except (zipfile.BadZipFile, OSError, EOFError) as e:
                        found.append((p, f"is not a readable torch.save archive ({e})"))
    manifest = os.path.join(ckpt_dir, "integrity.json")  # --verify-integrity
    if os.path.exists(manifest):
        try:
            with open(manifest) as f:
                listed = json.load(f).get("files", {})
            for rel in listed:
                if not os.path.exists(os.path.join(ckpt_dir, rel)) and not any(
                        p == os.path.join(ckpt_dir, rel) for p, _ in found):
                    found.append((os.path.join(ckpt_dir, rel), "is missing"))
        except (OSError, ValueError, AttributeError):
            pass
    return found


def clip(text: str, limit: int = 200) -> str:
    """text's first line, at most ``limit`` characters, cut at a word boundary ("..." marks a cut)."""
    first = text.splitlines()[0] if text else ""
    if len(first) <= limit:
        return first
    cut = first[:limit - 4]
    if first[limit - 4] != " ":  # a word runs over the cut: drop it whole
        cut = cut.rsplit(" ", 1)[0]
    return cut.rstrip(" ,;:") + " ..."


def _abbreviated(iterations: List[int], most: int = 8) -> str:
    shown = ", ".join(str(it) for it in iterations[:most])
    return shown if len(iterations) <= most else f"{shown}, ... ({len(iterations)} in all)"


def complete_checkpoints(load_dir: str, exclude: Optional[int] = None) -> List[int]:
    """The iterations of load_dir whose directory has every file its index lists, newest first."""
    return [it for it in reversed(_iterations(load_dir))
            if it != exclude and not damaged_files(iteration_dir(load_dir, it))]


def read_json(path: str, check: Callable[[object], Optional[str]]) -> Tuple[object, Optional[str]]:
    """A checkpoint's JSON file: (its value, None), or (None, why it cannot be used: not text, not JSON, not
    readable, or what ``check`` says of the value) - for the caller's one line naming the file."""
    try:
        with open(path, "rb") as f:
            value = json.loads(f.read().decode("utf-8"))
    except UnicodeDecodeError as e:
        return None, f"not text: {e.reason} at byte {e.start}"
    except ValueError as e:
        return None, f"not JSON: {e}"
    except OSError as e:
        return None, f"cannot be read: {e.strerror or e}"
    why = check(value)
    return (None, why) if why else (value, None)


def resume_advice(load_dir: str, iteration: Optional[int], verifies: Optional[Callable[[str], bool]] = None,
                  tool: bool = False) -> str:
    """What to do when the checkpoint of ``iteration`` in ``load_dir`` cannot be loaded, from what is on disk:
    the complete checkpoints there, newest first, and how to resume from the newest one (with ``verifies``,
    integrity.verifies: the newest whose integrity.json verifies). The tracker is never advised below a complete
    checkpoint newer than that one, and only an existing directory is ever advised to be deleted. ``tool``: the
    advice of a tool's --load (an iteration directory) instead of the trainer's tracker / --ckpt-step."""
    complete = complete_checkpoints(load_dir, exclude=iteration)
    verified = verifies is not None
    if verified:
        target = next((it for it in complete if verifies(iteration_dir(load_dir, it))), None)
    else:
        target = complete[0] if complete else None
    tracker = os.path.join(load_dir, TRACKER)
    ckpt_dir = iteration_dir(load_dir, iteration) if iteration is not None else None
    listing = f"Complete checkpoints in {load_dir}, newest first: {_abbreviated(complete)}"
    if target is None:
        if complete:
            head = f"{listing}; none of them verifies: "
        else:
            head = f"No {'other ' if iteration is not None else ''}complete checkpoint in {load_dir}: "
        if tool:
            return head + "--load another checkpoint"
        doomed = [p for p in (ckpt_dir, tracker) if p is not None and os.path.exists(p)]
        scratch = f"delete {' and '.join(doomed)} to start from scratch, or " if doomed else ""
        return head + scratch + "--load another directory"
    which = "the newest that verifies" if verified else "the newest"
    if tool:
        return f"{listing}; load {which}, iteration {target}, with --load {iteration_dir(load_dir, target)}"
    if tracker_iteration(load_dir) == target:  # --ckpt-step named another iteration
        return (f"{listing}; {tracker} names iteration {target}, {which}: resume without --ckpt-step, "
                f"or pass --ckpt-step {target}")
    delete = (ckpt_dir is not None and iteration is not None and iteration > target and os.path.isdir(ckpt_dir))
    todo = f"Delete {ckpt_dir} and write" if delete else "Write"
    return (f"{listing}. {todo} {target} into {tracker} to resume from iteration {target} ({which}), "
            f"or pass --ckpt-step {target}")


def _named_in_messages(exc: BaseException, load_dir: str) -> List[Tuple[str, str]]:
    """Files under load_dir that the exceptions name themselves (OSError.filename, integrity manifest)."""
    root = os.path.abspath(load_dir)
    out = []
    for e in exception_chain(exc):
        name = getattr(e, "filename", None)
        if isinstance(name, str) and os.path.abspath(name).startswith(root):
            out.append((name, f"cannot be read ({type(e).__name__}: {getattr(e, 'strerror', None) or e})"))
        for m in re.finditer(r"^\s+(\S+): (hash mismatch|file missing or unreadable)", str(e), re.M):
            out.append((m.group(1), f"fails --verify-integrity ({m.group(2)})"))
    return out


def describe_load_failure(exc: BaseException, load_dir: Optional[str],
                          ckpt_step: Optional[int] = None, tool: bool = False) -> Optional[str]:
    """One line for a checkpoint load that failed on a damaged file, or None (not such a failure).

    ``load_dir`` and ``ckpt_step`` are the run's ``--load`` and ``--ckpt-step``. Note that
    torch.distributed.checkpoint's ``CheckpointException`` derives from BaseException, not Exception:
    the caller must catch BaseException (and let SystemExit / KeyboardInterrupt through).
    """
    if not load_dir or isinstance(exc, (SystemExit, KeyboardInterrupt, GeneratorExit)):
        return None
    if not _raised_in(exc, _LOAD_FUNCTIONS):
        return None
    iteration = ckpt_step if ckpt_step else tracker_iteration(load_dir)
    if iteration is None:
        return None
    ckpt_dir = iteration_dir(load_dir, iteration)
    found = damaged_files(ckpt_dir)
    if not found:
        found = [(p if os.path.isabs(p) else os.path.join(ckpt_dir, p), why)
                 for p, why in _named_in_messages(exc, load_dir)]
    if not found:
        return None
    path, why = found[0]
    more = f" (and {len(found) - 1} more file(s))" if len(found) > 1 else ""
    cause = next((e for e in exception_chain(exc) if not type(e).__name__.endswith("CheckpointException")), exc)
    detail = f"{type(cause).__name__}: {cause}" if str(cause) else type(cause).__name__
    tracker = os.path.join(load_dir, TRACKER)
    tracked = tracker_iteration(load_dir)
    unfinished = ""
    if why == "is missing" and os.path.basename(path) in ("metadata.json", ".metadata") and tracked != iteration:
        unfinished = f" (a save that did not finish: {tracker} names iteration {tracked})" if tracked is not None \
            else " (a save that did not finish)"
    line = (f"cannot load the checkpoint of iteration {iteration}: {path} {why}{more}{unfinished}; "
            f"the load failed with {clip(detail.splitlines()[0].rstrip('.'))}. ")
    return line + resume_advice(load_dir, iteration, tool=tool)


# ------------------------------------------------------------------------------- saving on a full disk
# Frames that mean "this exception came out of saving a checkpoint".
_SAVE_FUNCTIONS = {
    ("megatron/training/checkpointing.py", "save_checkpoint"),
    ("megatron/core/dist_checkpointing/serialization.py", "save"),
    ("torch/distributed/checkpoint/state_dict_saver.py", "save"),
    ("torch/serialization.py", "save"),
    ("megatron_delta/trainer/hooks.py", "save_checkpoint"),  # RunHooks' hook around upstream's
    ("megatron_delta/checkpoint/run_config.py", "write_run_config"),
}
_FULL = (errno.ENOSPC, errno.EDQUOT)
_NEARLY_FULL = 2**20  # bytes: less free space than this counts as a full disk even before any checkpoint


def _size(path: str) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.path.getsize(os.path.join(root, name))
            except OSError:
                pass
    return total


def _human(n: float) -> str:
    for unit in ("bytes", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def describe_save_failure(exc: BaseException, save_dir: Optional[str]) -> Optional[str]:
    """One line for a checkpoint save that failed because the ``--save`` filesystem is full, or None.

    The writer of torch_dist checkpoints (megatron-core's FileSystemWriterAsync) reports a failed write as
    "Worker failure: An error is caught while starting worker 0, error: <class 'RuntimeError'>": torch.save's
    "unexpected pos" or the OSError's errno does not survive it. So a failed save counts as a full disk when an
    ENOSPC / EDQUOT OSError is in the chain, or when the free space left on the ``--save`` filesystem is below
    what the last complete checkpoint there occupies (the size the failed save needed at least), or below
    1 MiB.
    """
    if not save_dir or isinstance(exc, (SystemExit, KeyboardInterrupt, GeneratorExit)):
        return None
    if not _raised_in(exc, _SAVE_FUNCTIONS):
        return None
    import shutil

    try:
        free = shutil.disk_usage(save_dir).free
    except OSError:
        return None
    tracked = tracker_iteration(save_dir)
    previous = iteration_dir(save_dir, tracked) if tracked is not None else None
    needed = _size(previous) if previous else 0
    full = any(isinstance(e, OSError) and e.errno in _FULL for e in exception_chain(exc)) or any(
        "No space left on device" in str(e) or "Disk quota exceeded" in str(e) for e in exception_chain(exc))
    if not full and free >= max(needed, _NEARLY_FULL):
        return None
    unfinished = [it for it in _iterations(save_dir) if tracked is None or it > tracked]
    what = f"the checkpoint of iteration {unfinished[-1]}" if unfinished else "a checkpoint"
    line = f"cannot save {what} in {save_dir}: no space left on device ({_human(free)} free"
    line += f", the last checkpoint took {_human(needed)}); " if needed else "); "
    if previous is not None and not damaged_files(previous):
        line += (f"the previous checkpoint, iteration {tracked} ({previous}), is intact and "
                 f"{os.path.join(save_dir, TRACKER)} names it. ")
    else:
        line += "no earlier complete checkpoint is there. "
    if unfinished:
        line += f"Delete the unfinished {iteration_dir(save_dir, unfinished[-1])} (it is never loaded), free "
    else:
        line += "Free "
    line += f"space or --save to a larger filesystem, and resume with --load {save_dir}"
    return line


# ------------------------------------------------------------------------------- schedule mismatch on resume
_SCHEDULER_ASSERT = re.compile(r"class input value (.*) and checkpoint ?value (.*) for (.*) do not match")
# OptimizerParamScheduler._check_and_set's names (megatron-core 0.19.2) -> the flags behind them, and whether the
# value counts samples (iterations x --global-batch-size for an iteration-based run)
_SCHEDULER_FIELDS = {
    "learning rate": ("--lr", False),
    "minimum learning rate": ("--min-lr", False),
    "warmup iterations": ("--lr-warmup-iters / --lr-warmup-fraction", True),
    "total number of iterations": ("--lr-decay-iters (default --train-iters)", True),
    "learning rate decay style": ("--lr-decay-style", False),
    "start weight decay": ("--start-weight-decay / --weight-decay", False),
    "end weight decay": ("--end-weight-decay / --weight-decay", False),
    "total number of weight decay iterations": ("--train-iters", True),
    "weight decay incr style": ("--weight-decay-incr-style", False),
}


def describe_schedule_mismatch(exc: BaseException, args) -> Optional[str]:
    """One line for a resume whose learning-rate / weight-decay schedule flags differ from the checkpoint's
    (OptimizerParamScheduler.load_state_dict's AssertionError), or None."""
    if not isinstance(exc, AssertionError):
        return None
    if not any(f.endswith("megatron/core/optimizer_param_scheduler.py") and fn == "_check_and_set"
               for f, fn in _frames(exc)):
        return None
    m = _SCHEDULER_ASSERT.search(str(exc))
    if m is None:
        return None
    ours, theirs, name = m.group(1), m.group(2), m.group(3)
    flag, in_samples = _SCHEDULER_FIELDS.get(name, ("the schedule flags", False))
    gbs = getattr(args, "global_batch_size", None)
    if in_samples and getattr(args, "train_iters", None) and gbs:
        def iters(v: str) -> str:
            try:
                f = float(v)
            except ValueError:
                return v
            return f"{f / gbs:g} iterations" if f % gbs == 0 else f"{f:g} samples"

        ours, theirs = iters(ours), iters(theirs)
    where = f"the checkpoint in {args.load}" if getattr(args, "load", None) else "the checkpoint"
    return (f"{where} was trained with another schedule: {name} ({flag}) is {ours} in this run but {theirs} "
            f"in the checkpoint. Resume with the checkpoint's value, or add --override-opt_param-scheduler to "
            f"continue with this run's schedule flags (learning rate, warmup, decay iterations and style, weight "
            f"decay; from the checkpoint's iteration on, so the learning rate may jump there; model, optimizer "
            f"state, iteration and data position still come from the checkpoint), or "
            f"--use-checkpoint-opt_param-scheduler to keep the checkpoint's schedule and ignore these flags")
