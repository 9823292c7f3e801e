"""The 1F1B pipeline schedule (``train.pipeline_schedule=1f1b``; interleaved 1F1B with ``train.virtual_stages`` > 1):
forward and backward of different microbatches alternate inside one loop, so a stage keeps the inputs of at most
``2 * stages * virtual - 1`` work items, whatever the number of microbatches.

The schedule is the circular one of :mod:`jaxtrain.parallel.pipeline` with the microbatches taken in groups of
``stages`` (Megatron-LM's interleaved order): forward work item ``w`` is microbatch ``(w // (S V)) * S + w % S`` on pass
``(w % (S V)) // S`` and runs on stage ``s`` at iteration ``w + s``. A group's output leaving the last stage enters
stage 0 for its next pass at the very next iteration, so no buffer is needed between passes. Backward work item ``u``
(the same group order, passes in reverse) runs on stage ``s`` at iteration ``S V - 1 + u + (S - 1 - s)``: the last stage
computes the loss of a microbatch's last pass and its cotangent in the iteration of its forward, and starts that item's
backward at once. Each iteration every stage runs (at most) one forward and one backward, and two ring permutes move the
activations one stage on and the cotangents one stage back.

The backward is written here, not left to JAX's transpose of the loop: each stage keeps the *input* of its passes
(slot ``w % (2 S V - 1)`` of a buffer) and its backward recomputes the pass with ``jax.vjp`` from that input (one
extra forward per pass, as ``model.remat=full`` costs); the weight and embedding gradients accumulate in the loop's
carry. The forward and the backward sit in ``lax.cond``: a stage with nothing to do in an iteration skips that
half, so the step takes ``(M V + S - 1)`` forward+backward times: the bubble is GPipe's,
``(S - 1) / (M V + S - 1)`` (:func:`jaxtrain.parallel.pipeline.bubble_fraction`).

The loss terms of statistics the model collects (``stats_fn``; jaxtrain.models.sidestate) are each microbatch's, from
its statistics over all its layers: the gradient with respect to one layer's statistics may need the microbatch's
totals over every layer (the balance loss's top-k counts), known once its last pass leaves the last stage, which is
where its backward starts. So each pass writes its layers' statistics into a buffer of every layer's that travels the
forward ring with the activations; the last stage's head sums the totals over the batch groups and adds the loss
terms, and the buffer's cotangent travels the backward ring with the activations' cotangent.

:func:`loss_and_grads` names no model; :func:`pipelined_loss` runs a Transformer through it, differentiable
(``jax.custom_vjp``) so that the train step takes ``jax.value_and_grad`` of it as of any loss.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec

from jaxtrain.models import sidestate
from jaxtrain.parallel import pipeline


def iterations(stages: int, microbatches: int, virtual: int = 1) -> int:
    """Iterations of the 1F1B loop: the last backward (work item ``M V - 1``) leaves stage 0 at iteration
    ``S V - 1 + M V - 1 + S - 1``."""
    return microbatches * virtual + (virtual + 1) * stages - 2


def saved_inputs(stages: int, microbatches: int, virtual: int = 1) -> int:
    """Stage inputs each stage keeps (the buffer's slots): an item's input lives from its forward until its backward,
    at most ``2 S V - 2`` iterations (pass 0 on stage 0), and never more than the ``M V`` items there are."""
    return min(2 * stages * virtual - 1, microbatches * virtual)


def forward_item(w, stages: int, virtual: int):
    """Forward work item ``w`` -> (pass, microbatch): microbatches in groups of ``stages``, each group's passes in
    order."""
    group, r = w // (stages * virtual), w % (stages * virtual)
    return r // stages, group * stages + r % stages


def backward_item(u, stages: int, virtual: int):
    """Backward work item ``u`` -> (pass, microbatch, forward work item of the same pass and microbatch): the groups
    in order, each group's passes in reverse."""
    group, r = u // (stages * virtual), u % (stages * virtual)
    v = virtual - 1 - r // stages
    return v, group * stages + r % stages, group * stages * virtual + v * stages + r % stages


def _zeros(tree):
    return jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), tree)


def _f32_zeros(tree):
    return jax.tree.map(lambda a: jnp.zeros(a.shape, jnp.float32), tree)


