"""State that rides the train step beside the gradients: each kind declared once, here, with its rule for combining
across microbatches, data-parallel groups and pipeline iterations. The step (train/step.py) and the pipelines
(parallel/pipeline*.py) ask this module and name no kind; the checkpoint package needs none of it (a
parameters-only restore reads ``nnx.Param`` leaves only).

Two sorts, one rule each:

- **Observed state** (:class:`ObservedRule`): variables of the model that the step differentiates like parameters,
  whose "gradient" is what the step observed rather than a derivative, and that are updated after the optimizer
  from that observation (a skipped step keeps them). Observations combine by the rule's ``combine`` over
  microbatches and pipeline passes, ``reduce`` over a stacked axis of data-parallel groups, ``collective`` over
  named mesh axes: never as gradients are scaled. Today: FP8 delayed scaling's amax histories (:data:`AMAX_HISTORY`:
  max) and the MoE expert-selection bias, observing the experts' load (:data:`EXPERT_LOAD`: a count, summed over
  everything, never rescaled with the loss).
- **Collected statistics** (:class:`CollectedRule`): what a forward pass records per layer, summed over a
  microbatch's rows, layers and data-parallel groups; each microbatch's sums become its loss terms and figures,
  each microbatch counting its share of the step (never a statistic pooled over microbatches). Today: the MoE
  router's statistics (:data:`ROUTER_STATS`: the balance loss, z-loss and load figures).

A new kind of observed state is a :class:`jaxtrain.models.fp8.Fp8Meta`-like ``nnx.Variable`` subclass with an
:class:`ObservedRule` in :data:`OBSERVED` (as :class:`jaxtrain.models.routing.ExpertBias` is); a new collected kind,
a :class:`CollectedRule`.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from jaxtrain.config import ModelConfig
from jaxtrain.models import fp8, moe, routing


@dataclasses.dataclass(frozen=True)
class ObservedRule:
    """One kind of observed state: ``variable`` its nnx.Variable type, found in gradient trees under the path key
    ``key``; ``combine(a, b)`` two observations (microbatches, passes); ``reduce(g, axis)`` over a stacked axis;
    ``collective(g, axes)`` over named mesh axes; ``rescale(g, factor)`` the observation of a loss computed
    ``1 / factor`` times too large; ``push(value, observation, model_cfg)`` the variable's new value (the model's
    config gives the rule's options); ``over(axes)`` a context in
    which the model's own observations are reduced over named axes (a vmap's or shard_map's); ``combine_at(acc, i,
    g)``: ``g`` combined into ``acc[i]``."""

    key: str
    variable: type
    combine: Callable[[jax.Array, jax.Array], jax.Array]
    combine_at: Callable[[jax.Array, Any, jax.Array], jax.Array]
    reduce: Callable[[jax.Array, int], jax.Array]
    collective: Callable[[jax.Array, tuple[str, ...]], jax.Array]
    rescale: Callable[[jax.Array, Any], jax.Array]
    push: Callable[[jax.Array, jax.Array, ModelConfig], jax.Array]
    over: Callable[[tuple[str, ...]], contextlib.AbstractContextManager]


# FP8 delayed scaling (models/fp8.py): the largest |x|, |w|, |g| seen, whatever split the step made of the tensors.
AMAX_HISTORY = ObservedRule(key=fp8.META_NAME, variable=fp8.Fp8Meta, combine=jnp.maximum,
                            combine_at=lambda acc, i, g: acc.at[i].max(g),
                            reduce=lambda g, axis: g.max(axis), collective=jax.lax.pmax,
                            rescale=fp8.scale_gradient_amax, push=lambda h, seen, cfg: fp8.push_observed(h, seen),
                            over=fp8.amax_over)
# MoE expert-selection bias (models/routing.py, model.moe.expert_bias): the observation is the top-k choices per
# expert, which add up over microbatches, passes and groups; a count does not scale with the loss (rescale: as is),
# and a device's or group's rows observe their own choices only (over: nothing to reduce inside, the sum over the
# groups comes from reduce / collective once).
EXPERT_LOAD = ObservedRule(key="expert_bias", variable=routing.ExpertBias, combine=jnp.add,
                           combine_at=lambda acc, i, g: acc.at[i].add(g), reduce=lambda g, axis: g.sum(axis),
                           collective=jax.lax.psum, rescale=lambda g, factor: g,
                           push=lambda bias, load, cfg: routing.update_bias(bias, load, cfg.moe.bias_update_rate),
                           over=lambda axes: contextlib.nullcontext())
OBSERVED: tuple[ObservedRule, ...] = (AMAX_HISTORY, EXPERT_LOAD)

# What the train step differentiates: the parameters and the observed state.
DIFFERENTIATED = nnx.Any(nnx.Param, *(r.variable for r in OBSERVED))
OBSERVED_STATE = nnx.Any(*(r.variable for r in OBSERVED))


def rule_of(path) -> ObservedRule | None:
    """The rule of the observed state a pytree key path leads into, or None (a parameter)."""
    keys = {getattr(k, "key", getattr(k, "name", None)) for k in path}
    return next((r for r in OBSERVED if r.key in keys), None)


def _rule(path) -> ObservedRule:
    """:func:`rule_of` where the path is known to lead into observed state."""
    rule = rule_of(path)
    assert rule is not None, f"no observed state at {jax.tree_util.keystr(path)}"
    return rule


@contextlib.contextmanager
def observed_over(axes: tuple[str, ...]) -> Iterator[None]:
    """Inside: the model's observations are also reduced over the named axes (a vmap's or shard_map's), so that they
    are the whole microbatch's, not this device's or group's rows'."""
    with contextlib.ExitStack() as stack:
        for rule in OBSERVED:
            stack.enter_context(rule.over(tuple(axes)))
        yield


def combine(acc: Any, new: Any, add: Callable = jnp.add) -> Any:
    """Two gradient trees combined leaf by leaf: observed state by its rule, parameters' gradients by ``add``."""
    def one(path, a, g):
        rule = rule_of(path)
        return rule.combine(a, g.astype(a.dtype)) if rule else add(a, g)
    return jax.tree_util.tree_map_with_path(one, acc, new)


