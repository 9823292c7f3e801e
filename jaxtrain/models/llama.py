"""Llama-style decoder in Flax NNX.

Token embedding, pre-norm blocks of RMSNorm + grouped-query attention with rotary positions + SwiGLU MLP, a final
RMSNorm, tied or untied output projection. The families differ by options of this one decoder, not by code paths:
q/k/v biases (``model.qkv_bias``: Qwen2/2.5), per-head q/k RMSNorm (``model.qk_norm``: Qwen3), an explicit head dim
(``model.head_dim``), a sliding window (``model.sliding_window``: Mistral). Layers are created stacked (leading
``layers`` axis) and applied with ``jax.lax.scan``: one compiled block whatever the depth, and few state leaves.

Every parameter names its logical axes (``embed``, ``mlp``, ``heads``, ...) and key activations are constrained to
logical axes (``batch``, ``act_embed``, ...). The mapping to mesh axes lives in the config (``mesh.rules``) and is
applied by the caller through ``nnx.logical_axis_rules``; this module never names a mesh axis. Attention is the
``attention`` callable the model is built with: by default :class:`jaxtrain.models.attention.Local` on the arrays it
is given; the layout passes :class:`jaxtrain.parallel.attention.MeshAttention`, which lays it out on the mesh.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx
from flax.linen import with_logical_constraint

from jaxtrain.config import ModelConfig
from jaxtrain.models.attention import (  # noqa: F401  (rotary and the decoding attention: importable from here)
    REMAT_POLICIES,
    Local,
    cached_attention,
    rope_frequencies,
    rotary,
    window_mask,
)
from jaxtrain.models.fp8 import use_fp8
from jaxtrain.models.mla import CACHE_AXES as LATENT_CACHE_AXES
from jaxtrain.models.mla import LatentAttention
from jaxtrain.models.precision import attend, use_reduce_dtype

# (q, k, v, segment_ids) -> out: q [batch, seq, heads, head_dim], k and v [batch, seq, kv_heads, head_dim], segment
# ids int [batch, seq] or None, out like q. Causal.
AttentionFn = Callable[[jax.Array, jax.Array, jax.Array, jax.Array | None], jax.Array]

def _init(std: float, axes: tuple[str | None, ...]):
    return nnx.with_partitioning(nnx.initializers.normal(std), axes)


CACHE_AXES = ("batch", None, "act_kv_heads", None)  # one layer's KV cache [batch, max_len, kv_heads, head_dim]


class Attention(nnx.Module):
    """Grouped-query attention with rotary positions; by the config, q/k/v biases (``qkv_bias``, each bias
    [heads or kv_heads, head_dim] on the logical axes of its kernel's outputs), an RMSNorm of each query and key head
    over head_dim before rotary (``qk_norm``, scales [head_dim]) and a sliding window (``sliding_window``: the
    ``attention`` callable applies it in training, :func:`cached_attention` in decoding). With ``kv_lora_rank``
    set it is multi-head latent attention instead: its one member ``latent``
    (:class:`jaxtrain.models.mla.LatentAttention`) holds the weights and does the work."""

    def __init__(self, cfg: ModelConfig, dtype, param_dtype, *, attention: AttentionFn, rngs: nnx.Rngs):
        self.cfg, self.attention = cfg, attention
        if cfg.mla:  # here rather than in Block, so that every block built on Attention (the MoE's too) gets it
            self.latent = LatentAttention(cfg, dtype, param_dtype, attention=attention, rngs=rngs)
            return
        d, hd = cfg.d_model, cfg.resolved_head_dim
        common = dict(use_bias=False, dtype=dtype, param_dtype=param_dtype, rngs=rngs)

        def qkv(heads: int, axis: str) -> nnx.LinearGeneral:
            bias = dict(use_bias=True, bias_init=nnx.with_partitioning(nnx.initializers.zeros, (axis, "head_dim")))
            return nnx.LinearGeneral(d, (heads, hd), kernel_init=_init(cfg.init_std, ("embed", axis, "head_dim")),
                                     **{**common, **(bias if cfg.qkv_bias else {})})

        self.q = qkv(cfg.n_heads, "heads")
        self.k = qkv(cfg.n_kv_heads, "kv_heads")
        self.v = qkv(cfg.n_kv_heads, "kv_heads")
        if cfg.qk_norm:
            self.q_norm = _norm(cfg, dtype, param_dtype, rngs, hd)
            self.k_norm = _norm(cfg, dtype, param_dtype, rngs, hd)
        # Scaled init of residual-branch outputs (GPT-2): keeps the residual stream's variance independent of depth.
        out_std = cfg.init_std / (2 * cfg.n_layers) ** 0.5
        self.o = nnx.LinearGeneral((cfg.n_heads, hd), d, axis=(-2, -1),
                                   kernel_init=_init(out_std, ("heads", "head_dim", "embed")), **common)
        use_fp8(cfg, self.q, self.k, self.v, self.o)  # model.fp8: these projections multiply in FP8
        use_reduce_dtype(cfg, self.q, self.k, self.v, self.o)  # model.reduce_dtype: their weight gradients' dtype

    def __call__(self, x: jax.Array, segment_ids: jax.Array | None, positions: jax.Array | None = None,
                 cache: tuple[jax.Array, jax.Array] | None = None):
        """x: [batch, seq, embed] -> [batch, seq, embed].

        Decoding passes ``positions`` int [batch, seq] and ``cache`` (k, v) [batch, max_len, kv_heads, head_dim]:
        the new keys and values are written at ``positions`` and the queries attend over the cache; then the
        result is (output, updated cache). MLA's cache is its latents instead (see LatentAttention).
        """
        if self.cfg.mla:
            return self.latent(x, segment_ids, positions, cache)
        q = with_logical_constraint(self.q(x), ("batch", "act_seq", "act_heads", None))
        k = with_logical_constraint(self.k(x), ("batch", "act_seq", "act_kv_heads", None))
        v = with_logical_constraint(self.v(x), ("batch", "act_seq", "act_kv_heads", None))
        if self.cfg.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        freqs = rope_frequencies(self.cfg)
        q, k = rotary(q, freqs, positions), rotary(k, freqs, positions)
        if cache is None:
            out = self.attention(q, k, v, segment_ids)
        else:
            rows = jnp.arange(x.shape[0])[:, None]
            k_cache = with_logical_constraint(cache[0].at[rows, positions].set(k.astype(cache[0].dtype)), CACHE_AXES)
            v_cache = with_logical_constraint(cache[1].at[rows, positions].set(v.astype(cache[1].dtype)), CACHE_AXES)
            out = cached_attention(q, k_cache, v_cache, positions, self.cfg.sliding_window)
        out = with_logical_constraint(out, ("batch", "act_seq", "act_heads", None))
        return self.o(out) if cache is None else (self.o(out), (k_cache, v_cache))


class MLP(nnx.Module):
    def __init__(self, cfg: ModelConfig, dtype, param_dtype, *, rngs: nnx.Rngs):
        common = dict(use_bias=False, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.gate = nnx.Linear(cfg.d_model, cfg.d_ff, kernel_init=_init(cfg.init_std, ("embed", "mlp")), **common)
        self.up = nnx.Linear(cfg.d_model, cfg.d_ff, kernel_init=_init(cfg.init_std, ("embed", "mlp")), **common)
        out_std = cfg.init_std / (2 * cfg.n_layers) ** 0.5
        self.down = nnx.Linear(cfg.d_ff, cfg.d_model, kernel_init=_init(out_std, ("mlp", "embed")), **common)
        use_fp8(cfg, self.gate, self.up, self.down)  # model.fp8: these projections multiply in FP8
        use_reduce_dtype(cfg, self.gate, self.up, self.down)  # model.reduce_dtype: their weight gradients' dtype

    def __call__(self, x: jax.Array) -> jax.Array:
        """SwiGLU. x: [batch, seq, embed] -> [batch, seq, embed]; hidden [batch, seq, mlp]."""
        h = nnx.silu(self.gate(x)) * self.up(x)
        h = with_logical_constraint(h, ("batch", "act_seq", "act_mlp"))
        return self.down(h)


def _norm(cfg: ModelConfig, dtype, param_dtype, rngs: nnx.Rngs, width: int | None = None) -> nnx.RMSNorm:
    """RMSNorm over the last axis, of ``width`` (default d_model); its scale is replicated (logical ``norm``)."""
    return nnx.RMSNorm(cfg.d_model if width is None else width, epsilon=cfg.norm_eps, dtype=dtype,
                       param_dtype=param_dtype,
                       scale_init=nnx.with_partitioning(nnx.initializers.ones, ("norm",)), rngs=rngs)


class Block(nnx.Module):
    def __init__(self, cfg: ModelConfig, dtype, param_dtype, *, attention: AttentionFn, rngs: nnx.Rngs):
        self.attn_norm = _norm(cfg, dtype, param_dtype, rngs)
        self.attn = Attention(cfg, dtype, param_dtype, attention=attention, rngs=rngs)
        self.mlp_norm = _norm(cfg, dtype, param_dtype, rngs)
        self.mlp = MLP(cfg, dtype, param_dtype, rngs=rngs)

    def __call__(self, x: jax.Array, segment_ids: jax.Array | None, positions: jax.Array | None = None,
                 cache: tuple[jax.Array, jax.Array] | None = None):
        """x [batch, seq, embed] -> same; with a KV ``cache`` (decoding, see Attention) -> (x, updated cache)."""
        attn = self.attn(self.attn_norm(x), segment_ids, positions, cache)
        attn, cache = attn if cache is not None else (attn, None)
        x = with_logical_constraint(x + attn, ("batch", "act_seq", "act_embed"))
        x = x + self.mlp(self.mlp_norm(x))
        x = with_logical_constraint(x, ("batch", "act_seq", "act_embed"))
        return x if cache is None else (x, cache)


def stack_blocks(cfg: ModelConfig, dtype, param_dtype, attention: AttentionFn, rngs: nnx.Rngs, n: int, axis: str):
    """``n`` :class:`Block` s created stacked, leading logical axis ``axis`` (``layers``: the dense model's stack,
    split over stages; ``sublayers``: dense layers inside or before an MoE model's groups, never split)."""
    @nnx.split_rngs(splits=n)
    @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: axis})
    def make(rngs):
        return Block(cfg, dtype, param_dtype, attention=attention, rngs=rngs)

    return make(rngs)


