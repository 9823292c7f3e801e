"""Token-choice top-k routing for the MoE layers (docs/moe.md): the router's choice, the capacity's drops, and the
statistics behind the load-balancing loss, the router z-loss and the load metrics.

Plain jnp on the global activations (the partitioner splits them like any other; no mesh axis is named). The router
arithmetic is float32 whatever the compute dtype (float64 when the input is). Routers:

- ``softmax`` (Mixtral, Qwen2-MoE): p = softmax(logits) over the experts; each token takes the ``top_k`` largest p,
  weighted p_k / sum of its top-k p when ``normalize`` (Mixtral), else p_k (Qwen2-MoE's default);
- ``sigmoid`` (DeepSeek-V3): s = sigmoid(logits); the ``top_k`` largest s, weighted s_k / sum of the top-k s when
  ``normalize``; the load-balancing loss's probabilities are s / sum(s).

DeepSeek-V3's selection (torchtitan's and Megatron-Core's arithmetic), each part an option of ``model.moe``:

- ``expert_bias``: the experts are chosen by s + b (b float32 [E], :class:`ExpertBias`, model state), the weights
  still taken from s (the bias steers the choice only). The bias's "gradient" is the step's load: the top-k choices
  per expert over the routed tokens, before capacity drops (:func:`biased_choice`); after the step
  :func:`update_bias` moves it by ``bias_update_rate`` x sign(mean load - load);
- ``n_group`` / ``topk_group``: the (biased) scores split into n_group consecutive groups, each scored by the sum
  of its best two; the experts of all but the topk_group best groups are out of the choice (-inf);
- ``routed_scaling_factor``: the weights, normalised or not, times this factor;
- ``seq_aux_loss``: the complementary sequence-wise balance loss (:func:`seq_balance_loss`).

With ``capacity_factor`` > 0 each expert takes at most ``slots`` = ceil(capacity_factor x seq x top_k / experts)
assignments of each sequence (a sequence is the group: the drops do not depend on the mesh); first choices of all
tokens before anyone's second (GShard, Switch), then in token order. A dropped assignment gets weight 0 and the expert
id ``experts`` (a sentinel no expert has): its token passes that expert by the residual.

Positions that are not routed (``routed`` false: the padding of chat rows) are never sent to an expert: all their
assignments get the sentinel and weight 0, they take no capacity slot, and they count nowhere in the statistics
(balance loss, z-loss, load figures), as transformers' ``attention_mask`` and Megatron-Core's ``padding_mask`` exclude
them.
"""

from __future__ import annotations

import math
from fractions import Fraction
from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from jaxtrain.config import MoEConfig

ROUTER_SCOPE = "router_logits"  # the name scope of the router's float32 logits GEMM, in the HLO's op_name


class Routing(NamedTuple):
    """Where each token goes. experts int32 [batch, seq, top_k]: the chosen experts, distinct per token, highest
    score first (``E`` = the number of experts where the capacity dropped the assignment); weights float32
    [batch, seq, top_k]: the combine weights (0 where dropped)."""

    experts: jax.Array
    weights: jax.Array


class RouterStats(NamedTuple):
    """One MoE layer's sums over its tokens, so that sums over layers, devices and microbatches combine exactly.
    counts float32 [E]: top-k choices per expert (before drops; no gradient); prob_sum float32 [E]: the router's
    probabilities summed over tokens; tokens float32 []: the routed tokens; z_sum float32 []: sum of
    logsumexp(logits)^2; dropped float32 []: assignments the capacity dropped; seq_sum float32 []: the sequence-wise
    balance losses summed over sequences (0 unless ``seq_aux_loss``); seqs float32 []: the sequences with routed
    tokens (likewise). Each over routed tokens only. Stacked over the layer groups by the model's scan: [G, ...]."""

    counts: jax.Array
    prob_sum: jax.Array
    tokens: jax.Array
    z_sum: jax.Array
    dropped: jax.Array
    seq_sum: jax.Array
    seqs: jax.Array


class ExpertBias(nnx.Variable):
    """One MoE layer's expert-selection bias float32 [E] (stacked [G, E]); model state, checkpointed with it, not an
    ``nnx.Param``: the optimizer, the gradient norm and the non-finite check never see it. Its cotangent in the train
    step is the observed load (:func:`biased_choice`), combined by
    :data:`jaxtrain.models.sidestate.EXPERT_LOAD`."""