def combine_at(acc: Any, new: Any, index, add_at: Callable) -> Any:
    """``new`` combined into ``acc`` [n, ...] at ``index``: observed state by its rule, gradients by
    ``add_at(a, g)``."""
    def one(path, a, g):
        rule = rule_of(path)
        return rule.combine_at(a, index, g.astype(a.dtype)) if rule else add_at(a, g)
    return jax.tree_util.tree_map_with_path(one, acc, new)


def reduce_groups(tree: Any, axis: int = 0) -> Any:
    """Per-group gradients reduced over ``axis``: observed state by its rule, gradients by sum."""
    return jax.tree_util.tree_map_with_path(lambda p, g: r.reduce(g, axis) if (r := rule_of(p)) else g.sum(axis), tree)


def group_mean(tree: Any, axes: tuple[str, ...], groups: int, split: Any = None) -> Any:
    """Gradients of per-group mean losses over the named batch axes: summed and divided by ``groups``; observed state
    by its collective, its observations rescaled for a loss ``groups`` times too large. ``split``: None, or a tree
    like ``tree`` of PartitionSpecs naming the axes a leaf is split over (each device's own part, whose gradient
    already gathers those axes' contributions, e.g. its experts' weights): not summed over them."""
    def one(path, g, spec=None):
        own = {a for e in (spec or ()) for a in (e if isinstance(e, tuple) else (e,)) if a is not None}
        over = tuple(a for a in axes if a not in own)
        rule = rule_of(path)
        if rule:
            return rule.rescale(rule.collective(g, over) if over else g, 1 / groups)
        return (jax.lax.psum(g, over) if over else g) / groups
    if split is None:
        return jax.tree_util.tree_map_with_path(one, tree)
    return jax.tree_util.tree_map_with_path(one, tree, split)


