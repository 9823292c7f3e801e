"""``mesh.auto``: the planner chooses the layout: mesh sizes over every axis of ``config.MESH_AXES``,
``model.remat``, ``train.microbatches`` and, where a stage axis > 1, ``train.pipeline_schedule``.

The choice is the fastest estimated candidate (``cost.estimate`` on the compiled step, no overlap) whose compiled
memory fits ``usable x (1 - mesh.auto_memory_margin)`` per device. To stay quick:

1. every candidate is costed in closed form first (``cost.state_bytes_lower``, ``cost.activation_bytes``,
   ``cost.compute_seconds``, ``cost.comm_seconds``); those whose state alone exceeds the budget are pruned;
2. the rest are compiled in order of the closed-form estimate (expected fits first), and one is skipped once its
   lower bound (its compute time, exact before compiling) is no faster than the runner-up compiled so far: the
   choice and the runner-up are then the best two under the cost model, at most ``MAX_COMPILES`` compiles;
3. each compile's reading (memory, collectives) is cached by a hash of the config, the devices and JAX's version
   (``cache_dir/<hash>.json``), so a second plan of the same config compiles nothing.

Then the trial (``mesh.auto_trial_steps`` > 0, ``train``'s hook): the finalists (:func:`finalists`: the fitting
candidates within ``TRIAL_WITHIN`` of the best estimate, at most ``TRIAL_MAX``) each run a few steps on random
tokens (``trial.measure``, reusing the search's executable where it compiled one) and the fastest measured is
chosen (:func:`apply_trial`); the estimate of each stays reported beside its measurement.

Ties break on the candidate's label: the same config, devices and hardware figures give the same choice.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from jaxtrain.config import Config, to_dict
from jaxtrain.config.hardware import Hardware
from jaxtrain.errors import ConfigError
from jaxtrain.parallel.dims import Axis, MeshShape
from jaxtrain.planner import cost, search
from jaxtrain.planner.collectives import Collective
from jaxtrain.planner.hlo import UnknownLoop
from jaxtrain.planner.trial import measure

REMATS = ("none", "save_matmuls", "full")
MAX_COMPILES = 6  # a bound on the search's time; the table says when it stopped a search
# The trial's finalists: fitting candidates estimated within this factor of the best, at most TRIAL_MAX of them. The
# CPU estimates have been off by up to 40% (docs/auto-layout.md), so the window is wide; each finalist costs its
# trial steps (+1 warm-up) and, when its reading came from the cache, a compile.
TRIAL_WITHIN = 1.5
TRIAL_MAX = 4
CACHE_DIR = "plan-cache"  # under run.dir
CACHE_VERSION = 1
# Sections that do not change the compiled step (a cached reading serves any of their values).
_NOT_COMPILED = ("run", "checkpoint", "observe", "check")


@dataclass(frozen=True)
class Candidate:
    """One layout the search considers."""

    shape: MeshShape
    remat: str
    microbatches: int
    schedule: str  # the pipeline schedule; the config's own where stage == 1 (it does nothing there)

    @property
    def stages(self) -> int:
        return self.shape.size(Axis.STAGE)

    @property
    def label(self) -> str:
        return (f"{self.shape.label}, remat {self.remat}, microbatches {self.microbatches}"
                + (f", {self.schedule}" if self.stages > 1 else ""))

    def apply(self, cfg: Config) -> Config:
        """``cfg`` with this layout as concrete values and ``mesh.auto`` false: reproducible without the planner."""
        c: Config = self.shape.apply(cfg)
        return dataclasses.replace(
            c, mesh=dataclasses.replace(c.mesh, auto=False),
            model=dataclasses.replace(c.model, remat=self.remat),  # type: ignore[arg-type]  # one of REMATS
            train=dataclasses.replace(c.train, microbatches=self.microbatches,
                                      pipeline_schedule=self.schedule))  # type: ignore[arg-type]

    def overrides(self) -> list[str]:
        return [*self.shape.overrides(), f"model.remat={self.remat}", f"train.microbatches={self.microbatches}",
                f"train.pipeline_schedule={self.schedule}", "mesh.auto=false"]


def candidates(cfg: Config, n_devices: int, nodes: int, remats=REMATS, microbatches=None) -> list[Candidate]:
    """Every layout over ``n_devices`` on ``nodes`` nodes that the model and batch allow: the meshes of
    ``search.search_shapes`` for each microbatch count (default: every divisor of ``train.global_batch``), each
    remat policy, and both pipeline schedules where stage > 1. ConfigError when none is valid."""
    counts = microbatches or [k for k in range(1, cfg.train.global_batch + 1) if cfg.train.global_batch % k == 0]
    out, why = [], ""
    for k in counts:
        c = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, microbatches=k))
        try:
            shapes, _ = search.search_shapes(c, n_devices, nodes)
        except ConfigError as e:
            why = why or str(e)
            continue
        for shape in shapes:
            schedules = ("gpipe", "1f1b") if shape.size(Axis.STAGE) > 1 else (cfg.train.pipeline_schedule,)
            out += [Candidate(shape, r, k, s) for r in remats for s in schedules]
    if not out:
        raise ConfigError(f"mesh.auto: no valid layout over {n_devices} device(s): {why}")
    return out


@dataclass
class Row:
    """A candidate with its closed-form figures and, once compiled, the plan's row."""

    cand: Candidate
    state_lower: float
    memory_guess: float
    lower_s: float  # compute time: a lower bound on the step
    guess_s: float
    result: dict | None = None  # search.candidate_result, with "fits" against the budget
    cached: bool = False
    measured_s: float | None = None  # the trial's fastest step, where it ran

    @property
    def est(self) -> float:
        assert self.result is not None
        return self.result["est_step_seconds"]


