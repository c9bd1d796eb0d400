"""What the routers' Triton kernels ask of a GPU's streaming multiprocessor (SM), counted without a GPU.

The cost model (cost_model.py) prices a router's passes at HBM_EFFICIENCY of the GPU's bandwidth. A kernel reaches
that only with enough bytes in flight: by Little's law, bandwidth <= bytes in flight / load latency. The kernels
loop over the sources, and each step of the loop loads one [BT tokens, hidden] row tile per program. A loop that
waits for each load has one tile in flight per program; a software-pipelined loop (tl.range's num_stages, cp.async
into shared memory) has the next STAGES - 1 (:func:`tiles_in_flight`). So what one SM has in flight is

    programs per SM x tiles in flight x BT x hidden x bytes per element

and programs per SM is set by the registers each thread of a program uses and the shared memory its launch asks
for. Those figures are exact, and this module counts them on a machine without a GPU:

1. capture: one stream of routed sublayers (perf.routed_stream, identity sublayers) at the real width
   runs under Triton's interpreter with its launches made no-ops. Each distinct launch configuration is recorded:
   kernel, argument types, compile-time constants, warps and grid, and which arguments Triton's JIT would mark
   divisible by 16 (16-byte aligned pointers, integers that 16 divides), as it does on a GPU. The token count
   changes only the grids (16 tokens divide by 16 as 2,048 do), so a short sequence is enough; the layer count
   matters, because it sets the group sizes of ``auto``.
2. compile: each configuration is compiled for the GPU's architecture (sm_90 for H100 / H200, sm_100 for B200)
   with Triton's own compiler and the ptxas it ships. cuobjdump then reads the registers per thread, the stack
   per thread (spilled registers: these kernels have no local arrays) and the static shared memory; Triton's
   metadata gives the dynamic shared memory (the pipelined loops' buffers).
3. occupancy: the programs one SM holds at once, from registers, warps and shared memory, by the CUDA occupancy
   rules (ARCH_LIMITS).

Capture needs TRITON_INTERPRET=1 from before Triton's import, and compiling needs it unset, so each step runs in
its own subprocess (``python -m megatron_delta.perf.kernel_resources capture|compile``); :func:`kernel_resources`
runs both. The load latency that turns bytes in flight into a bandwidth ceiling is not counted. It is a
parameter (``latency_ns``), and the report names it as an assumption.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from typing import Dict, List, Optional

__all__ = ["ARCHS", "ARCH_LIMITS", "DEFAULT_LATENCY_NS", "SOURCE_BYTES", "capture", "compile_configs",
           "programs_per_sm", "tiles_in_flight", "kernel_resources", "ceiling"]

ARCHS = {"H100": 90, "H200": 90, "B200": 100}  # compute capability x 10 (the datasheets)
ARCH_LIMITS = {  # per SM, per the CUDA C++ Programming Guide's table of compute capabilities (9.0, 10.0)
    90: dict(registers=65536, warps=64, programs=32, shared=233472, shared_reserved=1024, register_unit=256),
    100: dict(registers=65536, warps=64, programs=32, shared=233472, shared_reserved=1024, register_unit=256),
}
DEFAULT_LATENCY_NS = 800.0  # an HBM load under load on Hopper: an assumption (not counted, not measured here)
SOURCE_BYTES = 2  # the captured stream's sources are bf16
_TENSOR_TYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "int64": "i64", "int32": "i32"}


# ---------------------------------------------------------------------------------------------- 1. capture
def capture(mode: str, layers: int, hidden: int, seq: int = 16, group_size="auto") -> List[dict]:
    """The distinct launch configurations of ``mode``'s routed stream on the Triton kernels (bf16 sources),
    in first-launch order. Runs in this process, which must be under Triton's interpreter."""
    import inspect

    import torch
    import triton.runtime.interpreter as interp

    from megatron_delta.core import triton_router
    from megatron_delta.perf.host_work import _patched
    from megatron_delta.perf.routed_stream import routed_stream

    if not triton_router.interpreting():
        raise RuntimeError("capture runs under Triton's interpreter: use kernel_resources(), which sets "
                           "TRITON_INTERPRET=1 in its subprocess")
    seen: Dict[tuple, dict] = {}

    def launch(self, *args, grid, warmup, **kwargs):  # record the launch; run nothing
        params = inspect.signature(self.fn).parameters
        bound = dict(zip(params, args), **{k: v for k, v in kwargs.items() if k in params})
        sig, consts, aligned = {}, {}, []
        for index, (name, p) in enumerate(params.items()):
            value = bound[name]
            if "constexpr" in str(p.annotation):
                consts[name] = getattr(value, "name", value) if not isinstance(value, (bool, int)) else value
                sig[name] = "constexpr"
            elif isinstance(value, torch.Tensor):
                sig[name] = "*" + _TENSOR_TYPES[str(value.dtype).removeprefix("torch.")]
                if value.data_ptr() % 16 == 0:  # as Triton's JIT specialises a launch: 16-byte aligned pointers
                    aligned.append(index)
            elif isinstance(value, bool):
                sig[name] = "i1"
            elif isinstance(value, int):
                sig[name] = "i32" if -2 ** 31 <= value < 2 ** 31 else "i64"
                if value % 16 == 0:  # and integers divisible by 16
                    aligned.append(index)
            else:
                sig[name] = "fp32"
        warps = kwargs.get("num_warps", 4)
        key = (self.fn.__name__, warps, tuple(sig.items()), tuple((k, str(v)) for k, v in consts.items()),
               tuple(aligned))
        seen.setdefault(key, dict(kernel=self.fn.__name__, signature=sig, constants=consts, aligned=aligned,
                                  warps=warps, grid=list(grid), launches=0))["launches"] += 1

    with _patched(interp.InterpretedFunction, "run", launch):
        call, _ = routed_stream(mode, layers, "triton", group_size, seq, hidden, "cpu", dtype=torch.bfloat16,
                                seed=5)
        call()
    return list(seen.values())


