"""The ops that make a tensor from host data or read one back, counted as they are dispatched (the group router's,
the traffic counter's and the Triton kernels' tests)."""
import contextlib
import os
import traceback
from collections import Counter

from torch.utils._python_dispatch import TorchDispatchMode

# ops that, on a GPU, make a tensor from host data or read one back: each a copy the host waits for (a
# synchronisation, which drains the GPU's queue of launched work) and an error under CUDA graph capture
HOST_DATA_OPS = ("lift_fresh", "_local_scalar_dense", "nonzero", "is_nonzero", "equal")


@contextlib.contextmanager
def host_data_ops(package=None):
    """The HOST_DATA_OPS dispatched inside, counted by name (a Counter); with ``package`` (a path fragment such as
    "megatron_delta/") only those the innermost caller outside torch in that package dispatched, by (name, file,
    line)."""
    counts = Counter()

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.overloadpacket.__name__
            if name in HOST_DATA_OPS:
                if package is None:
                    counts[name] += 1
                else:
                    caller = next(f for f in reversed(traceback.extract_stack()[:-1])
                                  if f"{os.sep}torch{os.sep}" not in f.filename)
                    if package in caller.filename.replace(os.sep, "/"):
                        counts[name, caller.filename.rsplit(os.sep, 1)[-1], caller.lineno] += 1
            return func(*args, **(kwargs or {}))

    with Count():
        yield counts
