"""Flash multi-head self-attention in the Triton language, launched from JAX with ``jax_triton.triton_call``.

Same contract as ``flash_pallas`` (see ``api.flash_attention``): q [batch, seq, heads, head_dim],
k, v [batch, seq, kv_heads, head_dim], output [batch, seq, heads, head_dim] in q's dtype, differentiable through
``jax.custom_vjp``. GPU only.

This is the road JAX's own deprecation note for the Pallas Triton backend points to (official Triton + jax-triton),
kept beside the Pallas kernel so that either can carry on if the other's toolchain moves.

Kernels (FlashAttention-2, contiguous [B, S, H, D] layouts, base-2 exponentials), each with its own tiles, warps
and stages (``jaxtrain.kernels.tiling``):
  * ``_fwd_kernel``: grid (query tiles, batch*heads), the query tile on the fastest axis so that programs running
    together share K/V in L2, reversed under causal so the longest rows start first; online softmax over kv tiles
    with float32 accumulators; writes o and the base-2 log-sum-exp [B, H, S]. Causal: tiles above the diagonal are
    never visited (loop bound), the unmasked tiles run first and only the diagonal ones are masked.
  * ``_dq_kernel``: grid (query tiles, batch*heads), same order; loops over kv tiles.
  * ``_dkdv_kernel``: grid (kv tiles, batch*kv_heads*splits); loops over query heads of the group and their query
    tiles, so dk and dv are summed over the heads that share a kv head in registers. It works on S transposed
    ([kv, q]): P^T and dS^T come out of the matmuls in the layout the next matmul takes, with no transpose through
    shared memory; the unmasked query tiles run before the masked diagonal ones. When there are too few kv tiles x
    kv heads to fill the GPU (tensor parallelism leaves few kv heads per device), the group is split over
    ``splits`` programs that write float32 partial sums, added by XLA.
  * document masking: with segment ids, XLA computes per tile the range of tiles on the other side whose ids can
    match (``tiling.segment_tile_ranges``); the loops cover only that range, so other documents' tiles are skipped.
  * ``delta = rowsum(o * do)`` is an elementwise product and a float32 sum in XLA.
Any sequence length: loads and stores are masked (constexpr ``EVEN`` skips the masks when the tiles divide the
sequence). Masked logits take a large finite negative value, so no row ever computes ``exp(-inf + inf)``. Float32
inputs use exact float32 dots (``input_precision="ieee"``), never TF32.

``triton`` and ``jax_triton`` are imported only when a kernel is launched, so this module imports without them.
The kernel bodies are module-level functions wrapped with ``triton.jit`` on first use (``_kernels``): Triton's
interpreter (TRITON_INTERPRET=1, used by the tests on CPU) resolves ``tl`` and helper kernels through the module
globals, so they are bound there rather than in a closure.
"""

from __future__ import annotations

import functools
import types

import numpy as np

# The launch settings are part of this module's interface (re-exported for callers and tests).
from jaxtrain.kernels.triton_launch import SUPPORTED_HEAD_DIMS as SUPPORTED_HEAD_DIMS
from jaxtrain.kernels.triton_launch import CallConfig, call_config

MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)


# --------------------------------------------------------------------------------------------------------------
# Kernel bodies (Triton language). Wrapped with triton.jit by _kernels(), which also binds these names:
# --------------------------------------------------------------------------------------------------------------

tl = None  # triton.language
_TL_MASK_VALUE = None  # tl.constexpr(MASK_VALUE)
_fwd_inner = _dq_inner = _dkdv_inner = _shifted = _causal_key_bounds = None  # the jitted *_src helpers


def _shifted_src(x, OFFS, SHIFT: tl.constexpr, DYN_SHIFT: tl.constexpr):
    # x + (q_offset - kv_offset): a compile-time constant (0 adds nothing), or read from the int32 operand.
    if DYN_SHIFT:
        return x + tl.load(OFFS)
    else:
        return x + SHIFT