def _add(acc, d):
    return jax.tree.map(lambda a, g: a + g.astype(jnp.float32), acc, d)


def _add_pass(acc, d, v, virtual: int):
    """acc [virtual, ...] plus d at pass v; observed state's cotangents by its rule (models/sidestate.py)."""
    def add_at(a, g):
        return a + g[None] if virtual == 1 else a.at[v].add(g)
    return sidestate.combine_at(acc, jax.tree.map(lambda g: g.astype(jnp.float32), d), v, add_at)


def _record(stats, pass_stats, f_ok, v_f, m_f):
    """A forward pass's collected statistics per layer added at [its microbatch, its pass] (nothing when idle)."""
    return jax.tree.map(lambda b, a: b.at[m_f, v_f].add(jnp.where(f_ok, a, jnp.zeros_like(a))), stats, pass_stats)


def _reduce_chunks(d_chunks, batch_axes, groups, chunk_specs):
    """The chunks' gradients summed over the batch groups (observed state by its rule), per group's mean; a chunk
    split over a batch axis inside the loop (``chunk_specs``: the experts' weights over the expert axis) is this
    device's own part, whose gradient already holds that axis' tokens (the dispatch's transpose): not summed over
    it."""
    split = None if isinstance(chunk_specs, PartitionSpec) else chunk_specs
    return jax.tree.map(lambda g: g[:, None], sidestate.group_mean(d_chunks, batch_axes, groups, split))


