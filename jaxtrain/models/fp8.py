"""FP8 matmuls for training (``model.fp8``): the projections' dots through float8 with per-step scales.

Every recipe quantises the forward operands to float8_e4m3fn and the incoming gradient to float8_e5m2 (Transformer
Engine's HYBRID format): the forward dot is e4m3 x e4m3, the input gradient's dot e5m2 x e4m3, the weight
gradient's e4m3 x e5m2, each written as a ``lax.dot_general`` of float8 operands (not as quantise-dequantise around a
16-bit dot, which XLA:GPU's Triton path turns back into a 16-bit GEMM) that produces the compute dtype (float32 for
float16 compute, whose range the unscaled product could exceed).

A *scale* is the dequantisation factor ``amax / max`` (448 for e4m3, 57344 for e5m2); quantising is
``convert(clip(x / scale))``, rounding to nearest even; a scale is 1 where the amax is 0 or not finite.

- ``tensorwise``: current scaling, one scale per tensor (x, w, g) from its amax in this very step (torchao's
  tensorwise, TE's Float8CurrentScaling). The backward reuses the forward's float8 x and w.
- ``rowwise``: a scale per row of each operand along the dot's non-contracting axes, every dot quantising its
  operands anew (torchao's rowwise recipe, gradients e5m2 here): the forward scales x per token and w per output
  column, the backward per row of g and per column of the contracted axis; x and w are kept in high precision.
- ``delayed``: per-tensor scales from an amax history (TE's DelayedScaling: ``amax_compute_algo=max``, margin 0),
  ``history`` float32 [3, H] per projection (rows x, w, g; newest first), state of the model (:class:`Fp8Meta`),
  checkpointed with it. The first step, with an empty history, scales by the current amax (TE's scale 1 would flush
  gradients of 1e-5 to zero). The history's "gradient" is what the step observed: zeros but column 0, the amaxes
  of x, w and g (Flax's overwrite-with-gradient route, the only one out of a backward pass); the train step combines
  these with max over microbatches, data-parallel groups and pipeline iterations, never a sum (the history is
  observed state: its rule is declared in :mod:`jaxtrain.models.sidestate`), and pushes the result into the history
  (:func:`push_observed`). A use whose output gradient is all zero observes
  nothing (a pipeline's idle iterations).

Current-scaling amaxes are those of the whole tensor the program computes on: GSPMD reduces a sharded tensor's
amax over its devices itself; inside per-device regions (the pipelines' shard_map, unreduced accumulation's vmap
over data-parallel groups) the caller names the axes to reduce over with :func:`amax_over`, so that the scales, and
the numbers, do not depend on the layout.

The model gives its attention and MLP projections an :class:`Fp8Dot` each as their ``dot_general`` (:func:`use_fp8`);
embeddings, norms and the output projection stay in the compute dtype. The step and the pipelines combine the
histories' cotangents through :mod:`jaxtrain.models.sidestate`. This
module names no mesh axis.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

from jaxtrain.config.hardware import for_device_kind
from jaxtrain.errors import ConfigError

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
RECIPES = ("none", "tensorwise", "rowwise", "delayed")
META_NAME = "amax_history"  # the attribute (and path key) of a projection's history
_AMAX_AXES: contextvars.ContextVar[tuple[str, ...]] = contextvars.ContextVar("fp8_amax_axes", default=())


class Fp8Meta(nnx.Variable):
    """One projection's delayed-scaling amax history float32 [3, H] (x, w, g; newest first); stacked with the layers
    [layers, 3, H]. Not an ``nnx.Param``: the optimizer, the gradient norm and the non-finite check never see it."""


@contextlib.contextmanager
def amax_over(axes: tuple[str, ...]) -> Iterator[None]:
    """Inside: every amax is also reduced (``lax.pmax``) over the named axes (a vmap's or shard_map's), so that it is
    the whole tensor's, as GSPMD gives it outside such regions."""
    token = _AMAX_AXES.set(tuple(axes))
    try:
        yield
    finally:
        _AMAX_AXES.reset(token)


def fp8_max(dtype) -> float:
    return float(jnp.finfo(dtype).max)


def scale_from_amax(amax: jax.Array, dtype) -> jax.Array:
    """float32 dequantisation scale ``amax / max(dtype)``; 1 where amax is 0 or not finite."""
    amax = amax.astype(jnp.float32)
    scale = amax / jnp.float32(fp8_max(dtype))
    return jnp.where((amax > 0) & jnp.isfinite(amax), scale, jnp.float32(1.0))


def quantize(x: jax.Array, scale: jax.Array, dtype) -> jax.Array:
    """``x / scale`` in float32 (scale broadcast against x), clipped to dtype's range, rounded to nearest even."""
    m = fp8_max(dtype)
    return jnp.clip(x.astype(jnp.float32) / scale, -m, m).astype(dtype)


