"""Flash multi-head self-attention in Pallas: forward, backward and ``jax.custom_vjp``.

Shapes: q [batch, seq, heads, head_dim]; k, v [batch, seq, kv_heads, head_dim] with kv_heads dividing heads;
query head h reads kv head h // (heads // kv_heads). Output [batch, seq, heads, head_dim] in q's dtype.

Algorithm (FlashAttention-2):
  * forward: one program per (batch, head, query tile); online softmax over kv tiles in a ``fori_loop`` with
    float32 accumulators; the log-sum-exp (base 2) of every row is written for the backward. Under ``causal``
    the loop bound stops at the diagonal, so tiles wholly above it cost nothing, and only the tiles that the
    diagonal crosses pay for a mask.
  * backward: ``delta = rowsum(o * do)`` in XLA (elementwise, O(S·H·D)), then two kernels: dq per
    (batch, head, query tile) looping over kv tiles, and dk/dv per (batch, kv head, kv tile) looping over the
    query heads of its group and their query tiles, so the group sum happens in registers and no
    per-query-head dk/dv is ever materialised.
  * grouped-query attention by BlockSpec index maps (query head h -> kv head h // group in the forward and dq
    kernels; kv head j -> the query-head block [j*group, (j+1)*group) in the dk/dv kernel). k and v are never
    repeated in memory.
  * any sequence length: the wrapper pads the sequence up to a multiple of the block sizes and the kernels
    mask padded keys; padded query rows are sliced away (their cotangent is zero, so they add nothing to
    dk/dv).
  * masked logits take a large finite negative value instead of -inf, so a row never sees ``exp(-inf + inf)``:
    every real query row has at least one visible key (itself), which wipes out the contributions of fully
    masked tiles seen before it through the running-max correction; no NaN can arise.

GPU lowering choice: the kernels are written in the ``pl.pallas_call`` + BlockSpec dialect (ref indexing,
``jnp``/``lax`` ops, ``fori_loop``) and lowered through **Pallas' Triton backend**, selected explicitly with
``jax.experimental.pallas.triton.CompilerParams``. Why:
  * jax 0.10.2 (the dev/CI machines) defaults ``pl.pallas_call`` on GPU to Mosaic GPU, while jax 0.11.2 (the
    GPU machine) removed Mosaic GPU from ``pl.pallas_call`` entirely (Mosaic GPU kernels must be written with
    ``plgpu.kernel``, warpgroup-level WGMMA, TMA and barriers: a different program, not different flags). The
    Triton compiler params are the one setting that means the same thing on both versions.
  * the Triton backend handles this blocked, masked, data-dependent-loop style of kernel well, and lowering it
    needs no GPU: ``jax.jit(...).trace(...).lower(lowering_platforms=("cuda",))`` builds the Triton IR on a CPU
    machine with jax 0.10.2, which the tests use to check the GPU lowering.
  * its cost: jax 0.11 warns that the Pallas Triton backend is deprecated. The other roads stay open: the
    ``backend=`` keyword is the switch (only ``"triton"`` is implemented here; ``"mosaic_gpu"`` is refused
    with the reason), and ``impl="triton"`` in ``kernels.flash_triton`` is the road JAX's deprecation note
    recommends (official Triton language + jax-triton), with the same contract.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from kernels.tiling import MIN_BLOCK, checked_block_sizes

# Finite, so that fully masked tiles give exp2(MASK - MASK) = 1 rather than NaN; see the module docstring.
MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)
LOG2E = math.log2(math.e)

SUPPORTED_HEAD_DIMS = (32, 64, 128, 256)  # tiles must be powers of two for the Triton lowering
BACKENDS = ("triton",)


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tile sizes: forward (block_q x block_k) and backward (block_q_bwd x block_k_bwd); powers of two >= 16.

    The defaults are first guesses for an H100/H200 with the Triton lowering; they have not been tuned on a GPU.
    ``num_warps=None`` picks 4 for head_dim <= 64 and 8 above.
    """

    block_q: int = 128
    block_k: int = 64
    block_q_bwd: int = 64
    block_k_bwd: int = 64
    num_warps: int | None = None
    num_stages: int = 2

    @classmethod
    def from_kwargs(cls, kwargs: dict) -> "BlockSizes":
        return checked_block_sizes(cls, kwargs, ("block_q", "block_k", "block_q_bwd", "block_k_bwd"), "pallas")


