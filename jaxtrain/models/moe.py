"""Mixture-of-experts decoder (docs/moe.md): the Llama-style decoder whose every ``model.moe.every``-th layer has routed
experts instead of the SwiGLU MLP.

Structure: the stack is scanned over *groups* of ``every`` layers, ``every - 1`` dense blocks then one MoE block
(transformers' ``decoder_sparse_step``: layer i is MoE when (i + 1) % every == 0). Parameters, with their logical
axes (G = n_layers / every groups; the leading ``layers`` axis is the group axis, what the scan and remat see):

    blocks.dense.<Block's parameters>   [G, every - 1, ...]  (layers, sublayers, ...); absent when every == 1
    blocks.moe.attn_norm, attn, mlp_norm  as a Block's, [G, ...]
    blocks.moe.mlp.router               [G, embed, E]          (layers, embed, -)           float32 logits
    blocks.moe.mlp.w_gate, w_up         [G, E, embed, d_ff]    (layers, experts, embed, expert_mlp)
    blocks.moe.mlp.w_down               [G, E, d_ff, embed]    (layers, experts, expert_mlp, embed)
    blocks.moe.mlp.shared.{gate,up,down}  an MLP of width shared_experts x d_ff (only with shared experts)
    blocks.moe.mlp.shared_gate          [G, embed, 1]          (only with model.moe.shared_gate)
    blocks.moe.mlp.expert_bias          [G, E]                 (layers, -)  float32 state, not a parameter
                                                               (only with model.moe.expert_bias)

Hugging Face layer ``g * every + j`` is ``blocks.dense`` [g, j] for j < every - 1 and ``blocks.moe`` [g] for the
last; Mixtral's per-expert w1, w3, w2 are ``w_gate[e]``, ``w_up[e]``, ``w_down[e]`` transposed, its gate is
``router`` transposed. The experts run through the ``experts`` callable the model is built with
(:data:`jaxtrain.models.experts.ExpertsFn`): on the arrays as given by default; the layout passes
:class:`jaxtrain.parallel.expert.MeshExperts`, which sends tokens to the devices holding their experts.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from flax.linen import with_logical_constraint

from jaxtrain.config import ModelConfig, MoEConfig
from jaxtrain.models import fp8, fp8_experts, routing
from jaxtrain.models.attention import REMAT_POLICIES
from jaxtrain.models.experts import ExpertsFn, local_experts
from jaxtrain.models.llama import (
    MLP,
    Attention,
    AttentionFn,
    Transformer,
    _init,
    _norm,
    decode_blocks,
    scan_blocks,
    stack_blocks,
)

ACT = ("batch", "act_seq", "act_embed")


def _param(rngs: nnx.Rngs, std: float, axes: tuple[str | None, ...], shape: tuple[int, ...], dtype) -> nnx.Param:
    return nnx.Param(_init(std, axes)(rngs.params(), shape, dtype))


class MoE(nnx.Module):
    """Routed SwiGLU experts (and the shared ones) in place of a block's MLP: x [batch, seq, embed] -> (y like x,
    :class:`jaxtrain.models.routing.RouterStats`)."""

    def __init__(self, cfg: ModelConfig, dtype, param_dtype, *, experts: ExpertsFn, rngs: nnx.Rngs):
        moe, d, f = cfg.moe, cfg.d_model, cfg.expert_d_ff
        self.moe_cfg, self.dtype, self.experts = moe, dtype, experts
        out_std = cfg.init_std / (2 * cfg.n_layers) ** 0.5
        self.router = _param(rngs, cfg.init_std, ("embed", None), (d, moe.experts), param_dtype)
        self.w_gate = _param(rngs, cfg.init_std, ("experts", "embed", "expert_mlp"), (moe.experts, d, f), param_dtype)
        self.w_up = _param(rngs, cfg.init_std, ("experts", "embed", "expert_mlp"), (moe.experts, d, f), param_dtype)
        self.w_down = _param(rngs, out_std, ("experts", "expert_mlp", "embed"), (moe.experts, f, d), param_dtype)
        shared_cfg = dataclasses.replace(cfg, d_ff=moe.shared_experts * f)
        self.shared = nnx.data(MLP(shared_cfg, dtype, param_dtype, rngs=rngs) if moe.shared_experts else None)
        gate = _param(rngs, cfg.init_std, ("embed", None), (d, 1), param_dtype) if moe.shared_gate else None
        self.shared_gate = nnx.data(gate)
        if moe.expert_bias:  # float32 whatever param_dtype: 1e-3 steps would vanish in bfloat16 near 1
            self.expert_bias = routing.ExpertBias(jnp.zeros((moe.experts,), jnp.float32), out_sharding=(None,))
        self.fp8_recipe = fp8_experts.experts_recipe(cfg)  # the routed experts' (docs/fp8.md)
        if self.fp8_recipe == "delayed":  # gate, up, down: x, w, g each; the layer stack adds "layers"
            history = jnp.zeros((3, 3, cfg.fp8_amax_history), jnp.float32)
            setattr(self, fp8.META_NAME, fp8.Fp8Meta(history, out_sharding=(None, None, None)))

    def __call__(self, x: jax.Array, dropless: bool = False,
                 routed: jax.Array | None = None) -> tuple[jax.Array, routing.RouterStats]:
        """``dropless``: ignore the capacity (decoding: a drop would change what is generated); ``routed`` bool
        [batch, seq] or None (all): the positions sent to experts (padding is not)."""
        slots = None if dropless else routing.slots_per_expert(x.shape[1], self.moe_cfg)
        bias = self.expert_bias[...] if self.moe_cfg.expert_bias else None
        route, stats = routing.route(x, self.router[...], self.moe_cfg, slots, routed, bias)
        w = [p[...].astype(self.dtype) for p in (self.w_gate, self.w_up, self.w_down)]
        history = getattr(self, fp8.META_NAME)[...] if self.fp8_recipe == "delayed" else None
        y = self.experts(x.astype(self.dtype), route.experts, route.weights, *w, slots, fp8=self.fp8_recipe,
                         fp8_history=history)
        if self.shared is not None:
            shared = self.shared(x)
            if self.shared_gate is not None:
                gate = jnp.einsum("bsd,do->bso", x, self.shared_gate[...].astype(self.dtype))
                shared = jax.nn.sigmoid(gate.astype(jnp.float32)).astype(shared.dtype) * shared
            y = y + shared
        return with_logical_constraint(y, ACT), stats


class MoEBlock(nnx.Module):
    """A pre-norm block whose MLP is :class:`MoE`: attention, then the experts, each with its residual."""

    def __init__(self, cfg: ModelConfig, dtype, param_dtype, *, attention: AttentionFn, experts: ExpertsFn,
                 rngs: nnx.Rngs):
        self.attn_norm = _norm(cfg, dtype, param_dtype, rngs)
        self.attn = Attention(cfg, dtype, param_dtype, attention=attention, rngs=rngs)
        self.mlp_norm = _norm(cfg, dtype, param_dtype, rngs)
        self.mlp = MoE(cfg, dtype, param_dtype, experts=experts, rngs=rngs)

    def __call__(self, x: jax.Array, segment_ids: jax.Array | None, positions: jax.Array | None = None,
                 cache: tuple[jax.Array, jax.Array] | None = None, routed: jax.Array | None = None):
        """x [batch, seq, embed] -> (x, RouterStats, the updated KV cache or None); with a ``cache`` (decoding, as
        :class:`jaxtrain.models.llama.Attention`) the experts run dropless; ``routed`` as :class:`MoE`'s."""
        attn = self.attn(self.attn_norm(x), segment_ids, positions, cache)
        attn, cache = attn if cache is not None else (attn, None)
        x = with_logical_constraint(x + attn, ACT)
        y, stats = self.mlp(self.mlp_norm(x), dropless=cache is not None, routed=routed)
        return with_logical_constraint(x + y, ACT), stats, cache