def _amax(x: jax.Array, reduce: tuple[str, ...], axis=None) -> jax.Array:
    """float32 max |x| over ``axis`` (None: all; kept as size-1 dims), then over the named axes ``reduce``."""
    a = jnp.max(jnp.abs(x), axis=axis, keepdims=axis is not None).astype(jnp.float32)
    return lax.pmax(a, reduce) if reduce else a


def _gemm_dtype(out_dtype) -> Any:
    return jnp.float32 if jnp.dtype(out_dtype) == jnp.float16 else out_dtype


def _dot(a, b, ca, cb, out_dtype):
    """float8 x float8 dot_general contracting a's axes ``ca`` with b's ``cb``, no batch axes, in ``out_dtype``."""
    return lax.dot_general(a, b, ((tuple(ca), tuple(cb)), ((), ())), preferred_element_type=_gemm_dtype(out_dtype))


def _axes(nl: int, c: int, nr: int):
    """Contracting axes of the three dots of x [*L (nl), *C (c)] @ w [*C, *R (nr)] -> y [*L, *R]:
    forward (x's C, w's C), input gradient (g's R, w's R), weight gradient (x's L, g's L)."""
    return ((range(nl, nl + c), range(c)), (range(nl, nl + nr), range(c, c + nr)), (range(nl), range(nl)))


def _scaled(out, scale, dtype):
    return (out * scale.astype(out.dtype)).astype(dtype)


# ---------------------------------------------------------------------------------------------------- per tensor
def _tensorwise_fwd(x, w, nl, reduce, sx=None, sw=None):
    """Quantised operands, their scales and y for per-tensor scales (current ones unless sx, sw are given). Only
    x's and g's amaxes are reduced over ``reduce``: their token axes are what such regions split; w is whole."""
    sx = scale_from_amax(_amax(x, reduce), E4M3) if sx is None else sx
    sw = scale_from_amax(_amax(w, ()), E4M3) if sw is None else sw
    xq, wq = quantize(x, sx, E4M3), quantize(w, sw, E4M3)
    (cx, cw), _, _ = _axes(nl, x.ndim - nl, 0)
    return xq, wq, sx, sw, _scaled(_dot(xq, wq, cx, cw, x.dtype), sx * sw, x.dtype)


def _per_tensor_grads(xq, wq, sx, sw, sg, g, nl, dtypes):
    """(dx, dw) from the forward's float8 operands and g quantised with scale ``sg``."""
    c = xq.ndim - nl
    _, (cg, cw), (cx, cg2) = _axes(nl, c, g.ndim - nl)
    gq = quantize(g, sg, E5M2)
    dx = _scaled(_dot(gq, wq, cg, cw, dtypes[0]), sg * sw, dtypes[0])  # e5m2 x e4m3 -> x's shape
    dw = _scaled(_dot(xq, gq, cx, cg2, dtypes[1]), sx * sg, dtypes[1])  # e4m3 x e5m2 -> w's shape
    return dx, dw


@partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def tensorwise(x: jax.Array, w: jax.Array, nl: int, reduce: tuple[str, ...] = ()) -> jax.Array:
    """y [*L, *R] = x [*L, *C] . w [*C, *R] (``nl`` = len(L)) through float8 with one current scale per tensor;
    y in x's dtype. ``reduce``: named axes the amaxes are also reduced over (:func:`amax_over`)."""
    return _tensorwise_fwd(x, w, nl, reduce)[-1]


def _tw_fwd(x, w, nl, reduce):
    xq, wq, sx, sw, y = _tensorwise_fwd(x, w, nl, reduce)
    return y, (xq, wq, sx, sw, jnp.zeros((0,), x.dtype), jnp.zeros((0,), w.dtype))


def _tw_bwd(nl, reduce, res, g):
    xq, wq, sx, sw, xz, wz = res  # xz, wz: empty arrays carrying x's and w's dtypes into the backward
    return _per_tensor_grads(xq, wq, sx, sw, scale_from_amax(_amax(g, reduce), E5M2), g, nl, (xz.dtype, wz.dtype))


tensorwise.defvjp(_tw_fwd, _tw_bwd)


# ---------------------------------------------------------------------------------------------------- rowwise
def _rowwise_dot(a, b, ca, cb, dtypes, out_dtype, reduce=()):
    """a . b contracting ``ca`` with ``cb``, each operand quantised with a scale per slice along its kept axes. The
    amaxes are reduced over ``reduce`` only where they span the token axes (the weight gradient's dot, which
    contracts them): a per-token scale is the token's own."""
    sa = scale_from_amax(_amax(a, reduce, tuple(ca)), dtypes[0])
    sb = scale_from_amax(_amax(b, reduce, tuple(cb)), dtypes[1])
    out = _dot(quantize(a, sa, dtypes[0]), quantize(b, sb, dtypes[1]), ca, cb, out_dtype)
    kept_a = [n for i, n in enumerate(a.shape) if i not in ca]
    kept_b = [n for i, n in enumerate(b.shape) if i not in cb]
    # the output's axes: a's kept ones, then b's kept ones
    scale = sa.reshape(*kept_a, *[1] * len(kept_b)) * sb.reshape(*[1] * len(kept_a), *kept_b)
    return _scaled(out, scale, out_dtype)


@partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def rowwise(x: jax.Array, w: jax.Array, nl: int, reduce: tuple[str, ...] = ()) -> jax.Array:
    """y [*L, *R] = x [*L, *C] . w [*C, *R] through float8 with a scale per row of x (each of L) and per column of
    w (each of R); each backward dot quantises its operands along its own kept axes. y in x's dtype."""
    (cx, cw), _, _ = _axes(nl, x.ndim - nl, w.ndim - x.ndim + nl)
    return _rowwise_dot(x, w, cx, cw, (E4M3, E4M3), x.dtype)


def _rw_fwd(x, w, nl, reduce):
    return rowwise(x, w, nl, reduce), (x, w)


def _rw_bwd(nl, reduce, res, g):
    x, w = res
    _, (cg, cw), (cx, cg2) = _axes(nl, x.ndim - nl, g.ndim - nl)
    dx = _rowwise_dot(g, w, cg, cw, (E5M2, E4M3), x.dtype)  # scales per row of g, per row (C) of w
    dw = _rowwise_dot(x, g, cx, cg2, (E4M3, E5M2), w.dtype, reduce)  # per column (C) of x, per column of g
    return dx, dw


rowwise.defvjp(_rw_fwd, _rw_bwd)


# ---------------------------------------------------------------------------------------------------- delayed
def delayed_scale(history: jax.Array, amax_now: jax.Array, dtype) -> jax.Array:
    """Scale from max(history [H]); an empty history (the first step) uses the current amax instead."""
    hmax = jnp.max(history)
    return scale_from_amax(jnp.where(hmax > 0, hmax, amax_now), dtype)


@partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def delayed(x: jax.Array, w: jax.Array, history: jax.Array, nl: int, reduce: tuple[str, ...] = ()) -> jax.Array:
    """y [*L, *R] = x [*L, *C] . w [*C, *R] through float8 with per-tensor scales from ``history`` float32 [3, H]
    (rows x, w, g; newest first). The history's cotangent is zeros but column 0: the amaxes of x, w and g this use
    observed (zero if its output gradient is all zero); see the module docstring."""
    return _dl_fwd(x, w, history, nl, reduce)[0]


def _dl_fwd(x, w, history, nl, reduce):
    ax, aw = _amax(x, reduce), _amax(w, ())
    sx, sw = delayed_scale(history[0], ax, E4M3), delayed_scale(history[1], aw, E4M3)
    xq, wq, _, _, y = _tensorwise_fwd(x, w, nl, reduce, sx, sw)
    return y, (xq, wq, sx, sw, ax, aw, history, jnp.zeros((0,), x.dtype), jnp.zeros((0,), w.dtype))


def _dl_bwd(nl, reduce, res, g):
    xq, wq, sx, sw, ax, aw, history, xz, wz = res
    ag = _amax(g, reduce)
    dx, dw = _per_tensor_grads(xq, wq, sx, sw, delayed_scale(history[2], ag, E5M2), g, nl, (xz.dtype, wz.dtype))
    seen = jnp.stack([ax, aw, ag]) * (ag > 0)
    return dx, dw, jnp.zeros_like(history).at[:, 0].set(seen)


delayed.defvjp(_dl_fwd, _dl_bwd)


def push_observed(history: jax.Array, observed: jax.Array) -> jax.Array:
    """history [..., 3, H] with the step's amaxes (column 0 of ``observed``, the combined cotangent) entering at 0
    and the oldest leaving; a non-finite amax enters as 0."""
    amax = observed[..., :1]
    amax = jnp.where(jnp.isfinite(amax), amax, 0.0).astype(history.dtype)
    return jnp.concatenate([amax, history[..., :-1]], axis=-1)


def scale_gradient_amax(observed: jax.Array, factor) -> jax.Array:
    """Observed amaxes [..., 3, H] with the gradient's (row 2) times ``factor``: for a loss computed ``1 /
    factor`` times too large and scaled back afterwards (1F1B's per-group mean)."""
    return observed.at[..., 2, :].multiply(factor)


