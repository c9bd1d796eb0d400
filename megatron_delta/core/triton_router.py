"""The router on GPUs: the project's own Triton kernels, at the per-router floor of memory traffic
(docs/gpu.md).

``--delta-router-kernels triton`` routes through them; ``auto`` does so for CUDA tensors when Triton
imports (fla-core's kernel stays selectable with ``fla``: fla_router.py). Imported lazily: nothing here,
and nothing of Triton, is imported unless a router asks for it. On CPU the kernels run only under
Triton's interpreter (``TRITON_INTERPRET=1``, set before Triton is imported): that is how the tests run
them, in fp32.

The kernels are the C kernels' algorithm (csrc/router_kernels.c) on tiles of ``BT`` tokens x the hidden
size. Per router call, with sources v_1..v_N (all projected here: each source's 1/rms and logit are
computed in the pass that reads it for the weighted sum), q = w * g, optional null source z, gate a:

- forward, ONE read of each source: an online softmax over depth (running max, running sum, running
  weighted sum in fp32), then ``u = B + a * r`` written once, with B = x (``base``), the sum of the
  sources themselves (``unit``: the additive modes' residual stream kept as its sources, formed in the
  same pass) or 0. It also writes the logits and the log-sum-exp per token (fp32, [M, T] and [T]: small).
- backward: per tile, a first loop reads each source for dw_i = <grad, v_i> and the softmax's
  s = sum_i alpha_i dw_i; a second loop reads the same tile again (just loaded by the same program, so
  from cache, not from memory) and writes each source's whole gradient (the weighted sum's share and
  its projection's) IN PLACE into the source's gradient buffer: assigned by its first reader, added
  by the others (:class:`KernelSink`, the GradSink pattern of router.py), so autograd adds nothing.
  The query's, the null source's and the gate's gradients are reduced per program into [programs, d]
  partial sums (fp32, small: persistent programs, :func:`reducing_programs`), then over the programs: no
  [tokens, hidden] fp32 buffer.
- the partial sums (delta_block's P_b + v, attnres' p + v; SourceBuffer.hold_sum): where the router that
  alone reads the sum runs on these kernels, the forward reads the two parts and writes the sum once (no
  separate add, which read both and wrote the sum for the router to read again); the backward reads the
  sum's gradient from its later readers, adds this router's share and writes it once, for both parts (no
  autograd add of two gradients).

- the completed block sources (read by every router of a block through KernelSinks): their gradients are
  deferred to one pass per block (:class:`BlockDeferral`, where group_plan.block_defers says it moves fewer rows): the
  routers' backward leaves per-token coefficients, the block's pass reads each router's output gradient and
  each source once and writes each source's gradient once.

- x handed out as the sum of the sources (delta_block without a gate, delta on one router per pass): one pass
  (triton_group_kernels.sum_seeding_sinks), whose gradient seeds the sources' KernelSinks (:attr:`KernelSink.seed`):
  the block pass that writes a sink first reads the seed in place of the buffer, so autograd adds nothing.

Traffic per call (rows of [tokens, hidden], :func:`call_rows`): forward N + (1 with x) + 1 (+ 2 forming a
partial sum), backward 1 + N + (one write per source gradient not deferred) + (one read per gradient added to
an existing buffer) (+ 1 forming a partial sum with later readers). A block's pass: one read per router, and
per source a read, a write and (added to an existing buffer) a read.

Not done here: the sublayer's own input norm is not fused (what it would save, and why not: docs/gpu.md).
"""
from __future__ import annotations

import functools
import os
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch
from torch import Tensor

from megatron_delta.core import cpu_kernels, traffic
from megatron_delta.core.group_plan import block_defers

__all__ = ["SUPPORTED_DTYPES", "TritonUnavailable", "load", "available", "check", "interpreting",
           "device_ok", "fallback_reason", "KernelSink", "make_sink", "BlockDeferral", "DeferredSink",
           "defer_block", "route", "route_router", "call_rows", "device_tables", "kernel_rows", "summed",
           "TOKENS_PER_PROGRAM"]

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
KERNEL = "triton_route"  # the name the kernels' calls are recorded under (traffic.py)
DEFERRED_KERNEL = "triton_block_grad"  # the block pass of the deferred gradients (BlockDeferral)
REDUCE_KERNEL = "triton_reduce"  # the sums of the kernels' per-program partial gradients (reducing_programs)
TOKENS_PER_PROGRAM = 16  # BT at most: the tile is BT tokens x the hidden size (padded to a power of two)
TILE_ELEMENTS = 8192  # at most BT x BD fp32 values per tile (BT shrinks for large hidden sizes)


class TritonUnavailable(RuntimeError):
    """Triton cannot be imported here, or cannot run on this machine; the message says why."""


def unavailable(e: BaseException) -> TritonUnavailable:
    """The error of a failed build: why Triton cannot run here."""
    return TritonUnavailable(f"triton cannot be imported ({type(e).__name__}: {e}); pip install triton")


