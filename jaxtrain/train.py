"""Train state, the jitted train and eval steps, and the training loop.

Flow: config -> mesh -> (model, optimizer) state sharded by the logical rules -> compiled step -> loop.
The step is compiled ahead of time with explicit in/out shardings and the state donated; the loop fetches each
step's metrics only after the next step has been dispatched, so the host never waits for the device in between.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import resource
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxtrain import checkpoint as ckpt
from jaxtrain import data as data_lib
from jaxtrain import guards, hardware, observe, runtime
from jaxtrain.config import Config, TrainConfig, dump_yaml, resolve_auto, to_dict
from jaxtrain.mesh import MeshShape, Rules, build_mesh, rules_from_config, without_axes
from jaxtrain.metrics import MetricsWriter, log_info, summary_line
from jaxtrain.model import Transformer, count_params, train_flops_per_token


def make_optimizer(t: TrainConfig) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """AdamW with linear warmup and cosine decay, after global-norm clipping. Norm scales are not decayed.

    The schedule is indexed by the step being taken (1-based), so the first step already moves the parameters:
    step s < warmup_steps runs at lr * s / warmup_steps, step warmup_steps at lr, then the cosine.
    """
    base = optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=t.lr, warmup_steps=t.warmup_steps, decay_steps=t.decay_steps,
        end_value=t.lr * t.min_lr_ratio)

    def schedule(count):  # optax counts updates from 0
        return base(count + 1)

    def decay_mask(params):
        return jax.tree_util.tree_map_with_path(lambda path, _: "scale" not in jax.tree_util.keystr(path), params)

    adamw = optax.adamw(schedule, b1=t.b1, b2=t.b2, weight_decay=t.weight_decay, mask=decay_mask)
    tx = optax.chain(optax.clip_by_global_norm(t.grad_clip), adamw) if t.grad_clip > 0 else adamw
    # A step whose gradients (or loss: train_step folds it in) are not finite changes neither the parameters nor the
    # moments and schedule count (optax skips it inside a lax.cond). The loop stops after train.max_nonfinite_steps
    # in a row, long before optax's own limit, past which it would apply the update anyway.
    return optax.apply_if_finite(tx, max_consecutive_errors=2**30), schedule


class TrainState(nnx.Module):
    """Model parameters and optimizer state (sharded like the parameters), as one graph for split/merge."""

    def __init__(self, model: Transformer, tx: optax.GradientTransformation):
        self.model = model
        self.opt = nnx.Optimizer(model, tx, wrt=nnx.Param)


def cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Mean next-token loss. logits float32 [batch, seq, vocab], targets int [batch, seq]."""
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


