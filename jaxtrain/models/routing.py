"""Token-choice top-k routing for the MoE layers (docs/moe.md): the router's choice, the capacity's drops, and the
statistics behind the load-balancing loss, the router z-loss and the load metrics.

Plain jnp on the global activations (the partitioner splits them like any other; no mesh axis is named). The router
arithmetic is float32 whatever the compute dtype (float64 when the input is). Routers:

- ``softmax`` (Mixtral, Qwen2-MoE): p = softmax(logits) over the experts; each token takes the ``top_k`` largest p,
  weighted p_k / sum of its top-k p when ``normalize`` (Mixtral), else p_k (Qwen2-MoE's default);
- ``sigmoid`` (DeepSeek-V3): s = sigmoid(logits); the ``top_k`` largest s, weighted s_k / sum of the top-k s when
  ``normalize``; the load-balancing loss's probabilities are s / sum(s). (DeepSeek's bias-steered, group-limited
  selection is not modelled.)

With ``capacity_factor`` > 0 each expert takes at most ``slots`` = ceil(capacity_factor x seq x top_k / experts)
assignments of each sequence (a sequence is the group: the drops do not depend on the mesh); first choices of all
tokens before anyone's second (GShard, Switch), then in token order. A dropped assignment gets weight 0 and the expert
id ``experts`` (a sentinel no expert has): its token passes that expert by the residual.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxtrain.config import MoEConfig


class Routing(NamedTuple):
    """Where each token goes. experts int32 [batch, seq, top_k]: the chosen experts, distinct per token, highest
    score first (``E`` = the number of experts where the capacity dropped the assignment); weights float32
    [batch, seq, top_k]: the combine weights (0 where dropped)."""

    experts: jax.Array
    weights: jax.Array


class RouterStats(NamedTuple):
    """One MoE layer's sums over its tokens, so that sums over layers, devices and microbatches combine exactly.
    counts float32 [E]: top-k choices per expert (before drops; no gradient); prob_sum float32 [E]: the router's
    probabilities summed over tokens; tokens float32 []; z_sum float32 []: sum of logsumexp(logits)^2; dropped
    float32 []: assignments the capacity dropped. Stacked over the layer groups by the model's scan: [G, ...]."""

    counts: jax.Array
    prob_sum: jax.Array
    tokens: jax.Array
    z_sum: jax.Array
    dropped: jax.Array


def slots_per_expert(seq: int, moe: MoEConfig) -> int | None:
    """Assignments one expert takes from one sequence of ``seq`` tokens: ceil(capacity_factor x seq x top_k /
    experts), at most ``seq`` (an expert takes a token once); None when dropless (capacity_factor 0)."""
    if moe.capacity_factor <= 0:
        return None
    return min(seq, math.ceil(moe.capacity_factor * seq * moe.top_k / moe.experts))


def keep_mask(experts: jax.Array, num_experts: int, slots: int) -> jax.Array:
    """bool [batch, seq, k]: the assignments of experts int [batch, seq, k] that fit in ``slots`` per expert and
    sequence, slot-major (every token's first choice, in token order, then every second choice, ...)."""
    b, s, k = experts.shape
    flat = experts.transpose(0, 2, 1).reshape(b, k * s)  # [batch, k * seq], slot-major
    onehot = jax.nn.one_hot(flat, num_experts, dtype=jnp.int32)
    place = jnp.sum(jnp.cumsum(onehot, axis=1) * onehot, axis=-1) - 1  # its place in its expert's queue
    return (place < slots).reshape(b, k, s).transpose(0, 2, 1)


def route(x: jax.Array, router_w: jax.Array, moe: MoEConfig, slots: int | None) -> tuple[Routing, RouterStats]:
    """Route x [batch, seq, embed] with router weights [embed, E] (``slots``: :func:`slots_per_expert`, None:
    dropless) -> (:class:`Routing`, :class:`RouterStats`). Logits are float32 [batch, seq, E]."""
    acc = jnp.promote_types(x.dtype, jnp.float32)
    logits = jnp.einsum("bsd,de->bse", x.astype(acc), router_w.astype(acc), precision=jax.lax.Precision.HIGHEST)
    if moe.router == "softmax":
        scores = probs = jax.nn.softmax(logits, axis=-1)
    else:
        scores = jax.nn.sigmoid(logits)
        probs = scores / jnp.sum(scores, axis=-1, keepdims=True)
    _, experts = jax.lax.top_k(scores, moe.top_k)
    weights = jnp.take_along_axis(scores, experts, axis=-1)
    if moe.normalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    experts = experts.astype(jnp.int32)
    e = logits.shape[-1]
    counts = jnp.sum(jax.nn.one_hot(experts, e, dtype=acc), axis=(0, 1, 2))
    dropped = jnp.zeros((), acc)
    if slots is not None:
        keep = keep_mask(experts, e, slots)
        experts, weights = jnp.where(keep, experts, e), jnp.where(keep, weights, 0.0)
        dropped = jnp.sum(~keep).astype(acc)
    z = jax.nn.logsumexp(logits, axis=-1)
    stats = RouterStats(jax.lax.stop_gradient(counts), jnp.sum(probs, axis=(0, 1)),
                        jnp.asarray(logits.shape[0] * logits.shape[1], acc), jnp.sum(z * z), dropped)
    return Routing(experts, weights), stats


def load_balancing_loss(stats: RouterStats) -> jax.Array:
    """Switch Transformer's load-balancing loss from statistics with any leading axes (e.g. the layers [G, E]):
    E x sum_e f_e x P_e, with f_e = top-k choices of e / N and P_e = summed probabilities of e / N, N the tokens
    summed over layers. It equals transformers' ``load_balancing_loss_func`` given every MoE layer's router logits
    (counts and probabilities summed over layers before the product, not a mean of per-layer losses); uniform
    routing gives ``top_k`` (Megatron divides by top_k)."""
    e = stats.counts.shape[-1]
    n = jnp.sum(stats.tokens)
    return e * jnp.sum(stats.counts.reshape(-1, e).sum(0) / n * (stats.prob_sum.reshape(-1, e).sum(0) / n))


def z_loss(stats: RouterStats) -> jax.Array:
    """Router z-loss (ST-MoE): the mean over tokens and layers of logsumexp(logits)^2."""
    return jnp.sum(stats.z_sum) / jnp.sum(stats.tokens)


def load_metrics(stats: RouterStats, top_k: int) -> dict[str, jax.Array]:
    """The step's load figures from statistics stacked over layers [G, ...]:

    - ``moe_max_load``: the busiest expert's tokens over the mean per expert, in the worst layer (1: balanced);
    - ``moe_top_share``: the share of a layer's tokens that chose its busiest expert, in the worst layer (uniform:
      top_k / E; 1: every token chose it; the collapse warning watches this);
    - ``moe_dropped``: the share of all assignments the capacity dropped (0 when dropless).
    """
    counts = stats.counts.reshape(-1, stats.counts.shape[-1])
    tokens = stats.tokens.reshape(-1)
    busiest = jnp.max(counts, axis=-1)
    return {"moe_max_load": jnp.max(busiest / jnp.mean(counts, axis=-1)),
            "moe_top_share": jnp.max(busiest / tokens),
            "moe_dropped": jnp.sum(stats.dropped) / (jnp.sum(tokens) * top_k)}