def interpreting() -> bool:
    """True when Triton's interpreter runs the kernels (CPU tensors, for tests)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def load():
    """The jitted kernels (forward, backward, block pass), built on first use. Raises TritonUnavailable."""
    return _kernels.load()


def available() -> bool:
    """True when Triton imports here."""
    try:
        load()
        return True
    except TritonUnavailable:
        return False


def device_ok(device_type: str) -> bool:
    """Whether the kernels run on tensors of ``device_type``: CUDA, or CPU under the interpreter."""
    return device_type == "cuda" or (device_type == "cpu" and interpreting())


def check(choice: str) -> None:
    """Start-up check of ``--delta-router-kernels triton`` (raises ValueError, one line naming the flag)."""
    if choice != "triton":
        return
    try:
        load()
    except TritonUnavailable as e:
        raise ValueError(f"--delta-router-kernels triton: {e}; or use --delta-router-kernels auto") from None
    if not torch.cuda.is_available() and not interpreting():
        raise ValueError("--delta-router-kernels triton: no CUDA device here, and the Triton kernels run on CUDA "
                         "tensors only (or under TRITON_INTERPRET=1); use --delta-router-kernels auto "
                         "(C kernels on CPU)")


def fallback_reason(values: Sequence[Tensor]) -> Optional[str]:
    """Why the kernels cannot route these sources (the PyTorch path does), or None."""
    dtype = values[0].dtype
    if dtype not in SUPPORTED_DTYPES:
        return f"sources in {dtype} (the kernels compute in fp32; float64 keeps the PyTorch path)"
    if len({v.dtype for v in values}) > 1:
        return "sources of mixed dtypes (the kernels take one dtype)"
    if len({v.device for v in values}) > 1:
        return "sources on several devices"
    if not device_ok(values[0].device.type):
        return f"{values[0].device.type} tensors (the kernels run on CUDA, or on CPU under TRITON_INTERPRET=1)"
    return None


# ---------------------------------------------------------------------------------------- traffic
def call_rows(n_sources: int, *, has_base: bool, grads: Optional[int] = None, accumulated: int = 0,
              forms_partial: bool = False, partial_grad: Optional[bool] = None) -> Dict[str, int]:
    """The [tokens, hidden] traffic of one router call, in rows "u" (one tensor of that size read or
    written once, all in one dtype): {'forward': u, 'backward': u}. ``n_sources`` sources (the null
    source is a [hidden] vector: no row), ``has_base``: u = x + a r reads x; ``grads``: how many of the
    sources get a gradient (default all); ``accumulated``: how many of those are added into a gradient
    buffer an earlier reader made (read + write) rather than written fresh (write); ``forms_partial``: the
    last source is P + v, formed in the pass (its two parts read, the sum written; in backward the sum is
    read as a source and its gradient, written once, serves both parts); ``partial_grad`` (default
    ``forms_partial``): the formed sum has later readers, whose gradient the backward reads."""
    grads = n_sources if grads is None else grads
    partial_grad = forms_partial if partial_grad is None else partial_grad
    forward = n_sources + int(has_base) + 1 + 2 * int(forms_partial)  # each source (and x) read once, u written
    backward = 1 + n_sources + grads + accumulated + int(partial_grad)  # grad and each source read once
    return {"forward": forward, "backward": backward}


# ---------------------------------------------------------------------------------------- the kernels
def _build():
    import triton
    import triton.language as tl

    @triton.jit
    def _forward(src_ptrs, base_ptr, out_ptr, q_ptr, null_ptr, null_logit_ptr, gate_ptr, logit_ptr, lse_ptr,
                 inv_ptr, addend_ptr, partial_ptr, T, d, eps,
                 N: tl.constexpr, HAS_BASE: tl.constexpr, UNIT: tl.constexpr, HAS_NULL: tl.constexpr,
                 HAS_GATE: tl.constexpr, FORM: tl.constexpr, DT: tl.constexpr, BT: tl.constexpr,
                 BD: tl.constexpr):
        pid = tl.program_id(0)
        rows = pid * BT + tl.arange(0, BT)
        cols = tl.arange(0, BD)
        rmask = rows < T
        cmask = cols < d
        mask = rmask[:, None] & cmask[None, :]
        offs = rows.to(tl.int64)[:, None] * d + cols[None, :]
        q = tl.load(q_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
        if HAS_NULL:  # the null source starts the online softmax: max = its logit, sum = 1, mix = z
            zl = tl.load(null_logit_ptr).to(tl.float32)
            m = tl.zeros((BT,), tl.float32) + zl
            s = tl.zeros((BT,), tl.float32) + 1.0
            zv = tl.load(null_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
            acc = tl.zeros((BT, BD), tl.float32) + zv[None, :]
        else:
            m = tl.full((BT,), float("-inf"), tl.float32)
            s = tl.zeros((BT,), tl.float32)
            acc = tl.zeros((BT, BD), tl.float32)
        total = tl.zeros((BT, BD), tl.float32)
        for i in tl.static_range(N):
            src = tl.load(src_ptrs + i).to(tl.pointer_type(DT))
            v = tl.load(src + offs, mask=mask, other=0.0).to(tl.float32)
            if FORM and i == N - 1:  # the last source is P + v: formed here, rounded as a stored tensor, written
                part = (v + tl.load(addend_ptr + offs, mask=mask, other=0.0).to(tl.float32)).to(DT)
                tl.store(partial_ptr + offs, part, mask=mask)
                v = part.to(tl.float32)
            inv = 1.0 / tl.sqrt(tl.sum(v * v, 1) / d + eps)
            z = tl.sum(v * q[None, :], 1) * inv
            tl.store(inv_ptr + i * T + rows, inv, mask=rmask)
            tl.store(logit_ptr + i * T + rows, z, mask=rmask)
            m_new = tl.maximum(m, z)
            scale = tl.exp(m - m_new)
            p = tl.exp(z - m_new)
            acc = acc * scale[:, None] + p[:, None] * v
            s = s * scale + p
            m = m_new
            if UNIT:
                total += v
        tl.store(lse_ptr + rows, m + tl.log(s), mask=rmask)
        res = acc / s[:, None]
        if HAS_GATE:
            res = res * tl.load(gate_ptr).to(tl.float32)
        if HAS_BASE:
            res += tl.load(base_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        if UNIT:
            res += total
        tl.store(out_ptr + offs, res.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _backward(grad_ptr, src_ptrs, tgt_ptrs, flag_ptr, alpha_ptr, inv_ptr, logit_ptr, q_ptr, null_ptr,
                  gate_ptr, part_q_ptr, part_null_ptr, part_scalar_ptr, partial_grad_ptr, slot_ptr, coef_ptr, T, d,
                  C, N: tl.constexpr, UNIT: tl.constexpr, HAS_NULL: tl.constexpr, HAS_GATE: tl.constexpr,
                  PARTIAL_GRAD: tl.constexpr, DT: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr):
        # persistent programs (reducing_programs): program pid takes tiles pid, pid + programs, ... and writes one
        # partial sum of the query's, the null source's and the gate's gradients over all of them
        pid = tl.program_id(0)
        programs = tl.num_programs(0)
        cols = tl.arange(0, BD)
        cmask = cols < d
        q = tl.load(q_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
        a = 1.0
        if HAS_GATE:
            a = tl.load(gate_ptr).to(tl.float32)
        dq = tl.zeros((BD,), tl.float32)
        null_acc = tl.zeros((BD,), tl.float32)
        gate_acc = tl.zeros((BT,), tl.float32)
        dln_acc = tl.zeros((BT,), tl.float32)
        for tile in range(pid, tl.cdiv(T, BT), programs):
            rows = tile * BT + tl.arange(0, BT)
            rmask = rows < T
            mask = rmask[:, None] & cmask[None, :]
            offs = rows.to(tl.int64)[:, None] * d + cols[None, :]
            g = tl.load(grad_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            # loop 1: s = sum_i alpha_i <grad, v_i> (the null source's share included)
            s = tl.zeros((BT,), tl.float32)
            for i in tl.static_range(N):
                src = tl.load(src_ptrs + i).to(tl.pointer_type(DT))
                v = tl.load(src + offs, mask=mask, other=0.0).to(tl.float32)
                s += tl.load(alpha_ptr + i * T + rows, mask=rmask, other=0.0) * tl.sum(g * v, 1)
            if HAS_NULL:
                zv = tl.load(null_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
                an = tl.load(alpha_ptr + N * T + rows, mask=rmask, other=0.0)
                dwn = tl.sum(g * zv[None, :], 1)
                s += an * dwn
                dln = an * a * (dwn - s)  # the null logit's gradient per token (s is complete here)
            # loop 2: each source's gradient, into its buffer; the query's gradient per program
            for i in tl.static_range(N):
                src = tl.load(src_ptrs + i).to(tl.pointer_type(DT))
                v = tl.load(src + offs, mask=mask, other=0.0).to(tl.float32)
                al = tl.load(alpha_ptr + i * T + rows, mask=rmask, other=0.0)
                iv = tl.load(inv_ptr + i * T + rows, mask=rmask, other=0.0)
                z = tl.load(logit_ptr + i * T + rows, mask=rmask, other=0.0)
                dl = al * a * (tl.sum(g * v, 1) - s)
                c = dl * iv
                e = -dl * z * iv * iv / d
                dq += tl.sum(c[:, None] * v, 0)
                flag = tl.load(flag_ptr + i)  # 0: no gradient, 1: assign, 2: add to the buffer, 3: deferred
                w = al * a
                if UNIT:
                    w += 1.0
                # deferred (BlockDeferral): the gradient is w g + c q + e v; its block's pass forms it from w, c, e
                dmask = rmask & (flag == 3)
                coef = coef_ptr + tl.maximum(tl.load(slot_ptr + i), 0) * T + rows
                tl.store(coef, w, mask=dmask)
                tl.store(coef + C * T, c, mask=dmask)
                tl.store(coef + 2 * C * T, e, mask=dmask)
                gv = w[:, None] * g + c[:, None] * q[None, :] + e[:, None] * v
                if PARTIAL_GRAD and i == N - 1:  # the formed partial's gradient from its later readers
                    gv += tl.load(partial_grad_ptr + offs, mask=mask, other=0.0).to(tl.float32)
                tgt = tl.load(tgt_ptrs + i).to(tl.pointer_type(DT))
                gv += tl.load(tgt + offs, mask=mask & (flag == 2), other=0.0).to(tl.float32)
                tl.store(tgt + offs, gv.to(DT), mask=mask & (flag > 0) & (flag < 3))
            gate_acc += s  # sum_i alpha_i dw_i per token: summed over the tokens, the gate's gradient
            if HAS_NULL:
                null_acc += tl.sum((an * a)[:, None] * g, 0)
                dln_acc += dln
        tl.store(part_q_ptr + pid * BD + cols, dq, mask=cmask)
        if HAS_NULL:
            tl.store(part_null_ptr + pid * BD + cols, null_acc, mask=cmask)
            tl.store(part_scalar_ptr + 2 * pid + 1, tl.sum(dln_acc, 0))
        tl.store(part_scalar_ptr + 2 * pid, tl.sum(gate_acc, 0))

    @triton.jit
    def _block_grad(grad_ptrs, coef_ptrs, q_ptr, src_ptrs, tgt_ptrs, acc_ptrs, flag_ptr, T, d, C,
                    R: tl.constexpr, GT: tl.constexpr, DT: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr):
        # program (i, tile): source i's gradient on one tile, sum_j (w_ij g_j + c_ij q_j) + (sum_j e_ij) v_i.
        # The sources' programs of a tile are adjacent in the launch (i varies fastest): they read the same
        # output-gradient tiles, the first from memory and the others from L2.
        i = tl.program_id(0)
        pid = tl.program_id(1)
        rows = pid * BT + tl.arange(0, BT)
        cols = tl.arange(0, BD)
        rmask = rows < T
        cmask = cols < d
        mask = rmask[:, None] & cmask[None, :]
        offs = rows.to(tl.int64)[:, None] * d + cols[None, :]
        acc = tl.zeros((BT, BD), tl.float32)
        esum = tl.zeros((BT,), tl.float32)
        for j in tl.static_range(R):
            grad = tl.load(grad_ptrs + j).to(tl.pointer_type(GT))
            g = tl.load(grad + offs, mask=mask, other=0.0).to(tl.float32)
            # router j's [3, C, T]: its w, c, e for source i
            coef = tl.load(coef_ptrs + j).to(tl.pointer_type(tl.float32)) + i * T + rows
            w = tl.load(coef, mask=rmask, other=0.0)
            c = tl.load(coef + C * T, mask=rmask, other=0.0)
            esum += tl.load(coef + 2 * C * T, mask=rmask, other=0.0)
            q = tl.load(q_ptr + j * d + cols, mask=cmask, other=0.0)
            acc += w[:, None] * g + c[:, None] * q[None, :]
        src = tl.load(src_ptrs + i).to(tl.pointer_type(DT))
        acc += esum[:, None] * tl.load(src + offs, mask=mask, other=0.0).to(tl.float32)
        flag = tl.load(flag_ptr + i)  # 1: assign, 2: add to the buffer (or to x's seed, read in its place)
        tgt = tl.load(tgt_ptrs + i).to(tl.pointer_type(DT))
        add = tl.load(acc_ptrs + i).to(tl.pointer_type(DT))
        acc += tl.load(add + offs, mask=mask & (flag == 2), other=0.0).to(tl.float32)
        tl.store(tgt + offs, acc.to(DT), mask=mask)

    return _forward, _backward, _block_grad


# ImportError, or a broken Triton install: the one attempt's reason in every later error
_kernels = cpu_kernels.BuildOnce(_build, catch=Exception, fail=unavailable)
_TL_DTYPES = {}


def _tl_dtype(dtype: torch.dtype):
    if not _TL_DTYPES:
        import triton.language as tl

        _TL_DTYPES.update({torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16})
    return _TL_DTYPES[dtype]


def warps_for(elements: int) -> int:
    """Warps of a program whose live arrays hold ``elements`` fp32 values each: 4 below 2,048, 8 up to
    TILE_ELEMENTS, 16 above (a group tile [1, S, hidden]: at the 8B width with S = 8, 64 values per thread and
    array instead of 128 on 8 warps). Not tuned on a GPU yet."""
    return 4 if elements < 2048 else 8 if elements <= TILE_ELEMENTS else 16


def _tile(d: int) -> Tuple[int, int, int]:
    """(tokens per program, padded hidden size, warps). Not tuned on a GPU yet: a tile of at most
    TILE_ELEMENTS fp32 values per live [tokens, hidden] array (one token where the row alone is wider)."""
    bd = 1 << max(0, (d - 1).bit_length())
    bt = max(1, min(TOKENS_PER_PROGRAM, TILE_ELEMENTS // bd))
    return bt, bd, warps_for(bt * bd)


# The pinned host tables of the launches made during a CUDA graph capture (--cuda-graph-impl full_iteration): the
# graph's copy node re-reads its host buffer at every replay, so the buffer must never be freed, reused or
# rewritten while the graph lives. Held here for the process's life (a few hundred bytes per launch, one capture
# per graph); released by nothing on purpose.
CAPTURED_HOST_TABLES: List[Tensor] = []

TABLE_ALIGN = 2  # int64 entries per 16 bytes: each table of a launch starts 16-byte aligned (below)


def device_tables(*tables: Sequence[int], device) -> List[Tensor]:
    """A kernel launch's tables of small integers (tensor addresses, flags, slots) on ``device`` in ONE int64
    tensor, one copy for all of them, without waiting for the GPU: on CUDA it is copied from pinned memory,
    non-blocking (a plain ``.to("cuda")`` from pageable memory synchronises the stream: PyTorch's
    memcpy_and_sync). Returns one view per table. Each starts at a 16-byte boundary, so a launch's pointer
    arguments keep the alignment Triton specialises on whatever the tables' lengths (one compiled variant); a
    view holds its table and the padding after it.
    One copy per launch, not per table: each pinned copy costs the host tens of microseconds, and where the
    GPU outruns the host (the 1B shape on the H200, docs/performance.md) that time is the step's.
    During a CUDA graph capture the pinned host table is kept (CAPTURED_HOST_TABLES): the replay copies it again."""
    flat, sizes = table_layout(tables)
    if torch.device(device).type == "cuda":
        # the caching host allocator keeps the pinned block until the copy has run
        host = torch.tensor(flat or [0], dtype=torch.int64, pin_memory=True)
        buf = host.to(device, non_blocking=True)
        if torch.cuda.is_current_stream_capturing():
            CAPTURED_HOST_TABLES.append(host)
    else:
        buf = torch.tensor(flat or [0], dtype=torch.int64, device=device)
    if len(tables) == 1 and flat:
        return [buf]  # one table: the buffer itself, no view op
    return list(buf.split_with_sizes(sizes)) if flat else [buf[:0] for _ in tables]  # one op for all the views


def table_layout(tables: Sequence[Sequence[int]]) -> Tuple[List[int], List[int]]:
    """The tables' entries in one list, each table padded to a multiple of TABLE_ALIGN entries, and each padded
    table's length (what device_tables splits the device tensor into)."""
    flat: List[int] = []
    sizes = []
    for table in tables:
        start = len(flat)
        flat.extend(table)
        flat.extend([0] * (-len(flat) % TABLE_ALIGN))
        sizes.append(len(flat) - start)
    return flat, sizes


