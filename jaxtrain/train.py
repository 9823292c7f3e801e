"""Train state, the jitted train and eval steps, and the training loop.

Flow: config -> mesh -> (model, optimizer) state sharded by the logical rules -> compiled step -> loop.
The step is compiled ahead of time with explicit in/out shardings and the state donated; the loop fetches each
step's metrics only after the next step has been dispatched, so the host never waits for the device in between.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
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
from jaxtrain import runtime
from jaxtrain.config import Config, TrainConfig, dump_yaml, to_dict
from jaxtrain.mesh import MeshShape, Rules, build_mesh, resolve_shape, rules_from_config
from jaxtrain.metrics import MetricsWriter, log_info, peak_flops, summary_line, train_flops_per_token
from jaxtrain.model import Transformer, count_params


def compute_dtype(name: str) -> jnp.dtype:
    """``model.dtype``; "auto" is bfloat16 on accelerators and float32 on CPU."""
    if name == "auto":
        return jnp.dtype(jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16)
    return jnp.dtype(name)


def make_optimizer(t: TrainConfig) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """AdamW with linear warmup and cosine decay, after global-norm clipping. Norm scales are not decayed."""
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=t.lr, warmup_steps=t.warmup_steps, decay_steps=t.decay_steps,
        end_value=t.lr * t.min_lr_ratio)

    def decay_mask(params):
        return jax.tree_util.tree_map_with_path(lambda path, _: "scale" not in jax.tree_util.keystr(path), params)

    adamw = optax.adamw(schedule, b1=t.b1, b2=t.b2, weight_decay=t.weight_decay, mask=decay_mask)
    tx = optax.chain(optax.clip_by_global_norm(t.grad_clip), adamw) if t.grad_clip > 0 else adamw
    return tx, schedule


class TrainState(nnx.Module):
    """Model parameters and optimizer state (sharded like the parameters), as one graph for split/merge."""

    def __init__(self, model: Transformer, tx: optax.GradientTransformation):
        self.model = model
        self.opt = nnx.Optimizer(model, tx, wrt=nnx.Param)


def cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Mean next-token loss. logits float32 [batch, seq, vocab], targets int [batch, seq]."""
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