def scale_cotangent(tree: Any, like: Any, g: jax.Array) -> Any:
    """Gradients times the loss's cotangent ``g``, cast like ``like``; observations pass unscaled."""
    return jax.tree_util.tree_map_with_path(
        lambda path, d, p: (d if rule_of(path) else g * d).astype(p.dtype), tree, like)


def split_gradients(grads: Any) -> tuple[Any, Any]:
    """(the parameters' gradients, the observations) of a gradient tree over :data:`DIFFERENTIATED`."""
    params, observed = nnx.split_state(grads, nnx.Param, OBSERVED_STATE)
    return params, observed


def split_observed(state: Any) -> tuple[Any, Any]:
    """(everything else, the observed state) of a state tree."""
    rest, observed = nnx.split_state(state, nnx.Not(OBSERVED_STATE), OBSERVED_STATE)
    return rest, observed


def record(model: nnx.Module, observed: Any, applied: jax.Array) -> None:
    """Push a step's combined observations into the model's observed state, in place; a skipped step (``applied``
    false: non-finite loss or gradients) keeps it."""
    state = nnx.state(model, OBSERVED_STATE)
    if not jax.tree.leaves(state):
        return

    cfg = model.cfg  # type: ignore[attr-defined]

    def one(path, value, obs):
        return jnp.where(applied, _rule(path).push(value, obs, cfg), value)

    nnx.update(model, jax.tree_util.tree_map_with_path(one, state, observed))


def _combine_cotangents(path, a, b):
    return _rule(path).combine(a, b)


@jax.custom_vjp
def split_carry(tree: Any) -> tuple[Any, Any]:
    """(tree, tree): two uses of observed state (a loop carry and this iteration's) whose cotangents combine by the
    state's rule, not by +."""
    return tree, tree


split_carry.defvjp(lambda t: ((t, t), None),
                   lambda _, cts: (jax.tree_util.tree_map_with_path(_combine_cotangents, *cts),))


@partial(jax.custom_vjp, nondiff_argnums=(1,))
def fan_out(tree: Any, n: int) -> Any:
    """Each leaf of observed state broadcast to [n, ...]: n uses whose cotangents combine by its rule."""
    return jax.tree.map(lambda a: jnp.broadcast_to(a, (n, *a.shape)), tree)


fan_out.defvjp(lambda t, n: (fan_out(t, n), None),
               lambda n, _, ct: (jax.tree_util.tree_map_with_path(lambda p, a: _rule(p).reduce(a, 0), ct),))


# ------------------------------------------------------------------------------------------------ collected
@dataclasses.dataclass(frozen=True)
class CollectedRule:
    """One kind of collected statistics. ``collects(model_cfg)``: whether the model records them; ``forward(model,
    tokens, segments, positions, counted)`` -> (logits, the statistics stacked over layers, over the ``counted``
    positions); ``figures``: the names of the
    metrics they give; ``objective(loss, stats, model_cfg, share)`` -> (loss plus ``share`` x their loss terms, the
    metrics times ``share``); ``totals(sums)``: what ``loss_part`` needs summed over all of a microbatch's rows (no
    gradient); ``loss_part(sums, totals, model_cfg, share)`` -> some rows' part of one microbatch's
    loss terms from the rows' sums over layers (``sums``) and the microbatch's ``totals`` (no gradient)."""

    name: str
    collects: Callable[[ModelConfig], bool]
    forward: Callable[..., tuple[jax.Array, Any]]
    figures: tuple[str, ...]
    objective: Callable[..., tuple[jax.Array, dict[str, Any]]]
    totals: Callable[[Any], Any]
    loss_part: Callable[..., jax.Array]


