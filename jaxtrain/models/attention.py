"""Attention as one device computes it, and what the remat policies may save of it. No mesh is named here.

:class:`Local` is causal self-attention on the arrays it is given: the XLA reference einsum, cuDNN's fused kernel, or
jaxtrain's flash kernels (Pallas or Triton). Run on whole (GSPMD-partitioned) arrays it is the attention of one
device or of XLA's automatic partitioning; :mod:`jaxtrain.parallel.attention` wraps it for a mesh (per-device shards
under ``shard_map``, ring attention over the context axis). The model takes either as its ``attention``. Rotary
positions (:func:`rotary`) and the decoding attention over a cache (:func:`cached_attention`) live here too, shared
by the standard attention (``llama.py``) and multi-head latent attention (``mla.py``).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from jaxtrain.config import ModelConfig, kernel_head_dim
from jaxtrain.kernels import flash_attention, mha_reference
from jaxtrain.kernels.flash.pallas import CHECKPOINT_NAMES

IMPLS = ("xla", "cudnn", "pallas", "triton")  # the resolved values of model.attention
WINDOW_IMPLS = ("xla", "cudnn", "pallas")  # those with a sliding-window mask (model.sliding_window)

# The flash kernels and cuDNN's attention (keep_residuals) name their forward results (output and log-sum-exp or
# softmax statistics, CHECKPOINT_NAMES): saving them costs [batch, seq, heads, head_dim] + [batch, heads, seq] per
# layer and spares re-running the forward kernel in the backward pass. With the XLA reference there are no such
# names and nothing extra is saved.
_SAVE_ATTENTION = jax.checkpoint_policies.save_only_these_names(*CHECKPOINT_NAMES)
REMAT_POLICIES = {
    "full": _SAVE_ATTENTION,
    # Keep the outputs of weight matmuls, recompute the cheap elementwise work and attention probabilities.
    "save_matmuls": jax.checkpoint_policies.save_from_both_policies(
        jax.checkpoint_policies.dots_with_no_batch_dims_saveable, _SAVE_ATTENTION),
}


@dataclass(frozen=True)
class Local:
    """Causal self-attention on the given arrays: ``impl`` one of :data:`IMPLS` (``layout.resolve_auto`` gave
    "auto" its meaning); ``interpret`` runs the flash kernels in Pallas' interpreter (CPU). Frozen, so that two
    models built with the same choice have equal graph definitions."""

    impl: str
    interpret: bool = False
    window: int | None = None  # model.sliding_window: keys within this many positions up to the query

    def __call__(self, q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array | None) -> jax.Array:
        """q [batch, seq, heads, head_dim], k and v [batch, seq, kv_heads, head_dim] (v's head dim may differ on
        xla: MLA), segment_ids int [batch, seq] or None -> [batch, seq, heads, v's head_dim]."""
        if self.window is not None and self.impl not in WINDOW_IMPLS:  # the config refuses it; a caller is told
            raise ValueError(f"attention impl {self.impl!r} has no sliding window; use one of {WINDOW_IMPLS}")
        if self.impl == "xla":
            return mha_reference(q, k, v, causal=True, segment_ids=segment_ids, window=self.window)
        if self.impl not in ("cudnn", "pallas", "triton"):
            raise ValueError(f"attention impl {self.impl!r} is not resolved; expected one of {', '.join(IMPLS)}")
        width = kernel_head_dim(self.impl, q.shape[-1], v.shape[-1])
        if width is None:
            raise ValueError(f"attention impl {self.impl!r} takes no head dim for q/k {q.shape[-1]} and v "
                             f"{v.shape[-1]}; use xla")
        if (q.shape[-1], v.shape[-1]) == (width, width):
            return self._kernel(q, k, v, segment_ids, None)
        # MLA (v's head dim of its own) or a width the kernel lacks: zero columns change neither q.k nor the
        # output's real columns; the scale stays q's own.
        pad = lambda a: jnp.pad(a, [(0, 0)] * (a.ndim - 1) + [(0, width - a.shape[-1])])  # noqa: E731
        out = self._kernel(pad(q), pad(k), pad(v), segment_ids, 1 / math.sqrt(q.shape[-1]))
        return out[..., :v.shape[-1]]

    def _kernel(self, q, k, v, segment_ids, scale: float | None) -> jax.Array:
        """The kernel of ``impl`` on q, k, v of one head dim; ``scale`` None: 1/sqrt(head dim)."""
        if self.impl == "cudnn":
            if segment_ids is not None:
                raise ValueError("model.attention=cudnn does not take segment ids (data.document_mask)")
            return _cudnn_attention(self.window, scale)(q, k, v)
        return flash_attention(q, k, v, causal=True, segment_ids=segment_ids, impl=self.impl,
                               interpret=self.interpret, window=self.window, sm_scale=scale)


def window_mask(q_positions: jax.Array, k_positions: jax.Array, window: int | None) -> jax.Array:
    """bool [..., queries, keys]: key position at or before the query's, and (with a window) within ``window``
    positions of it, the query itself included (transformers' sliding-window causal mask: q - window < k <= q).
    ``q_positions`` int [..., queries], ``k_positions`` int [..., keys]."""
    diff = q_positions[..., :, None] - k_positions[..., None, :]
    return (diff >= 0) if window is None else (diff >= 0) & (diff < window)


def rope_frequencies(cfg: ModelConfig, dim: int | None = None) -> jax.Array:
    """Rotary inverse frequencies float32 [dim / 2] for a rotated width ``dim`` (default the head dim; MLA rotates
    ``qk_rope_head_dim``), with Llama 3.1's scaling when ``cfg.rope_scaling`` asks."""
    dim = cfg.resolved_head_dim if dim is None else dim
    freqs = cfg.rope_theta ** (-jnp.arange(0, dim // 2, dtype=jnp.float32) * 2 / dim)
    rs = cfg.rope_scaling
    if rs.type == "llama3":
        # Wavelengths beyond the original context / low_freq_factor are stretched by `factor`, those below
        # original context / high_freq_factor kept, and those in between interpolated (Meta's Llama 3.1 recipe).
        wavelen = 2 * jnp.pi / freqs
        smooth = (rs.original_max_len / wavelen - rs.low_freq_factor) / (rs.high_freq_factor - rs.low_freq_factor)
        mid = (1 - smooth) * freqs / rs.factor + smooth * freqs
        freqs = jnp.where(wavelen > rs.original_max_len / rs.low_freq_factor, freqs / rs.factor,
                          jnp.where(wavelen < rs.original_max_len / rs.high_freq_factor, freqs, mid))
    return freqs


def rotary(x: jax.Array, freqs: jax.Array, positions: jax.Array | None = None) -> jax.Array:
    """Rotary position embedding (half-split layout) of x [batch, seq, heads, head_dim] with inverse frequencies
    ``freqs`` [head_dim / 2]; ``positions`` int [batch, seq] (default: 0..seq-1 for every row)."""
    if positions is None:
        positions = jnp.arange(x.shape[1])[None, :]
    angles = positions.astype(jnp.float32)[..., None] * freqs  # [batch or 1, seq, dim/2]
    sin, cos = jnp.sin(angles)[:, :, None, :], jnp.cos(angles)[:, :, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def cached_attention(q, k_cache, v_cache, q_positions, window: int | None = None) -> jax.Array:
    """Attention of new queries over a KV cache, for decoding. q [batch, new, heads, head_dim], caches
    [batch, max_len, kv_heads, head_dim] (v's head dim may differ: MLA's), q_positions int [batch, new]: a query
    attends to cache slots at or before its own position (slots past it may hold stale values; they are masked), and
    with a ``window`` (model.sliding_window) only to the last ``window`` of them. Same arithmetic as
    ``mha_reference``; out [batch, new, heads, v's head_dim]."""
    b, t, h, d = q.shape
    kv = k_cache.shape[2]
    qg = q.reshape(b, t, kv, h // kv, d)
    logits = jnp.einsum("btkgd,bskd->bkgts", qg, k_cache, preferred_element_type=jnp.float32) * d**-0.5
    visible = window_mask(q_positions, jnp.arange(k_cache.shape[1])[None, :], window)  # [batch, new, max_len]
    logits = jnp.where(visible[:, None, None], logits, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(logits, axis=-1)
    out = jnp.einsum("bkgts,bskd->btkgd", probs.astype(v_cache.dtype), v_cache, preferred_element_type=jnp.float32)
    return out.reshape(b, t, h, v_cache.shape[-1]).astype(q.dtype)


def keep_residuals(fn):
    """``fn(q, k, v) -> out`` (attention, out [batch, seq, heads, head_dim]) with its backward's residuals under
    the checkpoint names ``attn_out`` (the output) and ``attn_lse`` (the rest, e.g. cuDNN's softmax statistics).

    A name on ``fn``'s result alone is not enough for a ``jax.custom_vjp`` function such as cuDNN's attention: its
    backward reads the residuals its forward rule made, which are other values than the named result, so a remat
    policy saving the name still reruns the forward in the backward pass. Here the residuals themselves are named.
    Residuals that are q, k or v as passed stay unnamed (the policy decides about them as about any input).

    Zero-size residuals (cuDNN's forward saves its empty bias and mask placeholders, ``bf16[0]``) are not carried
    to the backward but made again there: a zero-size value crossing a ``shard_map`` boundary (the GPipe loop's
    forward to its transpose) makes jax 0.11's Shardy partitioner crash the compiler (docs/gpu.md, known issues).
    """

    @jax.custom_vjp
    def call(q, k, v):
        return fn(q, k, v)

    def forward(q, k, v):
        out, pull = jax.vjp(fn, q, k, v)
        named_out = checkpoint_name(out, CHECKPOINT_NAMES[0])
        leaves, tree = jax.tree.flatten(pull)
        kept, empty = [], []
        for i, r in enumerate(leaves):
            if math.prod(jnp.shape(r)) == 0:
                empty.append((i, jnp.shape(r), jnp.result_type(r)))
            elif any(r is x for x in (q, k, v)):
                kept.append(r)
            else:
                kept.append(named_out if r is out else checkpoint_name(r, CHECKPOINT_NAMES[1]))
        return named_out, (kept, _Static((tree, tuple(empty))))

    def backward(residuals, g):
        kept, static = residuals
        tree, empty = static.value
        leaves = list(kept)
        for i, shape, dtype in empty:  # in ascending position: each goes back where it was
            leaves.insert(i, jnp.zeros(shape, dtype))
        return jax.tree.unflatten(tree, leaves)(g)

    call.defvjp(forward, backward)
    return call


class _Static:
    """Static data in a custom VJP's residuals (a pytree node without leaves): the backward's tree structure and the
    zero-size residuals' positions, shapes and dtypes."""

    def __init__(self, value):
        self.value = value

    def __eq__(self, other):
        return isinstance(other, _Static) and self.value == other.value

    def __hash__(self):
        return hash(self.value)


jax.tree_util.register_pytree_node(_Static, lambda s: ((), s.value), lambda value, _: _Static(value))


@functools.cache
def _cudnn_attention(window: int | None, scale: float | None):
    """cuDNN's fused attention (GPU, 16-bit), causal (with a sliding ``window`` of keys: its sliding-window causal
    mask), softmax ``scale`` (None: 1/sqrt(head dim)), its output and softmax statistics saveable by the remat
    policies (REMAT_POLICIES save CHECKPOINT_NAMES)."""
    kwargs = {"is_causal": True} if window is None else window_kwargs(window)
    return keep_residuals(
        lambda q, k, v: jax.nn.dot_product_attention(q, k, v, implementation="cudnn", scale=scale, **kwargs))


def window_kwargs(window: int) -> dict:
    """``jax.nn.dot_product_attention``'s arguments for a causal sliding window of ``window`` keys, the query's own
    included: (left, right) = (window - 1, 0) keys beside the query."""
    return {"is_causal": True, "local_window_size": (window - 1, 0)}