class _Stage:
    """This device's stage inside the 1F1B loop (a ``shard_map`` body): its chunk of every pass, the step's inputs
    on this device, and the halves of one iteration: the forward of one work item, the loss head on the last
    stage, the backward of another work item. ``fns``: (stage_fn, embed_fn, loss_fn) of :func:`loss_and_grads`."""

    def __init__(self, fns: tuple[Callable, Callable, Callable, Callable | None], chunks: Any, rest: Any,
                 tokens: jax.Array, targets: jax.Array, side: Any, *, stages: int, virtual: int, stage_axis: str,
                 batch_axes: tuple[str, ...]):
        self.stage_fn, self.embed_fn, self.loss_fn, self.stats_fn = fns
        self.batch_axes, self.stage_axis = batch_axes, stage_axis
        self.rest, self.tokens, self.targets, self.side = rest, tokens, targets, side
        self.s_n, self.v_n = stages, virtual
        self.items = tokens.shape[0] * virtual
        self.slots = saved_inputs(stages, tokens.shape[0], virtual)
        self.me = jax.lax.axis_index(stage_axis)
        self.chunks = jax.tree.map(lambda a: a[:, 0], chunks)  # [virtual, ...]: this stage's chunk for each pass
        self.groups = jax.lax.psum(1, batch_axes) if batch_axes else 1
        h_shape = jax.eval_shape(self.embed_fn, rest, tokens[0])
        self.h_zero = jnp.zeros(h_shape.shape, h_shape.dtype)
        self.stats_zero = None  # one pass's collected statistics per layer [layers in the chunk, ...]
        if self.stats_fn is not None:
            self.stats_zero = _zeros(jax.eval_shape(self.stage_fn, self.chunk(0), self.h_zero, self.side_of(0))[1])
        # What travels the rings: the activations, and with collected statistics those of every layer so far
        # [layers of the model, ...] (zeros for the layers still ahead).
        self.x_zero = self.h_zero if self.stats_fn is None else (self.h_zero, _zeros(self.placed(self.stats_zero, 0)))

    def stats_buffer(self, microbatches: int):
        """Zeros for this stage's collected statistics of every microbatch and pass: [M, virtual, layers, ...]."""
        return jax.tree.map(lambda a: jnp.zeros((microbatches, self.v_n, *a.shape), a.dtype), self.stats_zero)

    def placed(self, stats, v):
        """One pass's statistics [layers in the chunk, ...] at their layers' rows of [layers of the model, ...]
        (pass ``v`` of this stage holds layers from ``(v * stages + stage) * layers in the chunk``, the model's
        order, as :func:`jaxtrain.parallel.pipeline.circular` returns them), zeros elsewhere."""
        def one(a):
            per_chunk = a.shape[0]
            whole = jnp.zeros((per_chunk * self.s_n * self.v_n, *a.shape[1:]), a.dtype)
            start = (v * self.s_n + self.me) * per_chunk
            return jax.lax.dynamic_update_slice_in_dim(whole, a, start, axis=0)
        return jax.tree.map(one, stats)

    def run(self, chunk, x, side_m, v):
        """Pass ``v``: x (h, or (h, the statistics of the layers so far)) -> (output like x, this pass's statistics
        per layer or None)."""
        if self.stats_fn is None:
            return self.stage_fn(chunk, x, side_m), None
        h, stats = self.stage_fn(chunk, x[0], side_m)
        return (h, jax.tree.map(jnp.add, x[1], self.placed(stats, v))), stats

    def hidden(self, x):
        return x if self.stats_fn is None else x[0]

    def with_sums(self, h):
        """Activations h entering the stack (or recomputed from their saved input): the sums start at zero (they
        enter a pass additively, so a backward's recomputation needs none)."""
        return h if self.stats_fn is None else (h, self.x_zero[1])

    def chunk(self, v):
        """One pass's chunk: a static index, so that no copy of the stage's weights is made per iteration."""
        return jax.tree.map(lambda a: a[0] if self.v_n == 1 else a[v], self.chunks)

    def side_of(self, m):
        return None if self.side is None else jax.tree.map(lambda a: a[m], self.side)  # may be a tuple (step.py)

    def forward(self, t, h_ring, saved):
        """Forward half of iteration ``t``: work item ``t - me``, its input fresh from the embedding (stage 0, pass
        0) or from the ring, kept in its slot of ``saved``. Returns (output, saved, (ok, pass, microbatch), the
        pass's collected statistics per layer or None)."""
        me, items, s_n, v_n = self.me, self.items, self.s_n, self.v_n
        w = t - me
        f_ok = (w >= 0) & (w < items)
        w = jnp.clip(w, 0, items - 1)
        v_f, m_f = forward_item(w, s_n, v_n)
        x = jax.lax.cond(f_ok & (me == 0) & (v_f == 0),
                         lambda: self.with_sums(self.embed_fn(self.rest, self.tokens[m_f])), lambda: h_ring)
        slot = w % self.slots
        saved = saved.at[slot].set(jnp.where(f_ok, self.hidden(x), saved[slot]))
        out, stats = jax.lax.cond(f_ok, lambda: self.run(self.chunk(v_f), x, self.side_of(m_f), v_f),
                                  lambda: (self.x_zero, self.stats_zero))
        return out, saved, (f_ok, v_f, m_f), stats

    def head(self, out, f_ok, v_f, m_f):
        """The last stage ends a microbatch's last pass: its loss (what is minimised, and its next-token part), the
        gradient of the loss head's parameters, and the cotangent that starts the backward (zeros on the other
        stages and passes). With collected statistics the microbatch's statistics of every layer have arrived with
        ``out``; their totals are summed over the batch groups first (no gradient; every device, every iteration,
        so that the collective sits outside the conditional)."""
        totals = None
        if self.stats_fn is not None:
            totals = self.stats_fn.totals(out[1])
            totals = jax.lax.psum(totals, self.batch_axes) if self.batch_axes else totals

        def loss_of(r, o):
            loss = self.loss_fn(r, self.hidden(o), self.targets[m_f])
            if self.stats_fn is None:
                return loss, loss
            # Each group's part of the loss terms; the loop's sums over groups are divided by groups (the rows'
            # means), hence the factor.
            return loss + self.groups * self.stats_fn.part(o[1], totals), loss

        def head():
            total, vjp, loss_m = jax.vjp(loss_of, self.rest, out, has_aux=True)
            d_r, d_out = vjp(jnp.ones_like(total))
            return (total.astype(jnp.float32), loss_m.astype(jnp.float32)), d_r, d_out

        ends = f_ok & (self.me == self.s_n - 1) & (v_f == self.v_n - 1)
        zero = jnp.zeros((), jnp.float32)
        return jax.lax.cond(ends, head, lambda: ((zero, zero), _zeros(self.rest), self.x_zero))

    def backward(self, t, ct_head, ct_ring, saved):
        """Backward half of iteration ``t``: work item u, recomputed from its saved input; the cotangent from the
        head (the item just forwarded, on the last stage's last pass) or from the ring. Returns (d_chunk, the
        cotangent of its input, the embedding's gradient where stage 0 ends a first pass, its pass)."""
        me, items, s_n, v_n = self.me, self.items, self.s_n, self.v_n
        u = t - (s_n * v_n - 1) - (s_n - 1 - me)
        b_ok = (u >= 0) & (u < items)
        u = jnp.clip(u, 0, items - 1)
        v_b, m_b, w_b = backward_item(u, s_n, v_n)
        head_ct = (me == s_n - 1) & (v_b == v_n - 1)
        ct = jax.tree.map(lambda a, b: jnp.where(head_ct, a, b), ct_head, ct_ring)

        def backward():
            _, vjp = jax.vjp(lambda c, x: self.run(c, x, self.side_of(m_b), v_b)[0], self.chunk(v_b),
                             self.with_sums(saved[w_b % self.slots]))
            return vjp(ct)

        d_chunk, d_in = jax.lax.cond(b_ok, backward, lambda: (_zeros(self.chunk(v_b)), self.x_zero))

        # Stage 0 ends a microbatch's first pass: the cotangent reaches the embedding.
        def embed_grad():
            return jax.vjp(lambda r: self.embed_fn(r, self.tokens[m_b]), self.rest)[1](self.hidden(d_in))[0]

        d_r_embed = jax.lax.cond(b_ok & (me == 0) & (v_b == 0), embed_grad, lambda: _zeros(self.rest))
        return d_chunk, d_in, d_r_embed, v_b

    def iteration(self, carry, t):
        """Iteration ``t`` of the loop (``lax.scan``'s body): a forward, the loss head, a backward, the two rings."""
        h_ring, ct_ring, saved, losses, d_chunks, d_rest, stats = carry
        out, saved, forwarded, pass_stats = self.forward(t, h_ring, saved)
        if stats is not None:
            stats = _record(stats, pass_stats, *forwarded)
        loss_m, d_r_head, ct_head = self.head(out, *forwarded)
        d_chunk, d_in, d_r_embed, v_b = self.backward(t, ct_head, ct_ring, saved)
        d_chunks = self.add_chunk_grads(d_chunks, d_chunk, v_b)
        d_rest = _add(_add(d_rest, d_r_head), d_r_embed)
        s_n = self.s_n
        forward_ring = [(i, (i + 1) % s_n) for i in range(s_n)]
        backward_ring = [((i + 1) % s_n, i) for i in range(s_n)]
        # Named, so that the program's two rings can be told apart (with two stages both are the same pairs).
        with jax.named_scope("forward_ring"):
            h_ring = jax.lax.ppermute(out, self.stage_axis, perm=forward_ring)
        with jax.named_scope("backward_ring"):
            ct_ring = jax.lax.ppermute(d_in, self.stage_axis, perm=backward_ring)
        return (h_ring, ct_ring, saved, _add(losses, loss_m), d_chunks, d_rest, stats), None

    def add_chunk_grads(self, d_chunks, d_chunk, v_b):
        """``d_chunk`` (of pass ``v_b``) added into the float32 sums of every pass's chunk gradients (observed
        state's cotangents: by its rule)."""
        return _add_pass(d_chunks, d_chunk, v_b, self.v_n)