def addresses(tensors: Sequence[Optional[Tensor]], fill: int = 0) -> List[int]:
    """The addresses of ``tensors`` for a pointer table; ``fill`` for a None entry (masked in the kernel)."""
    return [fill if t is None else t.data_ptr() for t in tensors]


def kernel_rows(tensors: Sequence[Tensor], rows: int, d: int) -> List[Tensor]:
    """The kernels' view of a list of same-dtype [.., d] tensors: row-major [rows, d] memory (a contiguous tensor
    as it is, whatever its shape; a copy only where it is strided); a kernel indexes their addresses (a pointer
    table) by source. Shared with the group router's Triton kernels (triton_group_kernels.py)."""
    return [t if t.is_contiguous() else t.reshape(rows, d).contiguous() for t in tensors]  # no view op per call


# ---------------------------------------------------------------------------------------- gradient sinks
class KernelSink:
    """The gradient buffer of one source that every router reading it accumulates into, in place.

    ``token`` is a zero-size tensor made from the source's value by :class:`_SinkToken`; each router that
    reads the source takes it as an input, so autograd runs the token's backward (which hands the sum to
    the value's gradient) only after every one of those routers' backward. ``seed``: the gradient of x handed
    out as the sum of the sources (triton_group_kernels.sum_seeding_sinks), held by reference - the same tensor for
    every source, never written - until the first writer adds it as it writes the buffer (the block pass reads it
    in place of the buffer; a router call copies it first), or the token hands it on where nothing wrote one."""

    __slots__ = ("grad", "token", "seed")

    def __init__(self) -> None:
        self.grad: Optional[Tensor] = None
        self.token: Optional[Tensor] = None
        self.seed: Optional[Tensor] = None

    def take_seed(self, kernel: str) -> None:
        """The seed as the buffer (a copy: the seed is shared), for a writer that adds in place."""
        if self.grad is None and self.seed is not None:
            self.grad = self.seed.clone()
            traffic.record(kernel, "backward", [self.seed], [self.grad])
        self.seed = None

    def add_late(self, grad: Tensor, kernel: str) -> None:
        """x's gradient where a writer reached the sink first (router.seed_sinks): added in place, its own pass."""
        self.take_seed(kernel)
        self.grad.add_(grad.to(self.grad.dtype))
        traffic.record(kernel, "backward", [self.grad, grad], [self.grad])


