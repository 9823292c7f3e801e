"""Which parameters the decoder reads in its compute dtype: a caller may hand those over already cast (to gather
them across devices in half the bytes, say) without changing a value the model computes.

Every projection kernel, bias, norm scale and expert weight is cast to ``model.dtype`` where it is used (Flax's
``promote_dtype``, the experts' grouped matmul), so casting it first gives the same forward values and the same
gradients (the cotangent of a cast is the cast back). Two kinds are not:

- the MoE router (``router``): its logits are computed in float32 whatever the compute dtype (``routing.py``);
- the embedding table (``embedding``): rows are gathered from it in its own dtype and cast afterwards, so its
  gradient is a scatter-add of the tokens' gradients in the table's dtype; cast to bfloat16 first, that sum would be
  rounded at every duplicate token.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

KEPT = ("router", "embedding")  # parameter names read or summed in their own (float32) dtype


def cast_at_use(path) -> bool:
    """Whether the parameter at ``path`` (a ``jax.tree_util`` key path into the model's ``nnx.Param`` state) is
    only ever read through a cast to the compute dtype."""
    names = {str(getattr(k, "key", getattr(k, "name", k))) for k in path}
    return not names & set(KEPT)


def narrowed(params, dtype):
    """``params`` with every float32 leaf :func:`cast_at_use` cast to ``dtype`` (the others as they are): the
    values the model would cast them to anyway. With a float32 ``dtype`` nothing changes."""
    dtype = jnp.dtype(dtype)
    if dtype == jnp.float32:
        return params

    def cast(path, p):
        return p.astype(dtype) if p.dtype == jnp.float32 and cast_at_use(path) else p

    return jax.tree_util.tree_map_with_path(cast, params)