class MoEGroup(nnx.Module):
    """``every`` consecutive layers: ``every - 1`` dense blocks (stacked, logical axis ``sublayers``), then one
    :class:`MoEBlock`."""

    def __init__(self, cfg: ModelConfig, dtype, param_dtype, *, attention: AttentionFn, experts: ExpertsFn,
                 rngs: nnx.Rngs):
        self.dense = nnx.data(stack_blocks(cfg, dtype, param_dtype, attention, rngs, cfg.moe.every - 1, "sublayers")
                              if cfg.moe.every > 1 else None)
        self.moe = MoEBlock(cfg, dtype, param_dtype, attention=attention, experts=experts, rngs=rngs)

    def __call__(self, x: jax.Array, segment_ids: jax.Array | None, positions: jax.Array | None = None,
                 routed: jax.Array | None = None) -> tuple[jax.Array, routing.RouterStats]:
        """x [batch, seq, embed] -> (x, the MoE layer's RouterStats); ``routed`` as :class:`MoE`'s."""
        if self.dense is not None:
            x = scan_blocks(self.dense, x, segment_ids, positions)
        x, stats, _ = self.moe(x, segment_ids, positions, routed=routed)
        return x, stats

    def decode(self, x: jax.Array, positions: jax.Array, cache: tuple[jax.Array, jax.Array]):
        """One decoding pass through the group: cache (k, v) [every, batch, max_len, kv_heads, head_dim] -> (x, the
        updated cache)."""
        k, v = cache
        if self.dense is not None:
            x, (kd, vd) = decode_blocks(self.dense, x, positions, (k[:-1], v[:-1]))
        x, _, (km, vm) = self.moe(x, None, positions, (k[-1], v[-1]))
        if self.dense is None:
            return x, (km[None], vm[None])
        return x, (jnp.concatenate([kd, km[None]]), jnp.concatenate([vd, vm[None]]))


