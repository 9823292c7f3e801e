"""Multi-head latent attention (MLA, DeepSeek-V2/V3): the attention of ``model.kv_lora_rank``.

Per token, keys and values come out of one compressed latent ``c_kv`` of ``kv_lora_rank`` (RMSNorm-ed) and one
rotary key of ``qk_rope_head_dim`` that every head shares; queries come out of a low-rank latent of ``q_lora_rank``
(RMSNorm-ed), or straight from the residual stream when it is null (DeepSeek-V2-Lite). Each q/k head is
``qk_nope_head_dim`` (no positions) + ``qk_rope_head_dim`` (rotary) wide, each v head ``v_head_dim``; the softmax
scale is 1/sqrt(q/k head width). Decoding caches ``c_kv`` and the rotary key only, not the expanded K/V.

The rotary part uses jaxtrain's half-split layout. DeepSeek's checkpoints (transformers' ``rope_interleave``) rotate
interleaved pairs (x0, x1), (x2, x3), ... and emit them de-interleaved; the same arithmetic here needs the rotary
rows of the q and kv_a projections de-interleaved (evens then odds) once, when weights are converted
(:func:`deinterleave_rope`).

Parameters name logical axes only: heads over ``heads`` (tensor), the latents' own width unnamed (replicated, as
Megatron-Core keeps its down projections), the residual stream ``embed``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from flax.linen import with_logical_constraint

from jaxtrain.config import ModelConfig
from jaxtrain.models.attention import cached_attention, rope_frequencies, rotary
from jaxtrain.models.fp8 import use_fp8
from jaxtrain.models.precision import use_reduce_dtype

Q_AXES = ("batch", "act_seq", "act_heads", None)  # q, k, v and the output [batch, seq, heads, head_dim]
LATENT_AXES = ("batch", "act_seq", None)  # c_kv [batch, seq, kv_lora_rank], the rotary key [batch, seq, rope dim]
CACHE_AXES = ("batch", None, None)  # one layer's latent cache [batch, max_len, kv_lora_rank or qk_rope_head_dim]


def deinterleave_rope(w: np.ndarray, nope: int, rope: int, axis: int = -1) -> np.ndarray:
    """Reorder the rotary columns of a projection weight from DeepSeek's interleaved pairs to the half-split layout.

    ``w``'s ``axis`` is made of blocks of ``nope + rope`` outputs (one per head; a single block for kv_a, whose
    outputs are [kv_lora_rank | rope] with ``nope`` = kv_lora_rank); within each block the last ``rope`` columns
    (x0, x1, x2, x3, ...) become (x0, x2, ..., x1, x3, ...). Returns a new array, same shape."""
    w = np.moveaxis(np.asarray(w), axis, -1)
    block = nope + rope
    order = np.concatenate([np.arange(nope), nope + np.arange(0, rope, 2), nope + np.arange(1, rope, 2)])
    blocks = w.reshape(*w.shape[:-1], w.shape[-1] // block, block)[..., order]
    return np.moveaxis(blocks.reshape(w.shape), -1, axis)


def _init(std: float, axes: tuple[str | None, ...]):
    """Normal init with logical axes (as llama.py's; llama imports this module, so not imported from there)."""
    return nnx.with_partitioning(nnx.initializers.normal(std), axes)


def _norm(cfg: ModelConfig, dtype, param_dtype, rngs: nnx.Rngs, width: int) -> nnx.RMSNorm:
    """RMSNorm of a latent of ``width``, scale replicated (logical ``norm``), as llama.py's norms."""
    return nnx.RMSNorm(width, epsilon=cfg.norm_eps, dtype=dtype, param_dtype=param_dtype,
                       scale_init=nnx.with_partitioning(nnx.initializers.ones, ("norm",)), rngs=rngs)


class LatentAttention(nnx.Module):
    """MLA for a config with ``kv_lora_rank`` set; called like :class:`jaxtrain.models.llama.Attention`.

    Weights: ``q`` [embed, heads, qk_head_dim] or ``q_a`` [embed, q_lora_rank] + ``q_a_norm`` + ``q_b``
    [q_lora_rank, heads, qk_head_dim]; ``kv_a`` [embed, kv_lora_rank + qk_rope_head_dim] + ``kv_a_norm``
    [kv_lora_rank]; ``kv_b`` [kv_lora_rank, heads, qk_nope_head_dim + v_head_dim]; ``o`` [heads, v_head_dim, embed].
    """

    def __init__(self, cfg: ModelConfig, dtype, param_dtype, *, attention, rngs: nnx.Rngs):
        self.cfg, self.attention = cfg, attention
        d, h, r = cfg.d_model, cfg.n_heads, cfg.kv_lora_rank
        assert r is not None
        common = dict(use_bias=False, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        std = cfg.init_std
        if cfg.q_lora_rank is None:
            self.q = nnx.LinearGeneral(d, (h, cfg.qk_head_dim), kernel_init=_init(std, ("embed", "heads", "head_dim")),
                                       **common)
            queries: list[nnx.Module] = [self.q]
        else:
            self.q_a = nnx.Linear(d, cfg.q_lora_rank, kernel_init=_init(std, ("embed", None)), **common)
            self.q_a_norm = _norm(cfg, dtype, param_dtype, rngs, cfg.q_lora_rank)
            self.q_b = nnx.LinearGeneral(cfg.q_lora_rank, (h, cfg.qk_head_dim),
                                         kernel_init=_init(std, (None, "heads", "head_dim")), **common)
            queries = [self.q_a, self.q_b]
        self.kv_a = nnx.Linear(d, r + cfg.qk_rope_head_dim, kernel_init=_init(std, ("embed", None)), **common)
        self.kv_a_norm = _norm(cfg, dtype, param_dtype, rngs, r)
        self.kv_b = nnx.LinearGeneral(r, (h, cfg.qk_nope_head_dim + cfg.v_head_dim),
                                      kernel_init=_init(std, (None, "heads", "head_dim")), **common)
        out_std = std / (2 * cfg.n_layers) ** 0.5  # scaled init of the residual branch's output, as llama.Attention
        self.o = nnx.LinearGeneral((h, cfg.v_head_dim), d, axis=(-2, -1),
                                   kernel_init=_init(out_std, ("heads", "head_dim", "embed")), **common)
        use_fp8(cfg, *queries, self.kv_a, self.kv_b, self.o)
        use_reduce_dtype(cfg, *queries, self.kv_a, self.kv_b, self.o)

    def queries(self, x: jax.Array, positions: jax.Array | None) -> jax.Array:
        """x [batch, seq, embed] -> q [batch, seq, heads, qk_head_dim], its rotary part rotated."""
        cfg = self.cfg
        q = self.q(x) if cfg.q_lora_rank is None else self.q_b(self.q_a_norm(self.q_a(x)))
        q = with_logical_constraint(q, Q_AXES)
        q_nope, q_rope = jnp.split(q, [cfg.qk_nope_head_dim], axis=-1)
        q_rope = rotary(q_rope, rope_frequencies(cfg, cfg.qk_rope_head_dim), positions)
        return jnp.concatenate([q_nope, q_rope], axis=-1)

    def latents(self, x: jax.Array, positions: jax.Array | None) -> tuple[jax.Array, jax.Array]:
        """x [batch, seq, embed] -> (c_kv [batch, seq, kv_lora_rank] normed, rotary key [batch, seq, rope dim])."""
        cfg = self.cfg
        assert cfg.kv_lora_rank is not None
        c_kv, k_rope = jnp.split(self.kv_a(x), [cfg.kv_lora_rank], axis=-1)
        c_kv = with_logical_constraint(self.kv_a_norm(c_kv), LATENT_AXES)
        k_rope = rotary(k_rope[:, :, None, :], rope_frequencies(cfg, cfg.qk_rope_head_dim), positions)[:, :, 0]
        return c_kv, with_logical_constraint(k_rope, LATENT_AXES)

    def expand(self, c_kv: jax.Array, k_rope: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Latents [batch, seq, kv_lora_rank] and [batch, seq, rope dim] -> k [batch, seq, heads, qk_head_dim]
        (the rotary key repeated for every head) and v [batch, seq, heads, v_head_dim]."""
        cfg = self.cfg
        kv = with_logical_constraint(self.kv_b(c_kv), Q_AXES)
        k_nope, v = jnp.split(kv, [cfg.qk_nope_head_dim], axis=-1)
        k_rope = jnp.broadcast_to(k_rope[:, :, None, :].astype(k_nope.dtype), (*k_nope.shape[:3], k_rope.shape[-1]))
        k = with_logical_constraint(jnp.concatenate([k_nope, k_rope], axis=-1), Q_AXES)
        return k, with_logical_constraint(v, Q_AXES)

    def __call__(self, x: jax.Array, segment_ids: jax.Array | None, positions: jax.Array | None = None,
                 cache: tuple[jax.Array, jax.Array] | None = None):
        """x: [batch, seq, embed] -> [batch, seq, embed].

        Decoding passes ``positions`` int [batch, seq] and ``cache`` (c_kv [batch, max_len, kv_lora_rank], rotary
        key [batch, max_len, qk_rope_head_dim]): the new latents are written at ``positions``, K/V expanded from
        the whole cache, and the result is (output, updated cache)."""
        q = self.queries(x, positions)
        c_kv, k_rope = self.latents(x, positions)
        if cache is None:
            out = self.attention(q, *self.expand(c_kv, k_rope), segment_ids)
        else:
            rows = jnp.arange(x.shape[0])[:, None]
            c_cache = with_logical_constraint(cache[0].at[rows, positions].set(c_kv.astype(cache[0].dtype)),
                                              CACHE_AXES)
            r_cache = with_logical_constraint(cache[1].at[rows, positions].set(k_rope.astype(cache[1].dtype)),
                                              CACHE_AXES)
            out = cached_attention(q, *self.expand(c_cache, r_cache), positions, self.cfg.sliding_window)
        out = self.o(with_logical_constraint(out, Q_AXES))
        return out if cache is None else (out, (c_cache, r_cache))
