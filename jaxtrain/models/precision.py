"""Which parameters the decoder reads in its compute dtype: a caller may hand those over already cast (to gather
them across devices in half the bytes, say) without changing a value the model computes.

Every projection kernel, bias, norm scale and expert weight is cast to ``model.dtype`` where it is used (Flax's
``promote_dtype``, the experts' grouped matmul), so casting it first gives the same forward values and the same
gradients (the cotangent of a cast is the cast back). Two kinds are not:

- the MoE router (``router``): its logits are computed in float32 whatever the compute dtype (``routing.py``);
- the embedding table (``embedding``): rows are gathered from it in its own dtype and cast afterwards, so its
  gradient is a scatter-add of the tokens' gradients in the table's dtype; cast to bfloat16 first, that sum would be
  rounded at every duplicate token.

With ``model.fp8`` the projections' weight gradients are float32 (:func:`gather_dtype`), so nothing is cast.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

KEPT = ("router", "embedding")  # parameter names read or summed in their own (float32) dtype


def gather_dtype(model) -> jnp.dtype:
    """The dtype :func:`narrowed` may cast a ``model`` config's parameters to: its compute dtype, but float32 for
    FP8 runs, whose float8 projections take the weight's gradient in float32 from the float32 weight (cast first,
    that gradient would be rounded to the compute dtype)."""
    return jnp.dtype(jnp.float32 if model.fp8 != "none" else model.dtype)


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