def closed_form(cfg: Config, cand: Candidate, hw: Hardware) -> Row:
    c = cand.apply(cfg)
    state = cost.state_bytes_lower(c, cand.shape)
    lower_act, act = cost.activation_bytes(c, cand.shape)
    compute = cost.compute_seconds(c, cand.shape, hw)
    update = cost.optimizer_bytes_moved(state / 3, 2 * state / 3) / hw.hbm_bandwidth
    return Row(cand, state + lower_act, state + act, compute, compute + cost.comm_seconds(c, cand.shape, hw) + update)


# ---------------------------------------------------------------------------------------------------------------
# Compiling, with a cache


def cache_key(cfg: Config, devices: list) -> str:
    import jax

    tree = {k: v for k, v in to_dict(cfg).items() if k not in _NOT_COMPILED}
    body = {"version": CACHE_VERSION, "config": tree, "devices": len(devices), "kind": devices[0].device_kind,
            "platform": devices[0].platform, "jax": jax.__version__, "xla_flags": os.environ.get("XLA_FLAGS", "")}
    return hashlib.sha256(json.dumps(body, sort_keys=True, default=str).encode()).hexdigest()[:32]


def _to_json(comp: search.Compiled) -> dict:
    return {**{k: getattr(comp, k) for k in ("params_bytes", "opt_bytes", "temp_bytes", "memory_bytes",
                                              "compile_s")},
            "collectives": [[c.kind, c.bytes, c.count, c.groups.tolist(), c.op_name] for c in comp.collectives],
            "unknown_loops": [[u.name, u.op_name, u.holds_collectives] for u in comp.unknown_loops]}


def _from_json(d: dict) -> search.Compiled:
    colls = [Collective(k, b, n, np.asarray(g, dtype=np.int64).reshape(len(g), -1), op)
             for k, b, n, g, op in d["collectives"]]
    loops = [UnknownLoop(name, op, holds_collectives=h) for name, op, h in d["unknown_loops"]]
    return search.Compiled(d["params_bytes"], d["opt_bytes"], d["temp_bytes"], d["memory_bytes"], colls, loops,
                           d["compile_s"])


def cache_path(cache_dir: str, cfg: Config, shape: MeshShape, devices: list) -> str:
    return os.path.join(cache_dir, cache_key(shape.apply(cfg), devices[:shape.num_devices]) + ".json")


def store(path: str, comp: search.Compiled) -> None:
    """Write one reading to the cache (process 0; never a half-written entry)."""
    import jax

    if jax.process_index() == 0:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(f"{path}.tmp", "w") as f:
            json.dump(_to_json(comp), f)
        os.replace(f"{path}.tmp", path)