def loss_and_grads(stage_fn: Callable, embed_fn: Callable, loss_fn: Callable, chunks: Any, rest: Any,
                   tokens: jax.Array, targets: jax.Array, side: Any, *, stages: int, virtual: int,
                   stage_axis: str, batch_axes: tuple[str, ...] = (), stats_fn: Callable | None = None,
                   chunk_specs: Any = None) -> tuple:
    """(loss, d_chunks, d_rest, (next-token loss, collected statistics) or None) of one step through the 1F1B
    schedule.

    stage_fn(chunk_weights, h, side_m) -> h: one chunk on one microbatch, h [rows, ...] (this device's rows); with
        ``stats_fn``, -> (h, collected statistics per layer [layers in the chunk, ...], sums over the rows).
    embed_fn(rest, tokens_m) -> h: the pipeline's input of one microbatch (stage 0, pass 0).
    loss_fn(rest, h, targets_m) -> scalar: one microbatch's share of the loss from the last stage's output on its
        last pass (this device's rows).
    stats_fn: :func:`jaxtrain.models.sidestate.loss_part_fn`'s, or None: ``.part(sums, totals)`` -> scalar, the
        loss terms of one microbatch's collected statistics, this device's part (the parts add up over the batch
        groups), from its rows' statistics summed over every layer (they travel the forward ring with the
        activations, their cotangents the backward ring) and ``.totals(sums)`` summed over all the microbatch's
        rows (no gradient).
    chunks: pytree of [virtual, stages, ...] (:func:`jaxtrain.parallel.pipeline.arrange_chunks`) split over
        ``stage_axis`` on dim 1, not over ``batch_axes`` except as ``chunk_specs`` (None, or a pytree prefix of
        chunks: :func:`jaxtrain.parallel.pipeline.loop_specs`) says. rest: pytree of the parameters embed_fn and
        loss_fn use, not split over the stage or batch axes.
    tokens, targets: [M, rows, ...] (M a multiple of ``stages``); side: pytree of [M, rows, ...] or None; rows split
        over ``batch_axes``.

    Returns the loss (sum over microbatches of loss_fn and stats_fn, mean over the batch groups) and its gradients
    with respect to ``chunks`` (float32, split like chunks) and ``rest`` (float32, replicated). The gradients are
    summed over the batch axes (and, for ``rest``, the stages) once, after the loop. With ``stats_fn`` also the
    loss_fn part alone and the statistics per microbatch and layer [M, L, ...] summed over the rows (as
    :func:`jaxtrain.parallel.pipeline.circular` gives them).
    """
    s_n, m_n = stages, tokens.shape[0]
    reduce_axes = (stage_axis, *batch_axes)
    chunk_specs = PartitionSpec(None, stage_axis) if chunk_specs is None else chunk_specs

    def local(chunks, rest, tokens, targets, side):
        stage = _Stage((stage_fn, embed_fn, loss_fn, stats_fn), chunks, rest, tokens, targets, side, stages=stages,
                       virtual=virtual, stage_axis=stage_axis, batch_axes=batch_axes)
        groups, x_zero = stage.groups, stage.x_zero

        stats = None if stage.stats_zero is None else _f32_zeros(stage.stats_buffer(m_n))
        carry = (x_zero, x_zero, jnp.zeros((stage.slots, *stage.h_zero.shape), stage.h_zero.dtype),
                 (jnp.zeros((), jnp.float32),) * 2, _f32_zeros(stage.chunks), _f32_zeros(rest), stats)
        steps = jnp.arange(iterations(s_n, m_n, virtual))
        with sidestate.observed_over(tuple(batch_axes)):  # of the whole microbatch, not of this device's rows
            (_, _, _, losses, d_chunks, d_rest, stats), _ = jax.lax.scan(stage.iteration, carry, steps)
        # The sums over devices, once per step: the loss and the embedding/head gradients live on one stage each.
        losses = jax.tree.map(lambda a: jax.lax.psum(a, reduce_axes) / groups, losses)
        d_rest = jax.tree.map(lambda g: jax.lax.psum(g, reduce_axes) / groups, d_rest)
        d_chunks = _reduce_chunks(d_chunks, batch_axes, groups, chunk_specs)
        return losses, d_chunks, d_rest, jax.tree.map(lambda a: a[None, :, :, None], stats)

    (loss, next_token), d_chunks, d_rest, stats = _on_each_device(local, stage_axis, batch_axes, chunk_specs)(
        chunks, rest, tokens, targets, side)
    if stats_fn is None:
        return loss, d_chunks, d_rest, None
    return loss, d_chunks, d_rest, (next_token, jax.tree.map(lambda a: a.sum(0).reshape(m_n, -1, *a.shape[5:]),
                                                             stats))