@dataclass
class Trainer:
    """Everything compiled for one config on one mesh. Build with :func:`build_trainer`."""

    cfg: Config
    mesh: Mesh
    rules: Rules
    graphdef: Any
    abstract_state: Any  # ShapeDtypeStructs with their target shardings: restore targets, planning
    state_sharding: Any
    batch_sharding: NamedSharding
    schedule: optax.Schedule
    dtype: jnp.dtype

    def scope(self):
        """Mesh and logical-rule context that tracing the model needs."""
        return _scope(self.mesh, self.rules)

    def init_state(self):
        """Fresh parameters (from train.seed) and optimizer state, created directly in their shards."""
        cfg, dtype = self.cfg, self.dtype
        tx, _ = make_optimizer(cfg.train)

        def create():
            return nnx.state(TrainState(Transformer(cfg.model, dtype, rngs=nnx.Rngs(cfg.train.seed)), tx))

        with self.scope():
            return jax.jit(create, out_shardings=self.state_sharding)()

    def local_rows(self) -> tuple[int, int]:
        """The rows [lo, hi) of the global batch that this process's devices hold."""
        shape = (self.cfg.train.global_batch, self.cfg.data.seq_len + 1)
        starts, stops = set(), set()
        for idx in self.batch_sharding.addressable_devices_indices_map(shape).values():
            rows = idx[0]
            starts.add(rows.start or 0)
            stops.add(shape[0] if rows.stop is None else rows.stop)
        lo, hi = min(starts), max(stops)
        return lo, hi

    def to_device(self, local: np.ndarray) -> jax.Array:
        """This process's rows -> the global batch array int32 [global_batch, seq_len + 1] (logical: batch, act_seq)."""
        shape = (self.cfg.train.global_batch, self.cfg.data.seq_len + 1)
        return jax.make_array_from_process_local_data(self.batch_sharding, local, shape)

    # -- the pure functions that get compiled --------------------------------------------------------------------

    def _loss(self, params, graphdef, tokens):
        model = nnx.merge(graphdef, params)
        inputs, segments = tokens[:, :-1], None
        if self.cfg.data.document_mask:
            # A document ends with its eos token; the next token starts a new segment.
            is_eos = (inputs == self.cfg.data.eos_id).astype(jnp.int32)
            segments = jnp.cumsum(is_eos, axis=1) - is_eos
        return cross_entropy(model(inputs, segments), tokens[:, 1:])

    def train_step(self, state, batch):
        """One optimizer step on the global batch int32 [global_batch, seq_len + 1]; returns (state, metrics)."""
        ts = nnx.merge(self.graphdef, state)
        model_def, params = nnx.split(ts.model, nnx.Param)
        grad_fn = jax.value_and_grad(self._loss)
        k = self.cfg.train.microbatches
        if k == 1:
            loss, grads = grad_fn(params, model_def, batch)
        else:
            # Microbatch i takes rows i, i+k, ...: each device's block of rows splits evenly over the microbatches,
            # so no data moves between devices.
            b = batch.shape[0]
            micro = batch.reshape(b // k, k, -1).swapaxes(0, 1)
            micro = jax.lax.with_sharding_constraint(micro, NamedSharding(self.mesh, PartitionSpec(None, *self.batch_sharding.spec)))
            zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)

            def accumulate(carry, tokens):
                loss_sum, grad_sum = carry
                loss, grads = grad_fn(params, model_def, tokens)
                return (loss_sum + loss, jax.tree.map(lambda a, g: a + g.astype(jnp.float32), grad_sum, grads)), None

            (loss, grads), _ = jax.lax.scan(accumulate, (jnp.zeros((), jnp.float32), zeros), micro)
            loss = loss / k
            grads = jax.tree.map(lambda g, p: (g / k).astype(p.dtype), grads, params)
        lr = self.schedule(ts.opt.step[...])
        grad_norm = optax.tree.norm(grads)
        ts.opt.update(ts.model, grads)
        return nnx.state(ts), {"loss": loss, "grad_norm": grad_norm, "lr": lr}

    def eval_step(self, state, batch):
        """Mean loss on one batch, no update."""
        ts = nnx.merge(self.graphdef, state)
        model_def, params = nnx.split(ts.model, nnx.Param)
        return self._loss(params, model_def, batch)

    def compile(self, state):
        """Ahead-of-time compiled (train_step, eval_step) for this state and batch layout, and the compile seconds."""
        batch = jax.ShapeDtypeStruct((self.cfg.train.global_batch, self.cfg.data.seq_len + 1), jnp.int32,
                                     sharding=self.batch_sharding)
        replicated = NamedSharding(self.mesh, PartitionSpec())
        t0 = time.perf_counter()
        with self.scope():
            train = jax.jit(self.train_step, in_shardings=(self.state_sharding, self.batch_sharding),
                            out_shardings=(self.state_sharding, replicated), donate_argnums=0)
            train = train.lower(state, batch).compile()
            evaluate = jax.jit(self.eval_step, in_shardings=(self.state_sharding, self.batch_sharding),
                               out_shardings=replicated).lower(state, batch).compile()
        return train, evaluate, time.perf_counter() - t0


@contextlib.contextmanager
def _scope(mesh: Mesh, rules: Rules):
    with jax.set_mesh(mesh), nnx.logical_axis_rules(rules):
        yield