def compile_cached(cfg: Config, shape: MeshShape, devices: list, cache_dir: str | None, keep: dict | None = None,
                   key=None) -> tuple[search.Compiled, bool]:
    """The compiled step's reading for ``cfg`` on ``shape`` and whether it came from the cache; a fresh compile's
    (step, executable) go into ``keep[key]`` when ``keep`` is given (the trial runs them without compiling again)."""
    path = cache_path(cache_dir, cfg, shape, devices) if cache_dir else None
    if path and os.path.isfile(path):
        try:
            with open(path) as f:
                return _from_json(json.load(f)), True
        except (OSError, ValueError, KeyError, TypeError):
            pass  # a damaged entry is compiled again and rewritten
    step = search._step(cfg, shape, devices)
    train, seconds = search.compile_train_step(step)
    comp = search.reading(step, train, seconds)
    if keep is not None:
        keep[key] = (step, train)
    if path:
        store(path, comp)
    return comp, False


# ---------------------------------------------------------------------------------------------------------------
# The search


@dataclass
class AutoResult:
    choice: Row
    runner_up: Row | None
    why: list[str]  # the choice against the runner-up and against faster layouts that do not fit
    rows: list[Row]  # every candidate, compiled ones first (ranked)
    budget: float
    seconds: float
    compiles: int
    cache_hits: int
    pruned: int  # state alone over the budget
    bounded: int  # not compiled: no faster than the runner-up even with no communication
    capped: int  # not compiled: MAX_COMPILES reached
    fitting: list[Row] = field(default_factory=list)  # compiled, fit, not dominated: ranked by estimate
    estimated: Row | None = None  # the estimate's choice, where a trial then chose (maybe another)
    trial: list[Row] = field(default_factory=list)  # the finalists the trial measured, fastest first

    @property
    def compiled(self) -> list[Row]:
        return [r for r in self.rows if r.result is not None]


def _rank_key(r: Row):
    return (not r.result["fits"], r.est, r.cand.label)  # type: ignore[index]


def _gb(x: float) -> str:
    return f"{x / 1e9:.3g} GB" if x >= 1e8 else f"{x / 1e6:.3g} MB"


def _ms(x: float) -> str:
    return f"{x * 1e3:.1f} ms" if x < 10 else f"{x:.1f} s"


def _why(choice: Row, runner: Row | None, compiled: list[Row], budget: float) -> list[str]:
    lines = []
    if runner is not None and runner.measured_s is not None and choice.measured_s is not None:
        # After the trial the measurement decided: the estimate's breakdown would explain a gap it did not see.
        lines.append(f"runner-up {runner.cand.label}: {_ms(runner.measured_s)} measured in the trial "
                     f"({(runner.measured_s / choice.measured_s - 1) * 100:+.1f}%), est. {_ms(runner.est)}")
    elif runner is not None:
        a, b = choice.result["time"], runner.result["time"]  # type: ignore[index]
        parts = {"compute": "compute", "intra_node": "in-node communication", "inter_node": "inter-node "
                 "communication", "optimizer": "optimizer update"}
        worst = max(parts, key=lambda p: b[p] - a[p])
        lines.append(f"runner-up {runner.cand.label}: {_ms(runner.est)} "
                     f"({(runner.est / choice.est - 1) * 100:+.1f}%), mostly {parts[worst]} "
                     f"({_ms(b[worst])} against {_ms(a[worst])})")
    faster = [r for r in compiled if not r.result["fits"] and r.est < choice.est]  # type: ignore[index]
    if faster:
        f = min(faster, key=lambda r: (r.est, r.cand.label))
        lines.append(f"faster but over the memory budget: {f.cand.label}: {_ms(f.est)}, needs "
                     f"{_gb(f.result['memory_bytes_per_device'])} > {_gb(budget)}")  # type: ignore[index]
    return lines


