"""The compiled step: the loss, the gradient strategies (plain, accumulated over microbatches, pipelined) and the
optimizer update, as pure functions of (state, batch) compiled ahead of time for one layout.

Every parallel fact (batch axes, data-parallel size, stages, rows per group, the rules inside vmapped or manual
regions) comes from the :class:`jaxtrain.parallel.layout.Layout`; this module derives none.
"""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from jaxtrain.config import Config
from jaxtrain.data.tokens import DOC_START, NO_LOSS, PAD, TOKEN_BITS
from jaxtrain.models import precision, sidestate
from jaxtrain.optim.state import make_optimizer
from jaxtrain.parallel import pipeline, pipeline_1f1b
from jaxtrain.parallel.layout import Layout
from jaxtrain.parallel.mesh import without_axes


def cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Mean next-token loss. logits float32 [batch, seq, vocab], targets int [batch, seq]."""
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


def document_segments(inputs: jax.Array, eos_id: int) -> jax.Array:
    """Segment ids int32 [batch, seq] of packed documents: a document ends with its eos token (which stays in it),
    the next token starts the next segment."""
    is_eos = (inputs == eos_id).astype(jnp.int32)
    return jnp.cumsum(is_eos, axis=1) - is_eos


def trained_targets(batch: jax.Array) -> jax.Array:
    """float32 [batch, seq]: 1 where the target (token t + 1 of a row of batch int32 [batch, seq + 1]) is trained:
    its word carries neither NO_LOSS (a prompt or padding token of chat data) nor DOC_START (the first token of the
    next packed example, which the previous one must not learn to predict). Token files set no flag: all 1."""
    return ((batch[:, 1:] & (NO_LOSS | DOC_START)) == 0).astype(jnp.float32)


class Step:
    """The train and eval steps of one layout. Build with :func:`setup` (or ``Step(layout)``)."""

    def __init__(self, layout: Layout):
        self.layout = layout
        self.schedule = make_optimizer(layout.cfg.train)[1]

    @property
    def cfg(self) -> Config:
        """The layout's resolved config."""
        return self.layout.cfg

    def _trained_tokens(self, batch):
        """The loss's normaliser: the trained targets of the whole global batch int32 [global_batch, seq + 1] (all of
        them for token data; chat data: the unmasked ones, at least 1), so that every microbatch's and data-parallel
        group's sum of token losses divided by it adds up to the step's mean loss per trained token."""
        if self.cfg.data.format != "chat":
            return jnp.float32(batch.shape[0] * (batch.shape[1] - 1))
        return jnp.maximum(trained_targets(batch).sum(), 1.0)

    def _loss(self, params, graphdef, words, trained_tokens):
        """Sum of the trained next-token losses of ``words`` int32 [rows, seq + 1] (flagged token words) divided by
        ``trained_tokens`` (the whole step's count, :meth:`_trained_tokens`)."""
        return self._objective(params, graphdef, words, trained_tokens)[1]["loss"]

    def _objective(self, params, graphdef, words, trained_tokens, share=1.0):
        """(what the step minimises, metrics): :meth:`_loss` plus the loss terms of the statistics the model
        collects, times ``share`` (this part's share of the step); metrics: ``loss`` (the next-token part) and the
        collected kind's figures (``jaxtrain.models.sidestate.objective``)."""
        model = nnx.merge(graphdef, params)
        chat = self.cfg.data.format == "chat"
        tokens = words & TOKEN_BITS if chat else words
        inputs, targets, segments, positions = tokens[:, :-1], tokens[:, 1:], None, None
        if chat and self.cfg.data.pack:  # each packed example is a document of its own
            segments = jnp.cumsum((words[:, :-1] & DOC_START) > 0, axis=1, dtype=jnp.int32)
        elif self.cfg.data.document_mask:
            segments = document_segments(inputs, self.cfg.data.eos_id)
        weights = trained_targets(words) if chat else None
        routed = (words[:, :-1] & PAD) == 0 if chat else None  # padding is never routed to an expert
        order = self.layout.token_order
        if order is not None:
            # Context parallelism: the int32 inputs, targets, segment ids, loss weights and their real positions
            # (rotary) take the load-balanced zigzag order once per step; nothing is permuted per layer, and the
            # summed loss does not depend on the order (jaxtrain/parallel/context.py).
            inputs, targets, segments, weights, routed = (None if x is None else jnp.take(x, order, axis=1)
                                                          for x in (inputs, targets, segments, weights, routed))
            positions = jnp.broadcast_to(jnp.asarray(order, jnp.int32), inputs.shape)
        logits, collected = sidestate.forward(model, self.cfg.model, inputs, segments, positions, routed)
        losses = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
        if weights is not None:
            losses = losses * weights
        return sidestate.objective(losses.sum() / trained_tokens, collected, self.cfg.model, share)

    def _pipelined_loss(self, params, graphdef, batch):
        """Mean loss of the global batch through the pipeline (:meth:`_pipelined_objective`'s ``loss``)."""
        return self._pipelined_objective(params, graphdef, batch)[1]["loss"]

    def _pipelined_objective(self, params, graphdef, batch):
        """(what the step minimises, metrics) of the global batch through the pipeline
        (jaxtrain/parallel/pipeline.py), split into ``train.microbatches`` microbatches the way accumulation splits
        it (microbatch i: rows i, i+k, ...); metrics as :meth:`_accumulated_grads`' (collected statistics' loss
        terms from each microbatch's statistics over all its layers, each counting 1/k).

        The embedding is looked up on every stage (a gather: cheap, and it spares sending inputs to stage 0); the
        final norm, output projection and loss run once per microbatch, each stage taking its share."""
        model = nnx.merge(graphdef, params)
        k = self.cfg.train.microbatches
        micro = self._microbatches(batch)
        inputs, targets, segments = micro[:, :, :-1], micro[:, :, 1:], None
        if self.cfg.data.document_mask:
            segments = jax.vmap(document_segments, in_axes=(0, None))(inputs, self.cfg.data.eos_id)
        inputs, targets, segments = self._context_order(inputs, targets, segments)
        hidden, collected = pipeline.pipelined_layers(model, inputs, segments, self.layout)
        # [stages, k / stages, ...]: stage j computes the logits and loss of its k / stages microbatches.
        stages = self.layout.dims.stages
        shares = hidden.reshape(stages, k // stages, *hidden.shape[1:])
        targets = targets.reshape(stages, k // stages, *targets.shape[1:])

        def share_loss(h, tgt):
            return jax.vmap(lambda h1, t1: cross_entropy(model.head(h1), t1))(h, tgt).sum()

        loss = jax.vmap(share_loss, spmd_axis_name=self.layout.stage_axis)(shares, targets).sum() / k
        if collected is None:
            return loss, {"loss": loss}
        terms, figures = sidestate.microbatch_objectives(collected, self.cfg.model, k)
        return loss + terms, {**figures, "loss": loss}

    def _pipelined_1f1b_objective(self, params, graphdef, batch):
        """:meth:`_pipelined_objective` through the 1F1B schedule (parallel/pipeline_1f1b.py): the same
        microbatches, the loss computed inside the loop by the last stage, the gradients written by hand there;
        collected statistics' loss terms per microbatch, as there."""
        micro = self._microbatches(batch)
        inputs, segments = micro[:, :, :-1], None
        if self.cfg.data.document_mask:
            segments = jax.vmap(document_segments, in_axes=(0, None))(inputs, self.cfg.data.eos_id)
        inputs, targets, segments = self._context_order(inputs, micro[:, :, 1:], segments)
        model = nnx.merge(graphdef, params)
        k = self.cfg.train.microbatches
        part_fn = sidestate.loss_part_fn(self.cfg.model, k)
        if part_fn is None:
            loss = pipeline_1f1b.pipelined_loss(model, inputs, targets, segments, self.layout, cross_entropy)
            return loss, {"loss": loss}
        total, (loss, collected) = pipeline_1f1b.pipelined_loss(model, inputs, targets, segments, self.layout,
                                                                cross_entropy, part_fn)
        return total, {**sidestate.microbatch_objectives(collected, self.cfg.model, k)[1], "loss": loss}

    def _context_order(self, inputs, targets, segments):
        """The pipeline's int32 [M, rows, seq] inputs, targets and segment ids in the context axis's zigzag order,
        the segment ids joined by their real positions (the stages' side input, pipeline.chunk_function); as given
        without a context axis."""
        order = self.layout.token_order
        if order is None:
            return inputs, targets, segments
        inputs, targets, segments = (None if x is None else jnp.take(x, order, axis=-1)
                                     for x in (inputs, targets, segments))
        return inputs, targets, (segments, jnp.broadcast_to(jnp.asarray(order, jnp.int32), inputs.shape))

    def _microbatches(self, batch):
        """batch [b, seq+1] -> [k, b/k, seq+1] (k = train.microbatches): microbatch i takes rows i, i+k, ..., so each
        device's block of rows splits evenly over the microbatches and no data moves between devices."""
        k, b = self.cfg.train.microbatches, batch.shape[0]
        micro = batch.reshape(b // k, k, -1).swapaxes(0, 1)
        return jax.lax.with_sharding_constraint(
            micro, NamedSharding(self.layout.mesh, PartitionSpec(None, *self.layout.batch_sharding.spec)))

    def _accumulated_grads(self, params, model_def, batch):
        """(metrics, mean gradients) over ``train.microbatches`` sequential microbatches of ``batch``; metrics as
        :meth:`_objective`'s, summed over the microbatches (``loss``: the mean loss).

        Microbatch i takes rows i, i+k, ...: each device's block of rows splits evenly over the microbatches, so no
        data moves between devices. With ``train.accumulate=unreduced`` each data-parallel group (one device's rows)
        computes its own gradient against parameters gathered once before the loop, the sum over microbatches stays
        local, and the gradients are reduced across the batch axes once, after the loop: one all-gather and one
        reduce-scatter per step, as without accumulation, at the cost of holding the gathered parameters and a
        gradient accumulator of their size on each device. ``sharded`` keeps gradients reduced and sharded like
        the parameters inside the loop (the memory of a step without accumulation, the collectives k times).
        """
        k = self.cfg.train.microbatches
        trained = self._trained_tokens(batch)  # each microbatch's loss is its share of the step's mean
        grad_fn = jax.value_and_grad(lambda p, d, tokens: self._objective(p, d, tokens, trained, 1 / k),
                                     has_aux=True)
        micro = self._microbatches(batch)
        lay = self.layout
        dp_axes, dp, mesh = lay.dims.batch_axes, lay.dims.data_parallel, lay.mesh
        if self.cfg.train.accumulate == "sharded" or not dp_axes:
            zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
            no_metrics = sidestate.zero_metrics(self.cfg.model)

            def accumulate(carry, tokens):
                (_, metrics), grads = grad_fn(params, model_def, tokens)
                metrics = jax.tree.map(lambda a, m: a + m.astype(jnp.float32), carry[0], metrics)
                return (metrics, sidestate.combine(carry[1], grads, _add_float32)), None

            (metrics, grads), _ = jax.lax.scan(accumulate, (no_metrics, zeros), micro)
            return metrics, jax.tree.map(lambda g, p: g.astype(p.dtype), grads, params)

        # group g of a microbatch: rows of the g-th device block
        micro = micro.reshape(k, dp, lay.dims.rows_per_group, -1)
        micro = jax.lax.with_sharding_constraint(micro, NamedSharding(mesh, PartitionSpec(None, dp_axes)))
        specs = jax.tree.map(lambda a: a.sharding.spec, lay.abstract_params)
        gathered_specs = jax.tree.map(lambda s: without_axes(s, dp_axes), specs)
        # Gathered once for the whole loop: in the compute dtype (train.gather_dtype=compute), each parameter the
        # model casts at its use is cast on its shard first, halving the all-gather without changing a value; the
        # accumulators and their reduction stay float32.
        narrow = self.cfg.train.gather_dtype == "compute"
        to_gather = precision.narrowed(params, precision.gather_dtype(self.cfg.model)) if narrow else params
        gathered = jax.tree.map(lambda p, s: jax.lax.with_sharding_constraint(p, NamedSharding(mesh, s)),
                                to_gather, gathered_specs)

        def group_grad(tokens):
            # Inside the per-group function the batch axes belong to the vmapped group dimension (spmd_axis_name),
            # so the model's activations must not name them again: the layout's local rules.
            with nnx.logical_axis_rules(lay.local_rules), sidestate.observed_over((_GROUPS,)):
                return grad_fn(gathered, model_def, tokens)

        group_grads = jax.vmap(group_grad, spmd_axis_name=dp_axes, axis_name=_GROUPS)
        acc_sharding = jax.tree.map(lambda s: NamedSharding(mesh, PartitionSpec(dp_axes, *s)), gathered_specs)
        zeros = jax.tree.map(lambda p, s: jax.lax.with_sharding_constraint(jnp.zeros((dp, *p.shape), jnp.float32), s),
                             params, acc_sharding)

        def accumulate(carry, tokens):
            (_, metrics), grads = group_grads(tokens)  # loss [dp], grads [dp, *param] unreduced, one per group
            loss = metrics["loss"]  # the mesh check refuses this mode for models that collect statistics
            grads = jax.tree.map(jax.lax.with_sharding_constraint, sidestate.combine(carry[1], grads, _add_float32),
                                 acc_sharding)
            return (carry[0] + loss, grads), None

        (loss, grads), _ = jax.lax.scan(accumulate, (jnp.zeros((dp,), jnp.float32), zeros), micro)
        grads = jax.tree.map(lambda g, p: g.astype(p.dtype), sidestate.reduce_groups(grads), params)
        grads = jax.tree.map(lambda g, s: jax.lax.with_sharding_constraint(g, NamedSharding(mesh, s)),
                             grads, specs)
        return {"loss": loss.sum()}, grads

    def train_step(self, state, batch):
        """One optimizer step on the global batch int32 [global_batch, seq_len + 1]; returns (state, metrics)."""
        train_state = nnx.merge(self.layout.graphdef, state)
        model_def, params = nnx.split(train_state.model, sidestate.DIFFERENTIATED)
        if self.layout.dims.stages > 1:
            one_f_one_b = self.cfg.train.pipeline_schedule == "1f1b"
            pipelined = self._pipelined_1f1b_objective if one_f_one_b else self._pipelined_objective
            (loss, metrics), grads = jax.value_and_grad(pipelined, has_aux=True)(params, model_def, batch)
        elif self.cfg.train.microbatches == 1:
            (loss, metrics), grads = jax.value_and_grad(self._objective, has_aux=True)(
                params, model_def, batch, self._trained_tokens(batch))
        else:
            metrics, grads = self._accumulated_grads(params, model_def, batch)
            loss = metrics["loss"]
        grads, observed = sidestate.split_gradients(grads)  # observations never enter norm, clip or update
        # A non-finite loss poisons the gradients, so that optax.apply_if_finite skips the step for either cause.
        grads = jax.tree.map(lambda g: jnp.where(jnp.isfinite(loss), g, jnp.nan), grads)
        opt = train_state.opt
        lr = self.schedule(opt.step[...] - opt.opt_state.total_notfinite[...])  # skipped steps do not advance it
        grad_norm = optax.tree.norm(grads)
        opt.update(train_state.model, grads)
        sidestate.record(train_state.model, observed, applied=opt.opt_state.notfinite_count[...] == 0)
        # nonfinite_steps: consecutive steps skipped so far, this one included (0: this step was applied).
        return nnx.state(train_state), {"loss": metrics.pop("loss"), "grad_norm": grad_norm, "learning_rate": lr,
                                        "nonfinite_steps": opt.opt_state.notfinite_count[...], **metrics}

    def eval_step(self, state, batch):
        """Mean loss on one batch, no update."""
        model_def, params = nnx.split(nnx.merge(self.layout.graphdef, state).model, sidestate.DIFFERENTIATED)
        if self.layout.dims.stages > 1:
            return self._pipelined_loss(params, model_def, batch)
        return self._loss(params, model_def, batch, self._trained_tokens(batch))

    def compile(self, state=None, *, with_eval: bool = True):
        """Ahead-of-time compiled (train_step, eval_step or None) for this state (arrays, or ShapeDtypeStructs with
        shardings; default: the layout's abstract state, so nothing is allocated) and the compile seconds."""
        lay = self.layout
        state = lay.abstract_state if state is None else state
        t0 = time.perf_counter()
        with lay.scope():
            train = jax.jit(self.train_step, in_shardings=(lay.state_sharding, lay.batch_sharding),
                            out_shardings=(lay.state_sharding, self._replicated), donate_argnums=0
                            ).lower(state, lay.abstract_batch()).compile()
        evaluate = self.compile_eval(state)[0] if with_eval else None
        return train, evaluate, time.perf_counter() - t0

    def compile_eval(self, state=None):
        """The eval step compiled ahead of time for ``state`` (as :meth:`compile`), and the compile seconds."""
        lay = self.layout
        state = lay.abstract_state if state is None else state
        t0 = time.perf_counter()
        with lay.scope():
            evaluate = jax.jit(self.eval_step, in_shardings=(lay.state_sharding, lay.batch_sharding),
                               out_shardings=self._replicated).lower(state, lay.abstract_batch()).compile()
        return evaluate, time.perf_counter() - t0

    @property
    def _replicated(self) -> NamedSharding:
        return NamedSharding(self.layout.mesh, PartitionSpec())


_GROUPS = "data_parallel_groups"  # the vmap axis of unreduced accumulation's groups (observations reduce over it)


def _add_float32(a, g):
    return a + g.astype(jnp.float32)


def compiled_with_microbatches(layout: Layout, microbatches: int):
    """The train step of ``layout``'s config with another ``train.microbatches``, compiled from abstract shapes
    (what ``guards.check_memory_fit`` tries before it suggests a count)."""
    trial = layout.replace(train=dataclasses.replace(layout.cfg.train, microbatches=microbatches))
    return Step(trial).compile(with_eval=False)[0]


def setup(cfg: Config, devices: list | None = None) -> Step:
    """The step of ``cfg`` laid out on ``devices`` (default: all); raises ConfigError for a bad mesh."""
    return Step(Layout.build(cfg, devices))
