"""Kernel bodies of the Triton-language flash kernels, launched by ``jaxtrain.kernels.flash.triton`` (see its
docstring for the algorithm); their launch planning (grids, constexprs) is ``jaxtrain.kernels.flash.triton_launch``.

``triton`` is imported only by ``jitted()``, so this module imports without it. The kernel bodies are module-level
functions wrapped with ``triton.jit`` on first use: Triton's interpreter (TRITON_INTERPRET=1, used by the tests on
CPU) resolves ``tl`` and helper kernels through the module globals, so they are bound there rather than in a
closure. Every helper is inlined into the kernels that call it.
"""

from __future__ import annotations

import functools
import types

from jaxtrain.kernels.flash.common import MASK_VALUE

# --------------------------------------------------------------------------------------------------------------
# Kernel bodies (Triton language). Wrapped with triton.jit by jitted(), which also binds these names:
# --------------------------------------------------------------------------------------------------------------

tl = None  # triton.language
_TL_MASK_VALUE = None  # tl.constexpr(MASK_VALUE)
_key_tile = _fwd_inner = _dq_inner = _dkdv_inner = None  # the jitted *_src helpers
_shifted = _causal_key_bounds = _causal_query_bounds = None


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

def _key_tile_src(q, q_seg, offs_q, offs_d, k_base, v_base, seg_base, start_k,
                  SEQ_K: tl.constexpr, KVH: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_K: tl.constexpr,
                  HAS_SEG: tl.constexpr, ON_DIAG: tl.constexpr, EVEN: tl.constexpr, QK_SCALE: tl.constexpr,
                  INPUT_PRECISION: tl.constexpr):
    # One step of the forward and dq loops over key tiles: the key tile at start_k (k, v [BLOCK_K, HEAD_DIM]) and
    # the query tile's base-2 scores s = q k^T * QK_SCALE [BLOCK_Q, BLOCK_K], keys hidden from a row masked
    # (padding, the causal diagonal, other documents). offs_q: the query rows in key positions.
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
    return k, v, s


def _fwd_inner_src(acc, m_i, l_i, q, q_seg, offs_q, k_base, v_base, seg_base, lo, hi,
                   SEQ_K: tl.constexpr, KVH: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_K: tl.constexpr,
                   HAS_SEG: tl.constexpr, ON_DIAG: tl.constexpr, EVEN: tl.constexpr, QK_SCALE: tl.constexpr,
                   INPUT_PRECISION: tl.constexpr):
    offs_d = tl.arange(0, HEAD_DIM)
    for start_k in range(lo, hi, BLOCK_K):
        start_k = tl.multiple_of(start_k, BLOCK_K)
        k, v, s = _key_tile(q, q_seg, offs_q, offs_d, k_base, v_base, seg_base, start_k, SEQ_K, KVH, HEAD_DIM,
                            BLOCK_K, HAS_SEG, ON_DIAG, EVEN, QK_SCALE, INPUT_PRECISION)
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
        k, v, s = _key_tile(q, q_seg, offs_q, offs_d, k_base, v_base, seg_base, start_k, SEQ_K, KVH, HEAD_DIM,
                            BLOCK_K, HAS_SEG, ON_DIAG, EVEN, QK_SCALE, INPUT_PRECISION)
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

def _causal_query_bounds_src(start_k, neg, lo, hi, BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr,
                             SHIFT: tl.constexpr, DYN_SHIFT: tl.constexpr):
    # For the key tile at start_k under the causal mask (neg = -shift moves keys into query positions): query
    # tiles below diag_lo lie wholly before its keys and are never loaded, those from full_lo on see all of them
    # and need no causal mask, those in [diag_lo, full_lo) are masked.
    first = start_k + neg
    last = start_k + neg + BLOCK_K - 1
    if DYN_SHIFT or SHIFT > 0:  # the key tile may lie before every query: clamp before the divisions
        first = tl.maximum(first, 0)
        last = tl.maximum(last, 0)
    diag_lo = tl.maximum((first // BLOCK_Q) * BLOCK_Q, lo)
    full_lo = tl.maximum(tl.minimum(((last + BLOCK_Q - 1) // BLOCK_Q) * BLOCK_Q, hi), lo)
    return diag_lo, full_lo


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
        diag_lo, full_lo = _causal_query_bounds(start_k, neg, lo, hi, BLOCK_Q, BLOCK_K, SHIFT, DYN_SHIFT)
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
def jitted() -> types.SimpleNamespace:
    """Import Triton and wrap the kernel bodies with ``triton.jit`` (once): (fwd, dq, dkdv) kernels. Raises
    ImportError without Triton."""
    import triton
    import triton.language

    g = globals()
    g["tl"] = triton.language
    g["_TL_MASK_VALUE"] = triton.language.constexpr(MASK_VALUE)  # Triton reads only constexpr globals
    # The kernels call the helpers by these global names.
    g["_key_tile"] = triton.jit(_key_tile_src)
    g["_fwd_inner"] = triton.jit(_fwd_inner_src)
    g["_dq_inner"] = triton.jit(_dq_inner_src)
    g["_dkdv_inner"] = triton.jit(_dkdv_inner_src)
    g["_shifted"] = triton.jit(_shifted_src)
    g["_causal_key_bounds"] = triton.jit(_causal_key_bounds_src)
    g["_causal_query_bounds"] = triton.jit(_causal_query_bounds_src)
    return types.SimpleNamespace(
        fwd=triton.jit(_fwd_kernel_src), dq=triton.jit(_dq_kernel_src), dkdv=triton.jit(_dkdv_kernel_src)
    )
