# mypy: ignore-errors
# (The Triton language is a DSL mypy cannot read: tl.constexpr parameters, tl.* builtins, @triton.jit rewriting. The
# launch code that calls these kernels, jaxtrain/kernels/gmm/triton.py, is checked.)
"""Kernel bodies of the Triton-language grouped matmul, launched by ``jaxtrain.kernels.gmm.triton``; the algorithm
is the Pallas one (``jaxtrain.kernels.gmm.pallas``'s docstring), the geometry ``jaxtrain.kernels.gmm.plan``'s.

``triton`` is imported only by ``jitted()``, which wraps these module-level bodies with ``triton.jit`` and binds
``tl`` and the helpers as module globals (Triton's interpreter, used by the tests on CPU, resolves them there). Every
helper is inlined into the kernels. Offsets into the operands are int64 (a [groups, k, n] weight passes 2^31
elements at Mixtral-like sizes with more experts).
"""

from __future__ import annotations

import functools
import types

tl = None  # triton.language, bound by jitted()
_band_order = _load_tile = _store_tile = None  # the jitted *_src helpers


def _band_order_src(pid, TILES_M: tl.constexpr, TILES_N: tl.constexpr, BAND: tl.constexpr):
    # Program id -> (row tile, column tile) in bands of BAND row tiles (gmm_plan.band_order).
    per_band = BAND * TILES_N
    first = (pid // per_band) * BAND
    height = tl.minimum(TILES_M - first, BAND)
    local = pid % per_band
    return first + local % height, local // height


def _load_tile_src(ptrs, row_ok, col_ok, MASK_ROWS: tl.constexpr, MASK_COLS: tl.constexpr):
    # A 2-D tile; rows / columns outside row_ok / col_ok read as 0 (masks only where the constexprs ask).
    if MASK_ROWS and MASK_COLS:
        x = tl.load(ptrs, mask=row_ok[:, None] & col_ok[None, :], other=0.0)
    elif MASK_ROWS:
        x = tl.load(ptrs, mask=row_ok[:, None], other=0.0)
    elif MASK_COLS:
        x = tl.load(ptrs, mask=col_ok[None, :], other=0.0)
    else:
        x = tl.load(ptrs)
    return x


def _store_tile_src(ptrs, x, row_ok, col_ok, MASK_ROWS: tl.constexpr, MASK_COLS: tl.constexpr):
    if MASK_ROWS and MASK_COLS:
        tl.store(ptrs, x, mask=row_ok[:, None] & col_ok[None, :])
    elif MASK_ROWS:
        tl.store(ptrs, x, mask=row_ok[:, None])
    elif MASK_COLS:
        tl.store(ptrs, x, mask=col_ok[None, :])
    else:
        tl.store(ptrs, x)


def _gmm_kernel_src(A, W, OFFSETS, TILE_GROUPS, O,
                    ROWS: tl.constexpr, COLS: tl.constexpr, CONTRACT: tl.constexpr, TILES_M: tl.constexpr,
                    TILES_N: tl.constexpr, TM: tl.constexpr, TN: tl.constexpr, TC: tl.constexpr,
                    BAND: tl.constexpr, TRANSPOSE_W: tl.constexpr, EVEN_M: tl.constexpr, EVEN_N: tl.constexpr,
                    EVEN_C: tl.constexpr, INPUT_PRECISION: tl.constexpr):
    # out [ROWS, COLS] = A [ROWS, CONTRACT] @ W_g for the groups of this program's row tile; W [G, CONTRACT, COLS]
    # or, with TRANSPOSE_W, [G, COLS, CONTRACT].
    mi, ni = _band_order(tl.program_id(0), TILES_M, TILES_N, BAND)
    row0 = mi * TM
    rows = row0 + tl.arange(0, TM)
    cols = ni * TN + tl.arange(0, TN)
    offs_c = tl.arange(0, TC)
    col_ok = cols < COLS
    a_ptrs = A + rows.to(tl.int64)[:, None] * CONTRACT + offs_c[None, :]
    if TRANSPOSE_W:
        w_offs = cols.to(tl.int64)[:, None] * CONTRACT + offs_c[None, :]  # [TN, TC], as stored
    else:
        w_offs = offs_c.to(tl.int64)[:, None] * COLS + cols[None, :]  # [TC, TN]
    acc = tl.zeros((TM, TN), tl.float32)
    for g in range(tl.load(TILE_GROUPS + 2 * mi), tl.load(TILE_GROUPS + 2 * mi + 1)):
        first = tl.maximum(tl.load(OFFSETS + g), row0)
        end = tl.minimum(tl.load(OFFSETS + g + 1), row0 + TM)
        row_ok = (rows >= first) & (rows < end)  # this group's rows of the tile; the others read as 0
        w_ptrs = W + tl.cast(g, tl.int64) * (CONTRACT * COLS) + w_offs
        hi = tl.where(end > first, CONTRACT, 0)  # a group with no row in this tile costs nothing
        for c0 in range(0, hi, TC):
            c_ok = c0 + offs_c < CONTRACT
            a = _load_tile(a_ptrs + c0, row_ok, c_ok, True, not EVEN_C)
            if TRANSPOSE_W:
                w = _load_tile(w_ptrs + c0, col_ok, c_ok, not EVEN_N, not EVEN_C)
                acc = tl.dot(a, tl.trans(w), acc, input_precision=INPUT_PRECISION)
            else:
                w = _load_tile(w_ptrs + c0 * COLS, c_ok, col_ok, not EVEN_C, not EVEN_N)  # < one expert's size
                acc = tl.dot(a, w, acc, input_precision=INPUT_PRECISION)
    o_ptrs = O + rows.to(tl.int64)[:, None] * COLS + cols[None, :]
    _store_tile(o_ptrs, acc.to(O.dtype.element_ty), rows < ROWS, col_ok, not EVEN_M, not EVEN_N)


def _tgmm_kernel_src(A, B, OFFSETS, O,
                     P: tl.constexpr, Q: tl.constexpr, TILES_P: tl.constexpr, TILES_Q: tl.constexpr,
                     TR: tl.constexpr, TP: tl.constexpr, TQ: tl.constexpr, BAND: tl.constexpr,
                     EVEN_P: tl.constexpr, EVEN_Q: tl.constexpr, INPUT_PRECISION: tl.constexpr):
    # out [G, P, Q]: out[g] = A [rows of g, P]^T @ B [rows of g, Q], the rows in chunks of TR from the group's
    # first row; an empty group's tile is zeros.
    pid = tl.program_id(0)
    g = pid // (TILES_P * TILES_Q)
    pi, qi = _band_order(pid % (TILES_P * TILES_Q), TILES_P, TILES_Q, BAND)
    ps = pi * TP + tl.arange(0, TP)
    qs = qi * TQ + tl.arange(0, TQ)
    offs_r = tl.arange(0, TR)
    p_ok = ps < P
    q_ok = qs < Q
    end = tl.load(OFFSETS + g + 1)
    acc = tl.zeros((TP, TQ), tl.float32)
    for r0 in range(tl.load(OFFSETS + g), end, TR):
        rows = tl.cast(r0 + offs_r, tl.int64)
        row_ok = r0 + offs_r < end
        a = _load_tile(A + rows[:, None] * P + ps[None, :], row_ok, p_ok, True, not EVEN_P)
        b = _load_tile(B + rows[:, None] * Q + qs[None, :], row_ok, q_ok, True, not EVEN_Q)
        acc = tl.dot(tl.trans(a), b, acc, input_precision=INPUT_PRECISION)
    o_ptrs = O + tl.cast(g, tl.int64) * (P * Q) + ps.to(tl.int64)[:, None] * Q + qs[None, :]
    _store_tile(o_ptrs, acc.to(O.dtype.element_ty), p_ok, q_ok, not EVEN_P, not EVEN_Q)


@functools.cache
def jitted() -> types.SimpleNamespace:
    """Import Triton and wrap the kernel bodies with ``triton.jit`` (once): the gmm and tgmm kernels. Raises
    ImportError without Triton."""
    import triton
    import triton.language

    g = globals()
    g["tl"] = triton.language
    g["_band_order"] = triton.jit(_band_order_src)
    g["_load_tile"] = triton.jit(_load_tile_src)
    g["_store_tile"] = triton.jit(_store_tile_src)
    return types.SimpleNamespace(gmm=triton.jit(_gmm_kernel_src), tgmm=triton.jit(_tgmm_kernel_src))
