"""What this machine charges for the router's kind of work: ms per [tokens, hidden] fp32 tensor of the
operators a router is made of (op_costs, on tensors cycled beyond L2), the stream rate of an in-place
multiply-add in cache, and the memory rate of the same pass over tensors cycled through twice the last-level
cache (memory_rate, last_level_cache_bytes). The benchmark prices its touch-once router floor with them."""
import os
import statistics
import time

import torch


def op_costs(opts, rounds=5):
    """Median ms per [tokens, hidden] fp32 tensor of the operators a router is made of, on tensors
    cycled through more memory than the caches below L3 hold, and the stream rate (GB/s) of the
    in-place multiply-add (bytes: read a, read c, write c), and memory_rate's. ``opts``: seq_length,
    micro_batch_size, hidden_size and seed."""
    t, h = opts.seq_length * opts.micro_batch_size, opts.hidden_size
    sets = max(4, (64 << 20) // (3 * 4 * t * h))  # >= 64 MiB in rotation: beyond L2
    g = torch.Generator().manual_seed(opts.seed)
    data = [(torch.randn(t, h, generator=g), torch.randn(t, h, generator=g), torch.rand(t, 1, generator=g))
            for _ in range(sets)]
    kept = []
    ops = {
        "in-place multiply-add": lambda a, c, w: c.addcmul_(a, w),
        "add into a new tensor that is kept": lambda a, c, w: kept.append(torch.add(a, c)),
        "row-wise dot product": lambda a, c, w: torch.linalg.vecdot(a, c),
        "row-wise norm (read only)": lambda a, c, w: torch.linalg.vector_norm(a, dim=-1),
    }
    out = {}
    for name, op in ops.items():
        times = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            for a, c, w in data:
                op(a, c, w)
            times.append((time.perf_counter() - t0) / sets)
            kept.clear()
        out[name] = statistics.median(times) * 1e3
    out["stream_gbps"] = 3 * 4 * t * h / (out["in-place multiply-add"] / 1e3) / 1e9
    del data  # free the rotation before memory_rate allocates its own (kept is cleared every round)
    out["memory_gbps"], out["memory_rotation_bytes"] = memory_rate(rounds)
    return out


def last_level_cache_bytes(root="/sys/devices/system/cpu/cpu0/cache"):
    """The largest CPU cache's size in bytes (Linux sysfs: index*/size such as "2048K"), or None where
    it cannot be read."""
    sizes = []
    for entry in sorted(os.listdir(root)) if os.path.isdir(root) else []:
        try:
            text = open(os.path.join(root, entry, "size")).read().strip()
        except OSError:
            continue
        unit = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        digits = text.rstrip("KMG")
        if digits.isdigit():
            sizes.append(int(digits) * unit)
    return max(sizes, default=None)


def memory_rate(rounds=5, chunk=8 << 20):
    """GB/s of an in-place scaled add (read a, read c, write c) over 8 MiB tensors cycled through twice
    the last-level cache (256 MiB to 2 GiB): what a pass costs when its tensors come from memory, as
    a step's sources mostly do (a step's saved activations are several times the cache). Returns
    (GB/s, bytes in rotation)."""
    llc = last_level_cache_bytes()
    total = min(max(2 * (llc or 256 << 20), 256 << 20), 2 << 30)
    n = chunk // 4
    data = [(torch.ones(n), torch.ones(n)) for _ in range(max(2, total // (2 * chunk)))]
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for a, c in data:
            c.add_(a, alpha=0.5)
        times.append(time.perf_counter() - t0)
    return 3 * chunk * len(data) / statistics.median(times) / 1e9, 2 * chunk * len(data)
