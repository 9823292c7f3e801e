"""The circular (interleaved) pipeline schedule: a layer stack run over ``stages`` groups of devices.

The stack's L layers are cut into ``stages x virtual`` chunks of consecutive layers; chunk ``c`` runs on stage
``c % stages`` (so each stage holds ``virtual`` chunks, one per pass). Microbatches enter stage 0 one per
iteration; every iteration all stages run their current chunk at once (one function vmapped over a stage-sharded
axis) and then pass their outputs one stage on, around a ring: a collective permute along the stage axis. A
microbatch leaving the last stage goes back to stage 0 for its next pass, waiting there in a buffer while stage 0
feeds the microbatches still on their previous pass. Work item ``w`` (microbatch ``w % M``, pass ``w // M``) is on
stage ``s`` at iteration ``w + s``; the step takes ``M * virtual + stages - 1`` iterations, of which each stage
idles ``stages - 1``: the bubble fraction ``(stages - 1) / (M * virtual + stages - 1)``.

The backward pass is JAX's transpose of the same loop (GPipe order: all forwards, then all backwards). Under
rematerialisation each iteration keeps only its stage inputs, one ``[microbatch, seq, embed]`` per stage and
iteration: per device ``(M * virtual + stages - 1)`` microbatch activations, about ``virtual`` times the local
batch, whatever M is. MaxText's circular pipeline is the model for this design.

The schedule (:func:`circular`) names no mesh axis: the caller passes the stage axis and the shardings;
:func:`pipelined_layers` runs a Transformer's layer stack through it with the facts of the run's layout.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec

from jaxtrain.models import sidestate
from jaxtrain.models.attention import REMAT_POLICIES
from jaxtrain.parallel.mesh import without_axes


def iterations(stages: int, microbatches: int, virtual: int = 1) -> int:
    """Iterations of one step's loop: ``microbatches * virtual`` work items, the last entering stage 0 at iteration
    ``microbatches * virtual - 1`` and leaving the last stage ``stages - 1`` iterations later."""
    return microbatches * virtual + stages - 1


def bubble_fraction(stages: int, microbatches: int, virtual: int = 1) -> float:
    """Share of a stage's iterations spent idle: ``(stages - 1) / (microbatches * virtual + stages - 1)``."""
    return (stages - 1) / iterations(stages, microbatches, virtual)