def _causal_key_bounds_src(start_q, OFFS, hi, SEQ: tl.constexpr, SEQ_K: tl.constexpr, BLOCK_Q: tl.constexpr,
                           BLOCK_K: tl.constexpr, SHIFT: tl.constexpr, DYN_SHIFT: tl.constexpr, EVEN: tl.constexpr):
    # For query tile start_q under the causal mask: keys below full_hi need no mask (at or below the tile's first
    # query position), keys in [full_hi, diag_hi) need it, keys from diag_hi on are hidden from every query of the
    # tile and never loaded.
    first = _shifted(start_q * BLOCK_Q, OFFS, SHIFT, DYN_SHIFT)
    if DYN_SHIFT or SHIFT < 0:  # a query tile may lie before every key: clamp before the division
        full_hi = tl.minimum((tl.maximum(first + 1, 0) // BLOCK_K) * BLOCK_K, hi)
    else:
        full_hi = tl.minimum(((first + 1) // BLOCK_K) * BLOCK_K, hi)
    if (not EVEN) and (DYN_SHIFT or SHIFT != 0 or SEQ != SEQ_K):
        # Offsets can put the diagonal past the keys: a partial last key tile needs the padding mask.
        full_hi = tl.minimum(full_hi, (SEQ_K // BLOCK_K) * BLOCK_K)
    return full_hi, tl.minimum(first + BLOCK_Q, hi)


def _fwd_inner_src(acc, m_i, l_i, q, q_seg, offs_q, k_base, v_base, seg_base, lo, hi,
                   SEQ_K: tl.constexpr, KVH: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_K: tl.constexpr,
                   HAS_SEG: tl.constexpr, ON_DIAG: tl.constexpr, EVEN: tl.constexpr, QK_SCALE: tl.constexpr,
                   INPUT_PRECISION: tl.constexpr):
    offs_d = tl.arange(0, HEAD_DIM)
    for start_k in range(lo, hi, BLOCK_K):
        start_k = tl.multiple_of(start_k, BLOCK_K)
        offs_k = start_k + tl.arange(0, BLOCK_K)
        ptrs = offs_k[:, None] * (KVH * HEAD_DIM) + offs_d[None, :]
        if EVEN:
            k = tl.load(k_base + ptrs)
            v = tl.load(v_base + ptrs)
        else:
            k = tl.load(k_base + ptrs, mask=offs_k[:, None] < SEQ_K, other=0.0)
            v = tl.load(v_base + ptrs, mask=offs_k[:, None] < SEQ_K, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=INPUT_PRECISION) * QK_SCALE
        valid = tl.full((BLOCK_K,), 1, tl.int1)[None, :]
        if not EVEN:
            valid = valid & (offs_k[None, :] < SEQ_K)
        if ON_DIAG:
            valid = valid & (offs_q[:, None] >= offs_k[None, :])
        if HAS_SEG:
            k_seg = tl.load(seg_base + offs_k, mask=offs_k < SEQ_K, other=-1)
            valid = valid & (q_seg[:, None] == k_seg[None, :])
        if (not EVEN) or ON_DIAG or HAS_SEG:
            s = tl.where(valid, s, _TL_MASK_VALUE)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=INPUT_PRECISION)
        m_i = m_new
    return acc, m_i, l_i


def _fwd_kernel_src(Q, K, V, SEG, SEGK, RANGES, OFFS, O, LSE,
                    SEQ: tl.constexpr, SEQ_K: tl.constexpr, SHIFT: tl.constexpr, DYN_SHIFT: tl.constexpr,
                    EMPTY_ROWS: tl.constexpr, H: tl.constexpr, KVH: tl.constexpr, HEAD_DIM: tl.constexpr,
                    BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr, CAUSAL: tl.constexpr, HAS_SEG: tl.constexpr,
                    EVEN: tl.constexpr, QK_SCALE: tl.constexpr, SM_SCALE: tl.constexpr,
                    INPUT_PRECISION: tl.constexpr):
    if CAUSAL:  # longest rows first
        start_q = tl.num_programs(0) - 1 - tl.program_id(0)
    else:
        start_q = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)  # int64: batch offsets overflow int32 at long sequences
    h = bh % H
    kvh = h // (H // KVH)
    offs_q = start_q * BLOCK_Q + tl.arange(0, BLOCK_Q)
    offs_d = tl.arange(0, HEAD_DIM)
    q_ptrs = Q + b * (SEQ * H * HEAD_DIM) + h * HEAD_DIM + offs_q[:, None] * (H * HEAD_DIM) + offs_d[None, :]
    k_base = K + b * (SEQ_K * KVH * HEAD_DIM) + kvh * HEAD_DIM
    v_base = V + b * (SEQ_K * KVH * HEAD_DIM) + kvh * HEAD_DIM
    seg_base = SEGK + b * SEQ_K  # the keys' segment ids
    pos_q = _shifted(offs_q, OFFS, SHIFT, DYN_SHIFT)  # query positions in key positions, for the causal mask
    if EVEN:
        q = tl.load(q_ptrs)
    else:
        q = tl.load(q_ptrs, mask=offs_q[:, None] < SEQ, other=0.0)
    lo = 0
    hi = SEQ_K
    if HAS_SEG:
        q_seg = tl.load(SEG + b * SEQ + offs_q, mask=offs_q < SEQ, other=-1)
        # Only kv tiles whose segment ids can match this tile's (document masking skips the rest).
        range_ptr = RANGES + (b * tl.cdiv(SEQ, BLOCK_Q) + start_q) * 2
        lo = tl.load(range_ptr) * BLOCK_K
        hi = tl.minimum(tl.load(range_ptr + 1) * BLOCK_K, SEQ_K)
    else:
        q_seg = offs_q  # unused placeholder: HAS_SEG is a constexpr
    acc = tl.zeros((BLOCK_Q, HEAD_DIM), tl.float32)
    m_i = tl.full((BLOCK_Q,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_Q,), tl.float32)
    if CAUSAL:
        full_hi, diag_hi = _causal_key_bounds(start_q, OFFS, hi, SEQ, SEQ_K, BLOCK_Q, BLOCK_K, SHIFT, DYN_SHIFT,
                                              EVEN)
        acc, m_i, l_i = _fwd_inner(acc, m_i, l_i, q, q_seg, pos_q, k_base, v_base, seg_base, lo, full_hi,
                                   SEQ_K, KVH, HEAD_DIM, BLOCK_K, HAS_SEG, False, True, QK_SCALE, INPUT_PRECISION)
        acc, m_i, l_i = _fwd_inner(acc, m_i, l_i, q, q_seg, pos_q, k_base, v_base, seg_base,
                                   tl.maximum(full_hi, lo), diag_hi, SEQ_K, KVH, HEAD_DIM, BLOCK_K, HAS_SEG, True,
                                   EVEN, QK_SCALE, INPUT_PRECISION)
    else:
        acc, m_i, l_i = _fwd_inner(acc, m_i, l_i, q, q_seg, pos_q, k_base, v_base, seg_base, lo, hi,
                                   SEQ_K, KVH, HEAD_DIM, BLOCK_K, HAS_SEG, False, EVEN, QK_SCALE, INPUT_PRECISION)
    if EMPTY_ROWS:
        # A row without a visible key kept m at MASK_VALUE (masked entries only) or -inf (no tile visited).
        empty = m_i < 0.5 * _TL_MASK_VALUE
        l_safe = tl.where(empty, 1.0, l_i)
        out = tl.where(empty[:, None], 0.0, acc / l_safe[:, None])
        lse = tl.where(empty, float("-inf"), m_i + tl.math.log2(l_safe))
    else:
        out = acc / l_i[:, None]
        lse = m_i + tl.math.log2(l_i)
    o_ptrs = O + b * (SEQ * H * HEAD_DIM) + h * HEAD_DIM + offs_q[:, None] * (H * HEAD_DIM) + offs_d[None, :]
    lse_ptrs = LSE + (b * H + h) * SEQ + offs_q
    if EVEN:
        tl.store(o_ptrs, out.to(O.dtype.element_ty))
        tl.store(lse_ptrs, lse)
    else:
        tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=offs_q[:, None] < SEQ)
        tl.store(lse_ptrs, lse, mask=offs_q < SEQ)


def _dq_inner_src(dq, q, do, lse, delta, q_seg, offs_q, k_base, v_base, seg_base, lo, hi,
                  SEQ_K: tl.constexpr, KVH: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_K: tl.constexpr,
                  HAS_SEG: tl.constexpr, ON_DIAG: tl.constexpr, EVEN: tl.constexpr, QK_SCALE: tl.constexpr,
                  INPUT_PRECISION: tl.constexpr):
    offs_d = tl.arange(0, HEAD_DIM)
    for start_k in range(lo, hi, BLOCK_K):
        start_k = tl.multiple_of(start_k, BLOCK_K)
        offs_k = start_k + tl.arange(0, BLOCK_K)
        ptrs = offs_k[:, None] * (KVH * HEAD_DIM) + offs_d[None, :]
        if EVEN:
            k = tl.load(k_base + ptrs)
            v = tl.load(v_base + ptrs)
        else:
            k = tl.load(k_base + ptrs, mask=offs_k[:, None] < SEQ_K, other=0.0)
            v = tl.load(v_base + ptrs, mask=offs_k[:, None] < SEQ_K, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=INPUT_PRECISION) * QK_SCALE
        valid = tl.full((BLOCK_K,), 1, tl.int1)[None, :]
        if not EVEN:
            valid = valid & (offs_k[None, :] < SEQ_K)
        if ON_DIAG:
            valid = valid & (offs_q[:, None] >= offs_k[None, :])
        if HAS_SEG:
            k_seg = tl.load(seg_base + offs_k, mask=offs_k < SEQ_K, other=-1)
            valid = valid & (q_seg[:, None] == k_seg[None, :])
        if (not EVEN) or ON_DIAG or HAS_SEG:
            s = tl.where(valid, s, _TL_MASK_VALUE)
        p = tl.math.exp2(s - lse[:, None])
        dp = tl.dot(do, tl.trans(v), input_precision=INPUT_PRECISION)
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(k.dtype), k, input_precision=INPUT_PRECISION)
    return dq


def _dq_kernel_src(Q, K, V, SEG, SEGK, RANGES, OFFS, DO, LSE, DELTA, DQ,
                   SEQ: tl.constexpr, SEQ_K: tl.constexpr, SHIFT: tl.constexpr, DYN_SHIFT: tl.constexpr,
                   EMPTY_ROWS: tl.constexpr, H: tl.constexpr, KVH: tl.constexpr, HEAD_DIM: tl.constexpr,
                   BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr, CAUSAL: tl.constexpr, HAS_SEG: tl.constexpr,
                   EVEN: tl.constexpr, QK_SCALE: tl.constexpr, SM_SCALE: tl.constexpr,
                   INPUT_PRECISION: tl.constexpr):
    if CAUSAL:
        start_q = tl.num_programs(0) - 1 - tl.program_id(0)
    else:
        start_q = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = bh % H
    kvh = h // (H // KVH)
    offs_q = start_q * BLOCK_Q + tl.arange(0, BLOCK_Q)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ptrs = b * (SEQ * H * HEAD_DIM) + h * HEAD_DIM + offs_q[:, None] * (H * HEAD_DIM) + offs_d[None, :]
    stat_ptrs = (b * H + h) * SEQ + offs_q
    k_base = K + b * (SEQ_K * KVH * HEAD_DIM) + kvh * HEAD_DIM
    v_base = V + b * (SEQ_K * KVH * HEAD_DIM) + kvh * HEAD_DIM
    seg_base = SEGK + b * SEQ_K
    pos_q = _shifted(offs_q, OFFS, SHIFT, DYN_SHIFT)
    if EVEN:
        q = tl.load(Q + row_ptrs)
        do = tl.load(DO + row_ptrs)
        lse = tl.load(LSE + stat_ptrs)
        delta = tl.load(DELTA + stat_ptrs)
    else:
        q = tl.load(Q + row_ptrs, mask=offs_q[:, None] < SEQ, other=0.0)
        do = tl.load(DO + row_ptrs, mask=offs_q[:, None] < SEQ, other=0.0)
        lse = tl.load(LSE + stat_ptrs, mask=offs_q < SEQ, other=0.0)
        delta = tl.load(DELTA + stat_ptrs, mask=offs_q < SEQ, other=0.0)
    lo = 0
    hi = SEQ_K
    if HAS_SEG:
        q_seg = tl.load(SEG + b * SEQ + offs_q, mask=offs_q < SEQ, other=-1)
        range_ptr = RANGES + (b * tl.cdiv(SEQ, BLOCK_Q) + start_q) * 2
        lo = tl.load(range_ptr) * BLOCK_K
        hi = tl.minimum(tl.load(range_ptr + 1) * BLOCK_K, SEQ_K)
    else:
        q_seg = offs_q
    dq = tl.zeros((BLOCK_Q, HEAD_DIM), tl.float32)
    if CAUSAL:
        full_hi, diag_hi = _causal_key_bounds(start_q, OFFS, hi, SEQ, SEQ_K, BLOCK_Q, BLOCK_K, SHIFT, DYN_SHIFT,
                                              EVEN)
        dq = _dq_inner(dq, q, do, lse, delta, q_seg, pos_q, k_base, v_base, seg_base, lo, full_hi,
                       SEQ_K, KVH, HEAD_DIM, BLOCK_K, HAS_SEG, False, True, QK_SCALE, INPUT_PRECISION)
        dq = _dq_inner(dq, q, do, lse, delta, q_seg, pos_q, k_base, v_base, seg_base, tl.maximum(full_hi, lo),
                       diag_hi, SEQ_K, KVH, HEAD_DIM, BLOCK_K, HAS_SEG, True, EVEN, QK_SCALE, INPUT_PRECISION)
    else:
        dq = _dq_inner(dq, q, do, lse, delta, q_seg, pos_q, k_base, v_base, seg_base, lo, hi,
                       SEQ_K, KVH, HEAD_DIM, BLOCK_K, HAS_SEG, False, EVEN, QK_SCALE, INPUT_PRECISION)
    dq = dq * SM_SCALE
    if EVEN:
        tl.store(DQ + row_ptrs, dq.to(DQ.dtype.element_ty))
    else:
        tl.store(DQ + row_ptrs, dq.to(DQ.dtype.element_ty), mask=offs_q[:, None] < SEQ)


def _dkdv_inner_src(dk, dv, k, v, k_seg, offs_k, pos_k, q_base, do_base, lse_base, delta_base, seg_base, lo, hi,
                    SEQ: tl.constexpr, SEQ_K: tl.constexpr, H: tl.constexpr, HEAD_DIM: tl.constexpr,
                    BLOCK_Q: tl.constexpr, HAS_SEG: tl.constexpr, ON_DIAG: tl.constexpr, EVEN: tl.constexpr,
                    QK_SCALE: tl.constexpr, INPUT_PRECISION: tl.constexpr, WANT_DK: tl.constexpr,
                    WANT_DV: tl.constexpr):
    # Transposed: rows are this program's keys, columns the visited queries. pos_k: the keys' positions in query
    # positions (offs_k - shift), for the causal mask.
    offs_d = tl.arange(0, HEAD_DIM)
    for start_q in range(lo, hi, BLOCK_Q):
        start_q = tl.multiple_of(start_q, BLOCK_Q)
        offs_q = start_q + tl.arange(0, BLOCK_Q)
        ptrs = offs_q[:, None] * (H * HEAD_DIM) + offs_d[None, :]
        if EVEN:
            q = tl.load(q_base + ptrs)
            do = tl.load(do_base + ptrs)
            lse = tl.load(lse_base + offs_q)
            delta = tl.load(delta_base + offs_q)
        else:
            q = tl.load(q_base + ptrs, mask=offs_q[:, None] < SEQ, other=0.0)
            do = tl.load(do_base + ptrs, mask=offs_q[:, None] < SEQ, other=0.0)
            lse = tl.load(lse_base + offs_q, mask=offs_q < SEQ, other=0.0)
            delta = tl.load(delta_base + offs_q, mask=offs_q < SEQ, other=0.0)
        s_t = tl.dot(k, tl.trans(q), input_precision=INPUT_PRECISION) * QK_SCALE  # [BLOCK_K, BLOCK_Q]
        valid = tl.full((BLOCK_Q,), 1, tl.int1)[None, :]
        if not EVEN:
            valid = valid & (offs_q[None, :] < SEQ) & (offs_k[:, None] < SEQ_K)
        if ON_DIAG:
            valid = valid & (offs_q[None, :] >= pos_k[:, None])
        if HAS_SEG:
            q_seg = tl.load(seg_base + offs_q, mask=offs_q < SEQ, other=-1)
            valid = valid & (k_seg[:, None] == q_seg[None, :])
        if (not EVEN) or ON_DIAG or HAS_SEG:
            s_t = tl.where(valid, s_t, _TL_MASK_VALUE)
        p_t = tl.math.exp2(s_t - lse[None, :])
        if WANT_DV:
            dv += tl.dot(p_t.to(do.dtype), do, input_precision=INPUT_PRECISION)
        if WANT_DK:
            dp_t = tl.dot(v, tl.trans(do), input_precision=INPUT_PRECISION)
            ds_t = p_t * (dp_t - delta[None, :])
            dk += tl.dot(ds_t.to(q.dtype), q, input_precision=INPUT_PRECISION)
    return dk, dv


def _dkdv_kernel_src(Q, K, V, SEG, SEGK, RANGES, OFFS, DO, LSE, DELTA, DK, DV,
                     SEQ: tl.constexpr, SEQ_K: tl.constexpr, SHIFT: tl.constexpr, DYN_SHIFT: tl.constexpr,
                     EMPTY_ROWS: tl.constexpr, H: tl.constexpr, KVH: tl.constexpr, HEAD_DIM: tl.constexpr,
                     BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr, CAUSAL: tl.constexpr, HAS_SEG: tl.constexpr,
                     EVEN: tl.constexpr, QK_SCALE: tl.constexpr, SM_SCALE: tl.constexpr,
                     INPUT_PRECISION: tl.constexpr, SPLITS: tl.constexpr, WANT_DK: tl.constexpr,
                     WANT_DV: tl.constexpr):
    # kv tile 0 sees the most query tiles under causal: the natural order already starts with the heaviest.
    start_k = tl.program_id(0) * BLOCK_K
    pid = tl.program_id(1)
    split = pid % SPLITS
    bkv = pid // SPLITS
    b = (bkv // KVH).to(tl.int64)
    kvh = bkv % KVH
    GROUP: tl.constexpr = H // KVH
    PER_SPLIT: tl.constexpr = GROUP // SPLITS
    offs_k = start_k + tl.arange(0, BLOCK_K)
    offs_d = tl.arange(0, HEAD_DIM)
    kv_ptrs = b * (SEQ_K * KVH * HEAD_DIM) + kvh * HEAD_DIM + offs_k[:, None] * (KVH * HEAD_DIM) + offs_d[None, :]
    if EVEN:
        k = tl.load(K + kv_ptrs)
        v = tl.load(V + kv_ptrs)
    else:
        k = tl.load(K + kv_ptrs, mask=offs_k[:, None] < SEQ_K, other=0.0)
        v = tl.load(V + kv_ptrs, mask=offs_k[:, None] < SEQ_K, other=0.0)
    seg_base = SEG + b * SEQ  # the queries' segment ids
    neg = -_shifted(0, OFFS, SHIFT, DYN_SHIFT)
    pos_k = offs_k + neg  # the keys in query positions: query i sees key j when i >= j - shift
    lo = 0
    hi = SEQ
    if HAS_SEG:
        k_seg = tl.load(SEGK + b * SEQ_K + offs_k, mask=offs_k < SEQ_K, other=-1)
        range_ptr = RANGES + (b * tl.cdiv(SEQ_K, BLOCK_K) + tl.program_id(0)) * 2
        lo = tl.load(range_ptr) * BLOCK_Q
        hi = tl.minimum(tl.load(range_ptr + 1) * BLOCK_Q, SEQ)
    else:
        k_seg = offs_k
    dk = tl.zeros((BLOCK_K, HEAD_DIM), tl.float32)
    dv = tl.zeros((BLOCK_K, HEAD_DIM), tl.float32)
    if CAUSAL:
        # Query tiles wholly before this kv tile (in query positions) are skipped, never loaded; those wholly
        # after it need no causal mask.
        first = start_k + neg
        last = start_k + neg + BLOCK_K - 1
        if DYN_SHIFT or SHIFT > 0:  # the key tile may lie before every query: clamp before the divisions
            first = tl.maximum(first, 0)
            last = tl.maximum(last, 0)
        diag_lo = tl.maximum((first // BLOCK_Q) * BLOCK_Q, lo)
        full_lo = tl.maximum(tl.minimum(((last + BLOCK_Q - 1) // BLOCK_Q) * BLOCK_Q, hi), lo)
    else:
        diag_lo = lo
        full_lo = lo
    for g in range(PER_SPLIT):
        # The query heads of this kv head accumulate into the same dk/dv: the GQA sum, in registers.
        h = kvh * GROUP + split * PER_SPLIT + g
        q_base = Q + b * (SEQ * H * HEAD_DIM) + h * HEAD_DIM
        do_base = DO + b * (SEQ * H * HEAD_DIM) + h * HEAD_DIM
        lse_base = LSE + (b * H + h) * SEQ
        delta_base = DELTA + (b * H + h) * SEQ
        # Unmasked tiles first, then the masked diagonal ones.
        dk, dv = _dkdv_inner(dk, dv, k, v, k_seg, offs_k, pos_k, q_base, do_base, lse_base, delta_base,
                             seg_base, full_lo, hi, SEQ, SEQ_K, H, HEAD_DIM, BLOCK_Q, HAS_SEG, False, EVEN, QK_SCALE,
                             INPUT_PRECISION, WANT_DK, WANT_DV)
        if CAUSAL:
            dk, dv = _dkdv_inner(dk, dv, k, v, k_seg, offs_k, pos_k, q_base, do_base, lse_base, delta_base,
                                 seg_base, diag_lo, full_lo, SEQ, SEQ_K, H, HEAD_DIM, BLOCK_Q, HAS_SEG, True, EVEN,
                                 QK_SCALE, INPUT_PRECISION, WANT_DK, WANT_DV)
    dk = dk * SM_SCALE
    if SPLITS > 1:  # float32 partial sums, one slab per split: [SPLITS, B, S, KVH, D]
        part = split.to(tl.int64) * (tl.num_programs(1) // SPLITS) * (SEQ_K * HEAD_DIM)
        kv_ptrs = kv_ptrs + part
    if WANT_DK:
        if EVEN:
            tl.store(DK + kv_ptrs, dk.to(DK.dtype.element_ty))
        else:
            tl.store(DK + kv_ptrs, dk.to(DK.dtype.element_ty), mask=offs_k[:, None] < SEQ_K)
    if WANT_DV:
        if EVEN:
            tl.store(DV + kv_ptrs, dv.to(DV.dtype.element_ty))
        else:
            tl.store(DV + kv_ptrs, dv.to(DV.dtype.element_ty), mask=offs_k[:, None] < SEQ_K)


@functools.cache
def _kernels() -> types.SimpleNamespace:
    """Import Triton and wrap the kernel bodies with ``triton.jit`` (once). Raises ImportError without Triton."""
    import triton
    import triton.language

    g = globals()
    g["tl"] = triton.language
    g["_TL_MASK_VALUE"] = triton.language.constexpr(MASK_VALUE)  # Triton reads only constexpr globals
    # The kernels call the helpers by these global names.
    g["_fwd_inner"] = triton.jit(_fwd_inner_src)
    g["_dq_inner"] = triton.jit(_dq_inner_src)
    g["_dkdv_inner"] = triton.jit(_dkdv_inner_src)
    g["_shifted"] = triton.jit(_shifted_src)
    g["_causal_key_bounds"] = triton.jit(_causal_key_bounds_src)
    return types.SimpleNamespace(
        fwd=triton.jit(_fwd_kernel_src), dq=triton.jit(_dq_kernel_src), dkdv=triton.jit(_dkdv_kernel_src)
    )


# --------------------------------------------------------------------------------------------------------------
# Launch sequence, written against a `launch` callable so the same call configuration runs under jax-triton (GPU)
# or Triton's CPU interpreter (tests): launch(kernel, inputs, out_shapes [(shape, dtype)], grid, constexprs, num_warps,
# num_stages) -> list of outputs.
# --------------------------------------------------------------------------------------------------------------


def _ranges_arg(call: CallConfig, seg, seg_k, kind: str):
    """The RANGES operand: document-mask tile ranges with segments, else a one-element dummy never read."""
    if call.has_segments:
        return call.tile_ranges(seg, kind, seg_k)
    return seg  # the [1] int32 dummy


def _operands(call: CallConfig, seg, seg_k, offs):
    """(SEG, SEGK, OFFS): the queries' and keys' segment ids (seg_k None: seg) and the traced shift (offs None:
    a dummy never read, the shift being static)."""
    dummy = seg.reshape(-1)[:1]
    return seg, seg if seg_k is None else seg_k, dummy if offs is None else offs


def run_forward(launch, call: CallConfig, q, k, v, seg, seg_k=None, offs=None):
    """-> (o [B, S, H, D] in call.out_dtype or q's, lse [B, H, S] float32 base 2, -inf for rows without a visible
    key). ``seg`` is int32 [B, S] or a dummy [1]; seg_k int32 [B, Sk] (None: seg); offs int32 [1], the traced
    q_offset - kv_offset (None: static, in ``call``)."""
    grid, meta, lp = call.forward()
    seg, seg_k, offs = _operands(call, seg, seg_k, offs)
    o, lse = launch(_kernels().fwd, (q, k, v, seg, seg_k, _ranges_arg(call, seg, seg_k, "fwd"), offs),
                    [(q.shape, call.out_dtype or q.dtype), ((call.batch, call.heads, call.seq), np.float32)],
                    grid, meta, lp.num_warps, lp.num_stages)
    return o, lse


def run_backward(launch, call: CallConfig, q, k, v, seg, do, lse, delta, seg_k=None, offs=None):
    """-> (dq, dk, dv) in call.grad_dtype or the inputs' dtype. ``delta`` = rowsum(o * do) as float32 [B, H, S];
    ``lse`` base 2, +inf (not -inf) for rows without a visible key so that their p is 0."""
    kern = _kernels()
    grid, meta, lp = call.dq()
    seg, seg_k, offs = _operands(call, seg, seg_k, offs)
    grad_dtype = call.grad_dtype or q.dtype
    (dq,) = launch(kern.dq, (q, k, v, seg, seg_k, _ranges_arg(call, seg, seg_k, "dq"), offs, do, lse, delta),
                   [(q.shape, grad_dtype)], grid, meta, lp.num_warps, lp.num_stages)
    inputs = (q, k, v, seg, seg_k, _ranges_arg(call, seg, seg_k, "dkdv"), offs, do, lse, delta)
    # With splits, float32 partial sums [splits, B, Sk, KVH, D] that XLA adds up.
    outs = [(k.shape, grad_dtype)] * 2 if call.splits == 1 else [((call.splits, *k.shape), np.float32)] * 2
    dk = dv = None
    for grid, meta, lp in call.dkdv():  # a pass leaves the output it does not compute unwritten
        got = launch(kern.dkdv, inputs, outs, grid, meta, lp.num_warps, lp.num_stages)
        dk = got[0] if meta["WANT_DK"] else dk
        dv = got[1] if meta["WANT_DV"] else dv
    if call.splits > 1:
        dk, dv = dk.sum(0).astype(grad_dtype), dv.sum(0).astype(grad_dtype)
    return dq, dk, dv


# --------------------------------------------------------------------------------------------------------------
# JAX side
# --------------------------------------------------------------------------------------------------------------


def availability_error() -> str | None:
    """Why impl='triton' cannot run here, or None when it can (a CUDA GPU, triton and jax_triton importable)."""
    import jax

    try:
        gpus = jax.devices("gpu")
    except RuntimeError:
        gpus = []
    if not gpus:
        return (f"impl='triton' needs a CUDA GPU, but JAX sees none (backend: {jax.default_backend()}); "
                "use impl='pallas' (interpret=True runs it on CPU)")
    for module, hint in (("triton", "pip install triton"), ("jax_triton", "pip install jax-triton")):
        try:
            __import__(module)
        except ImportError as e:
            return f"impl='triton' needs the '{module}' package, which is not importable ({e}); {hint}"
    return None


def _jax_triton_launch(kernel, inputs, out_shapes, grid, meta, num_warps, num_stages):
    import jax
    import jax_triton as jt

    outs = jt.triton_call(
        *inputs, kernel=kernel, out_shape=[jax.ShapeDtypeStruct(s, d) for s, d in out_shapes], grid=grid,
        num_warps=num_warps, num_stages=num_stages, **meta)
    return list(outs)


def _custom_vjp():
    import jax

    from jaxtrain.kernels.flash_pallas import LN2, LOG2E, backward_lse, named_forward, row_dot

    def forward(q, k, v, seg, seg_k, offs, call):
        return run_forward(_jax_triton_launch, call, q, k, v, seg, seg_k, offs)

    @functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
    def attention(q, k, v, seg, seg_k, offs, call):
        return forward(q, k, v, seg, seg_k, offs, call)[0]

    def fwd(q, k, v, seg, seg_k, offs, call):
        o, lse = named_forward(forward, q, k, v, seg, seg_k, offs, call)  # checkpoint names attn_out / attn_lse
        return o, (q, k, v, seg, seg_k, offs, o, lse)

    def bwd(call, res, do):
        q, k, v, seg, seg_k, offs, o, lse = res
        lse = backward_lse(lse) if call.empty_rows else lse
        dq, dk, dv = run_backward(_jax_triton_launch, call, q, k, v, seg, do, lse, row_dot(o, do), seg_k, offs)
        return dq, dk, dv, None, None, None

    def fwd_entry(q, k, v, seg, seg_k, offs, call):
        o, lse = forward(q, k, v, seg, seg_k, offs, call)
        return o, lse * LN2  # natural log; -inf stays -inf

    def bwd_entry(q, k, v, out, lse, do, seg, seg_k, offs, call):
        lse2 = backward_lse(lse.astype("float32") * LOG2E)
        return run_backward(_jax_triton_launch, call, q, k, v, seg, do, lse2, row_dot(out, do), seg_k, offs)

    attention.defvjp(fwd, bwd)
    return types.SimpleNamespace(attention=jax.jit(attention, static_argnums=(6,)),
                                 fwd=jax.jit(fwd_entry, static_argnums=(6,)),
                                 bwd=jax.jit(bwd_entry, static_argnums=(9,)))


_jitted = None


def _prepare(q, k, *, causal, segment_ids, kv_segment_ids, q_offset, kv_offset, sm_scale, block_sizes,
             out_dtype=None, grad_dtype=None):
    """-> (jitted functions, call config, seg, seg_k, offs) for a validated call; RuntimeError without a GPU."""
    global _jitted
    from jaxtrain.kernels.flash_pallas import may_have_empty_rows, split_shift

    static_shift, offs = split_shift(q_offset, kv_offset) if causal else (0, None)
    call = call_config(q.shape, k.shape[2], q.dtype, causal=causal, sm_scale=sm_scale,
                       has_segments=segment_ids is not None, block_sizes=block_sizes, seq_k=k.shape[1],
                       shift=static_shift, empty_rows=may_have_empty_rows(causal, static_shift,
                                                                          kv_segment_ids is not None),
                       out_dtype=out_dtype, grad_dtype=grad_dtype)
    reason = availability_error()
    if reason:
        raise RuntimeError(reason)
    import jax.numpy as jnp

    _kernels()
    if _jitted is None:
        _jitted = _custom_vjp()
    # jax-triton passes arrays only; a kernel without segments gets a one-element dummy it never reads.
    seg = jnp.zeros((1,), jnp.int32) if segment_ids is None else jnp.asarray(segment_ids, jnp.int32)
    seg_k = None if kv_segment_ids is None else jnp.asarray(kv_segment_ids, jnp.int32)
    return _jitted, call, seg, seg_k, offs


def flash_attention_triton(q, k, v, *, causal: bool = True, segment_ids=None, kv_segment_ids=None, q_offset=0,
                           kv_offset=0, sm_scale: float | None = None, **block_sizes):
    """Triton flash attention via jax-triton. Inputs are assumed validated (see ``api.flash_attention``).

    Args:
      q: [batch, sq, heads, head_dim]; k, v: [batch, skv, kv_heads, head_dim]; segment_ids: int [batch, sq];
      kv_segment_ids: int [batch, skv] (None: segment_ids); q_offset, kv_offset: ints or traced int32 scalars.
      block_sizes: fields of ``jaxtrain.kernels.tiling.BlockSizes``.

    Returns:
      [batch, sq, heads, head_dim] in q's dtype. Raises RuntimeError when no GPU / triton / jax_triton.
    """
    jitted, call, seg, seg_k, offs = _prepare(q, k, causal=causal, segment_ids=segment_ids,
                                              kv_segment_ids=kv_segment_ids, q_offset=q_offset,
                                              kv_offset=kv_offset, sm_scale=sm_scale, block_sizes=block_sizes)
    return jitted.attention(q, k, v, seg, seg_k, offs, call)


def flash_attention_fwd_triton(q, k, v, *, causal: bool = True, segment_ids=None, kv_segment_ids=None, q_offset=0,
                               kv_offset=0, sm_scale: float | None = None, out_dtype=None, **block_sizes):
    """-> (out [batch, sq, heads, head_dim], lse [batch, heads, sq] float32 natural log); see jaxtrain.kernels.api."""
    jitted, call, seg, seg_k, offs = _prepare(q, k, causal=causal, segment_ids=segment_ids,
                                              kv_segment_ids=kv_segment_ids, q_offset=q_offset,
                                              kv_offset=kv_offset, sm_scale=sm_scale, block_sizes=block_sizes,
                                              out_dtype=out_dtype)
    return jitted.fwd(q, k, v, seg, seg_k, offs, call)


def flash_attention_bwd_triton(q, k, v, out, lse, dout, *, causal: bool = True, segment_ids=None,
                               kv_segment_ids=None, q_offset=0, kv_offset=0, sm_scale: float | None = None,
                               grad_dtype=None, **block_sizes):
    """-> (dq, dk, dv) of this key block from the final out and lse; see jaxtrain.kernels.api.flash_attention_bwd."""
    jitted, call, seg, seg_k, offs = _prepare(q, k, causal=causal, segment_ids=segment_ids,
                                              kv_segment_ids=kv_segment_ids, q_offset=q_offset,
                                              kv_offset=kv_offset, sm_scale=sm_scale, block_sizes=block_sizes,
                                              grad_dtype=grad_dtype)
    return jitted.bwd(q, k, v, out, lse, dout, seg, seg_k, offs, call)
