"""The group router's Triton kernels (GPU): the four kernels of csrc/group_router_kernels.c on tiles of ``BT``
tokens x the hidden size, for ``--delta-router-kernels triton`` (and ``auto`` on CUDA tensors when Triton
imports). group_router.py holds the math and calls them with the same arguments as group_kernels.py's C
kernels; imported lazily, as triton_router.py (whose start-up check, interpreter switch and dtype rules they
share): nothing of Triton is imported until a group routes on them. On CPU they run only under Triton's
interpreter (``TRITON_INTERPRET=1``), which is how the tests run them, in fp32.

Per program (a tile of tokens), S routers of a group at once: the S queries, partial mixes and output
gradients are [S, hidden] / [tokens, S, hidden] tiles (S padded to a power of two), so

- old forward: ONE read of each older source: its 1/rms, the S logits, and an online softmax per router
  (running max, sum and fp32 mix, the null source first); writes the S partial mixes r_k (fp32), lse_k, and
  X = the sum of the sources (unit); the logits and 1/rms as [S, M, T] / [n, T] tables (fp32, small);
- old backward: loop 1 reads each source for the softmax's s_k = sum_i p_ki dp_ki; loop 2 reads the same tile
  again (from cache) and writes each source's gradient in place into its sink (assigned by the first pass to
  reach it, added by the others); the S query gradients and the null sources' are reduced per program into
  [programs, S, hidden] partial sums (persistent programs, triton_router.reducing_programs), then over the
  programs;
- merge forward: an online softmax that starts from (lse_k, r_k) and reads each in-group source once; writes u
  once, in the output dtype;
- merge backward: as the per-router kernel's backward over (r_k, in-group sources), each in-group gradient
  into its sink in place.

The source, gradient and target tables are pointer tables (int64 device tensors), as triton_router.py's. The number
of sources a kernel loops over (N: the older sources of the old pass; K: a merge's in-group sources) is a runtime
loop bound (a software-pipelined loop: PIPELINE_STAGES), not a compile-time constant, so one compiled kernel serves
every group of a run whatever its position (a constant N compiled a variant per group, with its loop unrolled up to
2L times); S, the group size, is a dimension of the tiles and stays a constant.
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from megatron_delta.core import cpu_kernels, router, traffic, triton_router
from megatron_delta.core.triton_router import TritonUnavailable

__all__ = ["load", "eligible", "old_forward", "old_backward", "merge_forward", "merge_backward", "final_sum",
           "sum_seeding_sinks"]

TOKENS_PER_PROGRAM = triton_router.TOKENS_PER_PROGRAM
TILE_ELEMENTS = triton_router.TILE_ELEMENTS  # at most BT x S x BD fp32 values per [tokens, S, hidden] tile
# The loops over the sources are software-pipelined (tl.range's num_stages): the rows of the next PIPELINE_STAGES - 1
# sources are loaded (cp.async) while one is used, where a plain loop waits for each load. tools/kernel_resources.py
# counts what that costs in registers and shared memory.
PIPELINE_STAGES = 3

def load():
    """The five jitted kernels, built on first use. Raises TritonUnavailable."""
    return _kernels.load()


def eligible(kernels: str, values: Sequence[Tensor], others: Sequence[Optional[Tensor]] = ()) -> bool:
    """Whether a group's pass over ``values`` (one dtype, see triton_router.fallback_reason) runs on these kernels
    for a router's ``kernels`` choice: ``triton``, or ``auto`` on CUDA tensors; ``others`` (r, X, x, gradients)
    on the same device."""
    if kernels not in ("triton", "auto") or not values:
        return False
    if kernels == "auto" and values[0].device.type != "cuda":
        return False  # auto on CPU: the C kernels
    if triton_router.fallback_reason(list(values)) is not None:
        return False
    if any(t is not None and t.device != values[0].device for t in others):
        return False
    try:
        load()
    except TritonUnavailable:
        return False
    return True


def _build():
    import triton
    import triton.language as tl

    @triton.jit
    def _old_forward(src_ptrs, q_ptr, null_logit_ptr, null_ptr, inv_ptr, z_ptr, lse_ptr, r_ptr, x_ptr, u0_ptr, T, d,
                     eps, N, M, S: tl.constexpr, SP: tl.constexpr, HAS_NULL: tl.constexpr,
                     UNIT: tl.constexpr, FIRST_U: tl.constexpr, DT: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr,
                     STAGES: tl.constexpr):
        pid = tl.program_id(0)
        rows = pid * BT + tl.arange(0, BT)
        cols = tl.arange(0, BD)
        ks = tl.arange(0, SP)
        rmask, cmask, kmask = rows < T, cols < d, ks < S
        mask = rmask[:, None] & cmask[None, :]
        tk_mask = rmask[:, None] & kmask[None, :]  # [BT, SP]
        kd_mask = kmask[:, None] & cmask[None, :]  # [SP, BD]
        offs = rows.to(tl.int64)[:, None] * d + cols[None, :]
        Q = tl.load(q_ptr + ks[:, None] * d + cols[None, :], mask=kd_mask, other=0.0)  # [SP, BD]
        if HAS_NULL:  # each router's null source starts its online softmax: max = its logit, sum = 1, mix = z_k
            zl = tl.load(null_logit_ptr + ks, mask=kmask, other=0.0)
            m = tl.zeros((BT, SP), tl.float32) + zl[None, :]
            s = tl.zeros((BT, SP), tl.float32) + 1.0
            zv = tl.load(null_ptr + ks[:, None] * d + cols[None, :], mask=kd_mask, other=0.0)
            acc = tl.zeros((BT, SP, BD), tl.float32) + zv[None, :, :]
            tl.store(z_ptr + (ks[None, :] * M + N) * T + rows[:, None], m, mask=tk_mask)
        else:
            m = tl.full((BT, SP), float("-inf"), tl.float32)
            s = tl.zeros((BT, SP), tl.float32)
            acc = tl.zeros((BT, SP, BD), tl.float32)
        total = tl.zeros((BT, BD), tl.float32)
        for i in tl.range(N, num_stages=STAGES):
            src = tl.load(src_ptrs + i).to(tl.pointer_type(DT))
            v = tl.load(src + offs, mask=mask, other=0.0).to(tl.float32)
            inv = 1.0 / tl.sqrt(tl.sum(v * v, 1) / d + eps)
            tl.store(inv_ptr + i * T + rows, inv, mask=rmask)
            z = tl.sum(v[:, None, :] * Q[None, :, :], 2) * inv[:, None]  # [BT, SP]
            tl.store(z_ptr + (ks[None, :] * M + i) * T + rows[:, None], z, mask=tk_mask)
            m_new = tl.maximum(m, z)
            scale = tl.exp(m - m_new)
            p = tl.exp(z - m_new)
            acc = acc * scale[:, :, None] + p[:, :, None] * v[:, None, :]
            s = s * scale + p
            m = m_new
            if UNIT:
                total += v
        tl.store(lse_ptr + ks[None, :] * T + rows[:, None], m + tl.log(s), mask=tk_mask)
        mix = acc / s[:, :, None]
        # FIRST_U: router 0's u (r_0 + X, as its merge would add them) in the sources' dtype, r holds r_1 ..
        r_offs = (ks - FIRST_U).to(tl.int64)[None, :, None] * T * d + offs[:, None, :]
        r_mask = tk_mask & (ks >= FIRST_U)[None, :]
        tl.store(r_ptr + r_offs, mix, mask=r_mask[:, :, None] & cmask[None, None, :])
        if UNIT:  # X in the sources' dtype (group_router._OldPass)
            total = total.to(x_ptr.dtype.element_ty)
            tl.store(x_ptr + offs, total, mask=mask)
        if FIRST_U:
            u0 = tl.sum(tl.where((ks == 0)[None, :, None], mix, 0.0), 1)
            if UNIT:
                u0 += total.to(tl.float32)
            tl.store(u0_ptr + offs, u0.to(u0_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _old_backward(g_ptrs, g_flag_ptr, w_ptr, dlse_ptr, src_ptrs, tgt_ptrs, acc_ptrs, tgt_flag_ptr, inv_ptr, z_ptr,
                      p_ptr, q_ptr, null_ptr, dz_ptr, part_q_ptr, part_null_ptr, g2_ptrs, a2_ptr, c2_ptr, q2_ptr,
                      e2_ptr, T, d, N, M, K2, S2, S: tl.constexpr, SP: tl.constexpr, HAS_NULL: tl.constexpr,
                      UNIT: tl.constexpr, RECEIVED: tl.constexpr, DT: tl.constexpr, GDT: tl.constexpr,
                      BT: tl.constexpr, BD: tl.constexpr, STAGES: tl.constexpr):
        pid = tl.program_id(0)  # persistent (triton_router.reducing_programs): tiles pid, pid + programs, ...
        cols = tl.arange(0, BD)
        ks = tl.arange(0, SP)
        cmask, kmask = cols < d, ks < S
        kd_mask = kmask[:, None] & cmask[None, :]
        Q = tl.load(q_ptr + ks[:, None] * d + cols[None, :], mask=kd_mask, other=0.0)
        dq = tl.zeros((SP, BD), tl.float32)
        null_acc = tl.zeros((SP, BD), tl.float32)
        if HAS_NULL:
            zv = tl.load(null_ptr + ks[:, None] * d + cols[None, :], mask=kd_mask, other=0.0)
        for tile in range(pid, tl.cdiv(T, BT), tl.num_programs(0)):
            rows = tile * BT + tl.arange(0, BT)
            rmask = rows < T
            mask = rmask[:, None] & cmask[None, :]
            tk_mask = rmask[:, None] & kmask[None, :]
            offs = rows.to(tl.int64)[:, None] * d + cols[None, :]
            # the S output gradients as one [BT, SP, BD] tile (a router without a gradient: zeros)
            g_flag = tl.load(g_flag_ptr + ks, mask=kmask, other=0)
            g_base = tl.load(g_ptrs + ks, mask=kmask, other=0).to(tl.pointer_type(GDT))
            G = tl.load(g_base[None, :, None] + offs[:, None, :],
                        mask=(tk_mask & (g_flag[None, :] > 0))[:, :, None] & cmask[None, None, :], other=0.0)
            G = G.to(tl.float32)
            w = tl.load(w_ptr + ks[None, :] * T + rows[:, None], mask=tk_mask, other=0.0)  # gate * beta_k
            dlse = tl.load(dlse_ptr + ks[None, :] * T + rows[:, None], mask=tk_mask, other=0.0)
            # loop 1: s_k = sum_i p_ki dp_ki, dp_ki = w_k <G_k, v_i>
            sdp = tl.zeros((BT, SP), tl.float32)
            for i in tl.range(N, num_stages=STAGES):
                src = tl.load(src_ptrs + i).to(tl.pointer_type(DT))
                v = tl.load(src + offs, mask=mask, other=0.0).to(tl.float32)
                p_i = tl.load(p_ptr + (ks[None, :] * M + i) * T + rows[:, None], mask=tk_mask, other=0.0)
                sdp += p_i * (w * tl.sum(G * v[:, None, :], 2))
            if HAS_NULL:
                p_n = tl.load(p_ptr + (ks[None, :] * M + N) * T + rows[:, None], mask=tk_mask, other=0.0)
                dp_n = w * tl.sum(G * zv[None, :, :], 2)
                sdp += p_n * dp_n
                tl.store(dz_ptr + (ks[None, :] * M + N) * T + rows[:, None], p_n * (dp_n - sdp + dlse), mask=tk_mask)
                null_acc += tl.sum((w * p_n)[:, :, None] * G, 0)  # [SP, BD]: the null values' gradients
            gsum = tl.sum(G, 1)  # [BT, BD]: x = the sum of the sources passes each G_k to every older source
            # loop 2: dz, the query gradients, each source's gradient into its sink
            for i in tl.range(N, num_stages=STAGES):
                src = tl.load(src_ptrs + i).to(tl.pointer_type(DT))
                v = tl.load(src + offs, mask=mask, other=0.0).to(tl.float32)
                tab = (ks[None, :] * M + i) * T + rows[:, None]
                p_i = tl.load(p_ptr + tab, mask=tk_mask, other=0.0)
                z_i = tl.load(z_ptr + tab, mask=tk_mask, other=0.0)
                iv = tl.load(inv_ptr + i * T + rows, mask=rmask, other=0.0)
                dz = p_i * (w * tl.sum(G * v[:, None, :], 2) - sdp + dlse)
                tl.store(dz_ptr + tab, dz, mask=tk_mask)
                c = dz * iv[:, None]  # [BT, SP]
                e = -tl.sum(dz * z_i, 1) * iv * iv / d  # [BT]
                dq += tl.sum(c[:, :, None] * v[:, None, :], 0)
                gv = e[:, None] * v + tl.sum(c[:, :, None] * Q[None, :, :], 1) + tl.sum((w * p_i)[:, :, None] * G, 1)
                if UNIT:
                    gv += gsum
                if RECEIVED:  # the next group's deferred share (group_router.OldShare): its G_k rows come from cache
                    gv += tl.load(e2_ptr + i * T + rows, mask=rmask, other=0.0)[:, None] * v
                    for j in range(K2):
                        g2 = tl.load(tl.load(g2_ptrs + j).to(tl.pointer_type(GDT)) + offs, mask=mask, other=0.0)
                        a2 = tl.load(a2_ptr + (j * N + i) * T + rows, mask=rmask, other=0.0)
                        gv += a2[:, None] * g2.to(tl.float32)
                    for j in range(S2):
                        q2 = tl.load(q2_ptr + j * d + cols, mask=cmask, other=0.0)
                        c2 = tl.load(c2_ptr + (j * N + i) * T + rows, mask=rmask, other=0.0)
                        gv += c2[:, None] * q2[None, :]
                flag = tl.load(tgt_flag_ptr + i)  # 0: no gradient, 1: assign, 2: add to the sink (or to its seed)
                tgt = tl.load(tgt_ptrs + i).to(tl.pointer_type(DT))
                acc = tl.load(acc_ptrs + i).to(tl.pointer_type(DT))  # the sink itself, or the final sum's seed
                gv += tl.load(acc + offs, mask=mask & (flag == 2), other=0.0).to(tl.float32)
                tl.store(tgt + offs, gv.to(DT), mask=mask & (flag > 0))
        tl.store(part_q_ptr + pid * SP * BD + ks[:, None] * BD + cols[None, :], dq)
        if HAS_NULL:
            tl.store(part_null_ptr + pid * SP * BD + ks[:, None] * BD + cols[None, :], null_acc)

    @triton.jit
    def _merge_forward(r_ptr, lse_ptr, x_ptr, base_ptr, gate_ptr, q_ptr, src_ptrs, inv_ptr, z_ptr, a_ptr, out_ptr,
                       T, d, eps, K, HAS_X: tl.constexpr, HAS_BASE: tl.constexpr,
                       HAS_GATE: tl.constexpr, UNIT: tl.constexpr, DT: tl.constexpr, BT: tl.constexpr,
                       BD: tl.constexpr, STAGES: tl.constexpr):
        pid = tl.program_id(0)
        rows = pid * BT + tl.arange(0, BT)
        cols = tl.arange(0, BD)
        rmask, cmask = rows < T, cols < d
        mask = rmask[:, None] & cmask[None, :]
        offs = rows.to(tl.int64)[:, None] * d + cols[None, :]
        q = tl.load(q_ptr + cols, mask=cmask, other=0.0)
        lse = tl.load(lse_ptr + rows, mask=rmask, other=0.0)
        m = lse  # the older sources' block: logit lse_k, mix r_k (already normalised)
        s = tl.zeros((BT,), tl.float32) + 1.0
        acc = tl.load(r_ptr + offs, mask=mask, other=0.0)
        total = tl.zeros((BT, BD), tl.float32)
        for i in tl.range(K, num_stages=STAGES):
            src = tl.load(src_ptrs + i).to(tl.pointer_type(DT))
            v = tl.load(src + offs, mask=mask, other=0.0).to(tl.float32)
            inv = 1.0 / tl.sqrt(tl.sum(v * v, 1) / d + eps)
            z = tl.sum(v * q[None, :], 1) * inv
            tl.store(inv_ptr + i * T + rows, inv, mask=rmask)
            tl.store(z_ptr + i * T + rows, z, mask=rmask)
            m_new = tl.maximum(m, z)
            scale = tl.exp(m - m_new)
            p = tl.exp(z - m_new)
            acc = acc * scale[:, None] + p[:, None] * v
            s = s * scale + p
            m = m_new
            if UNIT:
                total += v
        res = acc / s[:, None]
        if HAS_GATE:
            res = res * tl.load(gate_ptr)
        if HAS_BASE:
            res += tl.load(base_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        if HAS_X:
            res += tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        if UNIT:
            res += total
        tl.store(out_ptr + offs, res.to(out_ptr.dtype.element_ty), mask=mask)
        tl.store(a_ptr + rows, tl.exp(lse - m) / s, mask=rmask)  # beta, then the in-group weights
        for i in range(K):
            z = tl.load(z_ptr + i * T + rows, mask=rmask, other=0.0)
            tl.store(a_ptr + (1 + i) * T + rows, tl.exp(z - m) / s, mask=rmask)

    @triton.jit
    def _merge_backward(grad_ptr, r_ptr, gate_ptr, q_ptr, src_ptrs, tgt_ptrs, acc_ptrs, flag_ptr, lg_ptrs, lq_ptrs,
                        lw_ptrs, lc_ptrs, le_ptrs, inv_ptr, z_ptr, a_ptr, coef_ptr, da_ptr, dlog_ptr, part_q_ptr, T, d,
                        K, L, UNIT: tl.constexpr, HAS_GATE: tl.constexpr, DT: tl.constexpr, GDT: tl.constexpr,
                        BT: tl.constexpr, BD: tl.constexpr, STAGES: tl.constexpr):
        pid = tl.program_id(0)  # persistent (triton_router.reducing_programs): tiles pid, pid + programs, ...
        cols = tl.arange(0, BD)
        cmask = cols < d
        q = tl.load(q_ptr + cols, mask=cmask, other=0.0)
        gate = 1.0
        if HAS_GATE:
            gate = tl.load(gate_ptr)
        dq = tl.zeros((BD,), tl.float32)
        for tile in range(pid, tl.cdiv(T, BT), tl.num_programs(0)):
            rows = tile * BT + tl.arange(0, BT)
            rmask = rows < T
            mask = rmask[:, None] & cmask[None, :]
            offs = rows.to(tl.int64)[:, None] * d + cols[None, :]
            g = tl.load(grad_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            # loop 1: da_j = <grad, r or v_i>, s = sum_j a_j gate da_j
            da0 = tl.sum(g * tl.load(r_ptr + offs, mask=mask, other=0.0), 1)
            a0 = tl.load(a_ptr + rows, mask=rmask, other=0.0)
            tl.store(da_ptr + rows, da0, mask=rmask)
            s = a0 * gate * da0
            for i in tl.range(K, num_stages=STAGES):
                src = tl.load(src_ptrs + i).to(tl.pointer_type(DT))
                v = tl.load(src + offs, mask=mask, other=0.0).to(tl.float32)
                da = tl.sum(g * v, 1)
                tl.store(da_ptr + (1 + i) * T + rows, da, mask=rmask)
                s += tl.load(a_ptr + (1 + i) * T + rows, mask=rmask, other=0.0) * gate * da
            tl.store(dlog_ptr + rows, a0 * (gate * da0 - s), mask=rmask)  # d lse_k
            # loop 2: the query's gradient per program, and each in-group source's share of its gradient,
            # w g + c q + e v, as its w, c, e (group_router._Merge: added by the merge of the source's next router)
            for i in tl.range(K, num_stages=STAGES):
                src = tl.load(src_ptrs + i).to(tl.pointer_type(DT))
                v = tl.load(src + offs, mask=mask, other=0.0).to(tl.float32)
                a = tl.load(a_ptr + (1 + i) * T + rows, mask=rmask, other=0.0)
                dl = a * (gate * tl.sum(g * v, 1) - s)
                tl.store(dlog_ptr + (1 + i) * T + rows, dl, mask=rmask)
                iv = tl.load(inv_ptr + i * T + rows, mask=rmask, other=0.0)
                z = tl.load(z_ptr + i * T + rows, mask=rmask, other=0.0)
                c = dl * iv
                e = -dl * z * iv * iv / d
                dq += tl.sum(c[:, None] * v, 0)
                wi = gate * a
                if UNIT:
                    wi += 1.0
                tl.store(coef_ptr + i * T + rows, wi, mask=rmask)
                tl.store(coef_ptr + (K + i) * T + rows, c, mask=rmask)
                tl.store(coef_ptr + (2 * K + i) * T + rows, e, mask=rmask)
            # the newest in-group source's gradient into its sink: this merge's share (as loop 2 computes it) and the
            # L later merges' deferred shares (their output gradients, queries and w, c, e rows)
            if K > 0:
                src = tl.load(src_ptrs + K - 1).to(tl.pointer_type(DT))
                v = tl.load(src + offs, mask=mask, other=0.0).to(tl.float32)
                a = tl.load(a_ptr + K * T + rows, mask=rmask, other=0.0)
                dl = a * (gate * tl.sum(g * v, 1) - s)
                iv = tl.load(inv_ptr + (K - 1) * T + rows, mask=rmask, other=0.0)
                z = tl.load(z_ptr + (K - 1) * T + rows, mask=rmask, other=0.0)
                c = dl * iv
                e = -dl * z * iv * iv / d
                wi = gate * a
                if UNIT:
                    wi += 1.0
                gv = wi[:, None] * g + c[:, None] * q[None, :]
                ev = e  # the later merges' e_m multiply the same v: their sum scales it once
                for j in range(L):
                    gm = tl.load(tl.load(lg_ptrs + j).to(tl.pointer_type(GDT)) + offs, mask=mask, other=0.0)
                    qm = tl.load(tl.load(lq_ptrs + j).to(tl.pointer_type(tl.float32)) + cols, mask=cmask, other=0.0)
                    wm = tl.load(tl.load(lw_ptrs + j).to(tl.pointer_type(tl.float32)) + rows, mask=rmask, other=0.0)
                    cm = tl.load(tl.load(lc_ptrs + j).to(tl.pointer_type(tl.float32)) + rows, mask=rmask, other=0.0)
                    ev += tl.load(tl.load(le_ptrs + j).to(tl.pointer_type(tl.float32)) + rows, mask=rmask, other=0.0)
                    gv += wm[:, None] * gm.to(tl.float32) + cm[:, None] * qm[None, :]
                gv += ev[:, None] * v
                flag = tl.load(flag_ptr)
                tgt = tl.load(tgt_ptrs).to(tl.pointer_type(DT))
                acc = tl.load(acc_ptrs).to(tl.pointer_type(DT))
                gv += tl.load(acc + offs, mask=mask & (flag == 2), other=0.0).to(tl.float32)
                tl.store(tgt + offs, gv.to(DT), mask=mask & (flag > 0))
        tl.store(part_q_ptr + pid * BD + cols, dq)

    @triton.jit
    def _final_sum(src_ptrs, x_ptr, T, d, N, DT: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr,
                   STAGES: tl.constexpr):
        pid = tl.program_id(0)
        rows = pid * BT + tl.arange(0, BT)
        cols = tl.arange(0, BD)
        mask = (rows < T)[:, None] & (cols < d)[None, :]
        offs = rows.to(tl.int64)[:, None] * d + cols[None, :]
        total = tl.zeros((BT, BD), tl.float32)
        for i in tl.range(N, num_stages=STAGES):
            src = tl.load(src_ptrs + i).to(tl.pointer_type(DT))
            total += tl.load(src + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(x_ptr + offs, total.to(DT), mask=mask)

    return _old_forward, _old_backward, _merge_forward, _merge_backward, _final_sum


_kernels = cpu_kernels.BuildOnce(_build, catch=Exception, fail=triton_router.unavailable)


# ---------------------------------------------------------------------------------------- launching
def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _tile(d: int, S: int = 1) -> Tuple[int, int, int, int]:
    """(tokens per program, padded S, padded hidden size, warps): at most TILE_ELEMENTS fp32 values per
    [tokens, S, hidden] tile, or one token where S x hidden alone is more (then 16 warps: triton_router.warps_for).
    Not tuned on a GPU yet."""
    sp, bd = _pow2(S), _pow2(d)
    bt = max(1, min(TOKENS_PER_PROGRAM, TILE_ELEMENTS // (sp * bd)))
    return bt, sp, bd, triton_router.warps_for(bt * sp * bd)


def _table(tensors: Sequence[Optional[Tensor]], fill: Tensor, size: Optional[int] = None) -> List[int]:
    """A pointer table's entries: a None entry (masked in the kernel) and the padding to ``size`` point at
    ``fill``, a valid address. A launch sends all its tables in one copy (triton_router.device_tables)."""
    ptrs = triton_router.addresses(tensors, fill.data_ptr())
    return ptrs + [fill.data_ptr()] * max(0, (size or len(ptrs)) - len(ptrs))


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def old_forward(values: Sequence[Tensor], Q: Tensor, eps: float, null_logits: Optional[Tensor],
                null_values: Optional[Tensor], inv: Tensor, z: Tensor, p: Tensor, lse: Tensor, r: Tensor,
                x: Optional[Tensor], u0: Optional[Tensor] = None) -> None:
    """The old pass (as group_kernels.old_forward): values n x [T, d] (contiguous, one dtype), Q [S, d] fp32,
    null [S] and [S, d] (or None); writes inv [n, T], z and p [S, M, T], lse [S, T], r [S, T, d] and x [T, d];
    with ``u0`` (group_router._OldPass's first_u) r holds r_1 .. r_{S-1} and u0 = r_0 (+ x) in its dtype. A
    contiguous tensor may have any shape of T x d elements (the kernel reads addresses)."""
    fwd = load()[0]
    T, d = inv.shape[1], values[0].shape[-1]
    S = Q.shape[0]
    has_null = null_values is not None
    bt, sp, bd, warps = _tile(d, S)
    Qf = Q.float().contiguous()
    nl = null_logits.float().contiguous() if has_null else Qf
    nv = null_values.float().contiguous() if has_null else Qf
    src_ptrs, = triton_router.device_tables(_table(values, values[0]), device=values[0].device)
    fwd[(_cdiv(T, bt),)](src_ptrs, Qf, nl, nv, inv, z, lse, r if r.numel() else inv, x if x is not None else inv,
                         u0 if u0 is not None else inv, T, d,
                         float(eps), N=len(values), M=len(values) + int(has_null), S=S, SP=sp, HAS_NULL=has_null,
                         UNIT=x is not None, FIRST_U=int(u0 is not None),
                         DT=triton_router._tl_dtype(values[0].dtype), BT=bt, BD=bd, STAGES=PIPELINE_STAGES,
                         num_warps=warps)
    torch.exp(z - lse.unsqueeze(1), out=p)  # the softmax weights, from the logits and lse ([S, M, T]: small)


def old_backward(G: Sequence[Tensor], ks: Sequence[int], w: Tensor, dlse: Tensor, values: Sequence[Tensor],
                 inv: Tensor, z: Tensor, p: Tensor, Q: Tensor, null_values: Optional[Tensor],
                 targets: List[Tuple[Optional[Tensor], bool, Optional[Tensor]]], unit: bool,
                 dz: Tensor, received=None) -> Tuple[Tensor, Optional[Tensor]]:
    """The old pass's backward (as group_kernels.old_backward; G[j]: router ks[j]'s output gradient, one dtype,
    contiguous; ``received``: the next group's deferred share, its output gradients in G's dtype). Returns the
    query gradients [S, d] and, with a null source, the null values' [S, d] (else None):
    the sums of the programs' partials, no buffer filled by a copy. Shapes as :func:`old_forward`'s."""
    bwd = load()[1]
    T, d = inv.shape[1], values[0].shape[-1]
    S = Q.shape[0]
    bt, sp, bd, warps = _tile(d, S)
    programs = triton_router.reducing_programs(_cdiv(T, bt), values[0].device)
    grads: List[Optional[Tensor]] = [None] * S
    for k, g in zip(ks, G):
        grads[k] = g
    has_null = null_values is not None
    dev = values[0].device
    part_q = torch.empty(programs, sp, bd, dtype=torch.float32, device=dev)
    part_null = torch.empty(programs if has_null else 1, sp, bd, dtype=torch.float32, device=dev)
    Qf = Q.float().contiguous()
    fill = G[0] if G else values[0]
    flags = [0 if t is None else (1 if fresh else 2) for t, fresh, _ in targets]
    accs = [t if seed is None else seed for t, _, seed in targets]
    g2 = list(received.grads) if received is not None else []
    g_ptrs, g_flags, src_ptrs, tgt_ptrs, acc_ptrs, tgt_flags, g2_ptrs = triton_router.device_tables(
        _table(grads, fill, sp), [int(g is not None) for g in grads] + [0] * (sp - S), _table(values, values[0]),
        _table([t for t, _, _ in targets], values[0]), _table(accs, values[0]), flags, _table(g2, fill, 1),
        device=dev)
    bwd[(programs,)](g_ptrs, g_flags, w, dlse, src_ptrs, tgt_ptrs, acc_ptrs, tgt_flags, inv, z, p, Qf,
                     null_values.float().contiguous() if has_null else Qf, dz,
                     part_q, part_null, g2_ptrs,
                     *((received.A, received.C, received.Q, received.E) if received is not None else (dz,) * 4),
                     T, d, N=len(values), M=len(values) + int(has_null), K2=len(g2),
                     S2=0 if received is None else received.C.shape[0], S=S, SP=sp,
                     HAS_NULL=has_null, UNIT=bool(unit), RECEIVED=received is not None,
                     DT=triton_router._tl_dtype(values[0].dtype),
                     GDT=triton_router._tl_dtype(fill.dtype), BT=bt, BD=bd, STAGES=PIPELINE_STAGES,
                     num_warps=warps)
    triton_router.record_partials([part_q, part_null if has_null else None])
    return triton_router.summed(part_q, S, d), triton_router.summed(part_null, S, d) if has_null else None


def merge_forward(r: Tensor, lse: Tensor, x: Optional[Tensor], base: Optional[Tensor], gate: Optional[Tensor],
                  q: Tensor, values: Sequence[Tensor], eps: float, unit: bool, inv: Tensor, z: Tensor, a: Tensor,
                  out: Tensor) -> None:
    """The merge of one router (as group_kernels.merge_forward; ``gate``: a 1-element tensor or None, read on
    the device; ``out`` in the output dtype)."""
    fwd = load()[2]
    T, d = r.shape
    bt, _, bd, warps = _tile(d)
    g = gate.detach().float().reshape(1) if gate is not None else lse
    src_ptrs, = triton_router.device_tables(_table(values, r), device=r.device)
    fwd[(_cdiv(T, bt),)](r, lse.contiguous(), x if x is not None else r, base if base is not None else r, g,
                         q.float().contiguous(), src_ptrs, inv, z, a, out, T, d, float(eps), K=len(values),
                         HAS_X=x is not None, HAS_BASE=base is not None, HAS_GATE=gate is not None, UNIT=bool(unit),
                         DT=triton_router._tl_dtype(values[0].dtype if values else r.dtype), BT=bt, BD=bd,
                         STAGES=PIPELINE_STAGES, num_warps=warps)


def merge_backward(grad: Tensor, r: Tensor, gate: Optional[Tensor], q: Tensor, values: Sequence[Tensor],
                   inv: Tensor, z: Tensor, a: Tensor, unit: bool,
                   target: Tuple[Optional[Tensor], bool, Optional[Tensor]],
                   later: Sequence[tuple], coef: Tensor,
                   da: Tensor, dlog: Tensor) -> Tensor:
    """The merge's backward (as group_kernels.merge_backward: the newest in-group source's ``target``, the later
    merges' shares ``later`` (group_router.DeferredShare), each source's w, c, e into ``coef``); returns the query's
    gradient [d], the sum of the programs' partials."""
    bwd = load()[3]
    T, d = r.shape
    bt, _, bd, warps = _tile(d)
    programs = triton_router.reducing_programs(_cdiv(T, bt), r.device)
    part_q = torch.empty(programs, bd, dtype=torch.float32, device=r.device)
    g = gate.detach().float().reshape(1) if gate is not None else r
    t, fresh, seed = target
    flag = 0 if t is None else (1 if fresh else 2)
    acc = t if seed is None else seed
    tables = triton_router.device_tables(
        _table(values, r), _table([t], r), _table([acc], r), [flag], _table([x.grad for x in later], r),
        _table([x.q for x in later], r), *[[x.address(j) for x in later] for j in range(3)], device=r.device)
    bwd[(programs,)](grad, r, g, q.float().contiguous(), *tables, inv, z, a, coef, da, dlog, part_q, T, d,
                     K=len(values), L=len(later), UNIT=bool(unit), HAS_GATE=gate is not None,
                     DT=triton_router._tl_dtype(values[0].dtype if values else r.dtype),
                     GDT=triton_router._tl_dtype(grad.dtype), BT=bt, BD=bd, STAGES=PIPELINE_STAGES, num_warps=warps)
    triton_router.record_partials([part_q])
    return triton_router.summed(part_q, d)


