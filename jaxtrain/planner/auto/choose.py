"""``mesh.auto``: the planner chooses the layout: mesh sizes over every axis of ``config.MESH_AXES``,
``model.remat``, ``train.microbatches`` and, where a stage axis > 1, ``train.pipeline_schedule``.

The choice is the fastest estimated candidate (``cost.estimate`` on the compiled step, no overlap) whose compiled
memory fits ``usable x (1 - mesh.auto_memory_margin)`` per device. To stay quick:

1. every candidate is costed in closed form first (``memory.state_bytes_lower``, ``memory.gradient_bytes``,
   ``memory.activation_bytes`` sized for the compiler whose figures rank them, ``cost.compute_seconds``,
   ``cost.comm_seconds``); those whose state alone exceeds the budget are pruned, those whose memory guess is over
   ``GUESS_OVER`` budgets not compiled;
2. the rest are compiled in order of the closed-form estimate (expected fits first), and one is skipped once its
   lower bound (its compute time, exact before compiling) is no faster than the runner-up compiled so far: the
   choice and the runner-up are then the best two under the cost model, at most ``MAX_COMPILES`` readings
   (compiled, or from the cache: a second search with the same figures visits the same candidates, compiling none);
3. each compile's reading (memory, collectives) is cached by a hash of the config, the devices and JAX's version
   (``cache_dir/<hash>.json``, :mod:`.compile_cache`), so a second plan of the same config compiles nothing.

Then the trial (``mesh.auto_trial_steps`` > 0, ``train``'s hook): the finalists (:func:`finalists`: the fitting
candidates within ``TRIAL_WITHIN`` of the best estimate, at most ``TRIAL_MAX``) each run a few steps on random
tokens (``trial.measure``, reusing the search's executable where it compiled one) and the fastest measured is
chosen (:func:`apply_trial`); the estimate of each stays reported beside its measurement.

Ties break on the candidate's label: the same config, devices and hardware figures give the same choice. The
candidates, their rows and the result are :mod:`.space`'s; the text and JSON a search prints, :mod:`.auto_report`'s.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np

from jaxtrain.config import Config
from jaxtrain.config.hardware import Hardware
from jaxtrain.errors import ConfigError
from jaxtrain.planner.auto.compile_cache import compile_cached, plan_cache_dir
from jaxtrain.planner.auto.figures import affordable, hardware_for  # noqa: F401  (auto's API)
from jaxtrain.planner.auto.report import format_result, gb, ms, nothing_fits, why
from jaxtrain.planner.auto.space import (
    GUESS_OVER,
    MAX_COMPILES,
    REMATS,
    AutoResult,
    Candidate,
    Row,
    candidates,
    closed_form,
)
from jaxtrain.planner.auto.trial import measure
from jaxtrain.planner.search import meshes as search

# The trial's finalists: fitting candidates estimated within this factor of the best, at most TRIAL_MAX of them. The
# CPU estimates have been off by up to 40% (docs/auto-layout.md), so the window is wide; each finalist costs its
# trial steps (+1 warm-up) and, when its reading came from the cache, a compile.
TRIAL_WITHIN = 1.5
TRIAL_MAX = 4


def _rank_key(r: Row):
    return (not r.result["fits"], r.est, r.cand.label)  # type: ignore[index]


def search_layout(cfg: Config, devices: list, hw: Hardware, nodes: int = 1, *, cache_dir: str | None = None,
                  remats=REMATS, microbatches=None, max_compiles: int = MAX_COMPILES, keep: dict | None = None,
                  progress: Callable[[str], None] = lambda msg: None, gpu=None,
                  attention: str | None = None) -> AutoResult:
    """The auto choice for ``cfg`` on ``devices`` (module docstring). ConfigError, one line, when nothing fits.
    ``gpu``: a ``xla_gpu.PlanCompiler`` (``plan --hardware``): each candidate's memory and collectives from XLA:GPU.
    ``attention``: the kernel the run uses where ``cfg`` compiles a stand-in (``target.Target.attention``)."""
    t0 = time.perf_counter()
    budget = hw.usable_bytes * (1 - cfg.mesh.auto_memory_margin)
    compiler = "xla-cpu" if gpu is None else "xla-gpu"  # whose memory figures rank the candidates
    rows = [closed_form(cfg, c, hw, attention, compiler)
            for c in candidates(cfg, len(devices), nodes, remats, microbatches)]
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
    progress(f"mesh.auto: {len(rows)} candidates, {len(rows) - len(viable)} over {gb(budget)} a device by their "
             f"state alone; compiling at most {max_compiles} of the rest (cached readings count), expected fits and "
             "fastest first, each skipped where it cannot beat the runner-up")
    for r in viable:
        # More recompute usually adds compute, and without a pipeline more microbatches cut the same matmuls
        # smaller: where a lighter setting of the same layout fits at no more compute, a heavier one is not tried;
        # else, nor where it is no faster than the runner-up even without communication, nor where its closed-form
        # memory is far over the budget (GUESS_OVER).
        if (any(_dominates(f, r) for f in fitting) or (len(fitting) >= 2 and r.lower_s >= fitting[1].est)
                or r.memory_guess > GUESS_OVER * budget):
            bounded += 1
            continue
        if compiles + hits >= max_compiles:  # cached readings count: a warm cache visits the same candidates
            capped += 1
            continue
        c = r.cand.apply(cfg)
        comp, r.cached = compile_cached(c, r.cand.shape, devices, cache_dir, keep, r.cand, gpu)
        hits += r.cached
        compiles += not r.cached
        r.result = search.candidate_result(c, r.cand.shape, hw, comp, attention)
        r.result["fits"] = comp.memory_bytes <= budget
        progress(f"mesh.auto: [{compiles + hits}/{max_compiles}] {r.cand.label}: {gb(comp.memory_bytes)}"
                 f"{'' if r.result['fits'] else ' (over the budget)'}, est. {ms(r.est)}"
                 f"{', from the cache' if r.cached else f', compiled in {comp.compile_s:.1f} s'}")
        if r.result["fits"]:
            fitting = sorted([f for f in fitting if not _dominates(r, f)] + [r], key=_rank_key)
    compiled = sorted((r for r in rows if r.result is not None), key=_rank_key)
    pruned = len(rows) - len(viable)
    if not fitting:
        raise ConfigError(nothing_fits(cfg, rows, compiled, budget, len(devices), hw.usable_bytes))
    choice, runner = fitting[0], (fitting[1] if len(fitting) > 1 else None)
    return AutoResult(choice, runner, why(choice, runner, compiled, budget),
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
    res.why = why(res.choice, res.runner_up, res.compiled, res.budget)


def resolve(cfg: Config, log: Callable[[str], None]) -> tuple[Config, tuple | None]:
    """``train``'s hook: ``cfg`` (``mesh.auto`` true) with the chosen layout as concrete values, on all devices, and
    the chosen layout's (Step, compiled train step) where this search compiled it (for ``loop.train``: the run
    then starts without compiling it again), else None."""
    import jax

    t0 = time.perf_counter()
    devices = jax.devices()
    nodes = max(1, jax.process_count())
    cache = plan_cache_dir(cfg.runtime.compile_cache)
    cal = hardware_for(cfg, devices, nodes=nodes, progress=log, cache_dir=cache)
    figures_s = time.perf_counter() - t0
    rows = cal.hw.matmul_rows
    log(f"mesh.auto: choosing the layout over {len(devices)} {devices[0].device_kind} device(s); "
        + cal.note("the devices at hand" if devices[0].platform == "cpu" else cal.hw.name)
        + (f"; matmul rate by rows per device {', '.join(f'{r:g}: {f:.2f}' for r, f in rows)}, a layer "
           f"iteration {ms(cal.hw.layer_overhead_s)}, the model's efficiency by remat and tensor "
           f"{', '.join(f'{r} x{t} {e:.3g}' for r, t, e in cal.hw.model_efficiency)} (measured)" if rows else ""))
    keep: dict = {}
    res = search_layout(cfg, devices, cal.hw, nodes, cache_dir=cache, progress=log, keep=keep)
    order = candidates(cfg, len(devices), nodes)
    steps = cfg.mesh.auto_trial_steps
    trial = [r.cand for r in finalists(res)] if steps > 0 else []
    if jax.process_count() > 1 and steps > 0:
        # The trial is collective: every process runs process 0's finalists, in its order.
        from jax.experimental import multihost_utils

        index = np.full(TRIAL_MAX, -1, np.int32)
        index[:len(trial)] = [order.index(c) for c in trial]
        trial = [order[int(i)] for i in multihost_utils.broadcast_one_to_all(index) if i >= 0]
    t1 = time.perf_counter()
    if trial:
        apply_trial(res, measure(cfg, trial, devices, steps, keep, log))
    log(format_result(res, top=3))
    log(f"mesh.auto: {time.perf_counter() - t0:.1f} s in all: the figures {figures_s:.1f} s, the search "
        f"{res.seconds:.1f} s ({res.compiles} compiled, {res.cache_hits} from the cache), the trial "
        f"{time.perf_counter() - t1:.1f} s")
    choice = res.choice.cand
    if jax.process_count() > 1:
        # Every process searches, but rates measured on CPUs (and near-ties) can differ between them: process 0's
        # choice is everyone's, sent as its index in the candidate list, which is the same on every process.
        from jax.experimental import multihost_utils

        index = multihost_utils.broadcast_one_to_all(np.int32(order.index(choice)))
        if order[int(index)] != choice:
            log(f"mesh.auto: process 0 chose {order[int(index)].label}; every process takes its choice")
        choice = order[int(index)]
    executable = keep.pop(choice, None)
    keep.clear()  # the other candidates' executables (and their device buffers) go before the run's state comes
    return choice.apply(cfg), executable
