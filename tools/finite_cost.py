#!/usr/bin/env python
"""What the finite-state check before each save costs: seconds per GB of parameters read by
megatron_delta.checkpoint.finite.first_non_finite (the smallest and largest value of each tensor), on
this machine, and the estimate for an 8B-parameter model from that rate.

    python tools/finite_cost.py [--size-gb 1] [--dtype bf16] [--tensor-mb 64] [--device cpu|cuda] [--repeats 5]

The parameters are --size-gb of --dtype split into tensors of --tensor-mb (an 8B model's largest tensors are
~100-300 MB, its norms a few KB); the best of --repeats runs is reported. The check reads each parameter byte
once, so its time is the bytes of the rank's parameters over this rate: a rank holding 1/(TP x PP) of an 8B
model in bf16 reads 16 GB / (TP x PP).
"""
import argparse
import os
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], prog="finite_cost.py")
    p.add_argument("--size-gb", type=float, default=1.0)
    p.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    p.add_argument("--tensor-mb", type=float, default=64.0)
    p.add_argument("--device", default="cpu")
    p.add_argument("--repeats", type=int, default=5)
    a = p.parse_args(argv)

    import torch

    from megatron_delta.checkpoint.finite import first_non_finite

    dtype = torch.bfloat16 if a.dtype == "bf16" else torch.float32
    per = max(1, int(a.tensor_mb * 2**20) // dtype.itemsize)
    total = int(a.size_gb * 2**30) // dtype.itemsize
    sizes = [per] * (total // per) + ([total % per] if total % per else [])
    named = [(f"t{i}", torch.randn(n, dtype=dtype, device=a.device)) for i, n in enumerate(sizes)]
    nbytes = sum(t.numel() * t.element_size() for _, t in named)
    best = float("inf")
    for _ in range(a.repeats):
        if a.device.startswith("cuda"):
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        assert first_non_finite(named) is None  # returns a host bool: the check has finished
        best = min(best, time.perf_counter() - t0)
    gb = nbytes / 1e9
    rate = gb / best
    params_8b = 8e9 * dtype.itemsize / 1e9  # GB of an 8B model's parameters in this dtype
    print(f"[finite_cost] {gb:.2f} GB of {a.dtype} in {len(named)} tensors on {a.device} ({torch.get_num_threads()} "
          f"thread(s)): {best:.3f} s, {rate:.2f} GB/s, {best / gb:.3f} s/GB; an 8B model's {params_8b:.0f} GB of "
          f"{a.dtype} parameters on one rank: {params_8b / rate:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
