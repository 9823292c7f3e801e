"""The Pallas backward kernels: dq per (query tile, batch, head) over the key tiles, and dk/dv per (key tile,
batch, kv head) over the query heads of its GQA group and their query tiles, on S transposed ([kv, q]) so that
P^T and dS^T come out of the matmuls in the layout the next one takes (see ``jaxtrain.kernels.flash.pallas``)."""

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
    is_zero,
    kv_ranges,
    leading_operands,
    plus,
    q_ranges,
    ref_bounds,
    tile_index,
    tile_mask,
    tile_ranges,
    unpack_refs,
)
from jaxtrain.kernels.flash.tiling import dkdv_passes


def _dq_kernel(*refs, cfg: CallConfig):
    shift, bounds_ref, seg_q_ref, seg_k_ref, rest = unpack_refs(refs, cfg)
    q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dq_ref = rest
    block_q, block_k = cfg.dq.block_q, cfg.dq.block_k
    head_dim = q_ref.shape[-1]
    i = tile_index(cfg, pl.program_id(0), cfg.padded_q // block_q)
    q = q_ref[...]
    do = do_ref[...]
    lse = lse_ref[...]
    delta = delta_ref[...]
    q_pos = plus(i * block_q + jnp.arange(block_q, dtype=jnp.int32), shift)
    q_seg = None if seg_q_ref is None else seg_q_ref[...]
    qk_scale = cfg.sm_scale * LOG2E
    pad_len = cfg.seq_k if cfg.padded else None

    def step(j, dq, on_diagonal):
        start = pl.multiple_of(j * block_k, block_k)
        k = k_ref[pl.ds(start, block_k), :]
        v = v_ref[pl.ds(start, block_k), :]
        s = dot_nt(q, k) * qk_scale
        k_pos = start + jnp.arange(block_k, dtype=jnp.int32)
        k_seg = None if seg_k_ref is None else seg_k_ref[pl.ds(start, block_k)]
        mask = tile_mask(q_pos, k_pos, q_seg, k_seg, causal=on_diagonal, seq_len=pad_len, window=cfg.window)
        if mask is not None:
            s = jnp.where(mask, s, MASK_VALUE)
        p = jnp.exp2(s - lse[:, None])
        dp = dot_nt(do, v)
        ds = p * (dp - delta[:, None])
        return dq + dot_nn(ds.astype(k.dtype), k)

    dq = jnp.zeros((block_q, head_dim), jnp.float32)
    num_k_blocks = cfg.padded_k // block_k
    for lo, hi, on_diagonal in clamp_ranges(kv_ranges(i, block_q, block_k, num_k_blocks, cfg.causal, shift,
                                                  cfg.padded_q > cfg.padded_k, cfg.window),
                                      ref_bounds(bounds_ref)):
        dq = lax.fori_loop(lo, hi, functools.partial(step, on_diagonal=on_diagonal), dq)
    dq_ref[...] = (dq * cfg.sm_scale).astype(dq_ref.dtype)


def _dkdv_kernel(*refs, cfg: CallConfig, group: int, want: tuple[str, ...]):
    """``want``: ("dk", "dv"), or one of them (a pass of a two-pass backward, see ``dkdv_passes``)."""
    refs, out_refs = refs[:len(refs) - len(want)], dict(zip(want, refs[len(refs) - len(want):]))
    shift, bounds_ref, seg_q_ref, seg_k_ref, rest = unpack_refs(refs, cfg)
    q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref = rest
    block_q, block_k = cfg.dkdv.block_q, cfg.dkdv.block_k
    head_dim = k_ref.shape[-1]
    j = pl.program_id(0)  # kv tile 0 sees the most query tiles under causal: natural order is heaviest first
    k = k_ref[...]  # [bk, D]
    v = v_ref[...]
    # Keys in query positions (k - shift), shifted once here rather than every query tile in the loop (fewer live
    # registers: the d128 kernel sits at the register limit); the padding bound moves with them.
    k_pos = plus(j * block_k + jnp.arange(block_k, dtype=jnp.int32), 0 if is_zero(shift) else -shift)
    k_seg = None if seg_k_ref is None else seg_k_ref[...]
    qk_scale = cfg.sm_scale * LOG2E
    pad_len = plus(cfg.seq_k, 0 if is_zero(shift) else -shift) if cfg.padded else None
    num_q_blocks = cfg.padded_q // block_q
    ranges = clamp_ranges(q_ranges(j, block_q, block_k, num_q_blocks, cfg.causal, shift, cfg.window),
                          ref_bounds(bounds_ref))

    def step(t, carry, g, on_diagonal):
        # Transposed: rows are keys, columns queries, so P^T and dS^T are produced, not transposed.
        dk, dv = carry
        start = pl.multiple_of(t * block_q, block_q)
        rows = pl.ds(start, block_q)
        q = q_ref[rows, g, :]
        do = do_ref[rows, g, :]
        lse = lse_ref[g, rows]
        delta = delta_ref[g, rows]
        s_t = dot_nt(k, q) * qk_scale  # [bk, bq]
        q_pos = start + jnp.arange(block_q, dtype=jnp.int32)
        q_seg = None if seg_q_ref is None else seg_q_ref[rows]
        mask = tile_mask(q_pos, k_pos, q_seg, k_seg, causal=on_diagonal, seq_len=pad_len, kv_major=True,
                         window=cfg.window)
        if mask is not None:
            s_t = jnp.where(mask, s_t, MASK_VALUE)
        p_t = jnp.exp2(s_t - lse[None, :])
        if "dv" in want:
            dv = dv + dot_nn(p_t.astype(do.dtype), do)
        if "dk" in want:
            dp_t = dot_nt(v, do)  # [bk, bq]
            ds_t = p_t * (dp_t - delta[None, :])
            dk = dk + dot_nn(ds_t.astype(q.dtype), q)
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


def backward_kernels(q, k, v, seg_q, seg_k, shift, do, lse, delta, cfg: CallConfig):
    """Padded inputs -> (dq [B, Sq, H, D], dk, dv [B, Sk, KVH, D]) in cfg.grad_dtype or the inputs' dtype.

    lse [B, H, Sq] float32 base 2, +inf for rows without a visible key (so their p is 0); delta [B, H, Sq]."""
    dq = _dq_call(q, k, v, seg_q, seg_k, shift, do, lse, delta, cfg)
    dk, dv = _dkdv_calls(q, k, v, seg_q, seg_k, shift, do, lse, delta, cfg)
    return dq, dk, dv


def _dq_call(q, k, v, seg_q, seg_k, shift, do, lse, delta, cfg: CallConfig):
    """The dq kernel's launch: one program per (query tile, batch, head), the query tile on the fastest axis."""
    b, sp, h, d = q.shape
    sk = k.shape[1]
    group = h // k.shape[2]
    bq = cfg.dq.block_q
    nq = sp // bq
    t = functools.partial(tile_index, cfg, num_tiles=nq)
    lead_specs, lead_args = leading_operands(cfg, shift, [
        pl.BlockSpec((None, None, 2), lambda qi, bi, hi: (bi, t(qi), 0)),
        pl.BlockSpec((None, bq), lambda qi, bi, hi: (bi, t(qi))),
        pl.BlockSpec((None, sk), lambda qi, bi, hi: (bi, 0)),
    ], lambda: [tile_ranges(seg_q, seg_k, cfg.dq, False), seg_q, seg_k])
    dq_specs = lead_specs + [
        pl.BlockSpec((None, bq, None, d), lambda qi, bi, hi: (bi, t(qi), hi, 0)),  # q
        pl.BlockSpec((None, sk, None, d), lambda qi, bi, hi: (bi, 0, hi // group, 0)),  # k
        pl.BlockSpec((None, sk, None, d), lambda qi, bi, hi: (bi, 0, hi // group, 0)),  # v
        pl.BlockSpec((None, bq, None, d), lambda qi, bi, hi: (bi, t(qi), hi, 0)),  # do
        pl.BlockSpec((None, None, bq), lambda qi, bi, hi: (bi, hi, t(qi))),  # lse
        pl.BlockSpec((None, None, bq), lambda qi, bi, hi: (bi, hi, t(qi))),  # delta
    ]
    return pl.pallas_call(
        functools.partial(_dq_kernel, cfg=cfg),
        grid=(nq, b, h),
        in_specs=dq_specs,
        out_specs=pl.BlockSpec((None, bq, None, d), lambda qi, bi, hi: (bi, t(qi), hi, 0)),
        out_shape=jax.ShapeDtypeStruct(q.shape, cfg.grad_dtype or q.dtype),
        compiler_params=compiler_params(cfg, cfg.dq),
        interpret=cfg.interpret,
        name="flash_attention_bwd_dq",
    )(*lead_args, q, k, v, do, lse, delta)


def _dkdv_calls(q, k, v, seg_q, seg_k, shift, do, lse, delta, cfg: CallConfig):
    """The dk/dv kernel's launch (two passes at head dim 256, see ``dkdv_passes``) -> (dk, dv); with a split GQA
    group the float32 partial sums are added here."""
    b, sp, h, d = q.shape
    sk, kvh = k.shape[1], k.shape[2]
    group = h // kvh
    # Program (kv tile, batch, x) with x = kv head * splits + split takes the `per` = group // splits consecutive
    # query heads [x*per, (x+1)*per) of kv head x // splits: a block of `per` along the head axis, block index x.
    bk, splits = cfg.dkdv.block_k, cfg.splits
    per = group // splits
    lead_specs, lead_args = leading_operands(cfg, shift, [
        pl.BlockSpec((None, None, 2), lambda kj, bi, x: (bi, kj, 0)),
        pl.BlockSpec((None, sp), lambda kj, bi, x: (bi, 0)),
        pl.BlockSpec((None, bk), lambda kj, bi, x: (bi, kj)),
    ], lambda: [tile_ranges(seg_q, seg_k, cfg.dkdv, True), seg_q, seg_k])
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
            compiler_params=compiler_params(cfg, cfg.dkdv),
            interpret=cfg.interpret,
            name="flash_attention_bwd_" + "".join(want),
        )(*lead_args, q, k, v, do, lse, delta)
        grads.update(zip(want, outs))
    if splits > 1:
        grads = {name: g.sum(0).astype(grad_dtype) for name, g in grads.items()}
    return grads["dk"], grads["dv"]