def choose(scores: jax.Array, moe: MoEConfig) -> jax.Array:
    """The experts int32 [batch, seq, top_k] of the largest ``scores`` [batch, seq, E] (highest first), within the
    ``topk_group`` best of ``n_group`` groups when n_group > 1 (a group scored by the sum of its best two)."""
    if moe.n_group > 1:
        b, s, e = scores.shape
        grouped = scores.reshape(b, s, moe.n_group, e // moe.n_group)
        group_scores = jnp.sum(jax.lax.top_k(grouped, 2)[0], axis=-1)  # [batch, seq, n_group]
        best = jax.lax.top_k(group_scores, moe.topk_group)[1]
        kept = jnp.any(best[..., None] == jnp.arange(moe.n_group), axis=-2)  # [batch, seq, n_group]
        scores = jnp.where(kept[..., None], grouped, -jnp.inf).reshape(b, s, e)
    return jax.lax.top_k(scores, moe.top_k)[1].astype(jnp.int32)


@partial(jax.custom_vjp, nondiff_argnums=(3,))
def biased_choice(scores: jax.Array, bias: jax.Array, counted: jax.Array,
                  moe: MoEConfig) -> tuple[jax.Array, jax.Array]:
    """(scores [batch, seq, top_k] of the experts chosen by scores + bias [E], those experts int32): the choice
    :func:`choose` makes on the biased scores, the weights from the unbiased ones. ``counted`` float [batch, seq]:
    1 where a token counts in the load. The bias's cotangent is the load, float [E]: the choices per expert over the
    counted tokens (0 where the output's cotangent is all zero: a pipeline's idle iteration observes nothing)."""
    return _bc_fwd(scores, bias, counted, moe)[0]


def _bc_fwd(scores, bias, counted, moe):
    experts = choose(scores + bias, moe)
    load = jnp.einsum("bske,bs->e", jax.nn.one_hot(experts, scores.shape[-1], dtype=scores.dtype), counted)
    return (jnp.take_along_axis(scores, experts, axis=-1), experts), (experts, load.astype(bias.dtype), counted)


def _bc_bwd(moe, res, g):
    experts, load, counted = res
    g_top = g[0]
    # experts are distinct per token: the scatter of g into the chosen columns is a sum of one-hots
    d_scores = jnp.einsum("bske,bsk->bse", jax.nn.one_hot(experts, load.shape[-1], dtype=g_top.dtype), g_top)
    return d_scores, load * jnp.any(g_top != 0).astype(load.dtype), jnp.zeros_like(counted)


biased_choice.defvjp(_bc_fwd, _bc_bwd)


def update_bias(bias: jax.Array, load: jax.Array, rate: float) -> jax.Array:
    """bias [..., E] + rate x sign(mean_e load - load) (Megatron-Core's get_updated_expert_bias), float32;
    ``load`` [..., E]: the step's choices per expert over all microbatches and data-parallel groups."""
    load = load.astype(jnp.float32)
    mean = jnp.sum(load, axis=-1, keepdims=True) / load.shape[-1]
    return (bias.astype(jnp.float32) + rate * jnp.sign(mean - load)).astype(bias.dtype)


def slots_per_expert(seq: int, moe: MoEConfig) -> int | None:
    """Assignments one expert takes from one sequence of ``seq`` tokens: ceil(capacity_factor x seq x top_k /
    experts), at most ``seq`` (an expert takes a token once); None when dropless (capacity_factor 0)."""
    if moe.capacity_factor <= 0:
        return None
    # The factor as the decimal the user wrote: in binary floating point 1.1 x 100 x 2 / 4 is 55.00000000000001.
    exact = Fraction(str(moe.capacity_factor)) * seq * moe.top_k / moe.experts
    return min(seq, math.ceil(exact))


def keep_mask(experts: jax.Array, num_experts: int, slots: int) -> jax.Array:
    """bool [batch, seq, k]: the assignments of experts int [batch, seq, k] that fit in ``slots`` per expert and
    sequence, slot-major (every token's first choice, in token order, then every second choice, ...)."""
    b, s, k = experts.shape
    flat = experts.transpose(0, 2, 1).reshape(b, k * s)  # [batch, k * seq], slot-major
    onehot = jax.nn.one_hot(flat, num_experts, dtype=jnp.int32)
    place = jnp.sum(jnp.cumsum(onehot, axis=1) * onehot, axis=-1) - 1  # its place in its expert's queue
    return (place < slots).reshape(b, k, s).transpose(0, 2, 1)


class Selection(NamedTuple):
    """What :func:`choose` reads of ``model.moe`` (hashable, for :func:`biased_choice`'s static argument)."""

    top_k: int
    n_group: int
    topk_group: int


def route(x: jax.Array, router_w: jax.Array, moe: MoEConfig, slots: int | None,
          routed: jax.Array | None = None, bias: jax.Array | None = None) -> tuple[Routing, RouterStats]:
    """Route x [batch, seq, embed] with router weights [embed, E] (``slots``: :func:`slots_per_expert`, None:
    dropless; ``routed`` bool [batch, seq] or None (all): the positions to route; ``bias`` float32 [E] or None: the
    expert-selection bias, ``model.moe.expert_bias``) -> (:class:`Routing`, :class:`RouterStats`). Logits are
    float32 [batch, seq, E]."""
    acc = jnp.promote_types(x.dtype, jnp.float32)
    with jax.named_scope(ROUTER_SCOPE):  # names the one float32 GEMM of a 16-bit run (planner/xla_gpu/program.py)
        logits = jnp.einsum("bsd,de->bse", x.astype(acc), router_w.astype(acc), precision=jax.lax.Precision.HIGHEST)
    if moe.router == "softmax":
        scores = probs = jax.nn.softmax(logits, axis=-1)
    else:
        scores = jax.nn.sigmoid(logits)
        probs = scores / jnp.sum(scores, axis=-1, keepdims=True)
    if bias is None:
        experts = choose(scores, moe)
        weights = jnp.take_along_axis(scores, experts, axis=-1)
    else:
        counted = jnp.ones(scores.shape[:2], acc) if routed is None else routed.astype(acc)
        weights, experts = biased_choice(scores, bias.astype(acc), counted,
                                         Selection(moe.top_k, moe.n_group, moe.topk_group))
    if moe.normalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    if moe.routed_scaling_factor != 1.0:
        weights = weights * moe.routed_scaling_factor
    e = logits.shape[-1]
    if routed is not None:  # not routed: the sentinel (no expert, no slot, no count) and weight 0
        experts, weights = jnp.where(routed[..., None], experts, e), jnp.where(routed[..., None], weights, 0.0)
    counts = jnp.sum(jax.nn.one_hot(experts, e, dtype=acc), axis=(0, 1, 2))
    seq_sum, seqs = _seq_sums(experts, probs, routed, moe) if moe.seq_aux_loss > 0 else (jnp.zeros((), acc),) * 2
    dropped = jnp.zeros((), acc)
    if slots is not None:
        keep = keep_mask(experts, e, slots)  # the sentinel claims no slot and is kept: not a drop
        experts, weights = jnp.where(keep, experts, e), jnp.where(keep, weights, 0.0)
        dropped = jnp.sum(~keep).astype(acc)
    z = jax.nn.logsumexp(logits, axis=-1)
    if routed is None:
        prob_sum, tokens, z_sum = jnp.sum(probs, axis=(0, 1)), jnp.asarray(z.size, acc), jnp.sum(z * z)
    else:
        w = routed.astype(acc)
        prob_sum, tokens, z_sum = jnp.einsum("bse,bs->e", probs, w), jnp.sum(w), jnp.sum(z * z * w)
    stats = RouterStats(jax.lax.stop_gradient(counts), prob_sum, tokens, z_sum, dropped, seq_sum, seqs)
    return Routing(experts, weights), stats


def _seq_sums(experts: jax.Array, probs: jax.Array, routed: jax.Array | None,
              moe: MoEConfig) -> tuple[jax.Array, jax.Array]:
    """(sum over sequences of DeepSeek-V3's sequence-wise balance loss, the sequences counted) from the chosen
    experts int [batch, seq, k] (the sentinel E where not routed) and the probabilities [batch, seq, E]: per
    sequence of T routed tokens, sum_e f_e P_e with f_e = E / (top_k T) x its tokens choosing e (no gradient) and
    P_e = its summed probabilities of e / T. A sequence with no routed token adds 0 and is not counted."""
    e = probs.shape[-1]
    w = jnp.ones(probs.shape[:2], probs.dtype) if routed is None else routed.astype(probs.dtype)
    chosen = jnp.sum(jax.nn.one_hot(experts, e, dtype=probs.dtype), axis=(1, 2))  # [batch, E]
    prob_sum = jnp.einsum("bse,bs->be", probs, w)
    t = jnp.sum(w, axis=1)  # [batch]
    per_seq = e / moe.top_k * jnp.sum(jax.lax.stop_gradient(chosen) * prob_sum, axis=-1) / jnp.maximum(t, 1.0) ** 2
    return jnp.sum(per_seq), jnp.sum(t > 0).astype(probs.dtype)


def load_balancing_loss(stats: RouterStats, form: str = "per_layer") -> jax.Array:
    """Switch Transformer's load-balancing loss E x sum_e f_e x P_e from statistics stacked over the MoE layers
    (counts, prob_sum [G, E], tokens [G]; any further leading axes are more layers), with f_e = e's top-k choices / N
    and P_e = e's summed router probabilities / N over the routed tokens N. Uniform routing gives ``top_k``
    (Megatron-Core divides by top_k).

    ``per_layer`` (the default, model.moe.balance_loss): each layer's loss from its own f and P, their mean over the
    layers (Megatron-Core sums its per-layer losses; MaxText takes them per layer too), so that a layer that
    collapses is penalised whatever the others do. ``pooled``: f and P summed over the layers before the product,
    as transformers' ``load_balancing_loss_func`` computes it from every layer's router logits; layers that collapse
    onto different experts cancel out there."""
    e = stats.counts.shape[-1]
    counts, probs = stats.counts.reshape(-1, e), stats.prob_sum.reshape(-1, e)
    tokens = jnp.maximum(stats.tokens.reshape(-1), 1.0)  # a layer that routed nothing adds 0
    if form == "pooled":
        n = jnp.maximum(jnp.sum(stats.tokens), 1.0)
        return e * jnp.sum(counts.sum(0) / n * (probs.sum(0) / n))
    return e * jnp.mean(jnp.sum(counts / tokens[:, None] * (probs / tokens[:, None]), axis=-1))


def seq_balance_loss(stats: RouterStats) -> jax.Array:
    """DeepSeek-V3's complementary sequence-wise balance loss (model.moe.seq_aux_loss, unweighted): the mean over
    sequences and MoE layers of sum_e f_e P_e, each sequence's own f and P (:class:`RouterStats`' seq_sum / seqs).
    Uniform routing gives 1 (Megatron-Core's seq_aux_loss, there summed over layers)."""
    return jnp.sum(stats.seq_sum) / jnp.maximum(jnp.sum(stats.seqs), 1.0)


def z_loss(stats: RouterStats) -> jax.Array:
    """Router z-loss (ST-MoE): the mean over routed tokens and layers of logsumexp(logits)^2."""
    return jnp.sum(stats.z_sum) / jnp.maximum(jnp.sum(stats.tokens), 1.0)


def load_metrics(stats: RouterStats, top_k: int) -> dict[str, jax.Array]:
    """The step's load figures from statistics stacked over layers [G, ...]:

    - ``moe_max_load``: the busiest expert's tokens over the mean per expert, in the worst layer (1: balanced);
    - ``moe_top_share``: the share of a layer's routed tokens that chose its busiest expert, in the worst layer
      (uniform: top_k / E; 1: every token chose it; the collapse warning watches this);
    - ``moe_dropped``: the share of all assignments the capacity dropped (0 when dropless).
    """
    counts = stats.counts.reshape(-1, stats.counts.shape[-1])
    tokens = stats.tokens.reshape(-1)
    busiest = jnp.max(counts, axis=-1)
    mean = jnp.maximum(jnp.mean(counts, axis=-1), 1e-30)  # a layer that routed nothing: 0, not nan
    return {"moe_max_load": jnp.max(busiest / mean),
            "moe_top_share": jnp.max(busiest / jnp.maximum(tokens, 1.0)),
            "moe_dropped": jnp.sum(stats.dropped) / jnp.maximum(jnp.sum(tokens) * top_k, 1.0)}