class _SinkToken(torch.autograd.Function):
    @staticmethod
    def forward(ctx, value, sink):
        # its readers hand it no gradient (None: autograd adds nothing); it still runs after the last of them
        ctx.set_materialize_grads(False)
        ctx.sink = sink
        ctx.shape = value.shape
        return value.new_empty(0)

    @staticmethod
    def backward(ctx, _grad):
        sink = ctx.sink
        acc = sink.grad if sink.grad is not None else sink.seed  # a seed no writer reached: handed on as is
        sink.grad = sink.seed = None
        return (None if acc is None else acc.view(ctx.shape)), None


def make_sink(value: Tensor) -> Optional[KernelSink]:
    """A sink for a source read by several routers on these kernels (None when the value needs no gradient)."""
    if not value.requires_grad:
        return None
    sink = KernelSink()
    sink.token = _SinkToken.apply(value, sink)
    return sink


class BlockDeferral:
    """The gradients of the completed sources that one block's routers (in one buffer scope) read through
    KernelSinks, written once for the block instead of once per router (group_plan.block_defers says where that pays).

    Each router's backward reads each source once as before (its dot products <grad, v_i> are needed for the
    softmax's gradient, hence for the in-block sources' gradients), but writes nothing for these sources: the
    gradient of source i from router j is w_ij g_j + c_ij q_j + e_ij v_i with per-token scalars w, c, e, which
    it leaves in the stash with its output gradient g_j and its query q_j. One pass (:meth:`flush`, kernel
    ``_block_grad``) then reads each g_j and each source once and adds the block's share into the source's
    gradient buffer once. The pass runs in the backward of a node (:class:`_DeferredPass`) that takes the
    sources' sink tokens and gives the block's routers the token they take instead: autograd runs it after
    every one of those routers' backward and before any sink hands its gradient on. It holds the block's
    output gradients (one [tokens, hidden] tensor per router) until then."""

    __slots__ = ("values", "sinks", "stash")

    def __init__(self, values: Sequence[Tensor], sinks: Sequence[KernelSink]) -> None:
        self.values = [v.detach() for v in values]  # the same storage as the routers' saved values
        self.sinks = list(sinks)
        self.stash: List[Tuple[Tensor, Tensor, Tensor]] = []  # (g_j [T, d], coefficients [3, C, T], q_j [d])

    def slots(self) -> List["DeferredSink"]:
        """One DeferredSink per source, in order, each carrying the token the block's routers take."""
        token = _DeferredPass.apply(self, *[s.token for s in self.sinks])
        return [DeferredSink(self, i, token) for i in range(len(self.sinks))]

    def flush(self) -> None:
        stash, self.stash = self.stash, []
        if not stash:
            return
        v0 = self.values[0]
        d = v0.shape[-1]
        rows, dev, dtype = v0.numel() // d, v0.device, v0.dtype
        gdt = stash[0][0].dtype
        grads = [g if g.dtype == gdt else g.to(gdt) for g, _, _ in stash]
        coefs = [c for _, c, _ in stash]  # [3, C, T] fp32 each
        queries = torch.stack([q for _, _, q in stash])  # [R, d] fp32
        flat = kernel_rows(self.values, rows, d)
        flags, accs = [], []  # accs: what a target adds to: the buffer itself, or x's seed (read, not written)
        for sink in self.sinks:  # the first writer to reach the sink makes the buffer (assigned, or seed + share)
            seed = sink.seed if sink.grad is None else None
            flags.append(1 if sink.grad is None and seed is None else 2)
            if sink.grad is None:
                sink.grad = torch.empty(rows, d, dtype=dtype, device=dev)
            sink.seed = None
            accs.append(sink.grad if seed is None else seed)  # a seed: [rows, d] in x's dtype (_SeededSum)
        targets = [s.grad for s in self.sinks]
        bt, bd, warps = _tile(d)
        grad_ptrs, coef_ptrs, src_ptrs, tgt_ptrs, acc_ptrs, flag_tab = device_tables(
            addresses(grads), addresses(coefs), addresses(flat), addresses(targets), addresses(accs), flags,
            device=dev)
        load()[2][(len(self.sinks), _cdiv(rows, bt))](
            grad_ptrs, coef_ptrs, queries, src_ptrs, tgt_ptrs, acc_ptrs, flag_tab, rows, d, len(self.sinks),
            R=len(grads), GT=_tl_dtype(gdt), DT=_tl_dtype(dtype), BT=bt, BD=bd, num_warps=warps)
        added = {a.data_ptr(): a for a, f in zip(accs, flags) if f == 2}  # the seed, shared by the sinks it seeds:
        traffic.record(DEFERRED_KERNEL, "backward",  # read once a tile (the first from memory, the others from L2)
                       reads=[*grads, *coefs, *flat, *added.values()], writes=targets)


