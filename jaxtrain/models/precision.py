"""Which parameters the decoder reads in its compute dtype: a caller may hand those over already cast (to gather
them across devices in half the bytes, say) without changing a value the model computes.

Every projection kernel, bias, norm scale and expert weight is cast to ``model.dtype`` where it is used (Flax's
``promote_dtype``, the experts' grouped matmul), so casting it first gives the same forward values and the same
gradients (the cotangent of a cast is the cast back). Two kinds are not:

- the MoE router (``router``): its logits are computed in float32 whatever the compute dtype (``routing.py``);
- the embedding table (``embedding``): rows are gathered from it in its own dtype and cast afterwards, so its
  gradient is a scatter-add of the tokens' gradients in the table's dtype; cast to bfloat16 first, that sum would be
  rounded at every duplicate token.

With ``model.reduce_dtype=float32`` the projections read their kernels in float32 (below), so nothing is cast
(:func:`gather_dtype`); FP8 runs are not cast either.

``model.reduce_dtype`` (:func:`use_reduce_dtype`): the dtype of the projections' weight gradients, and hence of their
reduction over the batch axes (FSDP's reduce-scatter, data parallelism's all-reduce: XLA's partitioner reduces the
weight-gradient dot's partial sums in that dot's result dtype). "compute" is Flax's: the kernel is cast to the compute
dtype before the dot, so its gradient is a compute-dtype dot, reduced in the compute dtype (MaxText). "float32"
(torchtitan FSDP2's ``reduce_dtype`` default) keeps the forward and the input gradient as they are and computes the
weight gradient as a compute-dtype dot accumulated in and returned as float32 (:func:`float32_grad_dot`).
"""

from __future__ import annotations

from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from flax.nnx.nn.dtypes import canonicalize_dtype
from jax import lax

from jaxtrain.models.fp8 import Fp8Dot

KEPT = ("router", "embedding")  # parameter names read or summed in their own (float32) dtype


def gather_dtype(model) -> jnp.dtype:
    """The dtype :func:`narrowed` may cast a ``model`` config's parameters to: its compute dtype, but float32 for
    ``model.reduce_dtype=float32``, whose projections read their float32 kernels (a kernel handed over in bfloat16
    has a bfloat16 gradient, whatever the dot does), and for FP8 runs. (For FP8 nothing would change: the float8
    dot receives its kernel already cast to the compute dtype by Flax's ``promote_dtype``, so its weight gradient
    is in the compute dtype either way.)"""
    wide = model.fp8 != "none" or model.reduce_dtype == "float32"
    return jnp.dtype(jnp.float32 if wide else model.dtype)


def cast_at_use(path) -> bool:
    """Whether the parameter at ``path`` (a ``jax.tree_util`` key path into the model's ``nnx.Param`` state) is
    only ever read through a cast to the compute dtype."""
    names = {str(getattr(k, "key", getattr(k, "name", k))) for k in path}
    return not names & set(KEPT)


def narrowed(params, dtype):
    """``params`` (an ``nnx.State``, or any pytree of ``nnx.Variable`` s) with every float32 ``nnx.Param`` that is
    :func:`cast_at_use` cast to ``dtype``: the values the model would cast it to anyway. Other variables (the side
    state beside the parameters: FP8 amax histories, the expert bias) and the kept parameters are left as they are.
    With a float32 ``dtype`` nothing changes."""
    dtype = jnp.dtype(dtype)
    if dtype == jnp.float32:
        return params

    def cast(path, v):
        if isinstance(v, nnx.Param) and v.value.dtype == jnp.float32 and cast_at_use(path):
            return v.replace(v.value.astype(dtype))
        return v

    return jax.tree_util.tree_map_with_path(cast, params, is_leaf=lambda x: isinstance(x, nnx.Variable))


# ---------------------------------------------------------------------------------------------------- reduce dtype
def kernel_kept(args, /, *, dtype=None, inexact=True):
    """Flax's ``promote_dtype`` for a projection's (inputs, kernel, bias), but the kernel is returned as stored:
    :func:`float32_grad_dot` casts it inside its own VJP, where the cast's cotangent would otherwise round the
    weight gradient to the compute dtype."""
    inputs, kernel, bias = args
    dtype = canonicalize_dtype(*args, dtype=dtype, inexact=inexact)
    return jnp.asarray(inputs, dtype), kernel, None if bias is None else jnp.asarray(bias, dtype)


