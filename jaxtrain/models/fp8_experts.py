"""FP8 in the routed experts' grouped matmuls (``model.fp8`` on an MoE model; docs/fp8.md, docs/moe.md).

The recipes of :mod:`jaxtrain.models.fp8` applied to ``jax.lax.ragged_dot``: the forward multiplies e4m3 x e4m3
(rows of x [M, K] by their group's w [G, K, N]), the input gradient e5m2 x e4m3 (g [M, N] by each group's w
transposed), the weight gradient e4m3 x e5m2 (each group's rows of x against its rows of g: a ragged contraction
giving [G, K, N]); every dot takes float8 operands and accumulates in float32, the scales applied to its output.

- ``tensorwise``: one current scale per tensor (x, all experts' w, g) from its amax in this step;
- ``delayed``: per-tensor scales from an amax history float32 [3, H] per projection (rows x, w, g), as the dense
  projections' (:func:`jaxtrain.models.fp8.delayed`): the history's cotangent is what the step observed.
- ``rowwise``: torchao's float8 rowwise ``_scaled_grouped_mm`` (torchtitan's ``quantize.grouped_mm.float8``) with
  the dense recipe's formats (gradients e5m2, scales not rounded to powers of two), every dot quantising its operands
  anew from x, w and g kept in high precision: the forward scales x per row (each assignment, amax over K) and w per
  expert and output column ([G, 1, N], amax over K); the input gradient g per row (over N) and w per expert and row
  of K ([G, K, 1], over N); the weight gradient, whose contraction is each group's own rows, x and g per group and
  column ([G, K] and [G, N], amaxes over that group's rows only).

The grouped-matmul kernels (``model.moe.gemm=pallas|triton``) take no float8 operands: with them the routed experts
stay in the compute dtype whatever the recipe, and :func:`precision_note` says so at start-up.

Per-tensor amaxes count only the rows inside the groups (sorted assignments; padding and dropped rows are not the
tensor's), and are reduced with ``lax.pmax`` over ``reduce``: the mesh axes of the per-device region the experts
run in (``jaxtrain.parallel.expert``), so that the scales are those of the whole tensor whatever the layout. A
rowwise amax is reduced only over the axes its own slice is split over (:class:`RowwiseAxes`): a row's over the
axes that split the contraction (``tensor``, for the down projection's K and gate's and up's N), a group's column
over the axes that split the group's rows (the token axes but the experts'), never over the axes whose devices hold
other rows, other experts or other columns.
"""

from __future__ import annotations

from functools import partial
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jaxtrain.models.fp8 import E4M3, E5M2, _amax, delayed_scale, quantize, scale_from_amax

RECIPES = ("tensorwise", "rowwise", "delayed")  # the model.fp8 recipes the routed experts multiply with


def experts_recipe(cfg: Any) -> str:
    """The recipe the routed experts of ``cfg`` (a ModelConfig, ``model.moe.gemm`` resolved) multiply with: the
    model's where it is one of :data:`RECIPES` and the grouped matmul is ragged_dot, else "none"."""
    return cfg.fp8 if cfg.fp8 in RECIPES and cfg.moe.gemm in ("xla", "auto") else "none"


def precision_note(cfg: Any) -> str | None:
    """The start-up line for an FP8 MoE model whose routed experts stay in the compute dtype, or None."""
    if not cfg.moe.experts or cfg.fp8 == "none" or experts_recipe(cfg) != "none":
        return None
    return (f"model.fp8: routed experts stay in {cfg.dtype} (the {cfg.moe.gemm} grouped-matmul kernel takes no "
            "float8 operands; model.moe.gemm=xla multiplies them in float8 through ragged_dot)")