def build_trainer(cfg: Config, devices: list | None = None) -> Trainer:
    """Mesh, shardings and the state's graph structure for ``cfg``; raises ConfigError for a bad mesh."""
    mesh = build_mesh(cfg, devices)
    rules = rules_from_config(cfg.mesh.rules)
    dtype = compute_dtype(cfg.model.dtype)
    tx, schedule = make_optimizer(cfg.train)
    with _scope(mesh, rules):
        abstract = nnx.eval_shape(lambda: TrainState(Transformer(cfg.model, dtype, rngs=nnx.Rngs(0)), tx))
        graphdef, abstract_state = nnx.split(abstract)
        state_sharding = nnx.get_named_sharding(abstract_state, mesh)
        abstract_state = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                                      abstract_state, state_sharding)
    batch_axes = dict(rules)["batch"]
    batch_sharding = NamedSharding(mesh, PartitionSpec(batch_axes, None))
    return Trainer(cfg, mesh, rules, graphdef, abstract_state, state_sharding, batch_sharding, schedule, dtype)


def effective_config(cfg: Config, shape: MeshShape, num_devices: int, dtype: jnp.dtype) -> Config:
    """The config with every "derived" value pinned: -1 mesh axis, per-process device count, compute dtype."""
    ici = dataclasses.replace(cfg.mesh.ici, **dict(zip(("data", "fsdp", "tensor"), shape.ici)))
    dcn = dataclasses.replace(cfg.mesh.dcn, **dict(zip(("data", "fsdp", "tensor"), shape.dcn)))
    return dataclasses.replace(
        cfg,
        mesh=dataclasses.replace(cfg.mesh, ici=ici, dcn=dcn),
        model=dataclasses.replace(cfg.model, dtype=str(dtype)),
        runtime=dataclasses.replace(cfg.runtime, cpu_devices=num_devices // jax.process_count()
                                    if jax.default_backend() == "cpu" else None),
    )


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
    """Train as configured. Everything that can fail on user input fails before ``run.dir`` is touched."""
    trainer = build_trainer(cfg, devices)
    tokens = data_lib.load_tokens(cfg.data, cfg.model.vocab_size)
    plan = ckpt.plan_restore(cfg, trainer.abstract_state)
    n_devices = trainer.mesh.devices.size
    shape = resolve_shape(cfg.mesh, n_devices)
    is_main = jax.process_index() == 0

    effective = effective_config(cfg, shape, n_devices, trainer.dtype)
    checkpointer = ckpt.Checkpointer(cfg, {"config": to_dict(effective), "mesh": shape.describe(),
                                           "processes": jax.process_count(), "devices": n_devices})
    if is_main:
        os.makedirs(cfg.run.dir, exist_ok=True)
        with open(os.path.join(cfg.run.dir, "config.yaml"), "w") as f:
            f.write(dump_yaml(effective))
    with runtime.process_log(cfg.run.dir):
        return _train(cfg, trainer, tokens, plan, checkpointer, shape)