def _weight_gradient(g, x, w_ndim: int, dimension_numbers, precision):
    """The cotangent of ``w`` in y = dot_general(x, w, dimension_numbers), for y's cotangent ``g``, as JAX's
    transpose rule computes it (g . x over x's kept axes, batch axes with batch axes), but accumulated in and
    returned as float32. y's axes are (batch, x's kept, w's kept); the result has w's shape."""
    (x_con, w_con), (x_bat, w_bat) = dimension_numbers
    x_kept = tuple(a for a in range(x.ndim) if a not in x_con and a not in x_bat)
    w_kept = [a for a in range(w_ndim) if a not in w_con and a not in w_bat]
    nb = len(x_bat)
    g_x = tuple(range(nb, nb + len(x_kept)))
    dims = ((g_x, x_kept), (tuple(range(nb)), x_bat))

    def native(a, b):
        return lax.dot_general(a, b, dims, precision=precision, preferred_element_type=jnp.float32)

    def widened(a, b):
        # XLA:CPU (jaxlib 0.10.2) fails to run some 16-bit dots with a float32 result ("Unsupported element type for
        # DotThunk::Execute: BF16 x BF16 = F32"); widening first gives the same numbers: the product of two 16-bit
        # floats is exact in float32, and the sum is float32 either way
        return native(a.astype(jnp.float32), b.astype(jnp.float32))

    out = lax.platform_dependent(g, x, cpu=widened, default=native)
    # out's axes: batch, g's rest (w's kept, in order), x's contracting axes in x's order: name them by w's axes
    w_axes = [*w_bat, *w_kept, *(w_con[x_con.index(a)] for a in sorted(x_con))]
    return jnp.transpose(out, tuple(int(i) for i in np.argsort(w_axes)))


@partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _dot(x, w, dimension_numbers, precision, preferred):
    return lax.dot_general(x, w.astype(x.dtype), dimension_numbers, precision=precision,
                           preferred_element_type=preferred)


def _dot_fwd(x, w, dimension_numbers, precision, preferred):
    wc = w.astype(x.dtype)  # what Flax's promote_dtype would have handed the dot: residuals as today
    y = lax.dot_general(x, wc, dimension_numbers, precision=precision, preferred_element_type=preferred)
    return y, (x, wc)


def _dot_bwd(dimension_numbers, precision, preferred, res, g):
    x, wc = res
    # the input's cotangent exactly as without this function (JAX's own transpose of the same dot)
    _, vjp = jax.vjp(lambda x_: lax.dot_general(x_, wc, dimension_numbers, precision=precision,
                                                preferred_element_type=preferred), x)
    dw = _weight_gradient(g, x, wc.ndim, dimension_numbers, precision)
    return vjp(g)[0], dw  # float32: the kernel's dtype (model.reduce_dtype=float32 needs float32 parameters)


_dot.defvjp(_dot_fwd, _dot_bwd)


def float32_grad_dot(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None, out_sharding=None):
    """A projection's ``dot_general`` for ``model.reduce_dtype=float32``: lhs (compute dtype, e.g. x [batch, seq,
    in]) . rhs (the stored float32 kernel, e.g. [in, out], cast to lhs's dtype here) -> [batch, seq, out] in lhs's
    dtype, for any ``lax.dot_general`` dimension numbers. Forward values and lhs's cotangent are exactly what
    ``lax.dot_general`` on the cast kernel gives; rhs's cotangent is a dot of lhs and the cotangent (both in the
    compute dtype) with ``preferred_element_type=float32``: never rounded to the compute dtype, so reduced in
    float32."""
    if out_sharding is not None:
        raise ValueError(f"float32_grad_dot: out_sharding={out_sharding} is not supported")
    (xc, wc), (xb, wb) = dimension_numbers
    dims = tuple(tuple(int(a) for a in axes) for axes in (xc, wc)), tuple(tuple(int(a) for a in axes)
                                                                          for axes in (xb, wb))
    return _dot(lhs, rhs, dims, precision, preferred_element_type)


def use_reduce_dtype(cfg: Any, *projections: Any) -> None:
    """Give each projection (nnx.Linear / LinearGeneral, as constructed) :func:`kernel_kept` as its
    ``promote_dtype`` and :func:`float32_grad_dot` as its ``dot_general`` when ``cfg.reduce_dtype`` (a ModelConfig)
    is "float32"; "compute" leaves them. Call it after :func:`jaxtrain.models.fp8.use_fp8`: a projection whose dot
    is FP8's keeps it (the FP8 dot computes its own weight gradient)."""
    if cfg.reduce_dtype != "float32":
        return
    for projection in projections:
        if isinstance(getattr(projection, "dot_general", None), Fp8Dot):
            continue
        # both modules call self.dot_general when given one (LinearGeneral: unless dot_general_cls is set)
        assert getattr(projection, "dot_general_cls", None) is None
        projection.promote_dtype = kernel_kept
        projection.dot_general = float32_grad_dot


def attend(embed: nnx.Embed, x: jax.Array) -> jax.Array:
    """``embed.attend(x)`` (the tied output projection: x [..., embed] -> logits [..., vocab] in the compute dtype)
    through :func:`float32_grad_dot`: the same values, the table's gradient from the logits in float32."""
    x = jnp.asarray(x, embed.dtype)  # as Flax's promote_dtype does for attend
    # Flax's jnp.dot(x, table.T): the same transpose and contraction, so that XLA compiles the same dot
    return float32_grad_dot(x, embed.embedding[...].T, (((x.ndim - 1,), (0,)), ((), ())))