@dataclasses.dataclass(frozen=True)
class _Config:
    """Everything static about one call; hashable so it can be a jit static / custom_vjp nondiff argument."""

    causal: bool
    sm_scale: float
    seq_len: int  # true (unpadded) sequence length
    padded_len: int
    block_q: int
    block_k: int
    block_q_bwd: int
    block_k_bwd: int
    num_warps: int
    num_stages: int
    has_segments: bool
    interpret: bool
    backend: str

    @property
    def padded(self) -> bool:
        return self.padded_len != self.seq_len


def _compiler_params(cfg: _Config):
    if cfg.interpret:
        return None
    if cfg.backend == "triton":
        from jax.experimental.pallas import triton as pltriton

        return pltriton.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    raise ValueError(f"unknown Pallas backend {cfg.backend!r}")  # validated earlier; kept for safety


def _dot_nt(a, b):
    """a [m, d] @ b[n, d]^T -> [m, n] in float32."""
    return lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def _dot_tn(a, b):
    """a [m, n]^T @ b[m, d] -> [n, d] in float32."""
    return lax.dot_general(a, b, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32)


def _dot_nn(a, b):
    return lax.dot_general(a, b, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)


def _mask(q_pos, k_pos, q_seg, k_seg, *, causal: bool, seq_len: int | None):
    """Boolean [bq, bk] mask of visible (query, key) pairs, or None when everything is visible.

    q_pos [bq], k_pos [bk]: absolute positions; q_seg [bq] / k_seg [bk]: segment ids or None;
    seq_len: mask keys at or past it (sequence padding), or None when there is no padding.
    """
    mask = None

    def _and(m, new):
        return new if m is None else jnp.logical_and(m, new)

    if causal:
        mask = _and(mask, q_pos[:, None] >= k_pos[None, :])
    if seq_len is not None:
        mask = _and(mask, k_pos[None, :] < seq_len)
    if q_seg is not None:
        mask = _and(mask, q_seg[:, None] == k_seg[None, :])
    return mask


def _kv_ranges(q_block, block_q, block_k, num_k_blocks, causal):
    """[(lo, hi, on_diagonal)] kv-tile ranges a query tile must visit; tiles above the diagonal are not listed."""
    if not causal:
        return [(0, num_k_blocks, False)]
    # Tile j is wholly visible when its last key <= the tile's first query: (j+1)*bk - 1 <= q_block*bq.
    end = lax.div(q_block * block_q + block_q + block_k - 1, block_k)
    full = jnp.minimum(lax.div(q_block * block_q + 1, block_k), end)
    return [(0, full, False), (full, end, True)]


def _q_ranges(k_block, block_q, block_k, num_q_blocks, causal):
    """[(lo, hi, on_diagonal)] query-tile ranges that can see kv tile ``k_block``; tiles wholly before it skipped."""
    if not causal:
        return [(0, num_q_blocks, False)]
    # Tile t sees some key of the kv tile when its last row (t+1)*bq - 1 >= k_block*bk; it sees all of them
    # when its first row t*bq >= (k_block+1)*bk - 1.
    start = lax.div(k_block * block_k, block_q)
    full = jnp.minimum(lax.div(k_block * block_k + block_k - 1 + block_q - 1, block_q), num_q_blocks)
    return [(start, full, True), (full, num_q_blocks, False)]


# --------------------------------------------------------------------------------------------------------------
# Forward
# --------------------------------------------------------------------------------------------------------------


def _fwd_kernel(*refs, cfg: _Config, block_q: int, block_k: int):
    if cfg.has_segments:
        seg_q_ref, seg_k_ref, q_ref, k_ref, v_ref, o_ref, lse_ref = refs
    else:
        q_ref, k_ref, v_ref, o_ref, lse_ref = refs
        seg_q_ref = seg_k_ref = None
    head_dim = q_ref.shape[-1]
    i = pl.program_id(2)
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
    for lo, hi, on_diagonal in _kv_ranges(i, block_q, block_k, num_k_blocks, cfg.causal):
        carry = lax.fori_loop(lo, hi, functools.partial(step, on_diagonal=on_diagonal), carry)
    acc, m, l = carry
    o_ref[...] = (acc / l[:, None]).astype(o_ref.dtype)
    lse_ref[...] = m + jnp.log2(l)