def _in_groups(x: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """x [M, ...] with the rows past the groups zeroed."""
    return jnp.where((jnp.arange(x.shape[0]) < group_sizes.sum()).reshape(-1, *[1] * (x.ndim - 1)), x, 0)


def _gmm(a: jax.Array, b: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """a [M, K] rows by their group's b [G, K, N] -> float32 [M, N]."""
    return lax.ragged_dot(a, b, group_sizes, preferred_element_type=jnp.float32)


def _tgmm(a: jax.Array, g: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """Each group's rows of a [M, K] contracted with its rows of g [M, N] -> float32 [G, K, N]."""
    dn = lax.RaggedDotDimensionNumbers(dot_dimension_numbers=(((0,), (0,)), ((), ())), lhs_ragged_dimensions=[0],
                                       rhs_group_dimensions=[])
    return lax.ragged_dot_general(a, g, group_sizes, dn, preferred_element_type=jnp.float32)


def _forward(x, w, group_sizes, sx, sw):
    xq, wq = quantize(x, sx, E4M3), quantize(w, sw, E4M3)
    return xq, wq, _gmm(xq, wq, group_sizes) * (sx * sw)


def _like(ct: jax.Array, primal: jax.Array) -> jax.Array:
    """A cotangent summed over the manual mesh axes it varies along and its primal does not (inside shard_map: a
    weight replicated over the token axes gets the sum of every device's gradient, as ragged_dot's own transpose)."""
    extra = sorted(_varying(ct) - _varying(primal))
    return lax.psum(ct, tuple(extra)) if extra else ct


def _varying(x: jax.Array) -> set[str]:
    """The manual mesh axes x varies along (jax 0.10 and 0.11: ``manual_axis_type.varying``)."""
    aval = jax.typeof(x)
    kind = getattr(aval, "manual_axis_type", None)
    return set(kind.varying if kind is not None else getattr(aval, "vma", ()))


def _grads(xq, wq, sx, sw, g, sg, group_sizes, dtypes):
    """(dx, dw): g quantised to e5m2 with scale ``sg`` against the forward's float8 operands (whose varying mesh
    axes are x's and w's)."""
    gq = quantize(_in_groups(g, group_sizes), sg, E5M2)
    dx = (_gmm(gq, jnp.swapaxes(wq, 1, 2), group_sizes) * (sg * sw)).astype(dtypes[0])  # e5m2 x e4m3
    dw = (_tgmm(xq, gq, group_sizes) * (sx * sg)).astype(dtypes[1])  # e4m3 x e5m2
    return _like(dx, xq), _like(dw, wq)


def _row_amax(x, group_sizes, reduce):
    return _amax(_in_groups(x, group_sizes), reduce)


@partial(jax.custom_vjp, nondiff_argnums=(3,))
def grouped_tensorwise(x: jax.Array, w: jax.Array, group_sizes: jax.Array, reduce: tuple[str, ...] = ()) -> jax.Array:
    """Rows of x [M, K] (grouped as ``group_sizes`` int32 [G]) times their group's w [G, K, N] through float8 with
    one current scale per tensor -> float32 [M, N] (rows past the groups: 0)."""
    return _gt_fwd(x, w, group_sizes, reduce)[0]


def _gt_fwd(x, w, group_sizes, reduce):
    sx = scale_from_amax(_row_amax(x, group_sizes, reduce), E4M3)
    sw = scale_from_amax(_amax(w, reduce), E4M3)
    xq, wq, y = _forward(x, w, group_sizes, sx, sw)
    return y, (xq, wq, sx, sw, group_sizes, jnp.zeros((0,), x.dtype), jnp.zeros((0,), w.dtype))


def _gt_bwd(reduce, res, g):
    xq, wq, sx, sw, group_sizes, xz, wz = res  # xz, wz: empty arrays carrying x's and w's dtypes
    sg = scale_from_amax(_row_amax(g, group_sizes, reduce), E5M2)
    return (*_grads(xq, wq, sx, sw, g, sg, group_sizes, (xz.dtype, wz.dtype)), None)


grouped_tensorwise.defvjp(_gt_fwd, _gt_bwd)


@partial(jax.custom_vjp, nondiff_argnums=(4,))
def grouped_delayed(x: jax.Array, w: jax.Array, group_sizes: jax.Array, history: jax.Array,
                    reduce: tuple[str, ...] = ()) -> jax.Array:
    """:func:`grouped_tensorwise` with per-tensor scales from ``history`` float32 [3, H] (x, w, g; newest first);
    the history's cotangent: zeros but column 0, the amaxes of x, w and g this use observed."""
    return _gd_fwd(x, w, group_sizes, history, reduce)[0]


def _gd_fwd(x, w, group_sizes, history, reduce):
    ax, aw = _row_amax(x, group_sizes, reduce), _amax(w, reduce)
    sx, sw = delayed_scale(history[0], ax, E4M3), delayed_scale(history[1], aw, E4M3)
    xq, wq, y = _forward(x, w, group_sizes, sx, sw)
    return y, (xq, wq, sx, sw, ax, aw, group_sizes, history, jnp.zeros((0,), x.dtype), jnp.zeros((0,), w.dtype))


def _gd_bwd(reduce, res, g):
    xq, wq, sx, sw, ax, aw, group_sizes, history, xz, wz = res
    ag = _row_amax(g, group_sizes, reduce)
    dx, dw = _grads(xq, wq, sx, sw, g, delayed_scale(history[2], ag, E5M2), group_sizes, (xz.dtype, wz.dtype))
    seen = jnp.stack([ax, aw, ag]) * (ag > 0)
    return dx, dw, None, jnp.zeros_like(history).at[:, 0].set(seen)


grouped_delayed.defvjp(_gd_fwd, _gd_bwd)


class RowwiseAxes(NamedTuple):
    """The mesh axes of a per-device region each rowwise amax is reduced over: ``k`` those that split the forward's
    contraction K (x's columns, w's rows), ``n`` those that split N (w's and y's columns: the input gradient's
    contraction), ``rows`` those that split a group's rows (the weight gradient's contraction)."""

    k: tuple[str, ...] = ()
    n: tuple[str, ...] = ()
    rows: tuple[str, ...] = ()


ONE_DEVICE = RowwiseAxes()  # outside any per-device region: nothing to reduce over


def _group_ids(group_sizes: jax.Array, m: int) -> jax.Array:
    """int32 [m]: each row's group (empty groups hold none), G for the rows past the groups: how many group ends lie
    at or before the row (a scatter and a cumsum: jnp.searchsorted fails inside shard_map in jax 0.10.2)."""
    ends = jnp.zeros((m + 1,), jnp.int32).at[jnp.cumsum(group_sizes)].add(1)
    return jnp.cumsum(ends)[:m]


def _of_rows(s: jax.Array, ids: jax.Array) -> jax.Array:
    """Per-group values s [G, N] -> [M, N], each row its group's (1 past the groups)."""
    return jnp.take(jnp.concatenate([s, jnp.ones_like(s[:1])]), ids, axis=0)


def _rowwise_gmm(a, b, group_sizes, dtypes, split):
    """Rows of a [M, C] by their group's b [G, C, N] -> float32 [M, N]: a scaled per row, b per group and column,
    both amaxes over C (reduced over ``split``, the axes C is split over)."""
    sa = scale_from_amax(_amax(a, split, (1,)), dtypes[0])  # [M, 1]
    sb = scale_from_amax(_amax(b, split, (1,)), dtypes[1])  # [G, 1, N]
    out = _gmm(quantize(a, sa, dtypes[0]), quantize(b, sb, dtypes[1]), group_sizes)
    return out * (sa * _of_rows(sb[:, 0], _group_ids(group_sizes, a.shape[0])))


def _group_amax(a, ids, groups, reduce):
    """float32 [G, C]: max |a| over each group's rows of a [M, C], per column (0 for an empty group)."""
    amax = jnp.maximum(jax.ops.segment_max(jnp.abs(a).astype(jnp.float32), ids, groups + 1)[:groups], 0.0)
    return lax.pmax(amax, reduce) if reduce else amax


def _rowwise_tgmm(a, g, group_sizes, dtypes, reduce):
    """Each group's rows of a [M, K] contracted with its rows of g [M, N] -> float32 [G, K, N], both operands scaled
    per group and column (amaxes over the group's rows, reduced over ``reduce``: the axes that split them)."""
    groups = group_sizes.shape[0]
    ids = _group_ids(group_sizes, a.shape[0])
    sa, sg = (scale_from_amax(_group_amax(v, ids, groups, reduce), d) for v, d in ((a, dtypes[0]), (g, dtypes[1])))
    out = _tgmm(quantize(a, _of_rows(sa, ids), dtypes[0]), quantize(g, _of_rows(sg, ids), dtypes[1]), group_sizes)
    return out * (sa[:, :, None] * sg[:, None, :])


@partial(jax.custom_vjp, nondiff_argnums=(3,))
def grouped_rowwise(x: jax.Array, w: jax.Array, group_sizes: jax.Array, axes: RowwiseAxes = ONE_DEVICE) -> jax.Array:
    """Rows of x [M, K] (grouped as ``group_sizes`` int32 [G]) times their group's w [G, K, N] through float8 with
    a scale per row of x and per expert and column of w; each backward dot quantises its operands along its own kept
    axes (module docstring) -> float32 [M, N] (rows past the groups: 0). ``axes``: :class:`RowwiseAxes`."""
    return _rowwise_gmm(x, w, group_sizes, (E4M3, E4M3), axes.k)


def _gr_fwd(x, w, group_sizes, axes):
    return grouped_rowwise(x, w, group_sizes, axes), (x, w, group_sizes)


def _gr_bwd(axes, res, g):
    x, w, group_sizes = res
    g = _in_groups(g, group_sizes)
    dx = _rowwise_gmm(g, jnp.swapaxes(w, 1, 2), group_sizes, (E5M2, E4M3), axes.n).astype(x.dtype)  # e5m2 x e4m3
    dw = _rowwise_tgmm(_in_groups(x, group_sizes), g, group_sizes, (E4M3, E5M2), axes.rows).astype(w.dtype)
    return _like(dx, x), _like(dw, w), None


grouped_rowwise.defvjp(_gr_fwd, _gr_bwd)


def grouped_fp8(x: jax.Array, w: jax.Array, group_sizes: jax.Array, recipe: str, history: jax.Array | None = None,
                reduce: tuple[str, ...] = (), rowwise_axes: RowwiseAxes = ONE_DEVICE) -> jax.Array:
    """The grouped matmul through ``recipe`` (:data:`RECIPES`; ``history`` [3, H] for delayed; ``reduce`` the axes
    of per-tensor amaxes, ``rowwise_axes`` those of rowwise ones) -> float32 [M, N]."""
    if recipe == "tensorwise":
        return grouped_tensorwise(x, w, group_sizes, reduce)
    if recipe == "rowwise":
        return grouped_rowwise(x, w, group_sizes, rowwise_axes)
    if recipe == "delayed":
        assert history is not None
        return grouped_delayed(x, w, group_sizes, history, reduce)
    raise ValueError(f"no grouped FP8 recipe {recipe!r}; expected one of {RECIPES}")