def search_layout(cfg: Config, devices: list, hw: Hardware, nodes: int = 1, *, cache_dir: str | None = None,
                  remats=REMATS, microbatches=None, max_compiles: int = MAX_COMPILES, keep: dict | None = None,
                  progress: Callable[[str], None] = lambda msg: None) -> AutoResult:
    """The auto choice for ``cfg`` on ``devices`` (module docstring). ConfigError, one line, when nothing fits."""
    t0 = time.perf_counter()
    budget = hw.usable_bytes * (1 - cfg.mesh.auto_memory_margin)
    rows = [closed_form(cfg, c, hw) for c in candidates(cfg, len(devices), nodes, remats, microbatches)]
    # Layouts in the order of their best guess, and within one the lighter settings first (less remat; without a
    # pipeline, fewer microbatches), so that a lighter setting that fits is compiled before the heavier ones it
    # dominates (below): the guesses favour accumulation, whose smaller matmuls they do not price.
    viable = [r for r in rows if r.state_lower <= budget]

    def layout(r: Row) -> tuple:
        return (r.cand.shape, r.cand.schedule, r.cand.microbatches if r.cand.stages > 1 else 0)

    best: dict[tuple, tuple] = {}
    for r in viable:
        guess = (r.memory_guess > budget, r.guess_s, r.cand.label)
        best[layout(r)] = min(best.get(layout(r), guess), guess)
    # Settings guessed not to fit go last within their layout (an MoE layout's lightest settings need terabytes).
    viable.sort(key=lambda r: (best[layout(r)], r.memory_guess > budget, r.cand.microbatches,
                               REMATS.index(r.cand.remat), r.cand.label))
    compiles = hits = bounded = capped = 0
    fitting: list[Row] = []
    for r in viable:
        # More recompute usually adds compute, and without a pipeline more microbatches cut the same matmuls
        # smaller: where a lighter setting of the same layout fits at no more compute, a heavier one is not tried;
        # else, nor where it is no faster than the runner-up even without communication.
        if any(_dominates(f, r) for f in fitting) or (len(fitting) >= 2 and r.lower_s >= fitting[1].est):
            bounded += 1
            continue
        if compiles >= max_compiles:
            capped += 1
            continue
        c = r.cand.apply(cfg)
        comp, r.cached = compile_cached(c, r.cand.shape, devices, cache_dir, keep, r.cand)
        hits += r.cached
        compiles += not r.cached
        r.result = search.candidate_result(c, r.cand.shape, hw, comp)
        r.result["fits"] = comp.memory_bytes <= budget
        progress(f"[{compiles + hits}] {r.cand.label}: {_gb(comp.memory_bytes)}, est. {_ms(r.est)}"
                 f"{' (cached)' if r.cached else f', compiled in {comp.compile_s:.1f} s'}")
        if r.result["fits"]:
            fitting = sorted([f for f in fitting if not _dominates(r, f)] + [r], key=_rank_key)
    compiled = sorted((r for r in rows if r.result is not None), key=_rank_key)
    pruned = len(rows) - len(viable)
    if not fitting:
        raise ConfigError(nothing_fits(cfg, rows, compiled, budget, len(devices), hw))
    choice, runner = fitting[0], (fitting[1] if len(fitting) > 1 else None)
    return AutoResult(choice, runner, _why(choice, runner, compiled, budget),
                      compiled + [r for r in rows if r.result is None], budget, time.perf_counter() - t0, compiles,
                      hits, pruned, bounded, capped, fitting)


def _dominates(a: Row, b: Row) -> bool:
    """``a`` fits and is lighter than ``b`` on the same mesh and schedule: less recompute, and (without a pipeline,
    whose bubble shrinks with more microbatches) no more microbatches, at no more compute. Such a ``b`` only trades
    speed for memory that is not needed, so it is neither compiled nor chosen. Where the heavier setting's compute
    is estimated lower (a CPU's measured efficiency can favour recompute: ``Hardware.model_efficiency``), both are
    kept."""
    x, y = a.cand, b.cand
    return (x != y and x.shape == y.shape and x.schedule == y.schedule and a.lower_s <= b.lower_s
            and REMATS.index(x.remat) <= REMATS.index(y.remat)
            and (x.microbatches == y.microbatches or (x.stages == 1 and x.microbatches < y.microbatches)))


