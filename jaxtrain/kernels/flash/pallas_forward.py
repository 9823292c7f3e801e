"""The Pallas forward kernel: one program per (query tile, batch, head), online softmax over the key tiles its
query tile can see, float32 accumulators; writes o and the base-2 log-sum-exp of every row for the backward
(see ``jaxtrain.kernels.flash.pallas`` for the algorithm)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jaxtrain.kernels.flash.common import LOG2E, MASK_VALUE
from jaxtrain.kernels.flash.pallas_launch import CallConfig, compiler_params
from jaxtrain.kernels.flash.pallas_tiles import (
    clamp_ranges,
    dot_nn,
    dot_nt,
    kv_ranges,
    leading_operands,
    plus,
    ref_bounds,
    tile_index,
    tile_mask,
    tile_ranges,
    unpack_refs,
)


def _fwd_kernel(*refs, cfg: CallConfig):
    shift, bounds_ref, seg_q_ref, seg_k_ref, (q_ref, k_ref, v_ref, o_ref, lse_ref) = unpack_refs(refs, cfg)
    block_q, block_k = cfg.fwd.block_q, cfg.fwd.block_k
    head_dim = q_ref.shape[-1]
    i = tile_index(cfg, pl.program_id(0), cfg.padded_q // block_q)
    q = q_ref[...]  # [bq, D]; stays resident for the whole kv loop
    q_pos = plus(i * block_q + jnp.arange(block_q, dtype=jnp.int32), shift)
    q_seg = None if seg_q_ref is None else seg_q_ref[...]
    qk_scale = cfg.sm_scale * LOG2E  # work in base 2: exp2 is the cheap instruction
    pad_len = cfg.seq_k if cfg.padded else None

    def step(j, carry, on_diagonal):
        acc, m_prev, l_prev = carry
        start = pl.multiple_of(j * block_k, block_k)
        k = k_ref[pl.ds(start, block_k), :]
        v = v_ref[pl.ds(start, block_k), :]
        s = dot_nt(q, k) * qk_scale  # [bq, bk] float32
        k_pos = start + jnp.arange(block_k, dtype=jnp.int32)
        k_seg = None if seg_k_ref is None else seg_k_ref[pl.ds(start, block_k)]
        mask = tile_mask(q_pos, k_pos, q_seg, k_seg, causal=on_diagonal, seq_len=pad_len, window=cfg.window)
        if mask is not None:
            s = jnp.where(mask, s, MASK_VALUE)
        m_new = jnp.maximum(m_prev, jnp.max(s, axis=1))
        alpha = jnp.exp2(m_prev - m_new)
        p = jnp.exp2(s - m_new[:, None])
        l_new = alpha * l_prev + jnp.sum(p, axis=1)
        acc = acc * alpha[:, None] + dot_nn(p.astype(v.dtype), v)
        return acc, m_new, l_new

    carry = (
        jnp.zeros((block_q, head_dim), jnp.float32),
        jnp.full((block_q,), -jnp.inf, jnp.float32),
        jnp.zeros((block_q,), jnp.float32),
    )
    num_k_blocks = cfg.padded_k // block_k
    for lo, hi, on_diagonal in clamp_ranges(kv_ranges(i, block_q, block_k, num_k_blocks, cfg.causal, shift,
                                                  cfg.padded_q > cfg.padded_k, cfg.window),
                                      ref_bounds(bounds_ref)):
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


def forward(q, k, v, seg_q, seg_k, shift, cfg: CallConfig):
    """Padded inputs -> (o [B, Sq, H, D] in cfg.out_dtype or q's, lse [B, H, Sq] float32, base 2).

    q [B, Sq, H, D]; k, v [B, Sk, KVH, D]; seg_q [B, Sq] / seg_k [B, Sk] int32 or None; shift int32 [1] or None."""
    b, sp, h, d = q.shape
    sk = k.shape[1]
    group = h // k.shape[2]
    bq = cfg.fwd.block_q
    nq = sp // bq
    t = functools.partial(tile_index, cfg, num_tiles=nq)
    lead_specs, lead_args = leading_operands(cfg, shift, [
        pl.BlockSpec((None, None, 2), lambda qi, bi, hi: (bi, t(qi), 0)),
        pl.BlockSpec((None, bq), lambda qi, bi, hi: (bi, t(qi))),
        pl.BlockSpec((None, sk), lambda qi, bi, hi: (bi, 0)),
    ], lambda: [tile_ranges(seg_q, seg_k, cfg.fwd, False), seg_q, seg_k])
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
        compiler_params=compiler_params(cfg, cfg.fwd),
        interpret=cfg.interpret,
        name="flash_attention_fwd",
    )(*lead_args, q, k, v)
