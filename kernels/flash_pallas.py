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

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.ad_checkpoint import checkpoint_name
from jax.experimental import pallas as pl

from kernels.tiling import BlockSizes, Launch, choose_splits, segment_tile_ranges

# Finite, so that fully masked tiles give exp2(MASK - MASK) = 1 rather than NaN; see the module docstring.
MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)
LOG2E = math.log2(math.e)

SUPPORTED_HEAD_DIMS = (32, 64, 128, 256)  # tiles must be powers of two for the Triton lowering
BACKENDS = ("triton",)
CHECKPOINT_NAMES = ("attn_out", "attn_lse")  # names of the saved forward results under jax.checkpoint

@dataclasses.dataclass(frozen=True)
class _Config:
    """Everything static about one call; hashable so it can be a jit static / custom_vjp nondiff argument."""

    causal: bool
    sm_scale: float
    seq_len: int  # true (unpadded) sequence length
    padded_len: int
    fwd: Launch
    dq: Launch
    dkdv: Launch
    splits: int  # dk/dv programs per GQA group (float32 partial sums added by XLA when > 1)
    has_segments: bool
    interpret: bool
    backend: str

    @property
    def padded(self) -> bool:
        return self.padded_len != self.seq_len


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


def _mask(q_pos, k_pos, q_seg, k_seg, *, causal: bool, seq_len: int | None, kv_major: bool = False):
    """Boolean mask of visible (query, key) pairs, [bq, bk] (or [bk, bq] with ``kv_major``); None when all visible.

    q_pos [bq], k_pos [bk]: absolute positions; q_seg [bq] / k_seg [bk]: segment ids or None;
    seq_len: mask keys at or past it (sequence padding), or None when there is no padding.
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


def _kv_ranges(q_block, block_q, block_k, num_k_blocks, causal):
    """[(lo, hi, on_diagonal)] kv-tile ranges a query tile must visit, unmasked first; tiles above the diagonal are
    not listed."""
    if not causal:
        return [(0, num_k_blocks, False)]
    # Tile j is wholly visible when its last key <= the tile's first query: (j+1)*bk - 1 <= q_block*bq.
    end = lax.div(q_block * block_q + block_q + block_k - 1, block_k)
    full = jnp.minimum(lax.div(q_block * block_q + 1, block_k), end)
    return [(0, full, False), (full, end, True)]


def _q_ranges(k_block, block_q, block_k, num_q_blocks, causal):
    """[(lo, hi, on_diagonal)] query-tile ranges that can see kv tile ``k_block``, unmasked first (the masked
    diagonal loop last: a loop of only-unmasked steps is what lets wgmma run without serialising); tiles wholly
    before it skipped."""
    if not causal:
        return [(0, num_q_blocks, False)]
    # Tile t sees some key of the kv tile when its last row (t+1)*bq - 1 >= k_block*bk; it sees all of them
    # when its first row t*bq >= (k_block+1)*bk - 1.
    start = lax.div(k_block * block_k, block_q)
    full = jnp.minimum(lax.div(k_block * block_k + block_k - 1 + block_q - 1, block_q), num_q_blocks)
    return [(full, num_q_blocks, False), (start, full, True)]


def _tile_index(cfg: _Config, i, num_tiles: int):
    """Grid index -> tile index: reversed under causal, so the tiles with the most work are launched first."""
    return num_tiles - 1 - i if cfg.causal else i


def _bounds(ref):
    return None if ref is None else (ref[0], ref[1])


# --------------------------------------------------------------------------------------------------------------
# Forward
# --------------------------------------------------------------------------------------------------------------


def _fwd_kernel(*refs, cfg: _Config):
    if cfg.has_segments:
        bounds_ref, seg_q_ref, seg_k_ref, q_ref, k_ref, v_ref, o_ref, lse_ref = refs
    else:
        q_ref, k_ref, v_ref, o_ref, lse_ref = refs
        bounds_ref = seg_q_ref = seg_k_ref = None
    block_q, block_k = cfg.fwd.block_q, cfg.fwd.block_k
    head_dim = q_ref.shape[-1]
    i = _tile_index(cfg, pl.program_id(0), cfg.padded_len // block_q)
    q = q_ref[...]  # [bq, D]; stays resident for the whole kv loop
    q_pos = i * block_q + jnp.arange(block_q, dtype=jnp.int32)
    q_seg = None if seg_q_ref is None else seg_q_ref[...]
    qk_scale = cfg.sm_scale * LOG2E  # work in base 2: exp2 is the cheap instruction
    pad_len = cfg.seq_len if cfg.padded else None

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
    num_k_blocks = cfg.padded_len // block_k
    for lo, hi, on_diagonal in _clamp(_kv_ranges(i, block_q, block_k, num_k_blocks, cfg.causal),
                                      _bounds(bounds_ref)):
        carry = lax.fori_loop(lo, hi, functools.partial(step, on_diagonal=on_diagonal), carry)
    acc, m, l = carry
    o_ref[...] = (acc / l[:, None]).astype(o_ref.dtype)
    lse_ref[...] = m + jnp.log2(l)


def _tile_ranges(seg, cfg: _Config, launch: Launch, kv_major: bool):
    """Document-mask ranges for one kernel: [B, tiles, 2] in units of the tiles its loop walks."""
    if kv_major:
        return segment_tile_ranges(seg, launch.block_k, launch.block_q)
    return segment_tile_ranges(seg, launch.block_q, launch.block_k)


def _forward(q, k, v, seg, cfg: _Config):
    """Padded inputs -> (o [B, Sp, H, D] in q.dtype, lse [B, H, Sp] float32, base 2)."""
    b, sp, h, d = q.shape
    group = h // k.shape[2]
    bq = cfg.fwd.block_q
    nq = sp // bq
    t = functools.partial(_tile_index, cfg, num_tiles=nq)
    in_specs = [
        pl.BlockSpec((None, bq, None, d), lambda qi, bi, hi: (bi, t(qi), hi, 0)),
        pl.BlockSpec((None, sp, None, d), lambda qi, bi, hi: (bi, 0, hi // group, 0)),
        pl.BlockSpec((None, sp, None, d), lambda qi, bi, hi: (bi, 0, hi // group, 0)),
    ]
    args = [q, k, v]
    if cfg.has_segments:
        in_specs = [
            pl.BlockSpec((None, None, 2), lambda qi, bi, hi: (bi, t(qi), 0)),
            pl.BlockSpec((None, bq), lambda qi, bi, hi: (bi, t(qi))),
            pl.BlockSpec((None, sp), lambda qi, bi, hi: (bi, 0)),
        ] + in_specs
        args = [_tile_ranges(seg, cfg, cfg.fwd, False), seg, seg] + args
    return pl.pallas_call(
        functools.partial(_fwd_kernel, cfg=cfg),
        grid=(nq, b, h),  # the query tile on the fastest launch axis
        in_specs=in_specs,
        out_specs=[
            pl.BlockSpec((None, bq, None, d), lambda qi, bi, hi: (bi, t(qi), hi, 0)),
            pl.BlockSpec((None, None, bq), lambda qi, bi, hi: (bi, hi, t(qi))),
        ],
        out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((b, h, sp), jnp.float32)],
        compiler_params=_compiler_params(cfg, cfg.fwd),
        interpret=cfg.interpret,
        name="flash_attention_fwd",
    )(*args)


# --------------------------------------------------------------------------------------------------------------
# Backward
# --------------------------------------------------------------------------------------------------------------


def _dq_kernel(*refs, cfg: _Config):
    if cfg.has_segments:
        bounds_ref, seg_q_ref, seg_k_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dq_ref = refs
    else:
        q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dq_ref = refs
        bounds_ref = seg_q_ref = seg_k_ref = None
    block_q, block_k = cfg.dq.block_q, cfg.dq.block_k
    head_dim = q_ref.shape[-1]
    i = _tile_index(cfg, pl.program_id(0), cfg.padded_len // block_q)
    q = q_ref[...]
    do = do_ref[...]
    lse = lse_ref[...]
    delta = delta_ref[...]
    q_pos = i * block_q + jnp.arange(block_q, dtype=jnp.int32)
    q_seg = None if seg_q_ref is None else seg_q_ref[...]
    qk_scale = cfg.sm_scale * LOG2E
    pad_len = cfg.seq_len if cfg.padded else None

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
    num_k_blocks = cfg.padded_len // block_k
    for lo, hi, on_diagonal in _clamp(_kv_ranges(i, block_q, block_k, num_k_blocks, cfg.causal),
                                      _bounds(bounds_ref)):
        dq = lax.fori_loop(lo, hi, functools.partial(step, on_diagonal=on_diagonal), dq)
    dq_ref[...] = (dq * cfg.sm_scale).astype(dq_ref.dtype)


def _dkdv_kernel(*refs, cfg: _Config, group: int, want: tuple[str, ...]):
    """``want``: ("dk", "dv"), or one of them (a pass of a two-pass backward, see ``dkdv_passes``)."""
    refs, out_refs = refs[:len(refs) - len(want)], dict(zip(want, refs[len(refs) - len(want):]))
    if cfg.has_segments:
        bounds_ref, seg_q_ref, seg_k_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref = refs
    else:
        q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref = refs
        bounds_ref = seg_q_ref = seg_k_ref = None
    block_q, block_k = cfg.dkdv.block_q, cfg.dkdv.block_k
    head_dim = k_ref.shape[-1]
    j = pl.program_id(0)  # kv tile 0 sees the most query tiles under causal: natural order is heaviest first
    k = k_ref[...]  # [bk, D]
    v = v_ref[...]
    k_pos = j * block_k + jnp.arange(block_k, dtype=jnp.int32)
    k_seg = None if seg_k_ref is None else seg_k_ref[...]
    qk_scale = cfg.sm_scale * LOG2E
    pad_len = cfg.seq_len if cfg.padded else None
    num_q_blocks = cfg.padded_len // block_q
    ranges = _clamp(_q_ranges(j, block_q, block_k, num_q_blocks, cfg.causal), _bounds(bounds_ref))

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


def _backward(cfg: _Config, res, do):
    q, k, v, seg, o, lse = res
    b, sp, h, d = q.shape
    kvh = k.shape[2]
    group = h // kvh
    delta = row_dot(o, do)

    bq, bk = cfg.dq.block_q, cfg.dq.block_k
    nq = sp // bq
    t = functools.partial(_tile_index, cfg, num_tiles=nq)
    dq_specs = [
        pl.BlockSpec((None, bq, None, d), lambda qi, bi, hi: (bi, t(qi), hi, 0)),  # q
        pl.BlockSpec((None, sp, None, d), lambda qi, bi, hi: (bi, 0, hi // group, 0)),  # k
        pl.BlockSpec((None, sp, None, d), lambda qi, bi, hi: (bi, 0, hi // group, 0)),  # v
        pl.BlockSpec((None, bq, None, d), lambda qi, bi, hi: (bi, t(qi), hi, 0)),  # do
        pl.BlockSpec((None, None, bq), lambda qi, bi, hi: (bi, hi, t(qi))),  # lse
        pl.BlockSpec((None, None, bq), lambda qi, bi, hi: (bi, hi, t(qi))),  # delta
    ]
    seg_args = []
    if cfg.has_segments:
        dq_specs = [
            pl.BlockSpec((None, None, 2), lambda qi, bi, hi: (bi, t(qi), 0)),
            pl.BlockSpec((None, bq), lambda qi, bi, hi: (bi, t(qi))),
            pl.BlockSpec((None, sp), lambda qi, bi, hi: (bi, 0)),
        ] + dq_specs
        seg_args = [_tile_ranges(seg, cfg, cfg.dq, False), seg, seg]
    dq = pl.pallas_call(
        functools.partial(_dq_kernel, cfg=cfg),
        grid=(nq, b, h),
        in_specs=dq_specs,
        out_specs=pl.BlockSpec((None, bq, None, d), lambda qi, bi, hi: (bi, t(qi), hi, 0)),
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        compiler_params=_compiler_params(cfg, cfg.dq),
        interpret=cfg.interpret,
        name="flash_attention_bwd_dq",
    )(*seg_args, q, k, v, do, lse, delta)

    # Program (kv tile, batch, x) with x = kv head * splits + split takes the `per` = group // splits consecutive
    # query heads [x*per, (x+1)*per) of kv head x // splits: a block of `per` along the head axis, block index x.
    bk, splits = cfg.dkdv.block_k, cfg.splits
    per = group // splits
    dkdv_specs = [
        pl.BlockSpec((None, sp, per, d), lambda kj, bi, x: (bi, 0, x, 0)),  # q
        pl.BlockSpec((None, bk, None, d), lambda kj, bi, x: (bi, kj, x // splits, 0)),  # k
        pl.BlockSpec((None, bk, None, d), lambda kj, bi, x: (bi, kj, x // splits, 0)),  # v
        pl.BlockSpec((None, sp, per, d), lambda kj, bi, x: (bi, 0, x, 0)),  # do
        pl.BlockSpec((None, per, sp), lambda kj, bi, x: (bi, x, 0)),  # lse
        pl.BlockSpec((None, per, sp), lambda kj, bi, x: (bi, x, 0)),  # delta
    ]
    seg_args = []
    if cfg.has_segments:
        dkdv_specs = [
            pl.BlockSpec((None, None, 2), lambda kj, bi, x: (bi, kj, 0)),
            pl.BlockSpec((None, sp), lambda kj, bi, x: (bi, 0)),
            pl.BlockSpec((None, bk), lambda kj, bi, x: (bi, kj)),
        ] + dkdv_specs
        seg_args = [_tile_ranges(seg, cfg, cfg.dkdv, True), seg, seg]
    if splits == 1:
        out_block = pl.BlockSpec((None, bk, None, d), lambda kj, bi, x: (bi, kj, x, 0))
        out_shape = jax.ShapeDtypeStruct(k.shape, k.dtype)
    else:  # float32 partial sums [splits, B, Sp, KVH, D]
        out_block = pl.BlockSpec((None, None, bk, None, d), lambda kj, bi, x: (x % splits, bi, kj, x // splits, 0))
        out_shape = jax.ShapeDtypeStruct((splits, *k.shape), jnp.float32)
    grads: dict[str, jax.Array] = {}
    for want in [("dk", "dv")] if dkdv_passes(d) == 1 else [("dv",), ("dk",)]:
        outs = pl.pallas_call(
            functools.partial(_dkdv_kernel, cfg=cfg, group=per, want=want),
            grid=(sp // bk, b, kvh * splits),
            in_specs=dkdv_specs,
            out_specs=[out_block] * len(want),
            out_shape=[out_shape] * len(want),
            compiler_params=_compiler_params(cfg, cfg.dkdv),
            interpret=cfg.interpret,
            name="flash_attention_bwd_" + "".join(want),
        )(*seg_args, q, k, v, do, lse, delta)
        grads.update(zip(want, outs))
    if splits > 1:
        grads = {name: g.sum(0).astype(k.dtype) for name, g in grads.items()}
    return dq, grads["dk"], grads["dv"], None


def named_forward(forward, q, k, v, seg, cfg):
    """forward(...) -> (o, lse) with the checkpoint names ``attn_out`` / ``attn_lse`` (see the module docstring)."""
    o, lse = forward(q, k, v, seg, cfg)
    return checkpoint_name(o, CHECKPOINT_NAMES[0]), checkpoint_name(lse, CHECKPOINT_NAMES[1])


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _flash_padded(q, k, v, seg, cfg: _Config):
    return named_forward(_forward, q, k, v, seg, cfg)[0]


def _flash_padded_fwd(q, k, v, seg, cfg: _Config):
    o, lse = named_forward(_forward, q, k, v, seg, cfg)
    return o, (q, k, v, seg, o, lse)


_flash_padded.defvjp(_flash_padded_fwd, _backward)


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def make_config(q_shape, kv_heads: int, dtype, *, causal: bool, sm_scale: float, has_segments: bool,
                interpret: bool, backend: str, sizes: BlockSizes) -> _Config:
    """Per-kernel launches (defaults by dtype and head_dim, user overrides, tiles clamped to the sequence), the
    padded length (a multiple of every tile: all are powers of two, so the largest is their lcm) and the dk/dv
    split of a GQA group."""
    batch, seq_len, heads, head_dim = q_shape
    launches = sizes.launches(dtype, head_dim, seq_len)
    padded_len = _round_up(seq_len, max(max(x.block_q, x.block_k) for x in launches.values()))
    group = heads // kv_heads
    # Not in interpret mode (CPU): more programs gain nothing there and partial sums cost memory.
    splits = sizes.splits(group, lambda: 1 if interpret else choose_splits(batch, seq_len, kv_heads, group,
                                                                          launches["dkdv"].block_k))
    return _Config(causal=causal, sm_scale=float(sm_scale), seq_len=seq_len, padded_len=padded_len, splits=splits,
                   has_segments=has_segments, interpret=interpret, backend=backend, **launches)


@functools.partial(jax.jit, static_argnames=("cfg",))
def _flash_attention(q, k, v, segment_ids, cfg: _Config):
    pad = cfg.padded_len - cfg.seq_len
    if pad:
        widths = ((0, 0), (0, pad), (0, 0), (0, 0))
        q, k, v = (jnp.pad(x, widths) for x in (q, k, v))
        if segment_ids is not None:
            # Padded keys are masked by position and padded rows are sliced away; repeating the last id keeps the
            # document-mask tile ranges as tight as without padding.
            segment_ids = jnp.pad(segment_ids, ((0, 0), (0, pad)), mode="edge")
    out = _flash_padded(q, k, v, segment_ids, cfg)
    return out[:, : cfg.seq_len] if pad else out


def flash_attention_pallas(q, k, v, *, causal: bool = True, segment_ids=None, sm_scale: float | None = None,
                           interpret: bool = False, backend: str = "triton", **block_sizes):
    """Pallas flash attention. Inputs are assumed validated (see ``kernels.api.flash_attention``).

    Args:
      q: [batch, seq, heads, head_dim]; k, v: [batch, seq, kv_heads, head_dim].
      segment_ids: optional int [batch, seq].
      interpret: run the kernels with the Pallas interpreter (CPU).
      backend: GPU lowering, "triton" (Pallas' Triton backend); see the module docstring.
      block_sizes: fields of ``kernels.tiling.BlockSizes``.

    Returns:
      [batch, seq, heads, head_dim] in q's dtype; differentiable w.r.t. q, k, v.
    """
    if backend not in BACKENDS:
        raise ValueError(_backend_error(backend))
    cfg = call_config(q.shape, q.dtype, causal=causal, sm_scale=sm_scale, has_segments=segment_ids is not None,
                      interpret=interpret, backend=backend, block_sizes=block_sizes, kv_heads=k.shape[2])
    if segment_ids is not None:
        segment_ids = jnp.asarray(segment_ids, jnp.int32)
    return _flash_attention(q, k, v, segment_ids, cfg)


def call_config(q_shape, dtype, *, causal: bool, sm_scale: float | None, has_segments: bool, interpret: bool = False,
                backend: str = "triton", block_sizes: dict | None = None, kv_heads: int | None = None) -> _Config:
    """The static configuration of a call; ValueError on bad block sizes. q_shape [batch, seq, heads, head_dim]."""
    sizes = BlockSizes.from_kwargs(block_sizes or {}, "pallas")
    d = q_shape[-1]
    scale = d**-0.5 if sm_scale is None else sm_scale
    return make_config(tuple(q_shape), kv_heads or q_shape[2], dtype, causal=causal, sm_scale=scale,
                       has_segments=has_segments, interpret=interpret, backend=backend, sizes=sizes)


def _backend_error(backend) -> str:
    if backend == "mosaic_gpu":
        return ("backend='mosaic_gpu' is not implemented: Mosaic GPU cannot lower this pl.pallas_call kernel "
                "(jax 0.11 removed Mosaic GPU from pl.pallas_call; it needs a separate plgpu.kernel program with "
                "warpgroup matmuls and TMA). Use backend='triton', or impl='triton' (official Triton via "
                "jax-triton).")
    return f"unknown Pallas backend {backend!r}; expected one of {BACKENDS}"
