"""Checkpoint integrity by default: Megatron-LM's ``--verify-integrity``, on unless ``--no-verify-integrity``,
for the trainer and for every tool that reads a checkpoint (checkpoint/reader.py).

Megatron-Core 0.19.2 (dist_checkpointing.serialization.save / load, validation.save_integrity_manifest):
with ``verify_integrity`` a torch_dist save writes ``integrity.json`` in the iteration directory, the SHA-256
of every file in it (the .distcp shards, .metadata, common.pt, metadata.json), hashed by rank 0 after the
data is written; a load re-hashes every listed file on rank 0 before reading any tensor and raises
CheckpointingException on a mismatch. run_config.json is written after the manifest of a synchronous save:
:func:`add_to_manifest` adds its hash (an asynchronous save writes it before the manifest, which then lists it),
so an edited run_config.json fails verification like a flipped shard. A checkpoint whose manifest does not list
run_config.json (saved by an older version) still loads, with a line: its other files are verified.

This module resolves the default (torch_dist only: upstream refuses the flag for other formats), verifies a
checkpoint before anything of it is read (:func:`verify_before_load`: integrity.json unreadable is one line
naming it; a checkpoint without it loads with a line saying it is unverified, and one loaded with
--no-verify-integrity although it has one says so too), and turns a mismatch into one line naming the shard,
the iteration and the checkpoints to resume from (errors.resume_advice).
"""
from __future__ import annotations

import json
import os
import re
from typing import Optional

from megatron_delta.checkpoint.errors import CheckpointError, damaged_files, exception_chain, read_json, resume_advice

MANIFEST = "integrity.json"  # megatron.core.dist_checkpointing.validation.INTEGRITY_FNAME
_ITER_DIR = re.compile(r"^iter_(\d{7})$")
_FAILED = "Checkpoint integrity verification failed"


def add_verify_integrity_argument(parser) -> None:
    """The tools' --no-verify-integrity (the trainer's flag): a tool verifies the checkpoint it reads by default."""
    parser.add_argument("--no-verify-integrity", dest="verify_integrity", action="store_false",
                        help="read the checkpoint without verifying its files against its integrity.json "
                             "(verified by default, as pretrain_gpt.py does)")


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
    from megatron_delta.checkpoint.errors import tracker_iteration

    return tracker_iteration(load_dir)


def read_manifest(ckpt_dir: str) -> Optional[dict]:
    """The checkpoint's integrity.json ({"algorithm", "files": {name: sha256}}), None when it has none; an
    unreadable or malformed manifest is a CheckpointError naming it."""
    path = os.path.join(ckpt_dir, MANIFEST)
    if not os.path.exists(path):
        return None
    manifest, why = read_json(path, lambda m: None if isinstance(m, dict) and isinstance(m.get("files"), dict)
                              else 'no "files" object of file hashes')
    if why is not None:
        raise CheckpointError(f"{path} is corrupt ({why}): the files of {ckpt_dir} cannot be verified. Restore it "
                              f"from a copy of the checkpoint, or load the checkpoint unverified with "
                              f"--no-verify-integrity")
    return manifest


def verify_before_load(ckpt_dir: str, verify_integrity: bool) -> Optional[str]:
    """Before anything of ckpt_dir is read (run_config.json included): with ``verify_integrity``, re-hash every
    file its integrity.json lists (rank 0 when torch.distributed runs more than one rank; every rank calls it).
    Returns the note to print once when the load goes on unverified (no integrity.json; or one there and
    --no-verify-integrity), else None. Raises CheckpointError (integrity.json unreadable) or upstream's
    CheckpointingException (a file differs from its hash: is_integrity_failure / describe_mismatch)."""
    if not os.path.isdir(ckpt_dir):
        return None
    if not verify_integrity:
        if os.path.exists(os.path.join(ckpt_dir, MANIFEST)):
            return (f"note: --no-verify-integrity: {ckpt_dir} is loaded without verifying its files against its "
                    f"{MANIFEST}")
        return None
    manifest = read_manifest(ckpt_dir)
    if manifest is None:
        return (f"note: {ckpt_dir} has no {MANIFEST} (saved with --no-verify-integrity or by another tool): "
                f"loaded without verifying its files")
    from megatron.core.dist_checkpointing.validation import verify_integrity_manifest

    from megatron_delta.checkpoint.run_config import RUN_CONFIG

    verify_integrity_manifest(ckpt_dir)
    if RUN_CONFIG not in manifest["files"] and os.path.exists(os.path.join(ckpt_dir, RUN_CONFIG)):
        return (f"note: the {MANIFEST} of {ckpt_dir} does not list {RUN_CONFIG} (saved by an older version): its "
                f"other files are verified, {RUN_CONFIG} is not")
    return None


def add_to_manifest(ckpt_dir: str, name: str) -> bool:
    """Add the SHA-256 of ckpt_dir/name to its integrity.json (atomically), when it has one."""
    from megatron.core.dist_checkpointing.validation import _compute_file_hash

    path = os.path.join(ckpt_dir, MANIFEST)
    if not os.path.exists(path):
        return False
    manifest = read_manifest(ckpt_dir)
    manifest["files"][name] = _compute_file_hash(os.path.join(ckpt_dir, name))
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(manifest, f, indent=2)
    os.replace(tmp, path)
    return True


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


def is_integrity_failure(exc: BaseException) -> bool:
    """Upstream's verification on load failed (dist_checkpointing.validation.verify_integrity_manifest)."""
    return any(_FAILED in str(e) for e in exception_chain(exc))


def describe_mismatch(exc: BaseException, load_dir: Optional[str], ckpt_step: Optional[int],
                      tool: bool = False) -> Optional[str]:
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
    return line + resume_advice(load_dir, iteration, verifies=verifies, tool=tool)


__all__ = ["MANIFEST", "add_verify_integrity_argument", "resolve_default", "read_manifest", "verify_before_load",
           "add_to_manifest", "verifies", "is_integrity_failure", "describe_mismatch"]