# ---------------------------------------------------------------------------------------------- 2. compile
def compile_configs(configs: List[dict], arch: int) -> List[dict]:
    """Each configuration compiled for sm_``arch`` (Triton's compiler and ptxas; no GPU needed), with its
    registers per thread, stack bytes per thread and static shared bytes read from the binary by cuobjdump, the
    dynamic shared bytes its launch requests (Triton's metadata: the pipelined loops' buffers). Runs in this
    process, which must not be under Triton's interpreter."""
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from megatron_delta.core import triton_group_kernels, triton_router

    if triton_router.interpreting():
        raise RuntimeError("compiling needs TRITON_INTERPRET unset: use kernel_resources()")
    kernels = {k.__name__: k for k in (*triton_router.load(), *triton_group_kernels.load())}
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    out = []
    scratch = tempfile.mkdtemp(prefix="kernel_resources_")
    for c in configs:  # the captured dtype constants by name (capture: tl.dtype.name)
        constants = {k: tl.dtype(v) if isinstance(v, str) else v for k, v in c["constants"].items()}
        attrs = {(i,): [["tt.divisibility", 16]] for i in c["aligned"]}
        binary = triton.compile(ASTSource(kernels[c["kernel"]], c["signature"], constants, attrs),
                                target=GPUTarget("cuda", arch, 32), options=dict(num_warps=c["warps"]))
        path = os.path.join(scratch, f"{c['kernel']}_{len(out)}.cubin")
        with open(path, "wb") as f:
            f.write(binary.asm["cubin"])
        usage = subprocess.run([cuobjdump, "--dump-resource-usage", path], capture_output=True, text=True,
                               check=True).stdout
        m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+)", usage)
        if m is None:
            raise RuntimeError(f"cuobjdump gave no resource usage for {c['kernel']}: {usage[:300]}")
        regs, stack, static_shared = map(int, m.groups())
        out.append(dict(c, registers=regs, stack=stack, static_shared=static_shared,
                        dynamic_shared=int(binary.metadata.shared), pipelined="cp.async" in binary.asm["ptx"]))
    shutil.rmtree(scratch, ignore_errors=True)
    return out