ROUTER_STATS = CollectedRule(
    name="router statistics", collects=lambda cfg: bool(cfg.moe.experts), forward=moe.logits_and_stats,
    figures=moe.METRICS, objective=lambda loss, stats, cfg, share: moe.objective(loss, stats, cfg.moe, share),
    totals=lambda stats: (stats.counts, stats.tokens, stats.seqs),
    loss_part=lambda sums, totals, cfg, share: moe.router_loss_part(sums, totals, cfg.moe, share))
COLLECTED: tuple[CollectedRule, ...] = (ROUTER_STATS,)


def collected_rule(cfg: ModelConfig) -> CollectedRule | None:
    """The collected kind ``cfg``'s model records (at most one per model today), or None."""
    found = [r for r in COLLECTED if r.collects(cfg)]
    assert len(found) <= 1, "one collected kind per model"
    return found[0] if found else None


def forward(model: nnx.Module, cfg: ModelConfig, tokens: jax.Array, segment_ids: jax.Array | None = None,
            positions: jax.Array | None = None, counted: jax.Array | None = None) -> tuple[jax.Array, Any]:
    """(logits float32 [batch, seq, vocab], the collected statistics stacked over layers, or None) of tokens int
    [batch, seq]; ``counted`` bool [batch, seq] or None (all): the positions the statistics count (not padding)."""
    rule = collected_rule(cfg)
    if rule is None:
        return model(tokens, segment_ids, positions=positions), None
    return rule.forward(model, tokens, segment_ids, positions, counted)


def objective(loss: jax.Array, collected: Any, cfg: ModelConfig, share: float = 1.0) -> tuple[jax.Array, dict]:
    """(what the step minimises, the metrics) of one part's next-token ``loss`` and its collected statistics: the
    loss plus ``share`` x their loss terms; metrics ``loss`` (the next-token part) and the kind's figures times
    ``share`` (summed over the parts of a step: their mean)."""
    rule = collected_rule(cfg)
    if rule is None or collected is None:
        return loss, {"loss": loss}
    return rule.objective(loss, collected, cfg, share)


def zero_metrics(cfg: ModelConfig) -> dict[str, jax.Array]:
    """The metrics :func:`objective` gives for ``cfg``'s model, all zero (float32): where sums over microbatches
    start."""
    rule = collected_rule(cfg)
    return {name: jnp.zeros((), jnp.float32) for name in ("loss", *(rule.figures if rule else ()))}


def microbatch_objectives(collected: Any, cfg: ModelConfig, microbatches: int) -> tuple[jax.Array, dict]:
    """(the loss terms, the figures) of statistics [k, ...] collected per microbatch (a pipeline's): each
    microbatch's from its own statistics, times 1/k, summed over microbatches (as accumulation sums them)."""
    zero = jnp.zeros((), jnp.float32)
    terms, figures = jax.vmap(lambda s: objective(zero, s, cfg, 1 / microbatches))(collected)
    return terms.sum(), {name: v.sum() for name, v in figures.items() if name != "loss"}


def loss_part_fn(cfg: ModelConfig, microbatches: int) -> LossPart | None:
    """``fn(sums, totals)``: some rows' part of one microbatch's loss terms (the kind's ``loss_part``, each
    microbatch counting 1 / ``microbatches``), or None when ``cfg``'s model collects nothing."""
    rule = collected_rule(cfg)
    if rule is None:
        return None
    return LossPart(rule.totals, lambda sums, totals: rule.loss_part(sums, totals, cfg, 1 / microbatches))


class LossPart(NamedTuple):
    """A microbatch's loss terms in parts over rows: ``totals(sums)`` the no-gradient figures to sum over all the
    microbatch's rows first, ``part(sums, totals)`` some rows' part."""

    totals: Callable[[Any], Any]
    part: Callable[[Any, Any], jax.Array]
