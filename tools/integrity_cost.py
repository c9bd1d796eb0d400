#!/usr/bin/env python
"""What checkpoint integrity costs: seconds per GB of Megatron-Core's SHA-256 hashing (--verify-integrity, on
by default in pretrain_gpt.py) on this machine.

    python tools/integrity_cost.py [--size-gb 1] [--dir /path/on/the/checkpoint/filesystem]
    python tools/integrity_cost.py --checkpoint runs/x/iter_0000200     # an existing checkpoint's manifest

Without --checkpoint it writes a file of random bytes in --dir (default: the temporary directory), hashes it
with the function upstream's save and load use (dist_checkpointing.validation._compute_file_hash) and
deletes it. The file was just written, so it is read back from the page cache: the figure is the hashing
cost itself; a load from a cold disk adds the reading (which the load then does again for the tensors).
With --checkpoint it times upstream's verification of that iteration directory (what a load does first).
A save hashes once (rank 0, after the data is written); a load hashes once (rank 0, before reading).
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], prog="integrity_cost.py")
    p.add_argument("--size-gb", type=float, default=1.0, help="size of the file hashed (default 1 GB)")
    p.add_argument("--dir", default=None, help="where the file is written (default: the temporary directory)")
    p.add_argument("--checkpoint", default=None, help="time the verification of this iteration directory instead")
    a = p.parse_args(argv)
    from megatron.core.dist_checkpointing.validation import _compute_file_hash, _verify_integrity_manifest_impl

    if a.checkpoint:
        size = sum(os.path.getsize(os.path.join(a.checkpoint, f)) for f in os.listdir(a.checkpoint)
                   if os.path.isfile(os.path.join(a.checkpoint, f)))
        start = time.perf_counter()
        _verify_integrity_manifest_impl(a.checkpoint)
        seconds = time.perf_counter() - start
    else:
        size = int(a.size_gb * 1e9)
        fd, path = tempfile.mkstemp(prefix="integrity-cost-", dir=a.dir)
        try:
            block = os.urandom(64 << 20)
            with os.fdopen(fd, "wb") as f:
                left = size
                while left > 0:
                    f.write(block[:min(left, len(block))])
                    left -= len(block)
            start = time.perf_counter()
            _compute_file_hash(path)
            seconds = time.perf_counter() - start
        finally:
            os.remove(path)
    gb = size / 1e9
    print(f"SHA-256 of {gb:.3f} GB: {seconds:.2f} s = {seconds / gb:.2f} s per GB ({gb / seconds:.2f} GB/s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
