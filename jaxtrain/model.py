"""Llama-style decoder in Flax NNX.

Token embedding, pre-norm blocks of RMSNorm + grouped-query attention with rotary positions + SwiGLU MLP, a final
RMSNorm, tied or untied output projection. Layers are created stacked (leading ``layers`` axis) and applied with
``jax.lax.scan``: one compiled block whatever the depth, and few state leaves.

Every parameter names its logical axes (``embed``, ``mlp``, ``heads``, ...) and key activations are constrained to
logical axes (``batch``, ``act_embed``, ...). The mapping to mesh axes lives in the config (``mesh.rules``) and is
applied by the caller through ``nnx.logical_axis_rules``; this module never names a mesh axis.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from flax.linen import partitioning as nn_partitioning
from flax.linen import with_logical_constraint
from jax.ad_checkpoint import checkpoint_name

from jaxtrain import context
from jaxtrain.config import ModelConfig
from kernels import flash_attention, mha_reference
from kernels.flash_pallas import CHECKPOINT_NAMES

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


def attention(q, k, v, segment_ids, impl: str, interpret: bool = False) -> jax.Array:
    """Causal self-attention. q [batch, seq, heads, head_dim], k and v [batch, seq, kv_heads, head_dim].

    ``impl`` is the resolved ``model.attention`` (``layout.resolve_auto`` gave "auto" its meaning at start-up);
    ``interpret`` runs the flash kernels in Pallas' interpreter (CPU). The flash kernels are custom calls that XLA
    cannot partition, so they run under ``shard_map`` on each device's shard: batch and heads split over the mesh
    axes their logical names map to (the config refuses a sharded sequence for them).
    """
    mesh = jax.sharding.get_abstract_mesh()
    ring = 1 if mesh.empty else dict(mesh.shape).get(context.AXIS, 1)
    if ring > 1:  # the sequence is split over the context axis, in the zigzag order (jaxtrain/context.py)
        if impl not in ("xla", "pallas", "triton"):
            raise ValueError(f"attention impl {impl!r} cannot run over a context axis; use xla, pallas or triton")
        blocks = context.XLA_BLOCKS if impl == "xla" else context.kernel_blocks(impl, interpret)
        specs = tuple(nn_partitioning.logical_to_mesh_axes(axes) for axes in (
            ("batch", "act_seq", "act_heads", None), ("batch", "act_seq", "act_kv_heads", None), ("batch", "act_seq")))
        return context.context_attention(q, k, v, segment_ids, mesh=mesh, specs=specs, n=ring, blocks=blocks)
    if impl == "xla":
        return mha_reference(q, k, v, causal=True, segment_ids=segment_ids)
    if impl == "cudnn":
        if segment_ids is not None:
            raise ValueError("model.attention=cudnn does not take segment ids (data.document_mask)")
        return _cudnn_attention(q, k, v)
    if impl not in ("pallas", "triton"):
        raise ValueError(f"attention impl {impl!r} is not resolved; expected xla, cudnn, pallas or triton")

    def local(q, k, v, segment_ids):
        return flash_attention(q, k, v, causal=True, segment_ids=segment_ids, impl=impl, interpret=interpret)

    if mesh.empty:
        return local(q, k, v, segment_ids)
    q_spec = nn_partitioning.logical_to_mesh_axes(("batch", "act_seq", "act_heads", None))
    kv_spec = nn_partitioning.logical_to_mesh_axes(("batch", "act_seq", "act_kv_heads", None))
    seg_spec = nn_partitioning.logical_to_mesh_axes(("batch", "act_seq"))
    if segment_ids is None:
        return jax.shard_map(lambda q, k, v: local(q, k, v, None), mesh=mesh, in_specs=(q_spec, kv_spec, kv_spec),
                             out_specs=q_spec, check_vma=False)(q, k, v)
    return jax.shard_map(local, mesh=mesh, in_specs=(q_spec, kv_spec, kv_spec, seg_spec), out_specs=q_spec,
                         check_vma=False)(q, k, v, segment_ids)


def keep_residuals(fn):
    """``fn(q, k, v) -> out`` (attention, out [batch, seq, heads, head_dim]) with its backward's residuals under
    the checkpoint names ``attn_out`` (the output) and ``attn_lse`` (the rest, e.g. cuDNN's softmax statistics).

    A name on ``fn``'s result alone is not enough for a ``jax.custom_vjp`` function such as cuDNN's attention: its
    backward reads the residuals its forward rule made, which are other values than the named result, so a remat
    policy saving the name still reruns the forward in the backward pass. Here the residuals themselves are named.
    Residuals that are q, k or v as passed stay unnamed (the policy decides about them as about any input).
    """

    @jax.custom_vjp
    def call(q, k, v):
        return fn(q, k, v)

    def forward(q, k, v):
        out, pull = jax.vjp(fn, q, k, v)
        named_out = checkpoint_name(out, CHECKPOINT_NAMES[0])

        def name(r):
            if any(r is x for x in (q, k, v)):
                return r
            return named_out if r is out else checkpoint_name(r, CHECKPOINT_NAMES[1])

        return named_out, jax.tree.map(name, pull)

    call.defvjp(forward, lambda pull, g: pull(g))
    return call


# cuDNN's fused attention (GPU, 16-bit), causal, with its output and softmax statistics saveable by the remat
# policies (REMAT_POLICIES save CHECKPOINT_NAMES).
_cudnn_attention = keep_residuals(
    lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn"))


def _init(std: float, axes: tuple[str | None, ...]):
    return nnx.with_partitioning(nnx.initializers.normal(std), axes)


def rope_frequencies(cfg: ModelConfig) -> jax.Array:
    """Rotary inverse frequencies float32 [head_dim / 2], with Llama 3.1's scaling when ``cfg.rope_scaling`` asks."""
    dim = cfg.resolved_head_dim
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


def cached_attention(q, k_cache, v_cache, q_positions) -> jax.Array:
    """Attention of new queries over a KV cache, for decoding. q [batch, new, heads, head_dim], caches
    [batch, max_len, kv_heads, head_dim], q_positions int [batch, new]: a query attends to cache slots at or before
    its own position (slots past it may hold stale values; they are masked). Same arithmetic as ``mha_reference``."""
    b, t, h, d = q.shape
    kv = k_cache.shape[2]
    qg = q.reshape(b, t, kv, h // kv, d)
    logits = jnp.einsum("btkgd,bskd->bkgts", qg, k_cache, preferred_element_type=jnp.float32) * d**-0.5
    visible = jnp.arange(k_cache.shape[1])[None, None, :] <= q_positions[:, :, None]  # [batch, new, max_len]
    logits = jnp.where(visible[:, None, None], logits, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(logits, axis=-1)
    out = jnp.einsum("bkgts,bskd->btkgd", probs.astype(v_cache.dtype), v_cache, preferred_element_type=jnp.float32)
    return out.reshape(b, t, h, d).astype(q.dtype)


CACHE_AXES = ("batch", None, "act_kv_heads", None)  # one layer's KV cache [batch, max_len, kv_heads, head_dim]


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, dtype, param_dtype, *, interpret: bool, rngs: nnx.Rngs):
        self.cfg, self.interpret = cfg, interpret
        d, hd = cfg.d_model, cfg.resolved_head_dim
        common = dict(use_bias=False, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.q = nnx.LinearGeneral(d, (cfg.n_heads, hd),
                                   kernel_init=_init(cfg.init_std, ("embed", "heads", "head_dim")), **common)
        self.k = nnx.LinearGeneral(d, (cfg.n_kv_heads, hd),
                                   kernel_init=_init(cfg.init_std, ("embed", "kv_heads", "head_dim")), **common)
        self.v = nnx.LinearGeneral(d, (cfg.n_kv_heads, hd),
                                   kernel_init=_init(cfg.init_std, ("embed", "kv_heads", "head_dim")), **common)
        # Scaled init of residual-branch outputs (GPT-2): keeps the residual stream's variance independent of depth.
        out_std = cfg.init_std / (2 * cfg.n_layers) ** 0.5
        self.o = nnx.LinearGeneral((cfg.n_heads, hd), d, axis=(-2, -1),
                                   kernel_init=_init(out_std, ("heads", "head_dim", "embed")), **common)

    def __call__(self, x: jax.Array, segment_ids: jax.Array | None, positions: jax.Array | None = None,
                 cache: tuple[jax.Array, jax.Array] | None = None):
        """x: [batch, seq, embed] -> [batch, seq, embed].

        Decoding passes ``positions`` int [batch, seq] and ``cache`` (k, v) [batch, max_len, kv_heads, head_dim]:
        the new keys and values are written at ``positions`` and the queries attend over the cache; then the
        result is (output, updated cache).
        """
        q = with_logical_constraint(self.q(x), ("batch", "act_seq", "act_heads", None))
        k = with_logical_constraint(self.k(x), ("batch", "act_seq", "act_kv_heads", None))
        v = with_logical_constraint(self.v(x), ("batch", "act_seq", "act_kv_heads", None))
        freqs = rope_frequencies(self.cfg)
        q, k = rotary(q, freqs, positions), rotary(k, freqs, positions)
        if cache is None:
            out = attention(q, k, v, segment_ids, self.cfg.attention, self.interpret)
        else:
            rows = jnp.arange(x.shape[0])[:, None]
            k_cache = with_logical_constraint(cache[0].at[rows, positions].set(k.astype(cache[0].dtype)), CACHE_AXES)
            v_cache = with_logical_constraint(cache[1].at[rows, positions].set(v.astype(cache[1].dtype)), CACHE_AXES)
            out = cached_attention(q, k_cache, v_cache, positions)
        out = with_logical_constraint(out, ("batch", "act_seq", "act_heads", None))
        return self.o(out) if cache is None else (self.o(out), (k_cache, v_cache))


class MLP(nnx.Module):
    def __init__(self, cfg: ModelConfig, dtype, param_dtype, *, rngs: nnx.Rngs):
        common = dict(use_bias=False, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.gate = nnx.Linear(cfg.d_model, cfg.d_ff, kernel_init=_init(cfg.init_std, ("embed", "mlp")), **common)
        self.up = nnx.Linear(cfg.d_model, cfg.d_ff, kernel_init=_init(cfg.init_std, ("embed", "mlp")), **common)
        out_std = cfg.init_std / (2 * cfg.n_layers) ** 0.5
        self.down = nnx.Linear(cfg.d_ff, cfg.d_model, kernel_init=_init(out_std, ("mlp", "embed")), **common)

    def __call__(self, x: jax.Array) -> jax.Array:
        """SwiGLU. x: [batch, seq, embed] -> [batch, seq, embed]; hidden [batch, seq, mlp]."""
        h = nnx.silu(self.gate(x)) * self.up(x)
        h = with_logical_constraint(h, ("batch", "act_seq", "act_mlp"))
        return self.down(h)


def _norm(cfg: ModelConfig, dtype, param_dtype, rngs: nnx.Rngs) -> nnx.RMSNorm:
    return nnx.RMSNorm(cfg.d_model, epsilon=cfg.norm_eps, dtype=dtype, param_dtype=param_dtype,
                       scale_init=nnx.with_partitioning(nnx.initializers.ones, ("norm",)), rngs=rngs)


class Block(nnx.Module):
    def __init__(self, cfg: ModelConfig, dtype, param_dtype, *, interpret: bool, rngs: nnx.Rngs):
        self.attn_norm = _norm(cfg, dtype, param_dtype, rngs)
        self.attn = Attention(cfg, dtype, param_dtype, interpret=interpret, rngs=rngs)
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


class Transformer(nnx.Module):
    """Decoder-only transformer for a resolved model config (``layout.resolve_auto``: no "auto" left).

    ``interpret_kernels``: run the flash kernels in Pallas' interpreter (the platform is a CPU).
    """

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, interpret_kernels: bool = False):
        if "auto" in (cfg.dtype, cfg.attention):
            raise ValueError("the model needs a resolved config (layout.resolve_auto): dtype and attention not auto")
        self.cfg = cfg
        dtype, param_dtype = jnp.dtype(cfg.dtype), jnp.dtype(cfg.param_dtype)
        self.embed = nnx.Embed(cfg.vocab_size, cfg.d_model, dtype=dtype, param_dtype=param_dtype,
                               embedding_init=_init(cfg.init_std, ("vocab", "embed")), rngs=rngs)

        @nnx.split_rngs(splits=cfg.n_layers)
        @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
        def make_blocks(rngs):
            return Block(cfg, dtype, param_dtype, interpret=interpret_kernels, rngs=rngs)

        self.blocks = make_blocks(rngs)
        self.final_norm = _norm(cfg, dtype, param_dtype, rngs)
        if not cfg.tie_embeddings:
            self.unembed = nnx.Linear(cfg.d_model, cfg.vocab_size, use_bias=False, dtype=dtype, param_dtype=param_dtype,
                                      kernel_init=_init(cfg.init_std, ("embed", "vocab")), rngs=rngs)

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
        graphdef, stacked = nnx.split(self.blocks)

        def decode_body(h, layer):
            layer_state, k, v = layer
            h, (k, v) = nnx.merge(graphdef, layer_state)(h, None, positions, (k, v))
            return h, (k, v)

        x, (k, v) = jax.lax.scan(decode_body, x, (stacked, cache["k"], cache["v"]))
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
        graphdef, stacked = nnx.split(self.blocks)

        def body(h, layer_state):
            return nnx.merge(graphdef, layer_state)(h, segment_ids, positions), None

        if self.cfg.remat != "none":
            body = jax.checkpoint(body, policy=REMAT_POLICIES[self.cfg.remat], prevent_cse=False)
        x, _ = jax.lax.scan(body, x, stacked)
        return x

    def head(self, x: jax.Array) -> jax.Array:
        """Final norm and output projection: x [batch, seq, embed] -> logits float32 [batch, seq, vocab]."""
        x = self.final_norm(x)
        logits = self.embed.attend(x) if self.cfg.tie_embeddings else self.unembed(x)
        return with_logical_constraint(logits.astype(jnp.float32), ("batch", "act_seq", "act_vocab"))

    def init_cache(self, batch: int, max_len: int) -> dict:
        """An empty KV cache for decoding: "k" and "v" zeros [layers, batch, max_len, kv_heads, head_dim] in the
        compute dtype, sharded like the attention activations (batch over data/fsdp, kv heads over tensor)."""
        cfg = self.cfg
        shape = (cfg.n_layers, batch, max_len, cfg.n_kv_heads, cfg.resolved_head_dim)
        zeros = jnp.zeros(shape, self.embed.dtype)
        zeros = with_logical_constraint(zeros, (None, *CACHE_AXES))
        return {"k": zeros, "v": zeros}


def train_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Model FLOPs of one training token (forward + backward = 3x forward), rematerialisation not counted.

    Forward: 2 FLOPs per weight of every matmul (the embedding lookup is not a matmul; the output projection is),
    plus attention's two [seq x seq] matmuls, 2 * 2 * seq * heads * head_dim per layer, halved for causal masking.
    The one formula for model FLOPs: MFU, the planner's compute time and the benchmarks all use it.
    """
    d, hd, l = cfg.d_model, cfg.resolved_head_dim, cfg.n_layers
    matmul_weights = l * (d * hd * (2 * cfg.n_heads + 2 * cfg.n_kv_heads) + 3 * d * cfg.d_ff) + d * cfg.vocab_size
    return 3 * (2 * matmul_weights + attention_flops_per_token(cfg, seq_len))


def attention_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Forward FLOPs of attention's two [seq x seq] matmuls per token, all layers: 2 * 2 * seq * heads * head_dim
    per layer, halved for causal masking (part of :func:`train_flops_per_token`; the planner's remat cost too)."""
    return cfg.n_layers * 2 * 2 * seq_len * cfg.n_heads * cfg.resolved_head_dim / 2


def count_params(cfg: ModelConfig) -> dict[str, int]:
    """Analytic parameter counts: total, and the embedding table alone."""
    d, hd, l = cfg.d_model, cfg.resolved_head_dim, cfg.n_layers
    attn = d * hd * (2 * cfg.n_heads + 2 * cfg.n_kv_heads)
    mlp = 3 * d * cfg.d_ff
    per_layer = attn + mlp + 2 * d
    embed = cfg.vocab_size * d
    unembed = 0 if cfg.tie_embeddings else embed
    return {"total": embed + unembed + l * per_layer + d, "embedding": embed}