class MoETransformer(Transformer):
    """The decoder with MoE layers (``cfg.moe.experts`` > 0); the same interface as
    :class:`jaxtrain.models.llama.Transformer`, plus :meth:`forward_with_stats` for training.

    ``experts``: the callable the MoE layers run their experts through (default: :func:`local_experts`)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, attention: AttentionFn | None = None,
                 experts: ExpertsFn | None = None):
        self.experts_fn = local_experts if experts is None else experts
        super().__init__(cfg, rngs=rngs, attention=attention)

    def stack_layers(self, cfg: ModelConfig, dtype, param_dtype, attention: AttentionFn, rngs: nnx.Rngs):
        """(n_layers - first_dense) / every groups (:class:`MoEGroup`) created stacked, leading logical axis
        ``layers``; also sets ``first_dense``: the ``model.moe.first_dense`` dense layers before them
        (:func:`jaxtrain.models.llama.stack_blocks`, [first_dense, ...]; None without)."""
        k = cfg.moe.first_dense
        dense = stack_blocks(cfg, dtype, param_dtype, attention, rngs, k, "sublayers") if k else None
        self.first_dense = nnx.data(dense)

        @nnx.split_rngs(splits=cfg.moe_layers)
        @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
        def make_groups(rngs):
            return MoEGroup(cfg, dtype, param_dtype, attention=attention, experts=self.experts_fn, rngs=rngs)

        return make_groups(rngs)

    def layers_with_stats(self, x: jax.Array, segment_ids: jax.Array | None, positions: jax.Array | None = None,
                          routed: jax.Array | None = None) -> tuple[jax.Array, routing.RouterStats]:
        """The stack, one scan over the groups: x [batch, seq, embed] -> (x, RouterStats stacked [G, ...]);
        ``routed`` as :class:`MoE`'s."""
        if self.first_dense is not None:
            x = scan_blocks(self.first_dense, x, segment_ids, positions, self.cfg.remat)
        graphdef, stacked = nnx.split(self.blocks)

        def body(h, group_state):
            return nnx.merge(graphdef, group_state)(h, segment_ids, positions, routed)

        if self.cfg.remat != "none":
            body = jax.checkpoint(body, policy=REMAT_POLICIES[self.cfg.remat], prevent_cse=False)
        return jax.lax.scan(body, x, stacked)

    def layers(self, x: jax.Array, segment_ids: jax.Array | None, positions: jax.Array | None = None) -> jax.Array:
        return self.layers_with_stats(x, segment_ids, positions)[0]

    def forward_with_stats(self, tokens: jax.Array, segment_ids: jax.Array | None = None, *,
                           positions: jax.Array | None = None,
                           routed: jax.Array | None = None) -> tuple[jax.Array, routing.RouterStats]:
        """tokens int [batch, seq] -> (logits float32 [batch, seq, vocab], RouterStats stacked [G, ...]);
        ``routed`` bool [batch, seq] or None (all): the positions sent to experts (not padding)."""
        x, stats = self.layers_with_stats(self.embed_tokens(tokens), segment_ids, positions, routed)
        return self.head(x), stats

    def __call__(self, tokens: jax.Array, segment_ids: jax.Array | None = None, *, positions: jax.Array | None = None,
                 cache: dict | None = None):
        """As :meth:`jaxtrain.models.llama.Transformer.__call__` (the cache [n_layers, ...] too); decoding runs the
        experts dropless."""
        if cache is None:
            return self.head(self.layers(self.embed_tokens(tokens), segment_ids, positions))
        assert positions is not None, "decoding needs each token's position"
        every, first = self.cfg.moe.every, self.cfg.moe.first_dense
        x = self.embed_tokens(tokens)
        if self.first_dense is not None:
            x, (k0, v0) = decode_blocks(self.first_dense, x, positions, (cache["k"][:first], cache["v"][:first]))
        graphdef, stacked = nnx.split(self.blocks)
        grouped = [c[first:].reshape(-1, every, *c.shape[1:]) for c in (cache["k"], cache["v"])]

        def body(h, item):
            group_state, k, v = item
            return nnx.merge(graphdef, group_state).decode(h, positions, (k, v))

        x, (k, v) = jax.lax.scan(body, x, (stacked, *grouped))
        k, v = (c.reshape(-1, *c.shape[2:]) for c in (k, v))
        if self.first_dense is not None:
            k, v = jnp.concatenate([k0, k]), jnp.concatenate([v0, v])
        return self.head(x), {"k": k, "v": v}