def _train(cfg, trainer, tokens, plan, checkpointer, shape) -> RunResult:
    t, d = cfg.train, cfg.data
    rows = trainer.local_rows()
    n_devices = trainer.mesh.devices.size
    is_main = jax.process_index() == 0
    if jax.process_count() > 1:
        log_info(f"reads rows [{rows[0]}, {rows[1]}) of each global batch of {t.global_batch}")
    n_params = count_params(cfg.model)
    log_info(f"mesh {shape.describe()} on {n_devices} {jax.devices()[0].device_kind} device(s); model "
             f"{n_params['total'] / 1e6:.2f}M parameters, compute {trainer.dtype}, params {cfg.model.param_dtype}")

    state, start, data_state = ckpt.restore(plan, trainer.abstract_state, trainer.init_state)
    if plan.kind == "resume":
        log_info(f"resumed from {plan.directory}/{plan.step}")
    elif plan.kind == "params":
        log_info(f"initialised parameters from {plan.directory}/{plan.step}, fresh optimizer")
    train_step, eval_step, compile_s = trainer.compile(state)
    log_info(f"compiled train and eval steps in {compile_s:.2f} s")

    batches = data_lib.train_batches(tokens, d, seed=t.seed, global_batch=t.global_batch, steps=t.steps, rows=rows)
    batches = iter(batches)
    if data_state is not None:
        if data_state.get("next_index") != start:
            raise ckpt.CheckpointError(f"checkpoint step {start} holds data iterator state {data_state}, "
                                       f"expected next_index={start}")
        batches.set_state(data_state)
    eval_set = [trainer.to_device(b) for b in
                data_lib.eval_batches(tokens, d, global_batch=t.global_batch, num_batches=t.eval_batches, rows=rows)]

    tokens_per_step = t.global_batch * d.seq_len
    flops_per_step = train_flops_per_token(cfg.model, d.seq_len) * tokens_per_step
    peak = peak_flops(jax.devices()[0].device_kind)
    writer = MetricsWriter(cfg.run.dir, enabled=is_main, total_steps=t.steps, start_step=start)
    result = RunResult({}, {}, compile_s, [], start_step=start)

    def evaluate(st) -> float:
        return float(np.mean([jax.device_get(eval_step(st, b)) for b in eval_set]))

    def finish(step: int, metrics, step_time: float | None, st=None) -> None:
        m = {k: float(v) for k, v in jax.device_get(metrics).items()}
        result.losses[step] = m["loss"]
        if step_time is not None:
            result.step_times.append(step_time)
        if step % t.log_every and step != t.steps and st is None:
            return
        record = {"step": step, **m, "step_time": step_time}
        if step_time is not None:
            record["tokens_per_sec"] = tokens_per_step / step_time
            record["tokens_per_sec_per_device"] = tokens_per_step / step_time / n_devices
            record["tflops_per_device"] = flops_per_step / step_time / n_devices / 1e12
            record["mfu"] = flops_per_step / step_time / n_devices / peak if peak else None
        if st is not None:
            record["eval_loss"] = result.eval_losses[step] = evaluate(st)
        writer.write(record)

    watch = ckpt.PreemptionWatch(checkpointer)
    pending = None  # (step, metrics on device, state if it must be evaluated), fetched after the next dispatch
    last_done = None
    try:
        for step in range(start + 1, t.steps + 1):
            batch = trainer.to_device(next(batches))
            state, metrics = train_step(state, batch)
            if pending is not None:
                last_done = _finish_pending(finish, pending, last_done)
                pending = None
            checkpointer.check()
            preempted = watch.reached(step)
            wants_eval = not preempted and (step == t.steps or (t.eval_every and step % t.eval_every == 0))
            pending = (step, metrics, state if wants_eval else None)
            if wants_eval:  # evaluation needs this step's state: drain now
                last_done = _finish_pending(finish, pending, last_done)
                pending = None
            if preempted or checkpointer.should_save(step):
                result.save_block_seconds.append(checkpointer.save(step, state, batches.get_state()))
            if preempted:
                if pending is not None:
                    _finish_pending(finish, pending, last_done)
                    pending = None
                checkpointer.wait()
                result.preempted_at = step
                log_info(f"stopped by a signal after step {step}; checkpoint saved to {checkpointer.directory}/{step}")
                break
        if pending is not None:
            _finish_pending(finish, pending, last_done)
        checkpointer.close()
    finally:
        watch.close()
        writer.close()
    if is_main and result.step_times:
        last = max(result.losses)
        print(summary_line(compile_s=compile_s, step_times=result.step_times, tokens_per_step=tokens_per_step,
                           final_loss=result.losses[last]), flush=True)
    elif is_main and start >= t.steps:
        log_info(f"nothing to do: the checkpoint is already at step {start} = train.steps")
    return result


def _finish_pending(finish, pending, last_done):
    step, metrics, st = pending
    jax.block_until_ready(metrics)
    now = time.perf_counter()
    finish(step, metrics, None if last_done is None else now - last_done, st)
    return time.perf_counter() if st is not None else now