def fp8_dot(x: jax.Array, w: jax.Array, nl: int, recipe: str, history: jax.Array | None = None) -> jax.Array:
    """x [*L, *C] . w [*C, *R] -> [*L, *R] in x's dtype through ``recipe`` (:data:`RECIPES`); ``nl`` = len(L);
    ``history`` [3, H] for "delayed". Amaxes are reduced over the axes of the enclosing :func:`amax_over`."""
    reduce = _AMAX_AXES.get()
    if recipe == "tensorwise":
        return tensorwise(x, w, nl, reduce)
    if recipe == "rowwise":
        return rowwise(x, w, nl, reduce)
    if recipe == "delayed":
        assert history is not None
        return delayed(x, w, history, nl, reduce)
    raise ValueError(f"unknown FP8 recipe {recipe!r}; expected one of {', '.join(RECIPES[1:])}")


class Fp8Dot(nnx.Module):
    """A projection's ``dot_general`` (nnx.Linear / LinearGeneral) through float8 with ``recipe``; "delayed" holds
    the projection's :class:`Fp8Meta` history [3, history]."""

    def __init__(self, recipe: str, history: int):
        if recipe not in RECIPES[1:]:
            raise ValueError(f"unknown FP8 recipe {recipe!r}; expected one of {', '.join(RECIPES[1:])}")
        self.recipe = recipe
        if recipe == "delayed":
            # logical axes (none of its own; the layer stack adds "layers")
            setattr(self, META_NAME, Fp8Meta(jnp.zeros((3, history), jnp.float32), out_sharding=(None, None)))

    def __call__(self, lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None,
                 out_sharding=None):
        """lhs [*L, *C] . rhs [*C, *R]: the contraction must be lhs's trailing axes with rhs's leading ones, in
        order, and no batch axes (how nnx.Linear and LinearGeneral call it). Precision is the recipe's."""
        (cl, cr), (bl, br) = dimension_numbers
        c = len(cl)
        nl = lhs.ndim - c
        if bl or br or tuple(cl) != tuple(range(nl, lhs.ndim)) or tuple(cr) != tuple(range(c)) or out_sharding:
            raise ValueError(f"FP8 dot: unsupported dimension numbers {dimension_numbers} (or out_sharding)")
        dtype = preferred_element_type or lhs.dtype
        history = getattr(self, META_NAME)[...] if self.recipe == "delayed" else None
        return fp8_dot(lhs.astype(dtype), rhs.astype(dtype), nl, self.recipe, history)


def use_fp8(cfg: Any, *projections: Any) -> None:
    """Give each projection (nnx.Linear / LinearGeneral, as constructed) a float8 ``dot_general`` of its own
    (:class:`Fp8Dot`: its own delayed-scaling state) per ``cfg.fp8`` (a ModelConfig); "none" leaves their dot."""
    if cfg.fp8 == "none":
        return
    for projection in projections:
        # both modules call self.dot_general when given one (LinearGeneral: unless dot_general_cls is set); a
        # function there is a static attribute, a module data (the history): nnx.data says so
        assert getattr(projection, "dot_general_cls", None) is None
        projection.dot_general = nnx.data(Fp8Dot(cfg.fp8, cfg.fp8_amax_history))


# ---------------------------------------------------------------------------------------------------- devices
MIN_COMPUTE_CAPABILITY = (8, 9)  # FP8 tensor cores: Ada (8.9), Hopper (9.0), Blackwell (10.0, 12.0)


def check_devices(recipe: str, devices: list) -> None:
    """ConfigError unless ``devices`` multiply float8 for real (an NVIDIA GPU of compute capability 8.9 or later:
    below it XLA computes such dots in 16 bits without a word) or are CPUs, whose XLA emulates float8 exactly (slowly:
    for tests and checks). Nothing to check for "none"."""
    if recipe == "none" or not devices:
        return
    dev = devices[0]
    if dev.platform == "cpu":
        return
    cc = getattr(dev, "compute_capability", None)
    if dev.platform in ("gpu", "cuda") and cc is None:  # a compile-only (topology) device: its hardware file says
        hw = for_device_kind(dev.device_kind)
        if hw is not None and hw.fp8_peak_flops > 0:
            return
        cc = "no FP8 rate in its hardware file" if hw else "an unknown compute capability"
    elif dev.platform in ("gpu", "cuda") and tuple(int(p) for p in str(cc).split(".")[:2]) >= MIN_COMPUTE_CAPABILITY:
        return
    if dev.platform in ("gpu", "cuda"):
        raise ConfigError(f"model.fp8={recipe} needs FP8 tensor cores (compute capability 8.9 or later: Ada, Hopper, "
                          f"Blackwell); {dev.device_kind} has {cc}, where XLA would compute in 16 bits instead; set "
                          "model.fp8=none")
    raise ConfigError(f"model.fp8={recipe} runs on NVIDIA GPUs of compute capability 8.9 or later (and emulated on "
                      f"CPUs), not on {dev.platform} devices ({dev.device_kind}); set model.fp8=none")