def exchange_rounds(stages: int, virtual: int) -> list[list[tuple[int, int, int, int]]]:
    """How the layer chunks move from their storage layout to the schedule's, as ``virtual`` rounds of one
    collective permute each: every round a list of (source stage, source slot, destination stage, destination slot)
    in which each stage sends one chunk and receives one.

    Stored contiguously, stage ``d`` holds chunks ``d * virtual + j`` (slot j); the schedule wants chunk ``c`` on
    stage ``c % stages`` in slot ``c // stages``. Each stage sends and receives ``virtual`` chunks, so the moves form
    a regular bipartite multigraph, which splits into ``virtual`` perfect matchings (Konig): one permute each.
    """
    moves = [(d, j, c % stages, c // stages) for d in range(stages) for j in range(virtual)
             for c in [d * virtual + j]]
    rounds = []
    while moves:
        match: dict[int, tuple[int, int, int, int]] = {}  # destination stage -> move
        for src in range(stages):
            if not _augment(moves, match, src, set()):
                raise AssertionError(f"no perfect matching for stages={stages} virtual={virtual}")
        rounds.append(sorted(match.values()))
        for mv in match.values():
            moves.remove(mv)
    return rounds


def _augment(moves: list, match: dict, src: int, seen: set[int]) -> bool:
    """Kuhn's augmenting path: give ``src`` a destination in ``match``, re-routing earlier choices if needed."""
    for mv in moves:
        if mv[0] == src and mv[2] not in seen:
            seen.add(mv[2])
            if mv[2] not in match or _augment(moves, match, match[mv[2]][0], seen):
                match[mv[2]] = mv
                return True
    return False


def arrange_chunks(stack: jax.Array, stages: int, virtual: int, stage_axis: str | tuple[str, ...]) -> jax.Array:
    """Layer stack [L, ...] (model order, split contiguously over ``stage_axis``) -> [virtual, stages, L / (stages *
    virtual), ...] split over ``stage_axis`` on dim 1: element [v, s] is chunk ``v * stages + s``, the layers stage
    ``s`` runs on pass ``v``. With one pass nothing moves. With more, each stage keeps the chunks it runs and
    exchanges the others: ``virtual`` collective permutes along the stage axis of one chunk each
    (:func:`exchange_rounds`), in the backward pass too (for the gradients)."""
    per_chunk = stack.shape[0] // (stages * virtual)
    if virtual == 1:
        return stack.reshape(1, stages, per_chunk, *stack.shape[1:])
    rounds = exchange_rounds(stages, virtual)
    stored = stack.reshape(stages, virtual, per_chunk, *stack.shape[1:])

    def exchange(local):  # local [1, virtual, per_chunk, ...]: this stage's stored chunks
        me = jax.lax.axis_index(stage_axis)
        out = jnp.zeros_like(local[0])
        for moves in rounds:
            src_slot = jnp.array([mv[1] for mv in moves])  # sorted by source stage
            by_dst = sorted(moves, key=lambda mv: mv[2])
            dst_slot = jnp.array([mv[3] for mv in by_dst])
            stays = jnp.array([mv[0] == mv[2] for mv in by_dst])  # this stage sends the chunk to itself
            send = local[0, src_slot[me]]
            perm = [(mv[0], mv[2]) for mv in moves if mv[0] != mv[2]]
            got = jax.lax.ppermute(send, stage_axis, perm=perm) if perm else send
            out = out.at[dst_slot[me]].set(jnp.where(stays[me], send, got))
        return out[:, None]  # [virtual, 1, per_chunk, ...]

    axes = frozenset(stage_axis if isinstance(stage_axis, tuple) else (stage_axis,))
    return jax.shard_map(exchange, in_specs=PartitionSpec(stage_axis), out_specs=PartitionSpec(None, stage_axis),
                         axis_names=axes)(stored)


def circular(stage_fn: Callable[[Any, jax.Array, Any], jax.Array], chunks: Any, x: jax.Array, side: Any, *,
             stages: int, virtual: int, stage_axis: str | tuple[str, ...], batch_axes: tuple[str, ...] = (),
             embed: Callable[[jax.Array], jax.Array] | None = None, remat_policy: Callable | None = None,
             meta: Any = None, with_stats: bool = False, chunk_specs: Any = None) -> Any:
    """Run ``x`` through all chunks in order, pipelined. Returns the outputs [M, microbatch, ...], M split over the
    stage axis (stage ``j`` holds microbatches ``j * M / stages`` onwards) and the microbatch rows over
    ``batch_axes``; with ``with_stats``, (outputs, stats) (below).

    stage_fn(chunk_weights, h, side_m) -> h: one chunk on one microbatch, h [microbatch, ...] (this device's rows).
    chunks: pytree of [virtual, stages, ...] (:func:`arrange_chunks`) split as ``chunk_specs`` says (:func:`loop_specs`;
        None: over ``stage_axis`` on dim 1, not over ``batch_axes``), their gradients summed over the batch axes a
        spec does not name (shard_map's transpose).
    x: [M, microbatch, ...] the microbatches' inputs (M a multiple of ``stages``), rows split over ``batch_axes``.
    side: pytree of [M, microbatch, ...] per-microbatch side inputs (segment ids) or None, split like x.
    remat_policy: what a pass through a stage keeps for the backward (``jax.checkpoint`` policy); None: everything.
        Either way the stage's chunk for the pass is re-selected in the backward rather than kept: a copy of the
        weights per iteration would make memory grow with the microbatches.
    embed: applied to x on each stage before the loop (e.g. token ids -> embeddings), so that what enters is
        integers: had the embeddings come in, their gradient would be summed over stages (an all-reduce the size of
        the local batch's activations) although only stage 0 uses them.
    meta: pytree of [virtual, stages, ...] like chunks, or None: the layers' observed state (models/sidestate.py),
        given to stage_fn beside the chunk's weights as (weights, meta); their cotangents (observations) combine by
        their rule over the iterations and batch groups, never summed; the observations reduce over the batch axes.
    with_stats: stage_fn returns (h, stats), stats a pytree of per-layer sums over this device's rows with leading
        axis [layers per chunk] (the statistics the model collects). Each stage adds its passes' stats into a buffer
        per microbatch; returned as [M, virtual * stages * layers per chunk, ...] (the layers in model order),
        summed over the batch groups: each microbatch's statistics of every layer, as without a pipeline.

    The loop runs on each device's own shard: ``shard_map`` over the stage axis and the batch axes (the other axes,
    tensor, stay with the partitioner; inside, ``stage_fn`` must not name the batch axes). So every move along
    ``stage`` is one the code states, the ring permute each iteration and one all-to-all at the end, and the weight
    gradients accumulate on each device over all iterations and are summed over the batch axes once, where the
    chunks enter (as ``train.accumulate=unreduced`` does), not once per iteration.
    """
    s_n, m_n = stages, x.shape[0]
    ring = [(i, (i + 1) % s_n) for i in range(s_n)]

    run_pass = _pass_function(stage_fn, remat_policy)

    def local(chunks, x, side, meta):
        me = jax.lax.axis_index(stage_axis)
        chunks = jax.tree.map(lambda a: a[:, 0], chunks)  # [virtual, ...]: this stage's chunk for each pass
        meta = jax.tree.map(lambda a: a[0, :, 0], meta)  # this device's copy of its stage's observed state
        x = x if embed is None else embed(x)

        def iteration(carry, t):
            h, buf, meta, stats = carry  # observed state in the carry: cotangents meet by its rule (closed over: +)
            meta, meta_now = sidestate.split_carry(meta) if meta is not None else (None, None)
            w = t - me  # this stage's work item: microbatch w % M on pass w // M (outside [0, M * virtual): idle)
            # Stage 0 reads its next work item from its buffer (fresh inputs, or microbatches back from the last
            # stage); the other stages take what the previous stage passed on.
            h = jnp.where(me == 0, buf[t % m_n], h)
            side_m = None if side is None else jax.tree.map(lambda a: a[w % m_n], side)
            v = jnp.clip(w // m_n, 0, virtual - 1)
            h = run_pass(chunks if meta is None else (chunks, meta_now), v, h, side_m)
            if with_stats:
                h, stats = h[0], _record(stats, h[1], w, v, m_n, virtual)
            h = jax.lax.ppermute(h, stage_axis, perm=ring)  # the ring step: stage s's output to stage s + 1
            # What reaches stage 0 from the last stage (work item t - stages + 1, once there is one) waits in the
            # buffer slot of its microbatch, whose previous occupant entered the pipeline stages - 1 iterations ago.
            slot = (t - s_n + 1) % m_n
            keep = (me == 0) & (t - s_n + 1 >= 0)
            buf = buf.at[slot].set(jnp.where(keep, h, buf[slot]))
            return (h, buf, meta, stats), None

        # Every stage keeps a buffer of the microbatches' size (x); only stage 0's is read, and at the end it holds
        # every microbatch's final output.
        steps = jnp.arange(iterations(s_n, m_n, virtual))
        stats = _stats_buffer(run_pass, chunks, meta, x[0], side, m_n, virtual) if with_stats else None
        with sidestate.observed_over(tuple(batch_axes)):  # of the whole microbatch, not of this device's rows
            (_, buf, _, stats), _ = jax.lax.scan(iteration, (jnp.zeros(x.shape[1:], x.dtype), x, meta, stats), steps)
        # Hand stage j its share of microbatches, so that the output layer and the loss run once, split over stages.
        shares = jax.lax.all_to_all(buf.reshape(s_n, m_n // s_n, *x.shape[1:]), stage_axis, 0, 0)
        # [M / stages, microbatch, ...] from stage 0 (the other stages sent their unused buffers); the stats leave
        # per device ([1, M, virtual, 1, per chunk, ...]) and are summed over the batch groups outside.
        return shares[0], jax.tree.map(lambda a: a[None, :, :, None], stats)

    out, stats = _on_each_device(local, chunks, x, side, meta, stage_axis, batch_axes, chunk_specs)
    stats = None if stats is None else jax.tree.map(lambda a: a.sum(0).reshape(m_n, -1, *a.shape[5:]), stats)
    return (out, stats) if with_stats else out


def _pass_function(stage_fn: Callable, remat_policy: Callable | None) -> Callable:
    """run_pass(chunks [virtual, ...], v, h, side_m): ``stage_fn`` on pass ``v``'s chunk under the remat policy,
    the chunk re-selected in the backward rather than kept (a copy of the weights per iteration would make memory
    grow with the microbatches)."""
    def run_pass(chunks, v, h, side_m):
        weights = jax.tree.map(lambda a: checkpoint_name(a[v], "pipeline_chunk"), chunks)
        return stage_fn(weights, h, side_m)  # weights: (chunk, meta) with observed state

    policy = remat_policy or jax.checkpoint_policies.save_anything_except_these_names("pipeline_chunk")
    return jax.checkpoint(run_pass, policy=policy, prevent_cse=False)


def _on_each_device(local: Callable, chunks: Any, x: jax.Array, side: Any, meta: Any, stage_axis,
                    batch_axes: tuple[str, ...], chunk_specs: Any) -> tuple[jax.Array, Any]:
    """:func:`circular`'s loop ``local`` under ``shard_map`` over the stage and batch axes: (outputs [M,
    microbatch, ...] split over stage and the rows over the batch axes, stats [groups, M, virtual, stages, ...] or
    None, one row per batch group)."""
    stage_names = stage_axis if isinstance(stage_axis, tuple) else (stage_axis,)
    rows = PartitionSpec(None, batch_axes or None)
    chunk_specs = PartitionSpec(None, stage_axis) if chunk_specs is None else chunk_specs
    return jax.shard_map(local, in_specs=(chunk_specs, rows, rows,
                                          PartitionSpec(batch_axes or None, None, stage_axis)),
                         out_specs=(PartitionSpec(stage_axis, batch_axes or None),
                                    PartitionSpec(batch_axes or None, None, None, stage_axis)),
                         axis_names=frozenset(stage_names + tuple(batch_axes)),
                         check_vma=False)(chunks, x, side, _meta_per_group(meta, batch_axes))


def _stats_buffer(run_pass: Callable, chunks: Any, meta: Any, h: jax.Array, side: Any, m_n: int,
                  virtual: int) -> Any:
    """Zeros for the stats of every microbatch and pass on this stage: leaves [M, virtual, per chunk, ...] (the
    shapes of one pass's stats, ``run_pass`` traced abstractly)."""
    side_0 = None if side is None else jax.tree.map(lambda a: a[0], side)
    weights = chunks if meta is None else (chunks, sidestate.split_carry(meta)[1])
    _, one = jax.eval_shape(run_pass, weights, 0, h, side_0)
    return jax.tree.map(lambda a: jnp.zeros((m_n, virtual, *a.shape), a.dtype), one)


def _record(buffer: Any, stats: Any, w: jax.Array, v: jax.Array, m_n: int, virtual: int) -> Any:
    """``stats`` of work item ``w`` (pass ``v``) added at [microbatch w % M, v] of ``buffer``; nothing for an idle
    iteration (w outside [0, M * virtual))."""
    busy = (w >= 0) & (w < m_n * virtual)
    return jax.tree.map(lambda b, s: b.at[w % m_n, v].add(jnp.where(busy, s, jnp.zeros_like(s))), buffer, stats)


def _meta_per_group(meta: Any, batch_axes: tuple[str, ...]) -> Any:
    """Observed state [virtual, stages, ...] -> [groups, virtual, stages, ...], one copy per batch group, so that
    shard_map's transpose combines their cotangents by their rule instead of summing them (None stays None)."""
    if meta is None:
        return None
    return sidestate.fan_out(meta, math.prod(jax.sharding.get_abstract_mesh().shape[a] for a in batch_axes))


def pipelined_layers(model, tokens: jax.Array, segment_ids: jax.Array | None, layout) -> tuple[jax.Array, Any]:
    """A Transformer's embedding and layer stack over the pipeline stages: tokens int [M, microbatch, seq] -> (the
    hidden states its layers give each microbatch, [M, microbatch, seq, embed] with M split over the stages
    (logical ``stage``); the statistics the model collects (jaxtrain.models.sidestate) per microbatch, [M, G, ...]
    summed over each microbatch's rows (G the layer groups, as the unpipelined model's scan stacks them), or None
    for a model that collects none). ``segment_ids`` int [M, microbatch, seq] or None. ``layout``: the run's
    :class:`jaxtrain.parallel.layout.Layout` (stages, the stage and batch axes, the rules inside the loop).

    The stack's parameters (logical ``layers`` split over stages) are gathered over the batch axes once per step
    and their gradients summed over them once, as ``train.accumulate=unreduced`` does, not once per pipeline
    iteration. The remat policy applies to each stage's chunk as a whole: a pass through a stage keeps its input
    (and what the policy saves).
    """
    graphdef, stacked = nnx.split(model.blocks)
    stacked, histories = sidestate.split_observed(stacked)  # combined by their rule, not summed
    chunks = stack_chunks(stacked, layout)
    meta = stack_chunks(histories, layout) if jax.tree.leaves(histories) else None
    with_stats = sidestate.collected_rule(model.cfg) is not None  # a layer returns (h, its statistics)
    chunk_fn = chunk_function(graphdef, layout, with_stats=with_stats)

    def stage_fn(weights, h, side):
        return chunk_fn(weights if meta is None else nnx.merge_state(*weights), h, side)

    def embed(tokens):
        with nnx.logical_axis_rules(layout.local_rules):
            return model.embed_tokens(tokens)

    policy = REMAT_POLICIES[model.cfg.remat] if model.cfg.remat != "none" else None
    out = circular(stage_fn, chunks, tokens, segment_ids, stages=layout.dims.stages,
                   virtual=layout.cfg.train.virtual_stages, stage_axis=layout.stage_axis,
                   batch_axes=layout.dims.batch_axes, embed=embed, remat_policy=policy, meta=meta,
                   with_stats=with_stats, chunk_specs=loop_specs(stacked, layout))
    return out if with_stats else (out, None)


def stack_chunks(stacked: Any, layout) -> Any:
    """The layer stack's state (leaves [L, ...], logical ``layers`` split over stages) -> the schedule's chunks,
    leaves [virtual, stages, L / (stages * virtual), ...] split over the stage axis on dim 1 and gathered over the
    batch axes (once per step, before the loop; the gradients are summed over them once, where they leave it),
    except the experts' dimension, which stays split over the expert axis (:func:`loop_specs`)."""
    stages, virtual, stage_axis = layout.dims.stages, layout.cfg.train.virtual_stages, layout.stage_axis

    def chunk_spec(spec: PartitionSpec, kept: PartitionSpec) -> PartitionSpec:
        # nnx.get_partition_spec gives mesh axes (the rules already applied): [layers, ...] -> [virtual, stages,
        # layers per chunk, ...], the batch axes dropped (gathered once, before the loop) where the loop does not
        # keep them.
        keep = tuple(kept)[3:]
        dims = [entry if i < len(keep) and keep[i] is not None
                else without_axes(PartitionSpec(entry), layout.dims.batch_axes)[0]
                for i, entry in enumerate(tuple(spec)[1:])]
        return PartitionSpec(None, stage_axis, None, *dims)

    def arrange(a, spec, kept):
        return jax.lax.with_sharding_constraint(arrange_chunks(a, stages, virtual, stage_axis),
                                                chunk_spec(spec, kept))

    specs, kept = nnx.get_partition_spec(stacked), loop_specs(stacked, layout)
    return jax.tree.map(arrange, stacked, specs, kept, is_leaf=lambda v: isinstance(v, PartitionSpec))


def loop_specs(stacked: Any, layout) -> Any:
    """The specs of the schedule's chunks (:func:`stack_chunks`) over the pipeline loop's manual axes, a tree like
    ``stacked`` (the layer stack's state, leaves [L, ...]): [virtual, stages, layers per chunk, ...] split over the
    stage axis on dim 1 and, on the experts' dimension (logical ``experts``), over the expert axis when it is one
    of the batch axes and larger than 1: each device keeps its own experts and the dispatch sends it the tokens
    (parallel/expert.py), so their gradients are summed over the other batch axes only."""
    rule = layout.cfg.mesh.rules.get("experts")  # 'expert' or null (dims.py)
    dims = layout.dims
    ep = rule if isinstance(rule, str) and rule in dims.batch_axes and dims.size(rule) > 1 else None

    def one(v):
        logical = tuple(v.get_metadata().get("out_sharding") or ())[1:]  # after ``layers``
        return v.replace(PartitionSpec(None, layout.stage_axis, None,
                                       *(ep if name == "experts" else None for name in logical)))

    return jax.tree.map(one, stacked, is_leaf=lambda x: isinstance(x, nnx.Variable))


def chunk_function(graphdef, layout, remat: str = "none", with_stats: bool = False) -> Callable:
    """stage_fn(chunk state, h [rows, seq, embed], segment ids [rows, seq] or None) -> h: the layers of one chunk
    (``graphdef``: one layer of the stack) as a scan, under the layout's local rules (the batch axes belong to the
    schedule's loop). ``remat`` other than "none": each layer under that ``jax.checkpoint`` policy. ``with_stats``:
    a layer returns (h, stats) (collected statistics), and stage_fn returns (h, the stats stacked [layers in the chunk,
    ...])."""
    def body(h, layer_state, segments, positions):
        out = nnx.merge(graphdef, layer_state)(h, segments, positions)
        return out if with_stats else (out, None)

    if remat != "none":
        body = jax.checkpoint(body, policy=REMAT_POLICIES[remat], prevent_cse=False)

    def stage_fn(chunk, h, side):
        # side: segment ids or None; with a context axis (segment ids or None, rotary positions) (step.py)
        segments, positions = side if isinstance(side, tuple) else (side, None)
        with nnx.logical_axis_rules(layout.local_rules):
            h, stats = jax.lax.scan(lambda h, layer: body(h, layer, segments, positions), h, chunk)
            return (h, stats) if with_stats else h

    return stage_fn