def final_sum(values: Sequence[Tensor], x: Tensor) -> None:
    """x = the sum of the sources (as group_kernels.final_sum; fp32 accumulation, x in the sources' dtype)."""
    T, d = x.shape
    bt, _, bd, warps = _tile(d)
    src_ptrs, = triton_router.device_tables(_table(values, x), device=x.device)
    load()[4][(_cdiv(T, bt),)](src_ptrs, x, T, d, N=len(values), DT=triton_router._tl_dtype(x.dtype),
                               BT=bt, BD=bd, STAGES=PIPELINE_STAGES, num_warps=warps)


class _SeededSum(torch.autograd.Function):
    """x = the sum of the sources in one pass (:func:`final_sum`), where x is handed out as the sum of the sources
    (delta_block, delta with S = 1) and the scope's routers run on the per-router Triton kernels. In backward x's
    gradient seeds the KernelSink of every source that has one, by reference (no pass): the source keeps one
    autograd reader (its sink token), so autograd adds nothing, and the sink's first writer reads the seed as it
    writes (triton_router.BlockDeferral.flush; a router call copies it first). The other sources get it as is."""

    @staticmethod
    def forward(ctx, sinks, *values):
        ctx.set_materialize_grads(False)
        ctx.sinks = sinks
        shape = values[0].shape
        flat = [v.reshape(-1, shape[-1]) for v in values]
        x = torch.empty_like(flat[0])
        final_sum(flat, x)
        traffic.record("x_sum", "forward", flat, [x])
        return x.view(shape)

    @staticmethod
    def backward(ctx, grad):
        if grad is None:
            return (None,) * (1 + len(ctx.sinks))
        return (None, *router.seed_sinks(ctx.sinks, grad))


def sum_seeding_sinks(values: Sequence[Tensor], sinks: Sequence[Optional["triton_router.KernelSink"]]
                      ) -> Optional[Tensor]:
    """x = the sum of ``values`` in order, one pass, its gradient seeding ``sinks`` (:class:`_SeededSum`); None
    where the final-sum kernel cannot take the values (several dtypes or devices, non-contiguous, not Triton's)."""
    if (len(values) < 2 or len({(v.dtype, v.device) for v in values}) != 1 or not all(v.is_contiguous() for v in values)
            or not eligible("triton", list(values))):
        return None
    return _SeededSum.apply(list(sinks), *values)