# ---------------------------------------------------------------------------------------------- 3. occupancy
def programs_per_sm(registers: int, warps: int, shared: int, arch: int = 90) -> int:
    """Programs (thread blocks) of one kernel an SM holds at once: the least of what its warps, its registers
    (allocated per warp in units of ``register_unit``) and its shared memory (plus the block's reserved 1 KiB)
    allow, and the per-SM cap."""
    lim = ARCH_LIMITS[arch]
    unit = lim["register_unit"]
    per_warp = -(-registers * 32 // unit) * unit
    by_regs = lim["registers"] // (per_warp * warps) if registers else lim["programs"]
    by_shared = lim["shared"] // (shared + lim["shared_reserved"])
    return max(0, min(lim["warps"] // warps, by_regs, by_shared, lim["programs"]))


def tiles_in_flight(config: dict, step: int) -> int:
    """Source row tiles one program has in flight per step of its loop: STAGES - 1 where the loop is software-
    pipelined (tl.range's num_stages, passed as the STAGES constant) and its shared memory holds that many row
    tiles (the rows, not only the pointer table, are staged: cp.async), else 1 (the loop waits for each load; a
    loop unrolled at compile time, tl.static_range, may overlap more, so 1 is a lower bound there)."""
    stages = config["constants"].get("STAGES", 1)
    if config["pipelined"] and stages > 1 and config["dynamic_shared"] >= (stages - 1) * step:
        return stages - 1
    return 1


def ceiling(in_flight_per_sm: int, sms: int, latency_ns: float = DEFAULT_LATENCY_NS) -> float:
    """Little's law: the bytes/s a loop that waits for each load reaches with ``in_flight_per_sm`` bytes in flight
    on each of ``sms`` SMs, at a load latency of ``latency_ns``."""
    return in_flight_per_sm * sms / (latency_ns * 1e-9)


def kernel_resources(mode: str, layers: int, hidden: int, gpu: str = "H100", group_size="auto", seq: int = 16,
                     latency_ns: float = DEFAULT_LATENCY_NS) -> List[dict]:
    """Every launch configuration of ``mode``'s routed stream (``layers`` layers at width ``hidden``, bf16, the
    Triton kernels) with its registers, spills, programs per SM and bytes in flight per SM, and the ceiling these
    put on its bandwidth as a fraction of what the cost model assumes (cost_model.HBM_EFFICIENCY of the GPU's
    peak) at ``latency_ns``. Capture and compile run in subprocesses (module docstring)."""
    from megatron_delta.perf.cost_model import GPUS, HBM_EFFICIENCY, SMS

    arch = ARCHS[gpu]
    args = dict(mode=mode, layers=layers, hidden=hidden, seq=seq, group_size=group_size)
    configs = _run("capture", args, interpret=True)
    compiled = _run("compile", dict(configs=configs, arch=arch), interpret=False)
    rows = []
    for c in compiled:
        k = c["constants"]
        shared = c["static_shared"] + c["dynamic_shared"]
        programs = programs_per_sm(c["registers"], c["warps"], shared, arch)
        step = k.get("BT", 1) * hidden * SOURCE_BYTES  # one source's [BT, hidden] row tile, loaded per loop step
        tiles = tiles_in_flight(c, step)
        in_flight = programs * tiles * step
        bw = ceiling(in_flight, SMS[gpu], latency_ns)
        rows.append(dict(c, gpu=gpu, arch=arch, shared=shared, programs_per_sm=programs,
                         warps_per_sm=programs * c["warps"], bytes_per_step=step, tiles_in_flight=tiles,
                         in_flight_per_sm=in_flight, ceiling_bytes_per_s=bw,
                         of_modelled_rate=bw / (HBM_EFFICIENCY * GPUS[gpu][0]), latency_ns=latency_ns))
    return rows


def _run(step: str, args: dict, interpret: bool) -> list:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    done = subprocess.run([sys.executable, "-m", "megatron_delta.perf.kernel_resources", step],
                          input=json.dumps(args), capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"kernel_resources {step} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _main(step: Optional[str] = None) -> None:
    step = step or sys.argv[1]
    args = json.loads(sys.stdin.read())
    result = capture(**args) if step == "capture" else compile_configs(args["configs"], args["arch"])
    print(json.dumps(result))


if __name__ == "__main__":
    _main()