def _forward(q, k, v, seg, cfg: _Config):
    """Padded inputs -> (o [B, Sp, H, D] in q.dtype, lse [B, H, Sp] float32, base 2)."""
    b, sp, h, d = q.shape
    group = h // k.shape[2]
    bq, bk = cfg.block_q, cfg.block_k
    grid = (b, h, sp // bq)
    in_specs = [
        pl.BlockSpec((None, bq, None, d), lambda bi, hi, qi: (bi, qi, hi, 0)),
        pl.BlockSpec((None, sp, None, d), lambda bi, hi, qi: (bi, 0, hi // group, 0)),
        pl.BlockSpec((None, sp, None, d), lambda bi, hi, qi: (bi, 0, hi // group, 0)),
    ]
    args = [q, k, v]
    if cfg.has_segments:
        in_specs = [
            pl.BlockSpec((None, bq), lambda bi, hi, qi: (bi, qi)),
            pl.BlockSpec((None, sp), lambda bi, hi, qi: (bi, 0)),
        ] + in_specs
        args = [seg, seg] + args
    return pl.pallas_call(
        functools.partial(_fwd_kernel, cfg=cfg, block_q=bq, block_k=bk),
        grid=grid,
        in_specs=in_specs,
        out_specs=[
            pl.BlockSpec((None, bq, None, d), lambda bi, hi, qi: (bi, qi, hi, 0)),
            pl.BlockSpec((None, None, bq), lambda bi, hi, qi: (bi, hi, qi)),
        ],
        out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((b, h, sp), jnp.float32)],
        compiler_params=_compiler_params(cfg),
        interpret=cfg.interpret,
        name="flash_attention_fwd",
    )(*args)


# --------------------------------------------------------------------------------------------------------------
# Backward
# --------------------------------------------------------------------------------------------------------------


def _dq_kernel(*refs, cfg: _Config, block_q: int, block_k: int):
    if cfg.has_segments:
        seg_q_ref, seg_k_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dq_ref = refs
    else:
        q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dq_ref = refs
        seg_q_ref = seg_k_ref = None
    head_dim = q_ref.shape[-1]
    i = pl.program_id(2)
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
    for lo, hi, on_diagonal in _kv_ranges(i, block_q, block_k, num_k_blocks, cfg.causal):
        dq = lax.fori_loop(lo, hi, functools.partial(step, on_diagonal=on_diagonal), dq)
    dq_ref[...] = (dq * cfg.sm_scale).astype(dq_ref.dtype)


def _dkdv_kernel(*refs, cfg: _Config, block_q: int, block_k: int, group: int):
    if cfg.has_segments:
        seg_q_ref, seg_k_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dk_ref, dv_ref = refs
    else:
        q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dk_ref, dv_ref = refs
        seg_q_ref = seg_k_ref = None
    head_dim = k_ref.shape[-1]
    j = pl.program_id(2)
    k = k_ref[...]  # [bk, D]
    v = v_ref[...]
    k_pos = j * block_k + jnp.arange(block_k, dtype=jnp.int32)
    k_seg = None if seg_k_ref is None else seg_k_ref[...]
    qk_scale = cfg.sm_scale * LOG2E
    pad_len = cfg.seq_len if cfg.padded else None
    num_q_blocks = cfg.padded_len // block_q

    def step(t, carry, g, on_diagonal):
        dk, dv = carry
        start = pl.multiple_of(t * block_q, block_q)
        rows = pl.ds(start, block_q)
        q = q_ref[rows, g, :]
        do = do_ref[rows, g, :]
        lse = lse_ref[g, rows]
        delta = delta_ref[g, rows]
        s = _dot_nt(q, k) * qk_scale  # [bq, bk]
        q_pos = start + jnp.arange(block_q, dtype=jnp.int32)
        q_seg = None if seg_q_ref is None else seg_q_ref[rows]
        mask = _mask(q_pos, k_pos, q_seg, k_seg, causal=on_diagonal, seq_len=pad_len)
        if mask is not None:
            s = jnp.where(mask, s, MASK_VALUE)
        p = jnp.exp2(s - lse[:, None])
        dv = dv + _dot_tn(p.astype(do.dtype), do)
        dp = _dot_nt(do, v)
        ds = p * (dp - delta[:, None])
        dk = dk + _dot_tn(ds.astype(q.dtype), q)
        return dk, dv

    def head(g, carry):
        # The query heads of this kv head's group share k and v: summing their contributions here is the
        # GQA reduction, done without ever writing a per-query-head dk/dv.
        for lo, hi, on_diagonal in _q_ranges(j, block_q, block_k, num_q_blocks, cfg.causal):
            carry = lax.fori_loop(lo, hi, functools.partial(step, g=g, on_diagonal=on_diagonal), carry)
        return carry

    zeros = jnp.zeros((block_k, head_dim), jnp.float32)
    dk, dv = lax.fori_loop(0, group, head, (zeros, zeros))
    dk_ref[...] = (dk * cfg.sm_scale).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


def _backward(cfg: _Config, res, do):
    q, k, v, seg, o, lse = res
    b, sp, h, d = q.shape
    kvh = k.shape[2]
    group = h // kvh
    # delta_i = sum_d o_id * do_id: elementwise and memory-bound, XLA fuses it into one pass.
    delta = jnp.einsum("bshd,bshd->bhs", o.astype(jnp.float32), do.astype(jnp.float32))
    seg_args = [seg, seg] if cfg.has_segments else []
    params = _compiler_params(cfg)

    bq, bk = cfg.block_q_bwd, cfg.block_k_bwd
    dq_specs = [
        pl.BlockSpec((None, bq, None, d), lambda bi, hi, qi: (bi, qi, hi, 0)),  # q
        pl.BlockSpec((None, sp, None, d), lambda bi, hi, qi: (bi, 0, hi // group, 0)),  # k
        pl.BlockSpec((None, sp, None, d), lambda bi, hi, qi: (bi, 0, hi // group, 0)),  # v
        pl.BlockSpec((None, bq, None, d), lambda bi, hi, qi: (bi, qi, hi, 0)),  # do
        pl.BlockSpec((None, None, bq), lambda bi, hi, qi: (bi, hi, qi)),  # lse
        pl.BlockSpec((None, None, bq), lambda bi, hi, qi: (bi, hi, qi)),  # delta
    ]
    if cfg.has_segments:
        dq_specs = [
            pl.BlockSpec((None, bq), lambda bi, hi, qi: (bi, qi)),
            pl.BlockSpec((None, sp), lambda bi, hi, qi: (bi, 0)),
        ] + dq_specs
    dq = pl.pallas_call(
        functools.partial(_dq_kernel, cfg=cfg, block_q=bq, block_k=bk),
        grid=(b, h, sp // bq),
        in_specs=dq_specs,
        out_specs=pl.BlockSpec((None, bq, None, d), lambda bi, hi, qi: (bi, qi, hi, 0)),
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        compiler_params=params,
        interpret=cfg.interpret,
        name="flash_attention_bwd_dq",
    )(*seg_args, q, k, v, do, lse, delta)

    # The query-side operands of kv head j are the `group` consecutive query heads [j*group, (j+1)*group):
    # a block of `group` along the head axis with block index j.
    dkdv_specs = [
        pl.BlockSpec((None, sp, group, d), lambda bi, ki, kj: (bi, 0, ki, 0)),  # q
        pl.BlockSpec((None, bk, None, d), lambda bi, ki, kj: (bi, kj, ki, 0)),  # k
        pl.BlockSpec((None, bk, None, d), lambda bi, ki, kj: (bi, kj, ki, 0)),  # v
        pl.BlockSpec((None, sp, group, d), lambda bi, ki, kj: (bi, 0, ki, 0)),  # do
        pl.BlockSpec((None, group, sp), lambda bi, ki, kj: (bi, ki, 0)),  # lse
        pl.BlockSpec((None, group, sp), lambda bi, ki, kj: (bi, ki, 0)),  # delta
    ]
    if cfg.has_segments:
        dkdv_specs = [
            pl.BlockSpec((None, sp), lambda bi, ki, kj: (bi, 0)),
            pl.BlockSpec((None, bk), lambda bi, ki, kj: (bi, kj)),
        ] + dkdv_specs
    kv_block = pl.BlockSpec((None, bk, None, d), lambda bi, ki, kj: (bi, kj, ki, 0))
    dk, dv = pl.pallas_call(
        functools.partial(_dkdv_kernel, cfg=cfg, block_q=bq, block_k=bk, group=group),
        grid=(b, kvh, sp // bk),
        in_specs=dkdv_specs,
        out_specs=[kv_block, kv_block],
        out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
        compiler_params=params,
        interpret=cfg.interpret,
        name="flash_attention_bwd_dkdv",
    )(*seg_args, q, k, v, do, lse, delta)
    return dq, dk, dv, None


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _flash_padded(q, k, v, seg, cfg: _Config):
    return _forward(q, k, v, seg, cfg)[0]


def _flash_padded_fwd(q, k, v, seg, cfg: _Config):
    o, lse = _forward(q, k, v, seg, cfg)
    return o, (q, k, v, seg, o, lse)


_flash_padded.defvjp(_flash_padded_fwd, _backward)


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def make_config(seq_len: int, head_dim: int, *, causal: bool, sm_scale: float, has_segments: bool,
                interpret: bool, backend: str, sizes: BlockSizes) -> _Config:
    """Clamp the tiles to the sequence (a 40-token call needs no 128-row tile) and pick the padded length."""
    cap = max(MIN_BLOCK, pl.next_power_of_2(seq_len))
    bq, bk = min(sizes.block_q, cap), min(sizes.block_k, cap)
    bq_bwd, bk_bwd = min(sizes.block_q_bwd, cap), min(sizes.block_k_bwd, cap)
    padded_len = _round_up(seq_len, max(bq, bk, bq_bwd, bk_bwd))  # all powers of two: max is their lcm
    num_warps = sizes.num_warps or (4 if head_dim <= 64 else 8)
    return _Config(causal=causal, sm_scale=float(sm_scale), seq_len=seq_len, padded_len=padded_len,
                   block_q=bq, block_k=bk, block_q_bwd=bq_bwd, block_k_bwd=bk_bwd, num_warps=num_warps,
                   num_stages=sizes.num_stages, has_segments=has_segments, interpret=interpret, backend=backend)


@functools.partial(jax.jit, static_argnames=("cfg",))
def _flash_attention(q, k, v, segment_ids, cfg: _Config):
    pad = cfg.padded_len - cfg.seq_len
    if pad:
        widths = ((0, 0), (0, pad), (0, 0), (0, 0))
        q, k, v = (jnp.pad(x, widths) for x in (q, k, v))
        if segment_ids is not None:
            # The value is irrelevant: padded keys are masked by position, padded rows are sliced away.
            segment_ids = jnp.pad(segment_ids, ((0, 0), (0, pad)))
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
      block_sizes: fields of ``BlockSizes``.

    Returns:
      [batch, seq, heads, head_dim] in q's dtype; differentiable w.r.t. q, k, v.
    """
    if backend not in BACKENDS:
        raise ValueError(_backend_error(backend))
    sizes = BlockSizes.from_kwargs(block_sizes)
    d = q.shape[-1]
    scale = d**-0.5 if sm_scale is None else sm_scale
    cfg = make_config(q.shape[1], d, causal=causal, sm_scale=scale, has_segments=segment_ids is not None,
                      interpret=interpret, backend=backend, sizes=sizes)
    if segment_ids is not None:
        segment_ids = jnp.asarray(segment_ids, jnp.int32)
    return _flash_attention(q, k, v, segment_ids, cfg)


def _backend_error(backend) -> str:
    if backend == "mosaic_gpu":
        return ("backend='mosaic_gpu' is not implemented: Mosaic GPU cannot lower this pl.pallas_call kernel "
                "(jax 0.11 removed Mosaic GPU from pl.pallas_call; it needs a separate plgpu.kernel program with "
                "warpgroup matmuls and TMA). Use backend='triton', or impl='triton' (official Triton via "
                "jax-triton).")
    return f"unknown Pallas backend {backend!r}; expected one of {BACKENDS}"
