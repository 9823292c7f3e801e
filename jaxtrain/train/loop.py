"""The training loop: ``python -m jaxtrain train`` calls :func:`train`.

Flow: config -> layout (mesh, rules, abstract state) -> compiled step (``step.py``) -> this loop, which feeds
batches, reports metrics, evaluates, saves checkpoints and stops (the last step, a signal, non-finite steps). The
step is compiled ahead of time with the state donated; each step's metrics are fetched only after the next step
has been dispatched, so the host never waits for the device in between.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import resource
import statistics
import threading
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from jaxtrain import data as data_lib
from jaxtrain import log, rundir
from jaxtrain.checkpoint import format as ckpt
from jaxtrain.checkpoint import local as checkpoint_local
from jaxtrain.checkpoint.orbax_io import PreemptionWatch
from jaxtrain.cluster import process as runtime
from jaxtrain.config import Config, ModelConfig, dump_yaml, hardware, to_dict
from jaxtrain.errors import CheckpointError, NonFiniteError
from jaxtrain.models.flops import count_params, train_flops_per_token
from jaxtrain.models.fp8_experts import precision_note
from jaxtrain.observe import observer as observe
from jaxtrain.observe.metrics import MetricsWriter, Throughput, summary_line
from jaxtrain.observe.moe import RoutingWatch
from jaxtrain.parallel.layout import Layout
from jaxtrain.train import guards
from jaxtrain.train.step import Step, compiled_with_microbatches


@dataclasses.dataclass
class RunResult:
    losses: dict[int, float]  # step (1-based) -> training loss, for the steps this run executed
    eval_losses: dict[int, float]
    compile_seconds: float
    step_times: list[float]
    start_step: int = 0  # the step restored from a checkpoint (0: fresh)
    save_block_seconds: list[float] = dataclasses.field(default_factory=list)
    preempted_at: int | None = None


def train(cfg: Config, devices: list | None = None, compiled: tuple | None = None) -> RunResult:
    """Train as configured. Everything that can fail on user input fails before ``run.dir`` is touched, and a run
    with nothing left to train writes nothing. ``compiled``: a (Step, compiled train step) already built for this
    config (mesh.auto's choice, compiled by its search), taken instead of compiling where its layout is this run's."""
    # First of all, so that a second job on this run.dir stops at once (process 0, flock).
    with rundir.RunLock(cfg.run.dir):
        return _start(cfg, devices, compiled)


def _start(cfg: Config, devices: list | None, prebuilt: tuple | None = None) -> RunResult:
    layout = Layout.build(cfg, devices)
    cfg, step = layout.cfg, Step(layout)
    if prebuilt is not None and (prebuilt[0].layout.cfg != cfg or prebuilt[0].layout.mesh != layout.mesh):
        prebuilt = None  # built for another layout: compiled here as usual
    run_dir = os.path.abspath(cfg.run.dir)
    guards.check_state_fits(layout)  # before reading data or compiling: a model that cannot fit at all stops at once
    tokens = data_lib.load_tokens(cfg.data, cfg.model.vocab_size)
    source = ckpt.choose_restore(cfg, layout.abstract_state)
    # The inputs are checked (a mistake so far is the run's one line); say where the run goes before the wait.
    log.info(f"run directory {run_dir}")
    if source.kind == "resume" and source.step >= cfg.train.steps:
        log.info(f"nothing to do: the checkpoint in {source.directory} is already at step {source.step} = "
                 f"train.steps; results are in {run_dir} (a larger train.steps continues this run; another run.dir "
                 f"trains anew){_changed_settings_note(layout, source)}")
        return RunResult({}, {}, 0.0, [], start_step=source.step)
    # Compiled from the abstract state, before any array exists: a step that cannot fit stops here (exit 2).
    m = cfg.model
    # The eval step is compiled at the first evaluation (off the path to the first step).
    what = "the train step (compiled by mesh.auto's search: reused)" if prebuilt else "compiling the train step"
    log.info(f"{what}: mesh {layout.shape.label} on {layout.num_devices} "
             f"{jax.devices()[0].device_kind} device(s); model {count_params(m)['total'] / 1e6:.2f}M parameters, "
             f"{precision(m)}, attention {m.attention}; global batch "
             f"{cfg.train.global_batch} x {cfg.data.seq_len} tokens{'' if prebuilt else ' ...'}")
    note = precision_note(m)  # FP8 that leaves the routed experts in 16 bits is said, never silent
    if note:
        log.info(note)
    # XLA compiles on one core without holding the GIL: the loop's own imports meanwhile take another.
    imports = threading.Thread(target=_import_loop_modules, name="jaxtrain-imports", daemon=True)
    imports.start()
    if prebuilt is not None:  # its compile was the search's (goodput's startup)
        step, compiled = prebuilt[0], (prebuilt[1], None, 0.0)
    else:
        compiled = step.compile(with_eval=False)
    imports.join()
    if prebuilt is None:
        log.info(f"compiled in {compiled[2]:.2f} s")
    guards.check_memory_fit(layout, compiled[0], functools.partial(compiled_with_microbatches, layout))
    # Restored (or initialised) before anything in run.dir is written: a damaged checkpoint found now leaves
    # config.yaml and metrics.jsonl as they were.
    restored = ckpt.restore(source, layout.abstract_state, layout.init_state)
    if source.kind == "resume" and (source.directory == ckpt.checkpoint_dir(cfg) or source.fallback):
        # After a local step too: a newer persistent step was passed over because it is damaged.
        for moved in ckpt.set_aside_damaged(ckpt.checkpoint_dir(cfg), restored[1]):
            log.info(f"moved the damaged checkpoint aside to {moved} (not deleted)")
    effective = layout.effective_config()
    checkpointer = ckpt.Checkpointer(cfg, ckpt.describe(to_dict(effective), layout.shape.label, layout.num_devices))
    if jax.process_index() == 0:
        os.makedirs(cfg.run.dir, exist_ok=True)
        with open(rundir.path(cfg.run.dir, rundir.CONFIG), "w") as f:
            f.write(dump_yaml(effective))
    with runtime.process_log(cfg.run.dir):
        return _Loop(step, source, checkpointer, compiled).run(tokens, restored)


def precision(m: ModelConfig) -> str:
    """The start-up line's number formats: compute and parameter dtypes, and the FP8 recipe when one is on
    (``compute bfloat16, FP8 projections (tensorwise), params float32``; docs/fp8.md)."""
    if m.fp8 == "none":
        return f"compute {m.dtype}, params {m.param_dtype}"
    history = f", amax history {m.fp8_amax_history}" if m.fp8 == "delayed" else ""
    return f"compute {m.dtype}, FP8 projections ({m.fp8}{history}), params {m.param_dtype}"


def _import_loop_modules() -> None:
    """Grain and Orbax (0.4-1 s of imports; Grain imports Orbax), which the loop needs only after the compile."""
    try:
        import grain  # noqa: F401
        import orbax.checkpoint  # noqa: F401
    except Exception:  # an import that fails fails again where the module is used, with its own message
        pass


def _changed_settings_note(layout: Layout, source: ckpt.RestoreSource) -> str:
    """For a finished run asked again with another model or mesh (which would otherwise do nothing silently): what
    differs, and what to do to train the new settings."""
    changed = ckpt.changed_settings(ckpt.saved_config(source.directory, source.step),
                                    to_dict(layout.effective_config()), ("model", "mesh"))
    if not changed:
        return ""
    listing = ", ".join(f"{key}={json.dumps(here)} here, {json.dumps(there)} there" for key, there, here in changed)
    return (f". It finished with other settings ({listing}); nothing was trained with the new ones: to train them, "
            "use another run.dir (this one's checkpoints and results are kept)")


class PendingMetrics:
    """Steps whose metrics are still on the device, reported in order without making the host wait needlessly.

    ``add`` records a step just dispatched and reports every older one (their values are ready or nearly so,
    while the new step keeps the device busy); a step that must be evaluated, and ``drain``, report everything.
    Each reported step gets its wall time: from the previous step's completion, or from when the host began it (its
    batch, its dispatch: on CPUs the dispatch itself may run the step) when the device was idle before it (the first
    step, the step after an evaluation).
    """

    def __init__(self, report: Callable[[int, dict, float, Any], None], waited: Callable[[float, float], None]):
        self._report, self._waited = report, waited  # waited(start, end): when the host waited for a step
        self._queue: list[tuple[int, Any, Any, float]] = []  # (step, metrics on device, state to evaluate, t dispatch)
        self._last_done: float | None = None

    def add(self, step: int, metrics, eval_state=None, started: float | None = None) -> None:
        """``started``: the perf_counter time the host began the step (default: now, after its dispatch)."""
        self._queue.append((step, metrics, eval_state, time.perf_counter() if started is None else started))
        self._flush(keep_newest=eval_state is None)

    def drain(self) -> None:
        self._flush(keep_newest=False)

    def _flush(self, keep_newest: bool) -> None:
        while len(self._queue) > (1 if keep_newest else 0):
            step, metrics, eval_state, dispatched = self._queue.pop(0)
            t0 = time.perf_counter()
            values = {k: float(v) for k, v in jax.device_get(metrics).items()}  # waits for the step
            now = time.perf_counter()
            self._waited(t0, now)
            start = dispatched if self._last_done is None else max(self._last_done, dispatched)
            self._report(step, values, now - start, eval_state)
            # Evaluation time is not the next step's time.
            self._last_done = time.perf_counter() if eval_state is not None else now


class _Loop:
    """One invocation's loop: the step's compiled functions, the metrics sinks, the stops. :meth:`run` drives it;
    :meth:`report` is called for each step once its metrics have arrived (one step late)."""

    def __init__(self, step: Step, source, checkpointer, compiled):
        self.layout, self.cfg = step.layout, step.cfg
        self.source, self.checkpointer = source, checkpointer
        self.step = step
        self.train_step, self.eval_step, self.compile_s = compiled  # eval_step None: compiled at the first eval
        t, d = self.cfg.train, self.cfg.data
        self.run_dir = os.path.abspath(self.cfg.run.dir)
        tokens_per_step = t.global_batch * d.seq_len
        self.speed = Throughput(tokens_per_step, train_flops_per_token(self.cfg.model, d.seq_len) * tokens_per_step,
                                self.layout.num_devices, hardware.peak_flops(jax.devices()[0].device_kind))
        self.nonfinite_first = 0  # the first step of the current run of non-finite steps
        self.eval_set: list[jax.Array] = []
        self.routing = RoutingWatch(self.cfg)  # MoE models: their gauges and the collapse warning (docs/moe.md)

    def run(self, tokens, restored) -> RunResult:
        """Train from ``restored`` (state, its step, the data iterator's state) to ``train.steps``, or to a stop."""
        state, batches = self._prepare(tokens, restored)
        obs, checkpointer, result = self.obs, self.checkpointer, self.result
        local_saver = checkpoint_local.saver(self.cfg, checkpointer.directory)  # None when off: no per-step work
        watch = PreemptionWatch(checkpointer)
        pending = PendingMetrics(self.report, obs.waited)
        failed = True  # until the loop ends; then the endpoint's linger (normal ends only) follows the summary
        try:
            self._steps(state, batches, watch, pending, local_saver)
            pending.drain()
            with obs.goodput.phase("checkpoint"):
                checkpointer.close()
                if local_saver:
                    local_saver.wait()
            failed = False
        except NonFiniteError:
            checkpointer.close()  # the saves in flight hold finite states (skipped steps change nothing): keep them
            raise
        except Exception as e:
            obs.out_of_memory(e, self.train_step)  # the device memory profile, if that is what it is
            raise
        finally:
            obs.close(stop_serving=failed)
            watch.close()
            self.writer.close()
        self._finish()
        return result

    def _prepare(self, tokens, restored) -> tuple[Any, Any]:
        """Before the first step: the observer, the batches (resumed where the checkpoint's iterator was), the
        evaluation set, the metrics writer and the result. Returns (state, the batch iterator)."""
        cfg, layout = self.cfg, self.layout
        t, d = cfg.train, cfg.data
        rows = layout.local_rows()
        if jax.process_count() > 1:
            log.info(f"reads rows [{rows[0]}, {rows[1]}) of each global batch of {t.global_batch}")
        self.obs = obs = observe.Observer(layout, self.run_dir, self.speed)
        state, start, data_state = restored
        if self.source.kind == "resume":
            log.info(f"resumed from {self.source.directory}/{start}")
        elif self.source.kind == "params":
            log.info(f"initialised parameters from {self.source.directory}/{self.source.step}, fresh optimizer")
        obs.goodput.charge("compilation", self.compile_s)  # compiled in _start, before the state existed

        batches = iter(data_lib.train_batches(tokens, d, seed=t.seed, global_batch=t.global_batch, steps=t.steps,
                                              rows=rows))
        if data_state is not None:
            if data_state.get("next_index") != start:
                raise CheckpointError(f"checkpoint step {start} holds data iterator state {data_state}, "
                                      f"expected next_index={start}")
            batches.set_state(data_state)
        self.eval_set = [layout.to_device(b) for b in data_lib.eval_batches(
            tokens, d, global_batch=t.global_batch, num_batches=t.eval_batches, rows=rows)]
        self.writer = MetricsWriter(cfg.run.dir, enabled=jax.process_index() == 0, total_steps=t.steps,
                                    start_step=start)
        self.result = RunResult({}, {}, self.compile_s, [], start_step=start)
        self.start, self.t_start = start, time.perf_counter()
        return state, batches

    def _steps(self, state, batches, watch: PreemptionWatch, pending: PendingMetrics, local_saver) -> None:
        """The steps after the restored one, to ``train.steps`` or a stop asked by a signal: each step dispatched,
        its metrics queued (reported one step late), saves started where due."""
        cfg, layout, obs, checkpointer, result = self.cfg, self.layout, self.obs, self.checkpointer, self.result
        t = cfg.train
        for step in range(self.start + 1, t.steps + 1):
            t_begin = obs.step_begin(step)
            local = next(batches)
            t_batch = time.perf_counter()
            batch = layout.to_device(local)
            t_sent = time.perf_counter()
            state, metrics = self.train_step(state, batch)
            obs.step_dispatched(step, t_begin, t_batch, t_sent)
            checkpointer.raise_if_failed()
            preempted = watch.reached(step)
            wants_eval = not preempted and (step == t.steps or (t.eval_every and step % t.eval_every == 0))
            pending.add(step, metrics, state if wants_eval else None, started=t_begin)
            if preempted or checkpointer.should_save(step):
                result.save_block_seconds.append(checkpointer.save(step, state, batches.get_state()))
                obs.saved(checkpointer, result.save_block_seconds[-1])
            if local_saver and step % cfg.checkpoint.local_every == 0:  # also at persistent steps (may not finish)
                obs.goodput.charge("checkpoint", local_saver.save(step, state, batches.get_state()))
            obs.step_end(step, metrics)
            if preempted:
                pending.drain()
                with obs.goodput.phase("checkpoint"):
                    checkpointer.wait()
                result.preempted_at = step
                log.info(f"stopped by a signal after step {step}; checkpoint saved to "
                         f"{checkpointer.directory}/{step}")
                return

    def _finish(self) -> None:
        """After a run that ended normally or by a signal: the summary (process 0), then the endpoint's last
        serving."""
        result, obs = self.result, self.obs
        if jax.process_index() == 0 and result.step_times:
            self.summary().write(self.cfg.run.dir)
            print(summary_line(compile_s=self.compile_s, step_times=result.step_times,
                               tokens_per_step=self.speed.tokens_per_step, final_loss=result.losses[max(result.losses)],
                               run_dir=self.run_dir), flush=True)
            print(obs.goodput.line(), flush=True)
        obs.stop_serving(linger=result.preempted_at is None)  # a stop asked by a signal must be quick

    def report(self, step: int, m: dict, step_seconds: float, eval_state) -> None:
        """A step's metrics (plain numbers) have arrived: record them, log them at the logging pace, evaluate where
        asked, and stop a run that cannot make progress."""
        t, result = self.cfg.train, self.result
        result.losses[step] = m["loss"]
        result.step_times.append(step_seconds)
        bad = int(m.get("nonfinite_steps", 0))  # consecutive skipped steps, this one included
        if bad:
            self.nonfinite_first = step - bad + 1  # consecutive: also right after a resume in the middle of a run
            log.info(f"warning: step {step}: loss or gradients not finite (loss {m['loss']}); update skipped, "
                     f"{bad} such step(s) in a row")
        logged = bool(bad) or not (step % t.log_every and step not in (self.start + 1, t.steps)
                                   and eval_state is None)
        self.obs.report(step, m, step_seconds, logged)
        self.routing.report(step, m, self.obs.metrics)
        if not logged:
            return
        record = {"step": step, **m, **self.speed.step_fields(step_seconds), **self.obs.step_split(step)}
        if eval_state is not None:
            with self.obs.goodput.phase("evaluation"):
                record["eval_loss"] = result.eval_losses[step] = self.evaluate(eval_state)
            self.obs.evaluated(record["eval_loss"])
        recent = statistics.median(result.step_times[-20:])
        self.writer.write(record, elapsed=time.perf_counter() - self.t_start, eta=recent * (t.steps - step))
        if bad >= t.max_nonfinite_steps:
            first = self.nonfinite_first
            raise NonFiniteError(
                f"training stopped: {bad} steps in a row (train.max_nonfinite_steps={t.max_nonfinite_steps}) had a "
                f"non-finite loss or gradients, the first at step {first}; their updates were skipped, so the state "
                f"is that of step {first - 1} (checkpoints in {self.checkpointer.directory}). Look at the data of "
                "those steps, lower train.lr, or use float32 (model.dtype)")

    def evaluate(self, state) -> float:
        if self.eval_step is None:  # the first evaluation: compile its step (goodput's compilation, not evaluation)
            with self.obs.goodput.phase("compilation"):
                self.eval_step, seconds = self.step.compile_eval()
            self.compile_s += seconds
            self.result.compile_seconds = self.compile_s
        return float(np.mean([jax.device_get(self.eval_step(state, b)) for b in self.eval_set]))

    def summary(self) -> rundir.Summary:
        """What this invocation measured (``run.dir/summary.json``)."""
        result, goodput = self.result, self.obs.goodput
        times = sorted(result.step_times)
        median = statistics.median(times)

        def pct(q: float) -> float:
            return times[min(len(times) - 1, int(q * len(times)))]

        mem = self.train_step.memory_analysis()
        device_stats = [d.memory_stats() or {} for d in jax.local_devices()]
        peaks = [s["peak_bytes_in_use"] for s in device_stats if "peak_bytes_in_use" in s]
        last = max(result.losses)
        return rundir.Summary(
            mesh=self.layout.shape.as_dict(), devices=self.layout.num_devices, processes=jax.process_count(),
            start_step=result.start_step, last_step=last, steps_timed=len(times),
            compile_seconds=result.compile_seconds,
            step_seconds={"median": median, "p10": pct(0.1), "p90": pct(0.9), "max": times[-1]},
            tokens_per_second=self.speed.tokens_per_second(median), mfu=self.speed.mfu(median),
            final_loss=result.losses[last],
            final_eval_loss=result.eval_losses[max(result.eval_losses)] if result.eval_losses else None,
            compiled_memory_bytes_per_device={"arguments": mem.argument_size_in_bytes,
                                              "temporaries": mem.temp_size_in_bytes,
                                              "outputs": mem.output_size_in_bytes} if mem else None,
            device_peak_bytes=max(peaks) if peaks else None,
            host_peak_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            preempted_at=result.preempted_at, goodput=goodput.summary(),
            goodput_wall_seconds=sum(goodput.totals().values()), recomputed_steps=goodput.recomputed_steps,
            lost_work=goodput.lost_work())