class DeferredSink(NamedTuple):
    """A source's place in its block's deferred pass: what a router of the block takes instead of the KernelSink."""

    deferral: BlockDeferral
    slot: int
    token: Tensor


class _DeferredPass(torch.autograd.Function):
    @staticmethod
    def forward(ctx, deferral, *sink_tokens):
        ctx.set_materialize_grads(False)  # as _SinkToken: the tokens carry order, not gradients
        ctx.deferral = deferral
        ctx.count = len(sink_tokens)
        return sink_tokens[0].new_empty(0)

    @staticmethod
    def backward(ctx, _grad):
        ctx.deferral.flush()
        return (None,) * (1 + ctx.count)


def defer_block(sources: Sequence, routers: int, deferrals: Dict[int, Optional[BlockDeferral]], block: int) -> list:
    """``sources`` (router.Source tuples) of a router of ``block`` as it should take them: the sources with a
    KernelSink in the block's deferred pass, where group_plan.block_defers says it pays for the block's ``routers``
    in this scope. ``deferrals`` (block -> the slots, or None: not deferred) is the buffer's, filled at the block's
    first router; a source the first router did not read keeps its sink."""
    if block not in deferrals:
        shared = [s for s in sources if isinstance(s.sink, KernelSink)]
        deferrals[block] = None
        if shared and block_defers(routers, len(shared)):
            slots = BlockDeferral([s.value for s in shared], [s.sink for s in shared]).slots()
            deferrals[block] = {id(s.sink): slot for s, slot in zip(shared, slots)}
    slots = deferrals[block]
    if not slots:
        return list(sources)
    return [s._replace(sink=slots[id(s.sink)]) if id(s.sink) in slots else s for s in sources]


