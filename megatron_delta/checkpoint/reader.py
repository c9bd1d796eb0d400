"""The one way a tool opens a checkpoint (export, evaluate, perplexity, routing report): the trainer's careful
path outside the trainer.

:func:`open_checkpoint` resolves ``--load`` (a run directory: the iteration its tracker names; or one
iter_NNNNNNN directory), verifies the checkpoint's files against its integrity.json before anything of it is
read (run_config.json included; ``verify_integrity=False`` is the tools' ``--no-verify-integrity``), says once
when the load goes on unverified, and reads run_config.json. Every failure is a CheckpointError whose message
is one line naming the file and what to do: the tools print it and exit before writing any output. A process
opens a checkpoint once: later opens of the same, unchanged directory return the first result without hashing
or printing again (store.load_checkpoint opens the checkpoint its caller opened).
"""
from __future__ import annotations

import os
import sys
from typing import Callable, NamedTuple, Optional

from megatron_delta.checkpoint.errors import CheckpointError
from megatron_delta.checkpoint.integrity import describe_mismatch, is_integrity_failure, verify_before_load
from megatron_delta.checkpoint.layout import TRACKER
from megatron_delta.checkpoint.run_config import PER_LAYER_CONFIG, read_run_config, resolve_checkpoint_dir


class OpenedCheckpoint(NamedTuple):
    ckpt_dir: str  # the iteration directory
    iteration: int
    run_config: dict
    root: str  # the directory holding iteration directories (and the tracker)
    step: Optional[int]  # the iteration when --load named one iteration directory, else None (the tracker's)


def _stderr(line: str) -> None:
    if os.environ.get("RANK", "0") in ("", "0"):
        print(line, file=sys.stderr, flush=True)


def _signature(ckpt_dir: str) -> tuple:
    """What changes when a file of the directory is written: (name, size, mtime) of each."""
    out = []
    for entry in sorted(os.scandir(ckpt_dir), key=lambda e: e.name):
        if entry.is_file():
            st = entry.stat()
            out.append((entry.name, st.st_size, st.st_mtime_ns))
    return tuple(out)


_OPENED: dict = {}


def open_checkpoint(load: str, verify_integrity: bool = True,
                    log: Callable[[str], None] = _stderr) -> OpenedCheckpoint:
    """The checkpoint of ``--load`` verified (unless not ``verify_integrity``) and its run_config.json read."""
    ckpt_dir, iteration = resolve_checkpoint_dir(load)
    from_tracker = os.path.isfile(os.path.join(load, TRACKER))
    root, step = (load, None) if from_tracker else (os.path.dirname(os.path.abspath(ckpt_dir)), iteration)
    key = (os.path.realpath(ckpt_dir), bool(verify_integrity))
    signature = _signature(ckpt_dir)
    cached = _OPENED.get(key)
    if cached is not None and cached[0] == signature:
        return cached[1]
    try:
        note = verify_before_load(ckpt_dir, verify_integrity)
    except CheckpointError:
        raise
    except BaseException as e:  # noqa: BLE001 - upstream's CheckpointingException on a hash mismatch
        if not is_integrity_failure(e):
            raise
        raise CheckpointError(describe_mismatch(e, root, step, tool=True)) from None
    if note:
        log(note)
    opened = OpenedCheckpoint(ckpt_dir, iteration, read_run_config(ckpt_dir), root, step)
    per_layer = opened.run_config.get(PER_LAYER_CONFIG)
    if per_layer:
        raise CheckpointError(f"{ckpt_dir} was trained with --heterogeneous-layers-config-path {per_layer}: the tools "
                              f"rebuild a model from run_config.json's flags and cannot rebuild per-layer "
                              f"configurations; evaluate it with pretrain_gpt.py --load {root} "
                              f"--heterogeneous-layers-config-path {per_layer} --skip-train and the run's other flags")
    _OPENED[key] = (signature, opened)
    return opened


__all__ = ["OpenedCheckpoint", "open_checkpoint"]