def scan_blocks(stack, x: jax.Array, segment_ids: jax.Array | None, positions: jax.Array | None,
                remat: str = "none") -> jax.Array:
    """x [batch, seq, embed] through a :func:`stack_blocks` stack's layers in turn -> same (one scan; ``remat`` the
    policy of each layer's body)."""
    graphdef, stacked = nnx.split(stack)

    def body(h, layer_state):
        return nnx.merge(graphdef, layer_state)(h, segment_ids, positions), None

    if remat != "none":
        body = jax.checkpoint(body, policy=REMAT_POLICIES[remat], prevent_cse=False)
    return jax.lax.scan(body, x, stacked)[0]


def decode_blocks(stack, x: jax.Array, positions: jax.Array, cache: tuple[jax.Array, jax.Array]):
    """One decoding pass through a :func:`stack_blocks` stack: cache (k, v), each [n, batch, max_len, ...] -> (x,
    the updated cache)."""
    graphdef, stacked = nnx.split(stack)

    def body(h, item):
        layer, k1, v1 = item
        h, (k1, v1) = nnx.merge(graphdef, layer)(h, None, positions, (k1, v1))
        return h, (k1, v1)

    return jax.lax.scan(body, x, (stacked, *cache))


class Transformer(nnx.Module):
    """Decoder-only transformer for a resolved model config (``layout.resolve_auto``: no "auto" left).

    ``attention``: the attention each layer calls (:data:`AttentionFn`, with ``cfg.sliding_window`` if set); default
    ``Local(cfg.attention, window=cfg.sliding_window)``, on the
    arrays as given (the layout passes the mesh-aware one, :class:`jaxtrain.parallel.attention.MeshAttention`).
    """

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, attention: AttentionFn | None = None):
        if "auto" in (cfg.dtype, cfg.attention):
            raise ValueError("the model needs a resolved config (layout.resolve_auto): dtype and attention not auto")
        self.cfg = cfg
        attention = Local(cfg.attention, window=cfg.sliding_window) if attention is None else attention
        dtype, param_dtype = jnp.dtype(cfg.dtype), jnp.dtype(cfg.param_dtype)
        self.embed = nnx.Embed(cfg.vocab_size, cfg.d_model, dtype=dtype, param_dtype=param_dtype,
                               embedding_init=_init(cfg.init_std, ("vocab", "embed")), rngs=rngs)
        self.blocks = self.stack_layers(cfg, dtype, param_dtype, attention, rngs)
        self.final_norm = _norm(cfg, dtype, param_dtype, rngs)
        if not cfg.tie_embeddings:
            self.unembed = nnx.Linear(cfg.d_model, cfg.vocab_size, use_bias=False, dtype=dtype, param_dtype=param_dtype,
                                      kernel_init=_init(cfg.init_std, ("embed", "vocab")), rngs=rngs)
            use_reduce_dtype(cfg, self.unembed)  # never FP8's: the logits stay in the compute dtype

    def stack_layers(self, cfg: ModelConfig, dtype, param_dtype, attention: AttentionFn, rngs: nnx.Rngs):
        """The layer stack: ``cfg.n_layers`` blocks created stacked, leading logical axis ``layers`` (the MoE model,
        ``jaxtrain.models.moe``, stacks groups of layers instead)."""
        return stack_blocks(cfg, dtype, param_dtype, attention, rngs, cfg.n_layers, "layers")

    def __call__(self, tokens: jax.Array, segment_ids: jax.Array | None = None, *, positions: jax.Array | None = None,
                 cache: dict | None = None):
        """tokens: int [batch, seq] -> logits float32 [batch, seq, vocab] (logical: batch, act_seq, act_vocab).

        ``positions`` int [batch, seq]: each token's place for rotary (default 0..seq-1; the context axis's zigzag
        order passes its real positions). Decoding (prefill and each step) passes them and ``cache`` (from
        :meth:`init_cache`: "k" and "v", [layers, batch, max_len, kv_heads, head_dim]) and gets (logits, cache).
        """
        x = self.embed_tokens(tokens)
        if cache is None:
            return self.head(self.layers(x, segment_ids, positions))
        assert positions is not None, "decoding needs each token's position"
        x, (k, v) = decode_blocks(self.blocks, x, positions, (cache["k"], cache["v"]))
        return self.head(x), {"k": k, "v": v}

    def embed_tokens(self, tokens: jax.Array) -> jax.Array:
        """tokens int [..., batch, seq] -> embeddings [..., batch, seq, embed] in the compute dtype."""
        # Gather the (vocab, fsdp)-sharded table before the lookup: XLA cannot partition a gather from a
        # vocab-sharded table into a batch-sharded result without replicating it anyway (and warns).
        table = with_logical_constraint(self.embed.embedding[...], (None, "act_embed"))
        x = jnp.take(table, tokens, axis=0).astype(self.embed.dtype)
        lead = (None,) * (tokens.ndim - 2)
        return with_logical_constraint(x, (*lead, "batch", "act_seq", "act_embed"))

    def layers(self, x: jax.Array, segment_ids: jax.Array | None, positions: jax.Array | None = None) -> jax.Array:
        """The layer stack, one scan: x [batch, seq, embed] -> same; ``positions`` int [batch, seq] each token's
        place in its sequence for rotary (default 0..seq-1; the context axis's zigzag order passes them)."""
        return scan_blocks(self.blocks, x, segment_ids, positions, self.cfg.remat)

    def head(self, x: jax.Array) -> jax.Array:
        """Final norm and output projection: x [batch, seq, embed] -> logits float32 [batch, seq, vocab]."""
        x = self.final_norm(x)
        if not self.cfg.tie_embeddings:
            logits = self.unembed(x)
        elif self.cfg.reduce_dtype == "float32":  # the tied table's gradient from the logits: float32 too
            logits = attend(self.embed, x)
        else:
            logits = self.embed.attend(x)
        return with_logical_constraint(logits.astype(jnp.float32), ("batch", "act_seq", "act_vocab"))

    def cache_shapes(self, batch: int, max_len: int) -> dict[str, tuple[tuple[int, ...], tuple[str | None, ...]]]:
        """The decoding cache's arrays: name -> (shape, logical axes). "k" and "v" [layers, batch, max_len, kv_heads,
        head_dim], sharded like the attention activations (batch over data/fsdp, kv heads over tensor).

        MLA (``kv_lora_rank``) caches its compressed form under the same two names: "k" the latent c_kv
        [layers, batch, max_len, kv_lora_rank], "v" the shared rotary key [layers, batch, max_len, qk_rope_head_dim]
        (kv_lora_rank + qk_rope_head_dim numbers a token and layer instead of 2 * heads * head_dim)."""
        cfg = self.cfg
        if cfg.mla:
            assert cfg.kv_lora_rank is not None
            return {name: ((cfg.n_layers, batch, max_len, width), (None, *LATENT_CACHE_AXES))
                    for name, width in (("k", cfg.kv_lora_rank), ("v", cfg.qk_rope_head_dim))}
        shape = (cfg.n_layers, batch, max_len, cfg.n_kv_heads, cfg.resolved_head_dim)
        return {name: (shape, (None, *CACHE_AXES)) for name in ("k", "v")}

    def init_cache(self, batch: int, max_len: int) -> dict:
        """An empty cache for decoding (:meth:`cache_shapes`): zeros in the compute dtype, laid out by their logical
        axes."""
        return {name: with_logical_constraint(jnp.zeros(shape, self.embed.dtype), axes)
                for name, (shape, axes) in self.cache_shapes(batch, max_len).items()}