# ---------------------------------------------------------------------------------------- routing
class _TritonRoute(torch.autograd.Function):
    """out = B + a * sum_i softmax_i(z_i) v_i (+ the null source), every logit projected in the pass.

    Inputs: n, out_dtype, sinks (a KernelSink or None per source), unit, eps, base, gate, null_logit,
    null_value, query (q = w * g), addend, then n values and n sink tokens (None where the sink is None).
    A source with a sink gets its gradient through the sink's token; the others directly. With ``addend``
    the last source is ``values[-1] + addend`` (a partial sum, its one reader is this router), formed and
    written here: the third output (else None). Its gradient (this router's share plus the formed partial's
    own, from its later readers) is written once and returned for both parts."""

    @staticmethod
    def forward(ctx, n, out_dtype, sinks, unit, eps, base, gate, null_logit, null_value, query, addend, *tensors):
        fwd = load()[0]
        ctx.set_materialize_grads(False)
        values = tensors[:n]
        v0 = values[0]
        d = v0.shape[-1]
        rows = v0.numel() // d
        dev = v0.device
        flat = kernel_rows(values, rows, d)
        ptrs, = device_tables(addresses(flat), device=dev)
        # the kernel reads addresses: tensors in their own shape where contiguous, no view op per call
        flat_base = None if base is None else kernel_rows([base], rows, d)[0]
        has_null = null_value is not None
        m = n + int(has_null)
        out = torch.empty(v0.shape, dtype=out_dtype or v0.dtype, device=dev)
        logits = torch.empty(m, rows, dtype=torch.float32, device=dev)
        inv = torch.empty(n, rows, dtype=torch.float32, device=dev)
        lse = torch.empty(rows, dtype=torch.float32, device=dev)
        q = query.detach().to(torch.float32).contiguous()
        zf = None if null_value is None else null_value.detach().to(torch.float32).contiguous()
        nl = None if null_logit is None else null_logit.detach().to(torch.float32).reshape(1)
        gf = None if gate is None else gate.detach().to(torch.float32).reshape(1)
        flat_addend = partial = None
        if addend is not None:
            flat_addend = kernel_rows([addend], rows, d)[0]
            partial = torch.empty(v0.shape, dtype=v0.dtype, device=dev)
        bt, bd, warps = _tile(d)
        fwd[(_cdiv(rows, bt),)](
            ptrs, flat_base if flat_base is not None else out, out, q, zf if zf is not None else q,
            nl if nl is not None else q, gf if gf is not None else q, logits, lse, inv,
            flat_addend if flat_addend is not None else out, partial if partial is not None else out, rows, d,
            float(eps), N=n, HAS_BASE=flat_base is not None, UNIT=bool(unit), HAS_NULL=has_null,
            HAS_GATE=gate is not None, FORM=addend is not None, DT=_tl_dtype(v0.dtype), BT=bt, BD=bd,
            num_warps=warps)
        traffic.record(KERNEL, "forward", reads=[*flat, flat_base, flat_addend],
                       writes=[out, partial, logits[:n], inv, lse])
        if has_null:
            logits[n].copy_(nl.expand(rows))
        alpha = torch.exp(logits - lse)  # [M, T]: the softmax over depth, from the kernel's logits and lse
        ctx.n, ctx.unit, ctx.sinks = n, bool(unit), sinks
        ctx.base_dtype = None if base is None else base.dtype
        ctx.formed = addend is not None
        kept = list(values)
        if partial is not None:  # backward reads the formed partial (alive: its next reader keeps it), not its parts
            kept[-1] = partial
        ctx.save_for_backward(gate, null_logit, null_value, query, alpha, inv, logits, *kept)
        ctx.mark_non_differentiable(alpha)
        return out, alpha, partial

    @staticmethod
    def backward(ctx, grad_out, _grad_alpha, grad_partial):
        bwd = load()[1]
        n = ctx.n
        gate, null_logit, null_value, query, alpha, inv, logits, *values = ctx.saved_tensors
        needs = ctx.needs_input_grad
        nv = 11  # index of the first value among forward's inputs
        m, rows = alpha.shape
        d = values[0].shape[-1]
        dev = values[0].device
        dtype = values[0].dtype
        flat = kernel_rows(values, rows, d)
        if grad_out is None:
            grad_out = torch.zeros(values[0].shape, dtype=torch.float32, device=dev)
        grad = kernel_rows([grad_out], rows, d)[0]
        flat_gp = None if grad_partial is None or not ctx.formed else kernel_rows([grad_partial], rows, d)[0]
        targets: List[Optional[Tensor]] = [None] * n
        flags = [0] * n
        slots = [-1] * n
        grad_values: List[Optional[Tensor]] = [None] * n
        deferral = None
        for i, sink in enumerate(ctx.sinks):
            if isinstance(sink, DeferredSink):  # its block's pass writes the gradient (coefficients stashed)
                deferral, slots[i], flags[i] = sink.deferral, sink.slot, 3
            elif sink is not None:
                sink.take_seed(KERNEL)  # x's seed: copied into the buffer, which this call adds to
                if sink.grad is None:  # the first writer to reach the sink makes the buffer (assigned)
                    sink.grad, flags[i] = torch.empty(rows, d, dtype=dtype, device=dev), 1
                else:
                    flags[i] = 2
                targets[i] = sink.grad
            elif needs[nv + i] or (ctx.formed and i == n - 1 and needs[10]):  # in the value's shape: no view op
                grad_values[i] = targets[i] = torch.empty(values[i].shape, dtype=dtype, device=dev)
                flags[i] = 1
        sources = 0 if deferral is None else len(deferral.values)
        coef = None if deferral is None else torch.zeros(3, sources, rows, dtype=torch.float32, device=dev)  # w, c, e
        has_null = null_value is not None
        bt, bd, warps = _tile(d)
        programs = reducing_programs(_cdiv(rows, bt), dev)
        part_q = torch.empty(programs, bd, dtype=torch.float32, device=dev)
        part_null = torch.empty(programs if has_null else 1, bd, dtype=torch.float32, device=dev)
        part_scalar = torch.zeros(programs, 2, dtype=torch.float32, device=dev)
        q = query.detach().to(torch.float32).contiguous()
        zf = None if null_value is None else null_value.detach().to(torch.float32).contiguous()
        gf = None if gate is None else gate.detach().to(torch.float32).reshape(1)
        ptrs, tgt_ptrs, flag_tab, slot_tab = device_tables(addresses(flat), addresses(targets), flags, slots,
                                                           device=dev)
        bwd[(programs,)](
            grad, ptrs, tgt_ptrs, flag_tab,
            alpha, inv, logits, q, zf if zf is not None else q, gf if gf is not None else q,
            part_q, part_null, part_scalar, flat_gp if flat_gp is not None else grad, slot_tab,
            coef if coef is not None else part_scalar,
            rows, d, sources, N=n, UNIT=ctx.unit, HAS_NULL=has_null, HAS_GATE=gate is not None,
            PARTIAL_GRAD=flat_gp is not None, DT=_tl_dtype(dtype), BT=bt, BD=bd, num_warps=warps)
        traffic.record(KERNEL, "backward", reads=[grad, *flat, flat_gp, *[t for t, f in zip(targets, flags) if f == 2]],
                       writes=[t for t in targets if t is not None] + [coef])
        record_partials([part_q, part_null if has_null else None])
        if deferral is not None:
            deferral.stash.append((grad, coef, q))
        grad_query = summed(part_q, d).to(query.dtype) if needs[9] else None
        grad_gate = grad_null_logit = grad_null_value = None
        if gate is not None and needs[6]:
            grad_gate = part_scalar[:, 0].sum().reshape(gate.shape).to(gate.dtype)
        if has_null:
            if needs[7]:
                grad_null_logit = part_scalar[:, 1].sum().reshape(null_logit.shape).to(null_logit.dtype)
            if needs[8]:
                grad_null_value = summed(part_null, d).to(null_value.dtype)
        grad_base = None
        if ctx.base_dtype is not None and needs[5]:
            grad_base = grad_out.to(ctx.base_dtype)
        grad_addend = grad_values[-1] if ctx.formed and needs[10] else None  # P' = P + v: one gradient for both
        if ctx.formed and not needs[nv + n - 1]:
            grad_values[-1] = None
        return (None, None, None, None, None, grad_base, grad_gate, grad_null_logit, grad_null_value, grad_query,
                grad_addend, *grad_values, *[None] * n)  # the sink tokens: no gradient (_SinkToken)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