@dataclass
class TrainSetup:
    """One config laid out on one mesh: the resolved config, mesh, shardings, the state's structure, and the step
    functions to compile from them. Build with :func:`setup`."""

    cfg: Config  # resolved: no "auto" left (config.resolve_auto for this platform)
    mesh: Mesh
    shape: MeshShape
    rules: Rules
    graphdef: Any
    abstract_state: Any  # ShapeDtypeStructs with their target shardings: restore targets, planning
    state_sharding: Any
    batch_sharding: NamedSharding
    schedule: optax.Schedule
    interpret_kernels: bool  # flash kernels in Pallas' interpreter (CPU)

    def scope(self):
        """Mesh and logical-rule context that tracing the model needs."""
        return _scope(self.mesh, self.rules)

    def _new_state(self, seed: int) -> TrainState:
        tx, _ = make_optimizer(self.cfg.train)
        return TrainState(Transformer(self.cfg.model, rngs=nnx.Rngs(seed), interpret_kernels=self.interpret_kernels),
                          tx)

    def init_state(self):
        """Fresh parameters (from train.seed) and optimizer state, created directly in their shards."""
        with self.scope():
            return jax.jit(lambda: nnx.state(self._new_state(self.cfg.train.seed)),
                           out_shardings=self.state_sharding)()

    def local_rows(self) -> tuple[int, int]:
        """The rows [lo, hi) of the global batch that this process's devices hold."""
        shape = (self.cfg.train.global_batch, self.cfg.data.seq_len + 1)
        starts, stops = set(), set()
        for idx in self.batch_sharding.addressable_devices_indices_map(shape).values():
            assert idx is not None  # every addressable device holds a block of the batch
            rows = idx[0]
            starts.add(rows.start or 0)
            stops.add(shape[0] if rows.stop is None else rows.stop)
        return min(starts), max(stops)

    def to_device(self, local: np.ndarray) -> jax.Array:
        """This process's rows -> the global batch array int32 [global_batch, seq_len + 1] (logical: batch, act_seq)."""
        shape = (self.cfg.train.global_batch, self.cfg.data.seq_len + 1)
        return jax.make_array_from_process_local_data(self.batch_sharding, local, shape)

    # -- the pure functions that get compiled --------------------------------------------------------------------

    @property
    def stages(self) -> int:
        """Pipeline stages: the mesh's stage axis size (1: no pipeline)."""
        return self.shape.axis_sizes["stage"]

    def _loss(self, params, graphdef, tokens):
        model = nnx.merge(graphdef, params)
        inputs, segments = tokens[:, :-1], None
        if self.cfg.data.document_mask:
            segments = document_segments(inputs, self.cfg.data.eos_id)
        return cross_entropy(model(inputs, segments), tokens[:, 1:])

    def _pipelined_loss(self, params, graphdef, batch):
        """Mean loss of the global batch through the pipeline (jaxtrain/pipeline.py), split into
        ``train.microbatches`` microbatches the way accumulation splits it (microbatch i: rows i, i+k, ...).

        The embedding is looked up on every stage (a gather: cheap, and it spares sending inputs to stage 0); the
        final norm, output projection and loss run once per microbatch, each stage taking its share."""
        model = nnx.merge(graphdef, params)
        k = self.cfg.train.microbatches
        micro = self._microbatches(batch)
        inputs, targets, segments = micro[:, :, :-1], micro[:, :, 1:], None
        if self.cfg.data.document_mask:
            segments = jax.vmap(document_segments, in_axes=(0, None))(inputs, self.cfg.data.eos_id)
        hidden = model.pipelined_layers(inputs, segments, virtual_stages=self.cfg.train.virtual_stages)
        # [stages, k / stages, ...]: stage j computes the logits and loss of its k / stages microbatches.
        stage_axis = dict(self.rules)["stage"]
        shares = hidden.reshape(self.stages, k // self.stages, *hidden.shape[1:])
        targets = targets.reshape(self.stages, k // self.stages, *targets.shape[1:])

        def share_loss(h, tgt):
            return jax.vmap(lambda h1, t1: cross_entropy(model.head(h1), t1))(h, tgt).sum()

        return jax.vmap(share_loss, spmd_axis_name=stage_axis)(shares, targets).sum() / k

    def _microbatches(self, batch):
        """batch [b, seq+1] -> [k, b/k, seq+1] (k = train.microbatches): microbatch i takes rows i, i+k, ..., so each
        device's block of rows splits evenly over the microbatches and no data moves between devices."""
        k, b = self.cfg.train.microbatches, batch.shape[0]
        micro = batch.reshape(b // k, k, -1).swapaxes(0, 1)
        return jax.lax.with_sharding_constraint(
            micro, NamedSharding(self.mesh, PartitionSpec(None, *self.batch_sharding.spec)))

    def _batch_axes(self) -> tuple[str, ...]:
        axes = dict(self.rules)["batch"]
        names = axes if isinstance(axes, tuple) else (axes,)
        return tuple(a for a in names if a is not None)

    def _accumulated_grads(self, params, model_def, batch):
        """(mean loss, mean gradients) over ``train.microbatches`` sequential microbatches of ``batch``.

        Microbatch i takes rows i, i+k, ...: each device's block of rows splits evenly over the microbatches, so no
        data moves between devices. With ``train.accumulate=unreduced`` each data-parallel group (one device's rows)
        computes its own gradient against parameters gathered once before the loop, the sum over microbatches stays
        local, and the gradients are reduced across the batch axes once, after the loop: one all-gather and one
        reduce-scatter per step, as without accumulation, at the cost of holding the gathered parameters and a
        gradient accumulator of their size on each device. ``sharded`` keeps gradients reduced and sharded like
        the parameters inside the loop (the memory of a step without accumulation, the collectives k times).
        """
        k = self.cfg.train.microbatches
        grad_fn = jax.value_and_grad(self._loss)
        b = batch.shape[0]
        micro = self._microbatches(batch)
        dp_axes = self._batch_axes()
        if self.cfg.train.accumulate == "sharded" or not dp_axes:
            zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)

            def accumulate(carry, tokens):
                loss, grads = grad_fn(params, model_def, tokens)
                return jax.tree.map(lambda a, g: a + g.astype(jnp.float32), carry, (loss, grads)), None

            (loss, grads), _ = jax.lax.scan(accumulate, (jnp.zeros((), jnp.float32), zeros), micro)
            return loss / k, jax.tree.map(lambda g, p: (g / k).astype(p.dtype), grads, params)

        dp = int(np.prod([self.mesh.shape[a] for a in dp_axes]))
        micro = micro.reshape(k, dp, b // k // dp, -1)  # group g of a microbatch: rows of the g-th device block
        micro = jax.lax.with_sharding_constraint(micro, NamedSharding(self.mesh, PartitionSpec(None, dp_axes)))
        specs = jax.tree.map(lambda a: a.sharding.spec, self.abstract_state["model"])
        gathered_specs = jax.tree.map(lambda s: without_axes(s, dp_axes), specs)
        gathered = jax.tree.map(lambda p, s: jax.lax.with_sharding_constraint(p, NamedSharding(self.mesh, s)),
                                params, gathered_specs)
        # Inside the per-group function the batch axes belong to the vmapped group dimension (spmd_axis_name), so
        # the model's activations must not name them again.
        local_rules = tuple((name, None if name == "batch" else target) for name, target in self.rules)

        def group_grad(tokens):
            with nnx.logical_axis_rules(local_rules):
                return grad_fn(gathered, model_def, tokens)

        group_grads = jax.vmap(group_grad, spmd_axis_name=dp_axes)
        acc_sharding = jax.tree.map(lambda s: NamedSharding(self.mesh, PartitionSpec(dp_axes, *s)), gathered_specs)
        zeros = jax.tree.map(lambda p, s: jax.lax.with_sharding_constraint(jnp.zeros((dp, *p.shape), jnp.float32), s),
                             params, acc_sharding)

        def accumulate(carry, tokens):
            loss, grads = group_grads(tokens)  # loss [dp], grads [dp, *param] unreduced, one row per group
            grads = jax.tree.map(lambda a, g, s: jax.lax.with_sharding_constraint(a + g.astype(jnp.float32), s),
                                 carry[1], grads, acc_sharding)
            return (carry[0] + loss, grads), None

        (loss, grads), _ = jax.lax.scan(accumulate, (jnp.zeros((dp,), jnp.float32), zeros), micro)
        grads = jax.tree.map(lambda g, p: (g.sum(0) / (k * dp)).astype(p.dtype), grads, params)
        grads = jax.tree.map(lambda g, s: jax.lax.with_sharding_constraint(g, NamedSharding(self.mesh, s)),
                             grads, specs)
        return loss.sum() / (k * dp), grads

    def train_step(self, state, batch):
        """One optimizer step on the global batch int32 [global_batch, seq_len + 1]; returns (state, metrics)."""
        ts = nnx.merge(self.graphdef, state)
        model_def, params = nnx.split(ts.model, nnx.Param)
        if self.stages > 1:
            loss, grads = jax.value_and_grad(self._pipelined_loss)(params, model_def, batch)
        elif self.cfg.train.microbatches == 1:
            loss, grads = jax.value_and_grad(self._loss)(params, model_def, batch)
        else:
            loss, grads = self._accumulated_grads(params, model_def, batch)
        # A non-finite loss poisons the gradients, so that optax.apply_if_finite skips the step for either cause.
        grads = jax.tree.map(lambda g: jnp.where(jnp.isfinite(loss), g, jnp.nan), grads)
        skipped = ts.opt.opt_state
        lr = self.schedule(ts.opt.step[...] - skipped.total_notfinite[...])  # skipped steps do not advance it
        grad_norm = optax.tree.norm(grads)
        ts.opt.update(ts.model, grads)
        # nonfinite_steps: consecutive steps skipped so far, this one included (0: this step was applied).
        return nnx.state(ts), {"loss": loss, "grad_norm": grad_norm, "lr": lr,
                               "nonfinite_steps": ts.opt.opt_state.notfinite_count[...]}

    def eval_step(self, state, batch):
        """Mean loss on one batch, no update."""
        ts = nnx.merge(self.graphdef, state)
        model_def, params = nnx.split(ts.model, nnx.Param)
        loss = self._pipelined_loss if self.stages > 1 else self._loss
        return loss(params, model_def, batch)

    def compile(self, state, *, with_eval: bool = True):
        """Ahead-of-time compiled (train_step, eval_step or None) for this state (arrays, or ShapeDtypeStructs with
        shardings: nothing is allocated) and batch layout, and the compile seconds."""
        batch = jax.ShapeDtypeStruct((self.cfg.train.global_batch, self.cfg.data.seq_len + 1), jnp.int32,
                                     sharding=self.batch_sharding)
        replicated = NamedSharding(self.mesh, PartitionSpec())
        t0 = time.perf_counter()
        evaluate = None
        with self.scope():
            train = jax.jit(self.train_step, in_shardings=(self.state_sharding, self.batch_sharding),
                            out_shardings=(self.state_sharding, replicated), donate_argnums=0
                            ).lower(state, batch).compile()
            if with_eval:
                evaluate = jax.jit(self.eval_step, in_shardings=(self.state_sharding, self.batch_sharding),
                                   out_shardings=replicated).lower(state, batch).compile()
        return train, evaluate, time.perf_counter() - t0


def document_segments(inputs: jax.Array, eos_id: int) -> jax.Array:
    """Segment ids int32 [batch, seq] of packed documents: a document ends with its eos token (which stays in it),
    the next token starts the next segment."""
    is_eos = (inputs == eos_id).astype(jnp.int32)
    return jnp.cumsum(is_eos, axis=1) - is_eos


@contextlib.contextmanager
def _scope(mesh: Mesh, rules: Rules):
    with jax.set_mesh(mesh), nnx.logical_axis_rules(rules):
        yield


def setup(cfg: Config, devices: list | None = None) -> TrainSetup:
    """Resolve ``cfg`` for the devices' platform, build the mesh, shardings and the state's graph structure;
    raises ConfigError for a bad mesh."""
    devices = list(jax.devices()) if devices is None else list(devices)
    cfg = resolve_auto(cfg, devices[0].platform)
    mesh, shape = build_mesh(cfg, devices)
    rules = rules_from_config(cfg.mesh.rules)
    tx, schedule = make_optimizer(cfg.train)
    interpret = devices[0].platform == "cpu"
    with _scope(mesh, rules):
        abstract = nnx.eval_shape(lambda: TrainState(Transformer(cfg.model, rngs=nnx.Rngs(0),
                                                                 interpret_kernels=interpret), tx))
        graphdef, abstract_state = nnx.split(abstract)
        state_sharding = nnx.get_named_sharding(abstract_state, mesh)
        abstract_state = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                                      abstract_state, state_sharding)
    batch_sharding = NamedSharding(mesh, PartitionSpec(dict(rules)["batch"], None))
    return TrainSetup(cfg, mesh, shape, rules, graphdef, abstract_state, state_sharding, batch_sharding, schedule,
                      interpret)


def effective_config(ts: TrainSetup) -> Config:
    """The config as this run executes it: "auto" resolved, the mesh pinned (no -1), devices per process on CPU."""
    cfg = ts.shape.apply(ts.cfg)
    cpu = ts.mesh.devices.flat[0].platform == "cpu"
    return dataclasses.replace(cfg, runtime=dataclasses.replace(
        cfg.runtime, cpu_devices=ts.shape.num_devices // jax.process_count() if cpu else None))


class NonFiniteError(RuntimeError):
    """train.max_nonfinite_steps steps in a row had a non-finite loss or gradients: the run cannot make progress."""


@dataclass
class RunResult:
    losses: dict[int, float]  # step (1-based) -> training loss, for the steps this run executed
    eval_losses: dict[int, float]
    compile_seconds: float
    step_times: list[float]
    start_step: int = 0  # the step restored from a checkpoint (0: fresh)
    save_block_seconds: list[float] = dataclasses.field(default_factory=list)
    preempted_at: int | None = None


def train(cfg: Config, devices: list | None = None) -> RunResult:
    """Train as configured. Everything that can fail on user input fails before ``run.dir`` is touched, and a run
    with nothing left to train writes nothing."""
    # First of all, so that a second job on this run.dir stops at once (guards.RunLock: process 0, flock).
    with guards.RunLock(cfg.run.dir):
        return _start(cfg, devices)


def _start(cfg: Config, devices: list | None) -> RunResult:
    ts = setup(cfg, devices)
    cfg = ts.cfg
    guards.check_state_fits(ts)  # before reading data or compiling: a model that cannot fit at all stops at once
    tokens = data_lib.load_tokens(cfg.data, cfg.model.vocab_size)
    source = ckpt.choose_restore(cfg, ts.abstract_state)
    if source.kind == "resume" and source.step >= cfg.train.steps:
        log_info(f"nothing to do: the checkpoint in {source.directory} is already at step {source.step} = "
                 f"train.steps; results are in {os.path.abspath(cfg.run.dir)}")
        return RunResult({}, {}, 0.0, [], start_step=source.step)
    # Compiled from the abstract state, before any array exists: a step that cannot fit stops here (exit 2).
    compiled = ts.compile(ts.abstract_state)
    guards.check_memory_fit(ts, compiled[0])
    # Restored (or initialised) before anything in run.dir is written: a damaged checkpoint found now leaves
    # config.yaml and metrics.jsonl as they were.
    restored = ckpt.restore(source, ts.abstract_state, ts.init_state)
    if source.kind == "resume" and source.directory == ckpt.checkpoint_dir(cfg):
        for moved in ckpt.set_aside_damaged(source.directory, restored[1]):
            log_info(f"moved the damaged checkpoint aside to {moved} (not deleted)")
    effective = effective_config(ts)
    checkpointer = ckpt.Checkpointer(cfg, {"config": to_dict(effective), "mesh": ts.shape.label,
                                           "processes": jax.process_count(), "devices": ts.shape.num_devices})
    if jax.process_index() == 0:
        os.makedirs(cfg.run.dir, exist_ok=True)
        with open(os.path.join(cfg.run.dir, "config.yaml"), "w") as f:
            f.write(dump_yaml(effective))
    with runtime.process_log(cfg.run.dir):
        return _train(ts, tokens, source, checkpointer, restored, compiled)


class PendingMetrics:
    """Steps whose metrics are still on the device, reported in order without making the host wait needlessly.

    ``add`` records a step just dispatched and reports every older one (their values are ready or nearly so,
    while the new step keeps the device busy); a step that must be evaluated, and ``drain``, report everything.
    Each reported step gets its wall time: from the previous step's completion, or from its own dispatch when the
    device was idle before it (the first step, the step after an evaluation).
    """

    def __init__(self, report: Callable[[int, dict, float, Any], None]):
        self._report = report
        self._queue: list[tuple[int, Any, Any, float]] = []  # (step, metrics on device, state to evaluate, t dispatch)
        self._last_done: float | None = None

    def add(self, step: int, metrics, eval_state=None) -> None:
        self._queue.append((step, metrics, eval_state, time.perf_counter()))
        self._flush(keep_newest=eval_state is None)

    def drain(self) -> None:
        self._flush(keep_newest=False)

    def _flush(self, keep_newest: bool) -> None:
        while len(self._queue) > (1 if keep_newest else 0):
            step, metrics, eval_state, dispatched = self._queue.pop(0)
            values = {k: float(v) for k, v in jax.device_get(metrics).items()}  # waits for the step
            now = time.perf_counter()
            start = dispatched if self._last_done is None else max(self._last_done, dispatched)
            self._report(step, values, now - start, eval_state)
            # Evaluation time is not the next step's time.
            self._last_done = time.perf_counter() if eval_state is not None else now


def _train(ts: TrainSetup, tokens, source, checkpointer, restored, compiled) -> RunResult:
    cfg = ts.cfg
    t, d = cfg.train, cfg.data
    rows = ts.local_rows()
    n_devices = ts.shape.num_devices
    is_main = jax.process_index() == 0
    if jax.process_count() > 1:
        log_info(f"reads rows [{rows[0]}, {rows[1]}) of each global batch of {t.global_batch}")
    run_dir = os.path.abspath(cfg.run.dir)
    log_info(f"run directory {run_dir} (config.yaml, metrics.jsonl, tb/, checkpoints/, logs/)")
    log_info(f"mesh {ts.shape.label} on {n_devices} {jax.devices()[0].device_kind} device(s); model "
             f"{count_params(cfg.model)['total'] / 1e6:.2f}M parameters, compute {cfg.model.dtype}, params "
             f"{cfg.model.param_dtype}, attention {cfg.model.attention}")

    tokens_per_step = t.global_batch * d.seq_len
    flops_per_step = train_flops_per_token(cfg.model, d.seq_len) * tokens_per_step
    peak = hardware.peak_flops(jax.devices()[0].device_kind)
    obs = observe.Observer(ts, run_dir, tokens_per_step=tokens_per_step, flops_per_step=flops_per_step, peak=peak)
    state, start, data_state = restored
    if source.kind == "resume":
        log_info(f"resumed from {source.directory}/{start}")
    elif source.kind == "params":
        log_info(f"initialised parameters from {source.directory}/{source.step}, fresh optimizer")
    train_step, eval_step, compile_s = compiled
    obs.goodput.charge("compilation", compile_s)  # compiled in train(), before the state existed
    log_info(f"compiled train and eval steps in {compile_s:.2f} s")

    batches = iter(data_lib.train_batches(tokens, d, seed=t.seed, global_batch=t.global_batch, steps=t.steps,
                                          rows=rows))
    if data_state is not None:
        if data_state.get("next_index") != start:
            raise ckpt.CheckpointError(f"checkpoint step {start} holds data iterator state {data_state}, "
                                       f"expected next_index={start}")
        batches.set_state(data_state)
    eval_set = [ts.to_device(b) for b in
                data_lib.eval_batches(tokens, d, global_batch=t.global_batch, num_batches=t.eval_batches, rows=rows)]

    writer = MetricsWriter(cfg.run.dir, enabled=is_main, total_steps=t.steps, start_step=start)
    result = RunResult({}, {}, compile_s, [], start_step=start)
    t_start = time.perf_counter()

    def evaluate(st) -> float:
        return float(np.mean([jax.device_get(eval_step(st, b)) for b in eval_set]))

    def report(step: int, m: dict, step_time: float, eval_state) -> None:
        result.losses[step] = m["loss"]
        result.step_times.append(step_time)
        bad = int(m.get("nonfinite_steps", 0))  # consecutive skipped steps, this one included
        if bad:
            nonfinite["first"] = step - bad + 1  # consecutive: also right after a resume in the middle of a run
            log_info(f"warning: step {step}: loss or gradients not finite (loss {m['loss']}); update skipped, "
                     f"{bad} such step(s) in a row")
        logged = bool(bad) or not (step % t.log_every and step not in (start + 1, t.steps) and eval_state is None)
        obs.report(step, m, step_time, logged)
        if not logged:
            return
        record = {"step": step, **m, "step_time": step_time, "tokens_per_sec": tokens_per_step / step_time,
                  "tokens_per_sec_per_device": tokens_per_step / step_time / n_devices,
                  "tflops_per_device": flops_per_step / step_time / n_devices / 1e12,
                  "mfu": flops_per_step / step_time / n_devices / peak if peak else None, **obs.step_split(step)}
        if eval_state is not None:
            with obs.goodput.phase("evaluation"):
                record["eval_loss"] = result.eval_losses[step] = evaluate(eval_state)
            obs.evaluated(record["eval_loss"])
        recent = statistics.median(result.step_times[-20:])
        writer.write(record, elapsed=time.perf_counter() - t_start, eta=recent * (t.steps - step))
        if bad >= t.max_nonfinite_steps:
            raise NonFiniteError(
                f"training stopped: {bad} steps in a row (train.max_nonfinite_steps={t.max_nonfinite_steps}) had a "
                f"non-finite loss or gradients, the first at step {nonfinite['first']}; their updates were skipped, "
                f"so the state is that of step {nonfinite['first'] - 1} (checkpoints in {checkpointer.directory}). "
                "Look at the data of those steps, lower train.lr, or use float32 (model.dtype)")

    nonfinite = {"first": 0}  # the first step of the current run of non-finite steps

    watch = ckpt.PreemptionWatch(checkpointer)
    pending = PendingMetrics(report)
    try:
        for step in range(start + 1, t.steps + 1):
            t_begin = obs.step_begin(step)
            local = next(batches)
            t_batch = time.perf_counter()
            state, metrics = train_step(state, ts.to_device(local))
            obs.step_dispatched(step, t_begin, t_batch)
            checkpointer.raise_if_failed()
            preempted = watch.reached(step)
            wants_eval = not preempted and (step == t.steps or (t.eval_every and step % t.eval_every == 0))
            pending.add(step, metrics, state if wants_eval else None)
            if preempted or checkpointer.should_save(step):
                result.save_block_seconds.append(checkpointer.save(step, state, batches.get_state()))
                obs.saved(checkpointer, result.save_block_seconds[-1])
            obs.step_end(step, metrics)
            if preempted:
                pending.drain()
                with obs.goodput.phase("checkpoint"):
                    checkpointer.wait()
                result.preempted_at = step
                log_info(f"stopped by a signal after step {step}; checkpoint saved to {checkpointer.directory}/{step}")
                break
        pending.drain()
        with obs.goodput.phase("checkpoint"):
            checkpointer.close()
    except NonFiniteError:
        checkpointer.close()  # the saves in flight hold finite states (skipped steps change nothing): keep them
        raise
    except Exception as e:
        obs.out_of_memory(e, train_step)  # the device memory profile, if that is what it is
        raise
    finally:
        obs.close()
        watch.close()
        writer.close()
    if is_main and result.step_times:
        summary = {**run_summary(ts, result, train_step, tokens_per_step, flops_per_step, peak),
                   **observe.summary_fields(obs)}
        with open(os.path.join(cfg.run.dir, "summary.json"), "w") as f:
            json.dump(summary, f, indent=1)
        print(summary_line(compile_s=compile_s, step_times=result.step_times, tokens_per_step=tokens_per_step,
                           final_loss=result.losses[max(result.losses)], run_dir=run_dir), flush=True)
        print(obs.goodput.line(), flush=True)
    return result


def run_summary(ts: TrainSetup, result: RunResult, compiled_step, tokens_per_step: int, flops_per_step: float,
                peak: float | None) -> dict:
    """``run.dir/summary.json``: what this invocation measured (``sweep`` and benchmarks read it)."""
    times = sorted(result.step_times)
    median = statistics.median(times)

    def pct(q: float) -> float:
        return times[min(len(times) - 1, int(q * len(times)))]

    mem = compiled_step.memory_analysis()
    device_stats = [d.memory_stats() or {} for d in jax.local_devices()]
    peaks = [s["peak_bytes_in_use"] for s in device_stats if "peak_bytes_in_use" in s]
    last = max(result.losses)
    return {
        "mesh": ts.shape.as_dict(), "devices": ts.shape.num_devices, "processes": jax.process_count(),
        "start_step": result.start_step, "last_step": last, "steps_timed": len(times),
        "compile_seconds": result.compile_seconds,
        "step_seconds": {"median": median, "p10": pct(0.1), "p90": pct(0.9), "max": times[-1]},
        "tokens_per_sec": tokens_per_step / median,
        "mfu": flops_per_step / median / ts.shape.num_devices / peak if peak else None,
        "final_loss": result.losses[last],
        "final_eval_loss": result.eval_losses[max(result.eval_losses)] if result.eval_losses else None,
        # The compiled step's own figures (per device): arguments (state, batch) and temporaries.
        "compiled_memory_bytes_per_device": {"arguments": mem.argument_size_in_bytes,
                                             "temporaries": mem.temp_size_in_bytes,
                                             "outputs": mem.output_size_in_bytes} if mem else None,
        "device_peak_bytes": max(peaks) if peaks else None,  # allocator's peak where the backend reports it (GPU)
        "host_peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "preempted_at": result.preempted_at,
    }
