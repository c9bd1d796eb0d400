"""Checkpoint integrity by default: Megatron-LM's ``--verify-integrity``, on unless ``--no-verify-integrity``.

Megatron-Core 0.19.2 (dist_checkpointing.serialization.save / load, validation.save_integrity_manifest):
with ``verify_integrity`` a torch_dist save writes ``integrity.json`` in the iteration directory, the SHA-256
of every file in it (the .distcp shards, .metadata, common.pt, metadata.json), hashed by rank 0 after the
data is written; a load re-hashes every listed file on rank 0 before reading any tensor and raises
CheckpointingException on a mismatch. run_config.json, written after the manifest, is not listed.

This module resolves the default (torch_dist only: upstream refuses the flag for other formats), lets a
checkpoint without ``integrity.json`` (saved with --no-verify-integrity, by an older version or another tool)
load with one line saying it is unverified, and turns a mismatch into one line naming the shard, the
iteration and the last checkpoint of the directory that verifies.
"""
from __future__ import annotations

import os
import re
from typing import Optional

from megatron_delta.checkpoint.errors import damaged_files, exception_chain

MANIFEST = "integrity.json"  # megatron.core.dist_checkpointing.validation.INTEGRITY_FNAME
_ITER_DIR = re.compile(r"^iter_(\d{7})$")
_FAILED = "Checkpoint integrity verification failed"


def resolve_default(args) -> Optional[str]:
    """--verify-integrity / --no-verify-integrity / neither (None: on for torch_dist). An error text or None."""
    if args.verify_integrity is None:
        args.verify_integrity = args.ckpt_format == "torch_dist"
        return None
    if args.verify_integrity and args.ckpt_format != "torch_dist":
        return (f"--verify-integrity needs --ckpt-format torch_dist (Megatron-LM hashes only those checkpoints), "
                f"not {args.ckpt_format}; drop --verify-integrity")
    return None


def iteration_to_load(load_dir: str, ckpt_step: Optional[int]) -> Optional[int]:
    if ckpt_step is not None:
        return ckpt_step
    from megatron_delta.checkpoint.run_config import read_tracker

    try:
        return read_tracker(load_dir)
    except (OSError, ValueError):
        return None


def unverified_load(args) -> Optional[str]:
    """The iteration directory about to be loaded when it has no integrity.json (then verification is off
    for this load), else None."""
    if not getattr(args, "verify_integrity", False) or not args.load or not os.path.isdir(args.load):
        return None
    iteration = iteration_to_load(args.load, getattr(args, "ckpt_step", None))
    if iteration is None:
        return None
    from megatron_delta.checkpoint.run_config import iteration_dir

    ckpt = iteration_dir(args.load, iteration)
    if os.path.isdir(ckpt) and not os.path.exists(os.path.join(ckpt, MANIFEST)):
        return ckpt
    return None


def verifies(ckpt_dir: str) -> bool:
    from megatron.core.dist_checkpointing.core import CheckpointingException
    from megatron.core.dist_checkpointing.validation import _verify_integrity_manifest_impl

    if not os.path.exists(os.path.join(ckpt_dir, MANIFEST)):
        return False
    try:
        _verify_integrity_manifest_impl(ckpt_dir)
    except (CheckpointingException, OSError, ValueError, KeyError):
        return False
    return True


def last_verified(load_dir: str, below: int) -> Optional[int]:
    from megatron_delta.checkpoint.run_config import iteration_dir

    try:
        names = os.listdir(load_dir)
    except OSError:
        return None
    for it in sorted((int(m.group(1)) for m in map(_ITER_DIR.match, names) if m), reverse=True):
        if it < below and verifies(iteration_dir(load_dir, it)):
            return it
    return None


def is_integrity_failure(exc: BaseException) -> bool:
    """Upstream's verification on load failed (dist_checkpointing.validation.verify_integrity_manifest)."""
    return any(_FAILED in str(e) for e in exception_chain(exc))


def describe_mismatch(exc: BaseException, load_dir: Optional[str], ckpt_step: Optional[int]) -> Optional[str]:
    """One line for upstream's integrity failure on load, or None when exc is not one."""
    text = next((str(e) for e in exception_chain(exc) if _FAILED in str(e)), None)
    if text is None or not load_dir:
        return None
    files = re.findall(r"^\s+(\S+): (hash mismatch|file missing or unreadable)", text, re.M)
    where = re.search(r"file\(s\) in (.+?):\s*$", text.splitlines()[0])
    ckpt_dir = where.group(1) if where else load_dir
    m = _ITER_DIR.match(os.path.basename(os.path.normpath(ckpt_dir)))
    iteration = int(m.group(1)) if m else iteration_to_load(load_dir, ckpt_step)
    found = damaged_files(ckpt_dir)  # truncated / missing files, named as the other load errors name them
    if found:
        shard = " ".join(found[0])
    elif files:
        name, why = files[0]
        what = ("differs from its hash in integrity.json (bytes changed since the save)" if why == "hash mismatch"
                else "is missing or unreadable")
        shard = f"{os.path.join(ckpt_dir, name)} {what}"
    else:
        shard = f"a file of {ckpt_dir} fails its integrity check"
    more = max(len(found), len(files)) - 1
    if more > 0:
        shard += f" (and {more} more file(s))"
    line = f"cannot load the checkpoint of iteration {iteration}: {shard}. "
    previous = last_verified(load_dir, iteration if iteration is not None else 1 << 62)
    if previous is None:
        line += f"No earlier checkpoint in {load_dir} verifies: --load another directory or start from scratch"
    else:
        from megatron_delta.checkpoint.run_config import TRACKER, iteration_dir

        line += (f"The last checkpoint that verifies is iteration {previous} ({iteration_dir(load_dir, previous)}): "
                 f"resume from it with --ckpt-step {previous}, or delete {ckpt_dir} and write {previous} into "
                 f"{os.path.join(load_dir, TRACKER)}")
    return line


__all__ = ["MANIFEST", "resolve_default", "unverified_load", "verifies", "last_verified", "is_integrity_failure",
           "describe_mismatch"]