REDUCING_PROGRAMS_PER_SM = 2  # persistent programs per SM of a kernel that reduces over the tokens (not tuned yet)
INTERPRETER_REDUCING_PROGRAMS = 2  # under Triton's interpreter: few, so that the tests run programs of several tiles


def reducing_programs(tiles: int, device) -> int:
    """The programs of a kernel that reduces gradients over the tokens (the query's, the null source's, the
    gate's): persistent, each takes every programs-th tile of tokens and writes ONE partial sum, so the
    [programs, .., hidden] fp32 partials scale with the GPU, not with the tokens. (One program per tile made
    them [tokens / BT, .., hidden]: at the 8B width, BT = 2, an fp32 buffer of half the tokens - a row of
    activations written and read back per router call.) On CUDA REDUCING_PROGRAMS_PER_SM per SM; under the
    interpreter INTERPRETER_REDUCING_PROGRAMS."""
    device = torch.device(device)
    if device.type == "cuda":
        cap = REDUCING_PROGRAMS_PER_SM * _sm_count(device.index if device.index is not None
                                                   else torch.cuda.current_device())
    else:
        cap = INTERPRETER_REDUCING_PROGRAMS
    return max(1, min(tiles, cap))


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def summed(parts: Tensor, *sizes: int) -> Tensor:
    """The programs' partials [programs, padded sizes..] summed over the programs and cut to ``sizes``: no slice op
    where nothing was padded (hidden sizes that are powers of two)."""
    total = parts.sum(0)
    return total if tuple(total.shape) == sizes else total[tuple(slice(0, n) for n in sizes)]