def nothing_fits(cfg: Config, rows: list[Row], compiled: list[Row], budget: float, n_devices: int,
                 hw: Hardware) -> str:
    """The one-line error when no layout fits: the smallest need found, and what would make room."""
    if compiled:
        best = min(compiled, key=lambda r: (r.result["memory_bytes_per_device"], r.cand.label))  # type: ignore
        need, what = best.result["memory_bytes_per_device"], best.cand.label  # type: ignore[index]
    else:
        best = min(rows, key=lambda r: (r.state_lower, r.cand.label))
        need, what = best.state_lower, f"{best.cand.label}, parameters + optimizer state alone"
    more = int(np.ceil(n_devices * need / max(budget, 1.0)))
    return (f"mesh.auto: no layout fits {_gb(budget)} per device ({_gb(hw.usable_bytes)} usable x (1 - "
            f"mesh.auto_memory_margin={cfg.mesh.auto_memory_margin:g})) on {n_devices} device(s), remat none to "
            f"full and microbatches 1 to {cfg.train.global_batch} searched; the smallest needs {_gb(need)} ({what}): "
            f"use about {more} or more devices, a smaller train.global_batch or data.seq_len, or a lower "
            "mesh.auto_memory_margin")


# ---------------------------------------------------------------------------------------------------------------
# The trial: the finalists measured


def finalists(res: AutoResult, within: float = TRIAL_WITHIN, most: int = TRIAL_MAX) -> list[Row]:
    """The candidates the trial measures: those that fit (not dominated), estimated within ``within`` x the best
    estimate, the ``most`` best estimated; one alone is not worth a trial (an empty list)."""
    best = res.fitting[0].est
    out = [r for r in res.fitting if r.est <= best * within][:most]
    return out if len(out) > 1 else []


def apply_trial(res: AutoResult, seconds: dict[Candidate, float]) -> None:
    """The fastest measured of ``seconds`` (candidate -> trial seconds) becomes the choice, the second the
    runner-up; the estimate's choice is kept in ``res.estimated``. Candidates this search did not compile (another
    process's finalists) are left out here: that process's choice is broadcast."""
    by_cand = {r.cand: r for r in res.fitting}
    measured = []
    for cand, t in seconds.items():
        if cand in by_cand:
            by_cand[cand].measured_s = t
            measured.append(by_cand[cand])
    if not measured:
        return
    measured.sort(key=lambda r: (r.measured_s, r.cand.label))
    res.estimated, res.trial = res.choice, measured
    res.choice = measured[0]
    res.runner_up = measured[1] if len(measured) > 1 else res.runner_up
    res.why = _why(res.choice, res.runner_up, res.compiled, res.budget)


def format_result(res: AutoResult, top: int = 8) -> str:
    """The choice, the runner-up and why, the compiled candidates, and the search's cost."""
    c = res.choice
    lines = [f"auto layout: {c.cand.label}: est. step {_ms(c.est)}"
             + (f", measured {_ms(c.measured_s)} in the trial" if c.measured_s is not None else "")
             + f", {_gb(c.result['memory_bytes_per_device'])} per device of {_gb(res.budget)} allowed",  # type: ignore
             *(f"  {w}" for w in res.why)]
    if res.trial:
        est = res.estimated
        lines.append("  trial (fastest step, after a warm-up): " + "; ".join(
            f"{r.cand.label}: {_ms(r.measured_s)} measured, est. {_ms(r.est)}" for r in res.trial)  # type: ignore
            + ("" if est is None or est.cand == c.cand else f"; the estimate alone picked {est.cand.label}"))
    lines += [f"  searched {len(res.rows)} candidates in {res.seconds:.1f} s: {res.pruned} pruned (state alone "
              f"over the budget), {res.compiles} compiled, {res.cache_hits} from the cache, {res.bounded} not "
              f"compiled (a lighter remat of the layout fits, or no faster than the runner-up without any "
              f"communication)" + (f", {res.capped} not compiled (stopped at {MAX_COMPILES} compiles)"
                                   if res.capped else ""),
              "  compiled (fits first, then by estimated step):"]
    for i, r in enumerate(res.compiled[:top], 1):
        lines.append(f"  {i:2d}. {r.cand.label}: {_ms(r.est)}, {_gb(r.result['memory_bytes_per_device'])}"  # type: ignore
                     f"{'' if r.result['fits'] else ' (over budget)'}")  # type: ignore[index]
    return "\n".join(lines)