def _on_each_device(local: Callable, stage_axis: str, batch_axes: tuple[str, ...], chunk_specs: Any) -> Callable:
    """:func:`loss_and_grads`' loop ``local(chunks, rest, tokens, targets, side)`` under ``shard_map`` over the stage
    and batch axes (the chunks and their gradients split as ``chunk_specs``); its collected statistics leave one row
    per batch group ([groups, M, virtual, stages, ...])."""
    rows = PartitionSpec(None, batch_axes or None)
    return jax.shard_map(local, in_specs=(chunk_specs, PartitionSpec(), rows, rows, rows),
                         out_specs=(PartitionSpec(), chunk_specs, PartitionSpec(),
                                    PartitionSpec(batch_axes or None, None, None, stage_axis)),
                         axis_names=frozenset((stage_axis, *batch_axes)), check_vma=False)


def pipelined_loss(model, tokens: jax.Array, targets: jax.Array, segment_ids: jax.Array | None, layout,
                   loss_fn: Callable[[jax.Array, jax.Array], jax.Array], stats_fn: Callable | None = None) -> Any:
    """A Transformer's mean loss over M microbatches through the 1F1B schedule, differentiable in the model's
    parameters. tokens, targets int [M, microbatch, seq]; segment_ids int [M, microbatch, seq] or None.
    loss_fn(logits float32 [rows, seq, vocab], targets [rows, seq]) -> the mean loss of those rows.
    stats_fn: as :func:`loss_and_grads`'; then returns (the loss with the collected loss terms, (the
    next-token loss, the statistics [M, G, ...] per microbatch and layer group)), the second without gradient.

    The layer stack's parameters are arranged into chunks as the GPipe schedule arranges them
    (:func:`jaxtrain.parallel.pipeline.stack_chunks`); the other parameters (embedding, final norm, output projection)
    enter the loop gathered and their gradients leave it summed over stages and batch groups.
    """
    m_n = tokens.shape[0]
    is_stack = nnx.All(sidestate.DIFFERENTIATED, nnx.PathContains("blocks"))  # with the layers' observed state
    graphdef, *states = nnx.split(model, is_stack, nnx.Param, ...)
    stack, rest, other = states
    blocks_def = nnx.graphdef(model.blocks)  # one stacked layer's structure, as pipeline.pipelined_layers merges it
    abstract_stack = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), stack)
    stage_fn = pipeline.chunk_function(blocks_def, layout, model.cfg.remat, with_stats=stats_fn is not None)

    def view(r):  # the model with these non-stack parameters (the stack is never read outside the loop's chunks)
        return nnx.merge(graphdef, abstract_stack, r, other)

    def embed_fn(r, tokens_m):
        with nnx.logical_axis_rules(layout.local_rules):
            return view(r).embed_tokens(tokens_m)

    def head_loss(r, h, targets_m):
        with nnx.logical_axis_rules(layout.local_rules):
            return loss_fn(view(r).head(h), targets_m) / m_n

    schedule = partial(loss_and_grads, stage_fn, embed_fn, head_loss, stages=layout.dims.stages,
                       virtual=layout.cfg.train.virtual_stages, stage_axis=layout.stage_axis,
                       batch_axes=layout.dims.batch_axes, stats_fn=stats_fn,
                       chunk_specs=pipeline.loop_specs(stack["blocks"], layout))

    @jax.custom_vjp
    def run(chunks, rest, tokens, targets, segments):
        loss, _, _, aux = schedule(chunks, rest, tokens, targets, segments)
        return loss, aux

    def run_fwd(chunks, rest, tokens, targets, segments):
        loss, d_chunks, d_rest, aux = schedule(chunks, rest, tokens, targets, segments)
        return (loss, aux), (d_chunks, d_rest, chunks, rest)

    def run_bwd(res, cotangents):
        g = cotangents[0]  # the next-token loss and the statistics are figures to log: no gradient flows from them
        d_chunks, d_rest, chunks, rest = res
        # observed state's cotangents are observations, not scaled by the loss's cotangent
        cast = partial(sidestate.scale_cotangent, g=g)
        # token ids and segments (with a context axis: segments and positions, step.py): no gradient
        return cast(d_chunks, chunks), cast(d_rest, rest), None, None, jax.tree.map(lambda _: None, segment_ids)

    run.defvjp(run_fwd, run_bwd)
    loss, aux = run(pipeline.stack_chunks(stack["blocks"], layout), rest, tokens, targets, segment_ids)
    if stats_fn is None:
        return loss
    return loss, jax.lax.stop_gradient(aux)