def record_partials(parts: Sequence[Optional[Tensor]]) -> None:
    """The per-program partial sums a reducing kernel wrote and their sum reads back (traffic.py: REDUCE_KERNEL;
    [programs, .., hidden] fp32, below a row of [tokens, hidden] at the GPU's program count, so reported apart from
    the rows and priced by cost_model.reduction_bytes)."""
    traffic.record(REDUCE_KERNEL, "backward", reads=parts, writes=parts)


def route(values: Sequence[Tensor], *, query: Tensor, eps: float, sinks: Optional[Sequence] = None,
          null_logit: Optional[Tensor] = None, null_value: Optional[Tensor] = None, gate: Optional[Tensor] = None,
          base: Optional[Tensor] = None, base_sums: bool = False, out_dtype: Optional[torch.dtype] = None,
          addend: Optional[Tensor] = None) -> Tuple[Tensor, Tensor, Optional[Tensor]]:
    """``B + gate * r`` over ``values`` ([.., d] each, one dtype; see fallback_reason) on the kernels, alpha
    [M, T] fp32 (null source last) and the formed partial sum (or None). B: ``base``; with ``base=None,
    base_sums=True`` the sum of the values (formed in the pass); else 0. ``sinks``: a KernelSink (or None) per
    value: the value's gradient is accumulated there. ``addend``: the last source is ``values[-1] + addend``,
    formed in the pass and returned (a sum with this router as its one reader: no sink). Differentiable in
    every input."""
    n = len(values)
    sinks = list(sinks) if sinks is not None else [None] * n
    sinks = [s if isinstance(s, DeferredSink) or (isinstance(s, KernelSink) and s.token is not None) else None
             for s in sinks]
    if addend is not None:
        sinks[-1] = None
    tokens = [None if s is None else s.token for s in sinks]
    unit = base is None and bool(base_sums)
    return _TritonRoute.apply(n, out_dtype, sinks, unit, float(eps), base, gate, null_logit, null_value, query,
                              addend, *values, *tokens)


def route_router(router, sources, *, base: Optional[Tensor], gate: Optional[Tensor], base_sums: bool,
                 out_dtype: Optional[torch.dtype]) -> Optional[Tuple[Tensor, Tensor]]:
    """DepthRouter.forward's entry (``sources``: router.Source tuples): (out, alpha [M, T]), or None when this
    call falls back to the PyTorch path (fallback_reason, or sources made with different key-norm eps)."""
    sources = [s if s.pending is None or s.pending.value is None else s._replace(value=s.pending.value, pending=None)
               for s in sources]
    values = [s.value for s in sources]
    pending = [i for i, s in enumerate(sources) if s.pending is not None]
    addend = sources[-1].pending.addend if pending else None
    if pending and (pending != [len(sources) - 1] or addend.shape != values[-1].shape):
        return None  # only the last source may be formed here (DepthRouter forms the others)
    if fallback_reason(values + ([addend] if pending else [])) is not None:
        return None
    eps = {float(s.eps) for s in sources}
    if len(eps) > 1:
        return None
    q = router.query_vector()
    null_logit = null_value = None
    if router.null_source is not None:
        null_logit, null_value = router._null(q)
    out, alpha, partial = route(values, query=q, eps=eps.pop(), sinks=[s.sink for s in sources],
                                null_logit=null_logit, null_value=null_value, gate=gate, base=base,
                                base_sums=base_sums, out_dtype=out_dtype, addend=addend)
    if pending:
        sources[-1].pending.value = partial
        traffic.watch(partial)  # a source like any the buffer holds: its readers' gradients are counted
    return out, alpha