def to_json(res: AutoResult) -> dict:
    def row(r: Row) -> dict:
        return {"label": r.cand.label, "overrides": r.cand.overrides(), "est_step_seconds": r.est,
                "measured_step_seconds": r.measured_s,
                "memory_bytes_per_device": r.result["memory_bytes_per_device"], "fits": r.result["fits"],  # type: ignore
                "cached": r.cached}

    return {"choice": row(res.choice), "runner_up": row(res.runner_up) if res.runner_up else None, "why": res.why,
            "compiled": [row(r) for r in res.compiled], "budget_bytes": res.budget, "seconds": res.seconds,
            "candidates": len(res.rows), "compiles": res.compiles, "cache_hits": res.cache_hits,
            "pruned": res.pruned, "bounded": res.bounded, "capped": res.capped,
            "estimated_choice": row(res.estimated) if res.estimated else None, "trial": [row(r) for r in res.trial]}


def hardware_for(cfg: Config, devices: list, calibration_path: str | None = None):
    """The devices' hardware figures (``measure.hardware_at_hand``) with the calibration in (``calibration_path``,
    else ``run.dir/calibration.json`` if there): a ``calibration.Calibrated``."""
    from jaxtrain.parallel.layout import resolve_auto
    from jaxtrain.planner import calibration
    from jaxtrain.planner.measure import hardware_at_hand, measure_model, measure_sized, model_points

    resolved = resolve_auto(cfg, devices[0].platform, len(devices))
    dtype = resolved.model.dtype
    hw = hardware_at_hand(devices, None)
    if devices[0].platform == "cpu":  # measured at hand like the rest of the CPU's figures (a file may replace them)
        # On this process's devices only: they share its cores, and a timing loop of collectives across processes
        # could run a different number of times on each.
        import jax

        local = [d for d in devices if d.process_index == jax.process_index()] or devices
        hw = calibration.sized(hw, *measure_sized(local, cfg.model.d_model, cfg.model.d_ff, dtype))
        hw = dataclasses.replace(hw, model_efficiency=measure_model(resolved, local, hw,
                                                                    model_points(cfg, len(local), REMATS)))
    return calibration.for_plan(hw, calibration_path, cfg.run.dir, dtype)


def resolve(cfg: Config, log: Callable[[str], None]) -> Config:
    """``train``'s hook: ``cfg`` (``mesh.auto`` true) with the chosen layout as concrete values, on all devices."""
    import jax

    devices = jax.devices()
    cal = hardware_for(cfg, devices)
    rows = cal.hw.matmul_rows
    log(f"mesh.auto: choosing the layout over {len(devices)} {devices[0].device_kind} device(s); "
        + cal.note("the devices at hand" if devices[0].platform == "cpu" else cal.hw.name)
        + (f"; matmul rate by rows per device {', '.join(f'{r:g}: {f:.2f}' for r, f in rows)}, a layer "
           f"iteration {_ms(cal.hw.layer_overhead_s)}, the model's efficiency by remat and tensor "
           f"{', '.join(f'{r} x{t} {e:.3g}' for r, t, e in cal.hw.model_efficiency)} (measured)" if rows else ""))
    nodes = max(1, jax.process_count())
    keep: dict = {}
    res = search_layout(cfg, devices, cal.hw, nodes, cache_dir=os.path.join(cfg.run.dir, CACHE_DIR), progress=log,
                        keep=keep)
    order = candidates(cfg, len(devices), nodes)
    steps = cfg.mesh.auto_trial_steps
    trial = [r.cand for r in finalists(res)] if steps > 0 else []
    if jax.process_count() > 1 and steps > 0:
        # The trial is collective: every process runs process 0's finalists, in its order.
        from jax.experimental import multihost_utils

        index = np.full(TRIAL_MAX, -1, np.int32)
        index[:len(trial)] = [order.index(c) for c in trial]
        trial = [order[int(i)] for i in multihost_utils.broadcast_one_to_all(index) if i >= 0]
    if trial:
        apply_trial(res, measure(cfg, trial, devices, steps, keep, log))
    keep.clear()
    log(format_result(res, top=3))
    choice = res.choice.cand
    if jax.process_count() > 1:
        # Every process searches, but rates measured on CPUs (and near-ties) can differ between them: process 0's
        # choice is everyone's, sent as its index in the candidate list, which is the same on every process.
        from jax.experimental import multihost_utils

        index = multihost_utils.broadcast_one_to_all(np.int32(order.index(choice)))
        if order[int(index)] != choice:
            log(f"mesh.auto: process 0 chose {order[int(index)].label}; every process takes its choice")
        choice = order[int(index)]
    return choice.apply(cfg)
