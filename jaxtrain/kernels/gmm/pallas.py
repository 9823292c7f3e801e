"""The grouped matmul kernels in Pallas (``jaxtrain.kernels.gmm.api``, ``impl="pallas"``): ``gmm`` (the forward
and d_lhs) and ``tgmm`` (d_rhs), each one ``pl.pallas_call`` over a 1-D grid of output tiles.

``gmm``: a program owns an output tile of ``tm`` rows x ``tn`` columns. Its rows may belong to several groups (a
tile never needs to align with group boundaries, and m need not be a tile multiple): it loops over the groups
[lo, hi) that XLA listed for its row tile (``gmm_plan.row_tile_groups``), and for each over the contraction in
``tc`` steps, loading the lhs rows of that group only (a masked load: other rows read as 0) against W_g's tile, all
into one float32 accumulator; a group with no row in the tile is skipped. Rows past the last group get no group
and stay 0. W_g is rhs[g] (forward) or rhs[g]^T (d_lhs: ``transpose_w``, the tile loaded as stored and the dot
contracting its last axis).

``tgmm``: a program owns an output tile of d_rhs[g] (``tp`` x ``tq``) and loops over group g's rows from its first
row in chunks of ``tr``, masking rows past the group's end; an empty group's tile is zeros.

The operands are whole-array blocks indexed in the kernel (their tiles depend on the group tables, which no index
map can read in the Triton lowering: it has no scalar prefetch); loads and stores at the edges are masked
(``jax.experimental.pallas.triton.load`` / ``store``, which the interpreter also runs). Float32 operands get
exact float32 dots (``precision=HIGHEST``): the Triton lowering otherwise makes them TF32.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxtrain.kernels.gmm.plan import GmmGeometry, TgmmGeometry, band_order, group_offsets, row_tile_groups


def _dot(a, b, contract_a: int, contract_b: int):
    """float32 [x, y] product of two 2-D tiles contracting the given axes (HIGHEST: exact float32, no TF32)."""
    return lax.dot_general(a, b, (((contract_a,), (contract_b,)), ((), ())), precision=lax.Precision.HIGHEST,
                           preferred_element_type=jnp.float32)


def _compiler_params(geo, interpret: bool):
    if interpret:
        return None
    return plgpu.CompilerParams(num_warps=geo.num_warps, num_stages=geo.num_stages)


def _full_spec(shape):
    return pl.BlockSpec(shape, lambda pid: (0,) * len(shape))


def _mask2(row_ok, col_ok):
    """[r, c] (or broadcastable) mask from optional 1-D row and column masks; None when every position is valid."""
    mask = None if row_ok is None else row_ok[:, None]
    if col_ok is not None:
        mask = col_ok[None, :] if mask is None else mask & col_ok[None, :]
    return mask


def _load(ref, idx, mask):
    """ref[idx], masked positions 0 (an unmasked load when mask is None)."""
    return ref[idx] if mask is None else plgpu.load(ref.at[idx], mask=mask, other=0.0)


def _store(ref, idx, value, mask):
    if mask is None:
        ref[idx] = value
    else:
        plgpu.store(ref.at[idx], value, mask=mask)


def _gmm_kernel(offsets_ref, tiles_ref, a_ref, w_ref, o_ref, *, geo: GmmGeometry):
    mi, ni = band_order(pl.program_id(0), geo.tiles_m, geo.tiles_n, geo.band, jnp.minimum)
    row0, col0 = mi * geo.tm, ni * geo.tn
    rows = row0 + jnp.arange(geo.tm, dtype=jnp.int32)
    cols = col0 + jnp.arange(geo.tn, dtype=jnp.int32)
    col_mask = None if geo.even_n else cols < geo.cols
    tiles_c = -(-geo.contract // geo.tc)

    def contract_step(c, acc, g, row_ok):
        c0 = c * geo.tc
        cs = c0 + jnp.arange(geo.tc, dtype=jnp.int32)
        c_mask = None if geo.even_c else cs < geo.contract
        a = _load(a_ref, (pl.ds(row0, geo.tm), pl.ds(c0, geo.tc)), _mask2(row_ok, c_mask))
        if geo.transpose_w:  # W_g stored [cols, contract]: load the tile as stored, contract its last axis
            w = _load(w_ref, (g, pl.ds(col0, geo.tn), pl.ds(c0, geo.tc)), _mask2(col_mask, c_mask))
            return acc + _dot(a, w, 1, 1)
        w = _load(w_ref, (g, pl.ds(c0, geo.tc), pl.ds(col0, geo.tn)), _mask2(c_mask, col_mask))
        return acc + _dot(a, w, 1, 0)

    def group_step(g, acc):
        first = jnp.maximum(offsets_ref[g], row0)
        end = jnp.minimum(offsets_ref[g + 1], row0 + geo.tm)
        row_ok = (rows >= first) & (rows < end)
        steps = jnp.where(end > first, jnp.int32(tiles_c), jnp.int32(0))  # a group with no row here costs nothing
        return lax.fori_loop(0, steps, functools.partial(contract_step, g=g, row_ok=row_ok), acc)

    acc = lax.fori_loop(tiles_ref[mi, 0], tiles_ref[mi, 1], group_step,
                        jnp.zeros((geo.tm, geo.tn), jnp.float32))
    _store(o_ref, (pl.ds(row0, geo.tm), pl.ds(col0, geo.tn)), acc.astype(o_ref.dtype),
           _mask2(None if geo.even_m else rows < geo.rows, col_mask))


def gmm(a, w, group_sizes, geo: GmmGeometry, *, interpret: bool, name: str):
    """out [rows, cols] in a's dtype = a [rows, contract] @ W_g for each row's group g (rows past the groups: 0).

    w: [groups, contract, cols], or [groups, cols, contract] with ``geo.transpose_w``; group_sizes int [groups]."""
    offsets = group_offsets(group_sizes, geo.rows)
    tiles = row_tile_groups(offsets, geo.rows, geo.tm)
    return pl.pallas_call(
        functools.partial(_gmm_kernel, geo=geo),
        grid=(geo.programs,),
        in_specs=[_full_spec(offsets.shape), _full_spec(tiles.shape), _full_spec(a.shape), _full_spec(w.shape)],
        out_specs=_full_spec((geo.rows, geo.cols)),
        out_shape=jax.ShapeDtypeStruct((geo.rows, geo.cols), a.dtype),
        compiler_params=_compiler_params(geo, interpret),
        interpret=interpret,
        name=name,
    )(offsets, tiles, a, w)


def _tgmm_kernel(offsets_ref, a_ref, b_ref, o_ref, *, geo: TgmmGeometry):
    per_group = geo.tiles_p * geo.tiles_q
    pid = pl.program_id(0)
    g = pid // per_group
    pi, qi = band_order(pid % per_group, geo.tiles_p, geo.tiles_q, geo.band, jnp.minimum)
    p0, q0 = pi * geo.tp, qi * geo.tq
    ps = p0 + jnp.arange(geo.tp, dtype=jnp.int32)
    qs = q0 + jnp.arange(geo.tq, dtype=jnp.int32)
    p_mask = None if geo.even_p else ps < geo.p
    q_mask = None if geo.even_q else qs < geo.q
    start, end = offsets_ref[g], offsets_ref[g + 1]

    def row_step(r, acc):
        r0 = start + r * geo.tr
        row_ok = r0 + jnp.arange(geo.tr, dtype=jnp.int32) < end
        a = _load(a_ref, (pl.ds(r0, geo.tr), pl.ds(p0, geo.tp)), _mask2(row_ok, p_mask))
        b = _load(b_ref, (pl.ds(r0, geo.tr), pl.ds(q0, geo.tq)), _mask2(row_ok, q_mask))
        return acc + _dot(a, b, 0, 0)

    steps = lax.div(end - start + geo.tr - 1, geo.tr)
    acc = lax.fori_loop(0, steps, row_step, jnp.zeros((geo.tp, geo.tq), jnp.float32))
    _store(o_ref, (g, pl.ds(p0, geo.tp), pl.ds(q0, geo.tq)), acc.astype(o_ref.dtype), _mask2(p_mask, q_mask))


def tgmm(a, b, group_sizes, geo: TgmmGeometry, *, interpret: bool, out_dtype, name: str):
    """out [groups, p, q] in out_dtype: out[g] = a[rows of g]^T @ b[rows of g] (a [rows, p], b [rows, q])."""
    offsets = group_offsets(group_sizes, geo.rows)
    out_shape = (geo.groups, geo.p, geo.q)
    return pl.pallas_call(
        functools.partial(_tgmm_kernel, geo=geo),
        grid=(geo.programs,),
        in_specs=[_full_spec(offsets.shape), _full_spec(a.shape), _full_spec(b.shape)],
        out_specs=_full_spec(out_shape),
        out_shape=jax.ShapeDtypeStruct(out_shape, out_dtype),
        compiler_params=_compiler_params(geo, interpret),
        interpret=interpret,
        name=name,
    )(offsets, a, b)
