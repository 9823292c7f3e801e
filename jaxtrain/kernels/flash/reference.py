"""Reference multi-head attention in plain XLA ops: the `model.attention=xla` path and the kernels' test oracle."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def mha_reference(q, k, v, *, causal: bool = True, segment_ids=None, sm_scale: float | None = None,
                  window: int | None = None):
    """Grouped-query attention without repeating k and v.

    Args:
      q: [batch, seq, heads, head_dim].
      k, v: [batch, seq, kv_heads, head_dim], v's head dim may differ from q's and k's (MLA); kv_heads divides
        heads. Query head h reads kv head h // (heads // kv_heads).
      causal: mask keys after the query position.
      segment_ids: optional int [batch, seq]; a token attends only to tokens with the same id (packed sequences).
      sm_scale: softmax scale, default 1/sqrt(head_dim) (q's).
      window: with ``causal``, keys within this many positions up to the query, itself included (a sliding window:
        q - window < k <= q, as transformers masks it); None: every earlier key.

    Returns:
      [batch, seq, heads, v's head_dim] in q's dtype. Logits and softmax are computed in float32.
    """
    b, s, h, d = q.shape
    kv = k.shape[2]
    if h % kv:
        raise ValueError(f"heads={h} is not a multiple of kv_heads={kv}")
    scale = d**-0.5 if sm_scale is None else sm_scale
    qg = q.reshape(b, s, kv, h // kv, d)
    logits = jnp.einsum("bqkgd,bskd->bkgqs", qg, k, preferred_element_type=jnp.float32) * scale
    mask = jnp.ones((s, s), dtype=bool)
    if causal:
        mask = jnp.tril(mask) if window is None else jnp.tril(mask) & jnp.triu(mask, 1 - window)
    mask = mask[None, None, None]
    if segment_ids is not None:
        same = segment_ids[:, :, None] == segment_ids[:, None, :]  # [b, q, s]
        mask = mask & same[:, None, None]
    logits = jnp.where(mask, logits, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(logits, axis=-1)
    out = jnp.einsum("bkgqs,bskd->bqkgd", probs.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return out.reshape(b, s, h, v.shape[-1]).astype(q.dtype)