def make_model(cfg: ModelConfig, *, rngs: nnx.Rngs, attention: AttentionFn | None = None,
               experts: ExpertsFn | None = None) -> Transformer:
    """The model of ``cfg``: :class:`MoETransformer` when ``cfg.moe.experts`` > 0, else the dense Transformer."""
    if cfg.moe.experts:
        return MoETransformer(cfg, rngs=rngs, attention=attention, experts=experts)
    return Transformer(cfg, rngs=rngs, attention=attention)


def logits_and_stats(model: Transformer, tokens: jax.Array, segment_ids: jax.Array | None = None,
                     positions: jax.Array | None = None,
                     routed: jax.Array | None = None) -> tuple[jax.Array, routing.RouterStats | None]:
    """(logits float32 [batch, seq, vocab], RouterStats [G, ...] of an MoE model or None for a dense one);
    ``routed`` as :meth:`MoETransformer.forward_with_stats`'."""
    if isinstance(model, MoETransformer):
        return model.forward_with_stats(tokens, segment_ids, positions=positions, routed=routed)
    return model(tokens, segment_ids, positions=positions), None


METRICS = ("moe_balance_loss", "moe_z_loss", "moe_max_load", "moe_top_share", "moe_dropped")  # a step's MoE figures


def zero_metrics(cfg: ModelConfig) -> dict[str, jax.Array]:
    """The metrics :func:`objective` gives for ``cfg``'s model, all zero (float32): where sums over microbatches
    start."""
    return {name: jnp.zeros((), jnp.float32) for name in ("loss", *(METRICS if cfg.moe.experts else ()))}


def objective(loss: jax.Array, stats: routing.RouterStats | None, moe: MoEConfig,
              share: float = 1.0) -> tuple[jax.Array, dict[str, Any]]:
    """(what to minimise, the metrics) of a next-token ``loss`` (this microbatch's part of the step's mean) and the
    router's statistics: ``share`` x (aux_loss x the load-balancing loss + z_loss x the z-loss) is added, ``share``
    being this microbatch's part of the step (1 / microbatches). Metrics: ``loss`` (the next-token loss alone),
    and for an MoE model ``moe_balance_loss``, ``moe_z_loss`` (unweighted) and
    :func:`jaxtrain.models.routing.load_metrics`, each times ``share`` (summed over microbatches: their mean)."""
    if stats is None:
        return loss, {"loss": loss}
    balance, z = routing.load_balancing_loss(stats, moe.balance_loss), routing.z_loss(stats)
    terms = moe.aux_loss * balance + moe.z_loss * z
    if moe.seq_aux_loss > 0:  # a Python branch: without it the objective is the same program as before the option
        terms = terms + moe.seq_aux_loss * routing.seq_balance_loss(stats)
    total = loss + share * terms
    figures = {"moe_balance_loss": balance, "moe_z_loss": z, **routing.load_metrics(stats, moe.top_k)}
    return total, {"loss": loss, **{k: share * v for k, v in figures.items()}}


def router_loss_part(sums: routing.RouterStats, totals: tuple[jax.Array, jax.Array, jax.Array], moe: MoEConfig,
                     share: float) -> jax.Array:
    """Some rows' part of one microbatch's ``share`` x (aux_loss x balance + z_loss x z-loss + seq_aux_loss x the
    sequence-wise loss) (:func:`objective`), the parts of all its rows adding up to it: ``sums`` the rows'
    statistics per MoE layer (prob_sum [G, E], z_sum [G], seq_sum [G]), ``totals`` (counts float32 [G, E], tokens
    [G], seqs [G]) those of all the microbatch's rows (no gradient: the losses are linear in the rows'
    probabilities, z sums and sequence sums given the totals)."""
    counts, tokens, seqs = totals
    whole = routing.RouterStats(counts, sums.prob_sum, tokens, sums.z_sum, jnp.zeros_like(tokens), sums.seq_sum,
                                seqs)
    terms = moe.aux_loss * routing.load_balancing_loss(whole, moe.balance_loss) + moe.z_loss * routing.z_loss(whole)
    if moe.seq_aux_loss > 0:
        terms = terms + moe.seq_aux_loss * routing.seq_balance_loss(whole)
    return share * terms
