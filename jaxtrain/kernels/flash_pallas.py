"""Flash multi-head self-attention in Pallas: forward, backward and ``jax.custom_vjp``.

Shapes: q [batch, seq, heads, head_dim]; k, v [batch, seq, kv_heads, head_dim] with kv_heads dividing heads;
query head h reads kv head h // (heads // kv_heads). Output [batch, seq, heads, head_dim] in q's dtype.

Algorithm (FlashAttention-2):
  * forward: one program per (query tile, batch, head), the query tile on the fastest grid axis (so programs
    running together read the same K/V from L2) and, under ``causal``, in reverse (the longest rows start first);
    online softmax over kv tiles in a ``fori_loop`` with float32 accumulators; the log-sum-exp (base 2) of every
    row is written for the backward. Under ``causal`` the loop stops at the diagonal and only the tiles the
    diagonal crosses pay for a mask; the unmasked loop runs before the masked one.
  * document masking (``segment_ids``): XLA computes, per query tile, the range of kv tiles whose segment ids can
    match (``tiling.segment_tile_ranges``) and the kernels loop over that range only, so tiles of other
    documents are skipped, not computed and masked.
  * backward: ``delta = rowsum(o * do)`` in XLA as an elementwise product and a float32 sum (not a matmul, so no
    TF32 can creep in), then two kernels with their own tiles: dq per (query tile, batch, head) looping over kv
    tiles, and dk/dv per (kv tile, batch, kv head) looping over the query heads of its group and their query
    tiles, so the group sum happens in registers and no per-query-head dk/dv is ever materialised. dk/dv works
    on S transposed ([kv, q]): P^T and dS^T come out of the matmuls in the layout the next matmul wants.
  * float32 inputs get exact float32 dots (``precision=HIGHEST``): the Triton lowering would otherwise make
    every default-precision float32 dot a TF32 one (about 1e-3 relative error).
  * grouped-query attention by BlockSpec index maps (query head h -> kv head h // group in the forward and dq
    kernels; kv head j -> the query-head block [j*group, (j+1)*group) in the dk/dv kernel). k and v are never
    repeated in memory.
  * with ``jax.checkpoint`` (remat), the output and the log-sum-exp carry the checkpoint names ``attn_out`` and
    ``attn_lse``, so a policy that saves them keeps the backward from rerunning the forward kernel.
  * any sequence length: the wrapper pads the sequence up to a multiple of the block sizes and the kernels
    mask padded keys; padded query rows are sliced away (their cotangent is zero, so they add nothing to
    dk/dv).
  * masked logits take a large finite negative value instead of -inf, so a row never sees ``exp(-inf + inf)``:
    every real query row has at least one visible key (itself), which wipes out the contributions of fully
    masked tiles seen before it through the running-max correction; no NaN can arise.

GPU lowering: Pallas' Triton backend, selected with ``jax.experimental.pallas.triton.CompilerParams``: the one
``pl.pallas_call`` lowering that jax 0.10.2 (CI) and 0.11.2 (the GPU machine, which removed Mosaic GPU from
``pl.pallas_call``) both accept, and one that lowers without a GPU (``lowering_platforms=("cuda",)``; see
``tools/compile_check.py``). jax 0.11 deprecates it (0.12 still has it); ``backend=`` is the switch for another
lowering ("mosaic_gpu" is refused with the reason) and ``impl="triton"`` (official Triton + jax-triton, the road
JAX's note recommends) keeps the same contract.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.ad_checkpoint import checkpoint_name
from jax.experimental import pallas as pl

from jaxtrain.kernels.tiling import BlockSizes, Launch, choose_splits, clamp_tile, segment_tile_ranges

# Finite, so that fully masked tiles give exp2(MASK - MASK) = 1 rather than NaN; see the module docstring.
MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)
LOG2E = math.log2(math.e)
LN2 = math.log(2.0)

SUPPORTED_HEAD_DIMS = (32, 64, 128, 256)  # tiles must be powers of two for the Triton lowering
BACKENDS = ("triton",)
CHECKPOINT_NAMES = ("attn_out", "attn_lse")  # names of the saved forward results under jax.checkpoint

@dataclasses.dataclass(frozen=True)
class _Config:
    """Everything static about one call; hashable so it can be a jit static / custom_vjp nondiff argument."""

    causal: bool
    sm_scale: float
    seq_q: int  # true (unpadded) query length
    seq_k: int  # true key length
    padded_q: int
    padded_k: int
    fwd: Launch
    dq: Launch
    dkdv: Launch
    splits: int  # dk/dv programs per GQA group (float32 partial sums added by XLA when > 1)
    has_segments: bool
    interpret: bool
    backend: str
    # q_offset - kv_offset (the causal mask is q_pos + shift >= k_pos) when static; None: traced, read by the
    # kernels from an int32 [1] operand.
    shift: int | None = 0
    empty_rows: bool = False  # a query row may see no key (offsets, separate key segments): out 0, lse -inf
    out_dtype: str | None = None  # forward output (None: q's dtype)
    grad_dtype: str | None = None  # dq, dk, dv (None: the inputs' dtype)

    @property
    def padded(self) -> bool:  # keys past seq_k exist and must be masked
        return self.padded_k != self.seq_k


def _compiler_params(cfg: _Config, launch: Launch):
    if cfg.interpret:
        return None
    if cfg.backend == "triton":
        from jax.experimental.pallas import triton as pltriton

        return pltriton.CompilerParams(num_warps=launch.num_warps, num_stages=launch.num_stages)
    raise ValueError(f"unknown Pallas backend {cfg.backend!r}")  # validated earlier; kept for safety


# precision=HIGHEST: float32 operands give an exact float32 dot (IEEE) in the Triton lowering instead of TF32;
# 16-bit operands are unaffected.
def _dot_nt(a, b):
    """a [m, d] @ b[n, d]^T -> [m, n] in float32."""
    return lax.dot_general(a, b, (((1,), (1,)), ((), ())), precision=lax.Precision.HIGHEST,
                           preferred_element_type=jnp.float32)


def _dot_nn(a, b):
    """a [m, n] @ b[n, d] -> [m, d] in float32."""
    return lax.dot_general(a, b, (((1,), (0,)), ((), ())), precision=lax.Precision.HIGHEST,
                           preferred_element_type=jnp.float32)


def _is_zero(shift) -> bool:
    return isinstance(shift, int) and shift == 0


def _plus(x, shift):
    """x + shift, adding nothing for a static zero shift (the no-offset call compiles as before offsets existed)."""
    return x if _is_zero(shift) else x + shift


def _mask(q_pos, k_pos, q_seg, k_seg, *, causal: bool, seq_len: int | None, kv_major: bool = False):
    """Boolean mask of visible (query, key) pairs, [bq, bk] (or [bk, bq] with ``kv_major``); None when all visible.

    q_pos [bq] (shifted into key positions), k_pos [bk]: absolute positions; q_seg [bq] / k_seg [bk]: segment ids
    or None; seq_len: mask keys at or past it (sequence padding), or None when there is no padding.
    """
    if kv_major:  # rows are keys
        q_, k_ = (lambda x: x[None, :]), (lambda x: x[:, None])  # noqa: E731
    else:
        q_, k_ = (lambda x: x[:, None]), (lambda x: x[None, :])  # noqa: E731
    mask = None

    def _and(m, new):
        return new if m is None else jnp.logical_and(m, new)

    if causal:
        mask = _and(mask, q_(q_pos) >= k_(k_pos))
    if seq_len is not None:
        mask = _and(mask, k_(k_pos) < seq_len)
    if q_seg is not None:
        mask = _and(mask, q_(q_seg) == k_(k_seg))
    return mask


def _clamp(ranges, bounds):
    """Intersect each (lo, hi, on_diagonal) with the document-mask tile range ``bounds`` (lo, hi) or None."""
    if bounds is None:
        return ranges
    lo, hi = bounds
    return [(jnp.maximum(a, lo), jnp.minimum(b, hi), diag) for a, b, diag in ranges]


def _kv_ranges(q_block, block_q, block_k, num_k_blocks, causal, shift=0, more_queries=False):
    """[(lo, hi, on_diagonal)] kv-tile ranges a query tile must visit, unmasked first; tiles the causal mask hides
    wholly (past the tile's last query + shift) are not listed, so never loaded or computed. ``more_queries``: the
    padded queries outnumber the padded keys (the diagonal can pass the last key tile)."""
    if not causal:
        return [(0, num_k_blocks, False)]
    first = _plus(q_block * block_q, shift)  # the tile's first query, in key positions
    # Tile j is wholly visible when its last key <= first: (j+1)*bk - 1 <= first; visited while j*bk <= last query.
    if _is_zero(shift):
        end = lax.div(first + block_q + block_k - 1, block_k)
        end = jnp.minimum(end, num_k_blocks) if more_queries else end
        full = jnp.minimum(lax.div(first + 1, block_k), end)
    else:  # lax.div truncates toward zero: clamp negative numerators (a tile before every key visits none)
        end = jnp.minimum(lax.div(jnp.maximum(first + block_q - 1, -1) + block_k, block_k), num_k_blocks)
        full = jnp.minimum(lax.div(jnp.maximum(first + 1, 0), block_k), end)
    return [(0, full, False), (full, end, True)]


def _q_ranges(k_block, block_q, block_k, num_q_blocks, causal, shift=0):
    """[(lo, hi, on_diagonal)] query-tile ranges that can see kv tile ``k_block``, unmasked first (the masked
    diagonal loop last: a loop of only-unmasked steps is what lets wgmma run without serialising); tiles wholly
    before it skipped."""
    if not causal:
        return [(0, num_q_blocks, False)]
    # In query positions, the tile's keys span [first, last]. Query tile t sees some of them when its last row
    # (t+1)*bq - 1 >= first; all of them when its first row t*bq >= last.
    first = _plus(k_block * block_k, 0 if _is_zero(shift) else -shift)
    last = first + (block_k - 1)
    if not _is_zero(shift):  # lax.div truncates toward zero: negative numerators mean query tile 0
        first, last = jnp.maximum(first, 0), jnp.maximum(last, 0)
    start = lax.div(first, block_q)
    full = jnp.minimum(lax.div(last + block_q - 1, block_q), num_q_blocks)
    return [(full, num_q_blocks, False), (start, full, True)]


def _tile_index(cfg: _Config, i, num_tiles: int):
    """Grid index -> tile index: reversed under causal, so the tiles with the most work are launched first."""
    return num_tiles - 1 - i if cfg.causal else i


def _bounds(ref):
    return None if ref is None else (ref[0], ref[1])


def _unpack(refs, cfg: _Config):
    """Kernel refs -> (shift, bounds_ref, seg_q_ref, seg_k_ref, rest): the optional leading operands (the traced
    shift, then the document-mask tile ranges and the query / key segment ids) and the kernel's own."""
    refs = list(refs)
    shift = cfg.shift
    if shift is None:
        shift = refs.pop(0)[0]
    if cfg.has_segments:
        return (shift, *refs[:3], refs[3:])
    return shift, None, None, None, refs


def _leading(cfg: _Config, shift, seg_specs, seg_args: Callable[[], list]):
    """(in_specs, args) of the optional leading operands, in ``_unpack``'s order."""
    specs, args = [], []
    if cfg.shift is None:
        specs.append(pl.BlockSpec((1,), lambda *_: (0,)))
        args.append(shift)
    if cfg.has_segments:
        specs += seg_specs
        args += seg_args()  # a callable: the tile ranges are computed only for calls with segments
    return specs, args


# --------------------------------------------------------------------------------------------------------------
# Forward
# --------------------------------------------------------------------------------------------------------------


def _fwd_kernel(*refs, cfg: _Config):
    shift, bounds_ref, seg_q_ref, seg_k_ref, (q_ref, k_ref, v_ref, o_ref, lse_ref) = _unpack(refs, cfg)
    block_q, block_k = cfg.fwd.block_q, cfg.fwd.block_k
    head_dim = q_ref.shape[-1]
    i = _tile_index(cfg, pl.program_id(0), cfg.padded_q // block_q)
    q = q_ref[...]  # [bq, D]; stays resident for the whole kv loop
    q_pos = _plus(i * block_q + jnp.arange(block_q, dtype=jnp.int32), shift)
    q_seg = None if seg_q_ref is None else seg_q_ref[...]
    qk_scale = cfg.sm_scale * LOG2E  # work in base 2: exp2 is the cheap instruction
    pad_len = cfg.seq_k if cfg.padded else None

    def step(j, carry, on_diagonal):
        acc, m_prev, l_prev = carry
        start = pl.multiple_of(j * block_k, block_k)
        k = k_ref[pl.ds(start, block_k), :]
        v = v_ref[pl.ds(start, block_k), :]
        s = _dot_nt(q, k) * qk_scale  # [bq, bk] float32
        k_pos = start + jnp.arange(block_k, dtype=jnp.int32)
        k_seg = None if seg_k_ref is None else seg_k_ref[pl.ds(start, block_k)]
        mask = _mask(q_pos, k_pos, q_seg, k_seg, causal=on_diagonal, seq_len=pad_len)
        if mask is not None:
            s = jnp.where(mask, s, MASK_VALUE)
        m_new = jnp.maximum(m_prev, jnp.max(s, axis=1))
        alpha = jnp.exp2(m_prev - m_new)
        p = jnp.exp2(s - m_new[:, None])
        l_new = alpha * l_prev + jnp.sum(p, axis=1)
        acc = acc * alpha[:, None] + _dot_nn(p.astype(v.dtype), v)
        return acc, m_new, l_new

    carry = (
        jnp.zeros((block_q, head_dim), jnp.float32),
        jnp.full((block_q,), -jnp.inf, jnp.float32),
        jnp.zeros((block_q,), jnp.float32),
    )
    num_k_blocks = cfg.padded_k // block_k
    for lo, hi, on_diagonal in _clamp(_kv_ranges(i, block_q, block_k, num_k_blocks, cfg.causal, shift,
                                                  cfg.padded_q > cfg.padded_k),
                                      _bounds(bounds_ref)):
        carry = lax.fori_loop(lo, hi, functools.partial(step, on_diagonal=on_diagonal), carry)
    acc, m, l = carry
    if cfg.empty_rows:
        # A row without a visible key kept m at MASK_VALUE (it saw masked entries only) or -inf (no tile visited).
        empty = m < 0.5 * MASK_VALUE
        o_ref[...] = jnp.where(empty[:, None], 0.0, acc / jnp.where(empty, 1.0, l)[:, None]).astype(o_ref.dtype)
        lse_ref[...] = jnp.where(empty, -jnp.inf, m + jnp.log2(jnp.where(empty, 1.0, l)))
    else:
        o_ref[...] = (acc / l[:, None]).astype(o_ref.dtype)
        lse_ref[...] = m + jnp.log2(l)


def _tile_ranges(seg_q, seg_k, launch: Launch, kv_major: bool):
    """Document-mask ranges for one kernel: [B, tiles, 2] in units of the tiles its loop walks."""
    if kv_major:
        return segment_tile_ranges(seg_k, launch.block_k, launch.block_q, col_ids=seg_q)
    return segment_tile_ranges(seg_q, launch.block_q, launch.block_k, col_ids=seg_k)


def _forward(q, k, v, seg_q, seg_k, shift, cfg: _Config):
    """Padded inputs -> (o [B, Sq, H, D] in cfg.out_dtype or q's, lse [B, H, Sq] float32, base 2).

    q [B, Sq, H, D]; k, v [B, Sk, KVH, D]; seg_q [B, Sq] / seg_k [B, Sk] int32 or None; shift int32 [1] or None."""
    b, sp, h, d = q.shape
    sk = k.shape[1]
    group = h // k.shape[2]
    bq = cfg.fwd.block_q
    nq = sp // bq
    t = functools.partial(_tile_index, cfg, num_tiles=nq)
    lead_specs, lead_args = _leading(cfg, shift, [
        pl.BlockSpec((None, None, 2), lambda qi, bi, hi: (bi, t(qi), 0)),
        pl.BlockSpec((None, bq), lambda qi, bi, hi: (bi, t(qi))),
        pl.BlockSpec((None, sk), lambda qi, bi, hi: (bi, 0)),
    ], lambda: [_tile_ranges(seg_q, seg_k, cfg.fwd, False), seg_q, seg_k])
    in_specs = lead_specs + [
        pl.BlockSpec((None, bq, None, d), lambda qi, bi, hi: (bi, t(qi), hi, 0)),
        pl.BlockSpec((None, sk, None, d), lambda qi, bi, hi: (bi, 0, hi // group, 0)),
        pl.BlockSpec((None, sk, None, d), lambda qi, bi, hi: (bi, 0, hi // group, 0)),
    ]
    return pl.pallas_call(
        functools.partial(_fwd_kernel, cfg=cfg),
        grid=(nq, b, h),  # the query tile on the fastest launch axis
        in_specs=in_specs,
        out_specs=[
            pl.BlockSpec((None, bq, None, d), lambda qi, bi, hi: (bi, t(qi), hi, 0)),
            pl.BlockSpec((None, None, bq), lambda qi, bi, hi: (bi, hi, t(qi))),
        ],
        out_shape=[jax.ShapeDtypeStruct(q.shape, cfg.out_dtype or q.dtype),
                   jax.ShapeDtypeStruct((b, h, sp), jnp.float32)],
        compiler_params=_compiler_params(cfg, cfg.fwd),
        interpret=cfg.interpret,
        name="flash_attention_fwd",
    )(*lead_args, q, k, v)


# --------------------------------------------------------------------------------------------------------------
# Backward
# --------------------------------------------------------------------------------------------------------------


def _dq_kernel(*refs, cfg: _Config):
    shift, bounds_ref, seg_q_ref, seg_k_ref, rest = _unpack(refs, cfg)
    q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dq_ref = rest
    block_q, block_k = cfg.dq.block_q, cfg.dq.block_k
    head_dim = q_ref.shape[-1]
    i = _tile_index(cfg, pl.program_id(0), cfg.padded_q // block_q)
    q = q_ref[...]
    do = do_ref[...]
    lse = lse_ref[...]
    delta = delta_ref[...]
    q_pos = _plus(i * block_q + jnp.arange(block_q, dtype=jnp.int32), shift)
    q_seg = None if seg_q_ref is None else seg_q_ref[...]
    qk_scale = cfg.sm_scale * LOG2E
    pad_len = cfg.seq_k if cfg.padded else None

    def step(j, dq, on_diagonal):
        start = pl.multiple_of(j * block_k, block_k)
        k = k_ref[pl.ds(start, block_k), :]
        v = v_ref[pl.ds(start, block_k), :]
        s = _dot_nt(q, k) * qk_scale
        k_pos = start + jnp.arange(block_k, dtype=jnp.int32)
        k_seg = None if seg_k_ref is None else seg_k_ref[pl.ds(start, block_k)]
        mask = _mask(q_pos, k_pos, q_seg, k_seg, causal=on_diagonal, seq_len=pad_len)
        if mask is not None:
            s = jnp.where(mask, s, MASK_VALUE)
        p = jnp.exp2(s - lse[:, None])
        dp = _dot_nt(do, v)
        ds = p * (dp - delta[:, None])
        return dq + _dot_nn(ds.astype(k.dtype), k)

    dq = jnp.zeros((block_q, head_dim), jnp.float32)
    num_k_blocks = cfg.padded_k // block_k
    for lo, hi, on_diagonal in _clamp(_kv_ranges(i, block_q, block_k, num_k_blocks, cfg.causal, shift,
                                                  cfg.padded_q > cfg.padded_k),
                                      _bounds(bounds_ref)):
        dq = lax.fori_loop(lo, hi, functools.partial(step, on_diagonal=on_diagonal), dq)
    dq_ref[...] = (dq * cfg.sm_scale).astype(dq_ref.dtype)


def _dkdv_kernel(*refs, cfg: _Config, group: int, want: tuple[str, ...]):
    """``want``: ("dk", "dv"), or one of them (a pass of a two-pass backward, see ``dkdv_passes``)."""
    refs, out_refs = refs[:len(refs) - len(want)], dict(zip(want, refs[len(refs) - len(want):]))
    shift, bounds_ref, seg_q_ref, seg_k_ref, rest = _unpack(refs, cfg)
    q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref = rest
    block_q, block_k = cfg.dkdv.block_q, cfg.dkdv.block_k
    head_dim = k_ref.shape[-1]
    j = pl.program_id(0)  # kv tile 0 sees the most query tiles under causal: natural order is heaviest first
    k = k_ref[...]  # [bk, D]
    v = v_ref[...]
    # Keys in query positions (k - shift), shifted once here rather than every query tile in the loop (fewer live
    # registers: the d128 kernel sits at the register limit); the padding bound moves with them.
    k_pos = _plus(j * block_k + jnp.arange(block_k, dtype=jnp.int32), 0 if _is_zero(shift) else -shift)
    k_seg = None if seg_k_ref is None else seg_k_ref[...]
    qk_scale = cfg.sm_scale * LOG2E
    pad_len = _plus(cfg.seq_k, 0 if _is_zero(shift) else -shift) if cfg.padded else None
    num_q_blocks = cfg.padded_q // block_q
    ranges = _clamp(_q_ranges(j, block_q, block_k, num_q_blocks, cfg.causal, shift), _bounds(bounds_ref))

    def step(t, carry, g, on_diagonal):
        # Transposed: rows are keys, columns queries, so P^T and dS^T are produced, not transposed.
        dk, dv = carry
        start = pl.multiple_of(t * block_q, block_q)
        rows = pl.ds(start, block_q)
        q = q_ref[rows, g, :]
        do = do_ref[rows, g, :]
        lse = lse_ref[g, rows]
        delta = delta_ref[g, rows]
        s_t = _dot_nt(k, q) * qk_scale  # [bk, bq]
        q_pos = start + jnp.arange(block_q, dtype=jnp.int32)
        q_seg = None if seg_q_ref is None else seg_q_ref[rows]
        mask = _mask(q_pos, k_pos, q_seg, k_seg, causal=on_diagonal, seq_len=pad_len, kv_major=True)
        if mask is not None:
            s_t = jnp.where(mask, s_t, MASK_VALUE)
        p_t = jnp.exp2(s_t - lse[None, :])
        if "dv" in want:
            dv = dv + _dot_nn(p_t.astype(do.dtype), do)
        if "dk" in want:
            dp_t = _dot_nt(v, do)  # [bk, bq]
            ds_t = p_t * (dp_t - delta[None, :])
            dk = dk + _dot_nn(ds_t.astype(q.dtype), q)
        return dk, dv

    def head(g, carry):
        # The query heads of this kv head's group share k and v: summing their contributions here is the
        # GQA reduction, done without ever writing a per-query-head dk/dv.
        for lo, hi, on_diagonal in ranges:
            carry = lax.fori_loop(lo, hi, functools.partial(step, g=g, on_diagonal=on_diagonal), carry)
        return carry

    # An accumulator this pass does not compute is a [1, 1] placeholder, so it costs no registers.
    shape = {name: (block_k, head_dim) if name in want else (1, 1) for name in ("dk", "dv")}
    dk, dv = lax.fori_loop(0, group, head, tuple(jnp.zeros(shape[n], jnp.float32) for n in ("dk", "dv")))
    if "dk" in want:
        out_refs["dk"][...] = (dk * cfg.sm_scale).astype(out_refs["dk"].dtype)
    if "dv" in want:
        out_refs["dv"][...] = dv.astype(out_refs["dv"].dtype)


def dkdv_passes(head_dim: int) -> int:
    """2 at head_dim 256: dk and dv accumulators of a wgmma-sized kv tile ([64, 256] float32 each) do not fit the
    registers together (ptxas spills), so one kernel computes dv and a second dk, recomputing S and P."""
    return 2 if head_dim >= 256 else 1


def row_dot(o, do):
    """delta [B, H, S] float32 = sum_d o * do, as an elementwise product and a float32 sum (o, do [B, S, H, D]).

    Not an einsum: XLA may lower a contraction to a (TF32) matmul on GPU; this is a fused reduction."""
    return jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32), axis=-1).transpose(0, 2, 1)


def _backward_kernels(q, k, v, seg_q, seg_k, shift, do, lse, delta, cfg: _Config):
    """Padded inputs -> (dq [B, Sq, H, D], dk, dv [B, Sk, KVH, D]) in cfg.grad_dtype or the inputs' dtype.

    lse [B, H, Sq] float32 base 2, +inf for rows without a visible key (so their p is 0); delta [B, H, Sq]."""
    b, sp, h, d = q.shape
    sk = k.shape[1]
    kvh = k.shape[2]
    group = h // kvh

    bq = cfg.dq.block_q
    nq = sp // bq
    t = functools.partial(_tile_index, cfg, num_tiles=nq)
    lead_specs, lead_args = _leading(cfg, shift, [
        pl.BlockSpec((None, None, 2), lambda qi, bi, hi: (bi, t(qi), 0)),
        pl.BlockSpec((None, bq), lambda qi, bi, hi: (bi, t(qi))),
        pl.BlockSpec((None, sk), lambda qi, bi, hi: (bi, 0)),
    ], lambda: [_tile_ranges(seg_q, seg_k, cfg.dq, False), seg_q, seg_k])
    dq_specs = lead_specs + [
        pl.BlockSpec((None, bq, None, d), lambda qi, bi, hi: (bi, t(qi), hi, 0)),  # q
        pl.BlockSpec((None, sk, None, d), lambda qi, bi, hi: (bi, 0, hi // group, 0)),  # k
        pl.BlockSpec((None, sk, None, d), lambda qi, bi, hi: (bi, 0, hi // group, 0)),  # v
        pl.BlockSpec((None, bq, None, d), lambda qi, bi, hi: (bi, t(qi), hi, 0)),  # do
        pl.BlockSpec((None, None, bq), lambda qi, bi, hi: (bi, hi, t(qi))),  # lse
        pl.BlockSpec((None, None, bq), lambda qi, bi, hi: (bi, hi, t(qi))),  # delta
    ]
    dq = pl.pallas_call(
        functools.partial(_dq_kernel, cfg=cfg),
        grid=(nq, b, h),
        in_specs=dq_specs,
        out_specs=pl.BlockSpec((None, bq, None, d), lambda qi, bi, hi: (bi, t(qi), hi, 0)),
        out_shape=jax.ShapeDtypeStruct(q.shape, cfg.grad_dtype or q.dtype),
        compiler_params=_compiler_params(cfg, cfg.dq),
        interpret=cfg.interpret,
        name="flash_attention_bwd_dq",
    )(*lead_args, q, k, v, do, lse, delta)

    # Program (kv tile, batch, x) with x = kv head * splits + split takes the `per` = group // splits consecutive
    # query heads [x*per, (x+1)*per) of kv head x // splits: a block of `per` along the head axis, block index x.
    bk, splits = cfg.dkdv.block_k, cfg.splits
    per = group // splits
    lead_specs, lead_args = _leading(cfg, shift, [
        pl.BlockSpec((None, None, 2), lambda kj, bi, x: (bi, kj, 0)),
        pl.BlockSpec((None, sp), lambda kj, bi, x: (bi, 0)),
        pl.BlockSpec((None, bk), lambda kj, bi, x: (bi, kj)),
    ], lambda: [_tile_ranges(seg_q, seg_k, cfg.dkdv, True), seg_q, seg_k])
    dkdv_specs = lead_specs + [
        pl.BlockSpec((None, sp, per, d), lambda kj, bi, x: (bi, 0, x, 0)),  # q
        pl.BlockSpec((None, bk, None, d), lambda kj, bi, x: (bi, kj, x // splits, 0)),  # k
        pl.BlockSpec((None, bk, None, d), lambda kj, bi, x: (bi, kj, x // splits, 0)),  # v
        pl.BlockSpec((None, sp, per, d), lambda kj, bi, x: (bi, 0, x, 0)),  # do
        pl.BlockSpec((None, per, sp), lambda kj, bi, x: (bi, x, 0)),  # lse
        pl.BlockSpec((None, per, sp), lambda kj, bi, x: (bi, x, 0)),  # delta
    ]
    grad_dtype = cfg.grad_dtype or k.dtype
    if splits == 1:
        out_block = pl.BlockSpec((None, bk, None, d), lambda kj, bi, x: (bi, kj, x, 0))
        out_shape = jax.ShapeDtypeStruct(k.shape, grad_dtype)
    else:  # float32 partial sums [splits, B, Sk, KVH, D]
        out_block = pl.BlockSpec((None, None, bk, None, d), lambda kj, bi, x: (x % splits, bi, kj, x // splits, 0))
        out_shape = jax.ShapeDtypeStruct((splits, *k.shape), jnp.float32)
    grads: dict[str, jax.Array] = {}
    for want in [("dk", "dv")] if dkdv_passes(d) == 1 else [("dv",), ("dk",)]:
        outs = pl.pallas_call(
            functools.partial(_dkdv_kernel, cfg=cfg, group=per, want=want),
            grid=(sk // bk, b, kvh * splits),
            in_specs=dkdv_specs,
            out_specs=[out_block] * len(want),
            out_shape=[out_shape] * len(want),
            compiler_params=_compiler_params(cfg, cfg.dkdv),
            interpret=cfg.interpret,
            name="flash_attention_bwd_" + "".join(want),
        )(*lead_args, q, k, v, do, lse, delta)
        grads.update(zip(want, outs))
    if splits > 1:
        grads = {name: g.sum(0).astype(grad_dtype) for name, g in grads.items()}
    return dq, grads["dk"], grads["dv"]


def backward_lse(lse):
    """The backward kernels' log-sum-exp: a row without a visible key (-inf) becomes +inf, so its p = exp2(s - lse)
    is 0, not inf (and no 0 * inf = NaN reaches dk / dv)."""
    return jnp.where(lse == -jnp.inf, jnp.inf, lse)


def _backward(cfg: _Config, res, do):
    q, k, v, seg_q, seg_k, shift, o, lse = res
    if cfg.empty_rows:
        lse = backward_lse(lse)
    dq, dk, dv = _backward_kernels(q, k, v, seg_q, seg_k, shift, do, lse, row_dot(o, do), cfg)
    return dq, dk, dv, None, None, None


def named_forward(forward, *args):
    """forward(*args) -> (o, lse) with the checkpoint names ``attn_out`` / ``attn_lse`` (see the module
    docstring)."""
    o, lse = forward(*args)
    return checkpoint_name(o, CHECKPOINT_NAMES[0]), checkpoint_name(lse, CHECKPOINT_NAMES[1])


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _flash_padded(q, k, v, seg_q, seg_k, shift, cfg: _Config):
    return named_forward(_forward, q, k, v, seg_q, seg_k, shift, cfg)[0]


def _flash_padded_fwd(q, k, v, seg_q, seg_k, shift, cfg: _Config):
    o, lse = named_forward(_forward, q, k, v, seg_q, seg_k, shift, cfg)
    return o, (q, k, v, seg_q, seg_k, shift, o, lse)


_flash_padded.defvjp(_flash_padded_fwd, _backward)


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def make_config(q_shape, kv_heads: int, dtype, *, causal: bool, sm_scale: float, has_segments: bool,
                interpret: bool, backend: str, sizes: BlockSizes, seq_k: int | None = None, shift: int | None = 0,
                empty_rows: bool = False, out_dtype=None, grad_dtype=None) -> _Config:
    """Per-kernel launches (defaults by dtype and head_dim, user overrides, query tiles clamped to the query length
    and key tiles to the key length), the padded lengths (multiples of every tile: all are powers of two, so the
    largest is their lcm) and the dk/dv split of a GQA group."""
    batch, seq_q, heads, head_dim = q_shape
    seq_k = seq_q if seq_k is None else seq_k
    launches = sizes.launches(dtype, head_dim, seq_q, seq_k)
    if (causal and shift is None and head_dim == 128 and np.dtype(dtype).itemsize == 2
            and sizes.block_k_dkdv is None and sizes.block_k_bwd is None):
        # The 16-bit d128 dk/dv kernel sits at 254-255 registers; a traced shift spills it (572 B, sm_90a,
        # tools/compile_check.py ring cases), a 64-key tile does not (173 registers).
        launches["dkdv"] = dataclasses.replace(launches["dkdv"], block_k=clamp_tile(64, seq_k))
    tile = max(max(x.block_q, x.block_k) for x in launches.values())
    group = heads // kv_heads
    # Not in interpret mode (CPU): more programs gain nothing there and partial sums cost memory.
    splits = sizes.splits(group, lambda: 1 if interpret else choose_splits(batch, seq_k, kv_heads, group,
                                                                          launches["dkdv"].block_k))
    name = (lambda t: None if t is None else jnp.dtype(t).name)  # noqa: E731
    return _Config(causal=causal, sm_scale=float(sm_scale), seq_q=seq_q, seq_k=seq_k,
                   padded_q=_round_up(seq_q, tile), padded_k=_round_up(seq_k, tile), splits=splits,
                   has_segments=has_segments, interpret=interpret, backend=backend,
                   shift=shift if causal else 0, empty_rows=empty_rows, out_dtype=name(out_dtype),
                   grad_dtype=name(grad_dtype), **launches)


def _pad_to(x, length: int, value=0.0, mode="constant"):
    """Pad axis 1 of x up to ``length`` (None passes through)."""
    if x is None or x.shape[1] == length:
        return x
    widths = [(0, 0)] * x.ndim
    widths[1] = (0, length - x.shape[1])
    if mode == "edge":
        return jnp.pad(x, widths, mode="edge")
    return jnp.pad(x, widths, constant_values=value)


def _pad_inputs(q, k, v, seg_q, seg_k, cfg: _Config):
    """Pad queries to cfg.padded_q and keys to cfg.padded_k. Padded keys are masked by position and padded rows are
    sliced away; repeating the last segment id keeps the document-mask tile ranges as tight as without padding.
    seg_k None with segments: the keys' ids are the queries' (self-attention)."""
    q = _pad_to(q, cfg.padded_q)
    k, v = _pad_to(k, cfg.padded_k), _pad_to(v, cfg.padded_k)
    seg_q_p = _pad_to(seg_q, cfg.padded_q, mode="edge")
    seg_k_p = seg_q_p if seg_k is None else _pad_to(seg_k, cfg.padded_k, mode="edge")
    return q, k, v, seg_q_p, seg_k_p


@functools.partial(jax.jit, static_argnames=("cfg",))
def _flash_attention(q, k, v, seg_q, seg_k, shift, cfg: _Config):
    q, k, v, seg_q, seg_k = _pad_inputs(q, k, v, seg_q, seg_k, cfg)
    out = _flash_padded(q, k, v, seg_q, seg_k, shift, cfg)
    return out[:, : cfg.seq_q] if cfg.padded_q != cfg.seq_q else out


@functools.partial(jax.jit, static_argnames=("cfg",))
def _fwd_entry(q, k, v, seg_q, seg_k, shift, cfg: _Config):
    q, k, v, seg_q, seg_k = _pad_inputs(q, k, v, seg_q, seg_k, cfg)
    o, lse = _forward(q, k, v, seg_q, seg_k, shift, cfg)
    return o[:, : cfg.seq_q], lse[:, :, : cfg.seq_q] * LN2  # natural log; -inf stays -inf


@functools.partial(jax.jit, static_argnames=("cfg",))
def _bwd_entry(q, k, v, out, lse, do, seg_q, seg_k, shift, cfg: _Config):
    delta = _pad_to(row_dot(out, do).transpose(0, 2, 1), cfg.padded_q).transpose(0, 2, 1)
    lse = _pad_to(backward_lse(lse * LOG2E).transpose(0, 2, 1), cfg.padded_q, jnp.inf).transpose(0, 2, 1)
    do = _pad_to(do, cfg.padded_q)
    q, k, v, seg_q, seg_k = _pad_inputs(q, k, v, seg_q, seg_k, cfg)
    dq, dk, dv = _backward_kernels(q, k, v, seg_q, seg_k, shift, do, lse, delta, cfg)
    return dq[:, : cfg.seq_q], dk[:, : cfg.seq_k], dv[:, : cfg.seq_k]


def split_shift(q_offset, kv_offset):
    """(static shift or None, traced shift int32 [1] or None) for the causal mask q_offset + i >= kv_offset + j:
    Python ints stay static (compiled into the kernels), anything else becomes an operand."""
    if isinstance(q_offset, (int, np.integer)) and isinstance(kv_offset, (int, np.integer)):
        return int(q_offset) - int(kv_offset), None
    return None, (jnp.asarray(q_offset, jnp.int32) - jnp.asarray(kv_offset, jnp.int32)).reshape(1)


def may_have_empty_rows(causal: bool, static_shift: int | None, separate_kv_segments: bool) -> bool:
    """Can a query row see no key? Only with separate key segments or a causal shift that is traced or < 0 (with
    a shift >= 0 every row sees key 0 or its own position)."""
    return separate_kv_segments or (causal and (static_shift is None or static_shift < 0))


def _prepare(q, k, *, causal, segment_ids, kv_segment_ids, q_offset, kv_offset, sm_scale, interpret, backend,
             block_sizes, out_dtype=None, grad_dtype=None):
    if backend not in BACKENDS:
        raise ValueError(_backend_error(backend))
    static_shift, traced = split_shift(q_offset, kv_offset)
    if not causal:
        static_shift, traced = 0, None
    cfg = call_config(q.shape, q.dtype, causal=causal, sm_scale=sm_scale, has_segments=segment_ids is not None,
                      interpret=interpret, backend=backend, block_sizes=block_sizes, kv_heads=k.shape[2],
                      seq_k=k.shape[1], shift=static_shift,
                      empty_rows=may_have_empty_rows(causal, static_shift, kv_segment_ids is not None),
                      out_dtype=out_dtype, grad_dtype=grad_dtype)
    seg_q = None if segment_ids is None else jnp.asarray(segment_ids, jnp.int32)
    seg_k = None if kv_segment_ids is None else jnp.asarray(kv_segment_ids, jnp.int32)
    return cfg, seg_q, seg_k, traced


def flash_attention_pallas(q, k, v, *, causal: bool = True, segment_ids=None, kv_segment_ids=None, q_offset=0,
                           kv_offset=0, sm_scale: float | None = None, interpret: bool = False,
                           backend: str = "triton", **block_sizes):
    """Pallas flash attention. Inputs are assumed validated (see ``jaxtrain.kernels.api.flash_attention``).

    Args:
      q: [batch, sq, heads, head_dim]; k, v: [batch, skv, kv_heads, head_dim].
      segment_ids: optional int [batch, sq]; kv_segment_ids: int [batch, skv] (None: segment_ids).
      q_offset, kv_offset: positions of the first query / key (ints, or traced int32 scalars).
      interpret: run the kernels with the Pallas interpreter (CPU).
      backend: GPU lowering, "triton" (Pallas' Triton backend); see the module docstring.
      block_sizes: fields of ``jaxtrain.kernels.tiling.BlockSizes``.

    Returns:
      [batch, sq, heads, head_dim] in q's dtype; differentiable w.r.t. q, k, v.
    """
    cfg, seg_q, seg_k, shift = _prepare(q, k, causal=causal, segment_ids=segment_ids, kv_segment_ids=kv_segment_ids,
                                        q_offset=q_offset, kv_offset=kv_offset, sm_scale=sm_scale,
                                        interpret=interpret, backend=backend, block_sizes=block_sizes)
    return _flash_attention(q, k, v, seg_q, seg_k, shift, cfg)


def flash_attention_fwd_pallas(q, k, v, *, causal: bool = True, segment_ids=None, kv_segment_ids=None, q_offset=0,
                               kv_offset=0, sm_scale: float | None = None, interpret: bool = False,
                               backend: str = "triton", out_dtype=None, **block_sizes):
    """-> (out [batch, sq, heads, head_dim] in out_dtype or q's, lse [batch, heads, sq] float32, natural log)."""
    cfg, seg_q, seg_k, shift = _prepare(q, k, causal=causal, segment_ids=segment_ids, kv_segment_ids=kv_segment_ids,
                                        q_offset=q_offset, kv_offset=kv_offset, sm_scale=sm_scale,
                                        interpret=interpret, backend=backend, block_sizes=block_sizes,
                                        out_dtype=out_dtype)
    return _fwd_entry(q, k, v, seg_q, seg_k, shift, cfg)


def flash_attention_bwd_pallas(q, k, v, out, lse, dout, *, causal: bool = True, segment_ids=None,
                               kv_segment_ids=None, q_offset=0, kv_offset=0, sm_scale: float | None = None,
                               interpret: bool = False, backend: str = "triton", grad_dtype=None, **block_sizes):
    """-> (dq [batch, sq, heads, head_dim], dk, dv [batch, skv, kv_heads, head_dim]) of this key block, from the
    final (merged) out and natural-log lse [batch, heads, sq]; in grad_dtype or the inputs' dtype."""
    cfg, seg_q, seg_k, shift = _prepare(q, k, causal=causal, segment_ids=segment_ids, kv_segment_ids=kv_segment_ids,
                                        q_offset=q_offset, kv_offset=kv_offset, sm_scale=sm_scale,
                                        interpret=interpret, backend=backend, block_sizes=block_sizes,
                                        grad_dtype=grad_dtype)
    return _bwd_entry(q, k, v, out, jnp.asarray(lse, jnp.float32), dout, seg_q, seg_k, shift, cfg)


def call_config(q_shape, dtype, *, causal: bool, sm_scale: float | None, has_segments: bool, interpret: bool = False,
                backend: str = "triton", block_sizes: dict | None = None, kv_heads: int | None = None,
                seq_k: int | None = None, shift: int | None = 0, empty_rows: bool = False, out_dtype=None,
                grad_dtype=None) -> _Config:
    """The static configuration of a call; ValueError on bad block sizes. q_shape [batch, seq, heads, head_dim]."""
    sizes = BlockSizes.from_kwargs(block_sizes or {}, "pallas")
    d = q_shape[-1]
    scale = d**-0.5 if sm_scale is None else sm_scale
    return make_config(tuple(q_shape), kv_heads or q_shape[2], dtype, causal=causal, sm_scale=scale,
                       has_segments=has_segments, interpret=interpret, backend=backend, sizes=sizes, seq_k=seq_k,
                       shift=shift, empty_rows=empty_rows, out_dtype=out_dtype, grad_dtype=grad_dtype)


def _backend_error(backend) -> str:
    if backend == "mosaic_gpu":
        return ("backend='mosaic_gpu' is not implemented: Mosaic GPU cannot lower this pl.pallas_call kernel "
                "(jax 0.11 removed Mosaic GPU from pl.pallas_call; it needs a separate plgpu.kernel program with "
                "warpgroup matmuls and TMA). Use backend='triton', or impl='triton' (official Triton via "
                "jax-triton).")
    return f"unknown Pallas backend {backend!r}; expected one of {BACKENDS}"
