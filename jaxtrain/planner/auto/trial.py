"""The trial: the auto search's finalists measured by running their train steps (``mesh.auto_trial_steps``).

Each finalist runs on a zero state and random tokens (a step's work does not depend on the values), in
``PASSES`` passes over the finalists, the second in the reverse order: a machine whose speed drifts during the
trial (another job starting, the CPU's clock) then weighs on every finalist alike instead of on the last ones. Each
pass allocates the finalist's state, runs one warm-up step and its share of the timed steps, and frees the state
before the next finalist (two training states would not fit where the memory is the constraint). A finalist's
measured step is the fastest of its timed steps over both passes: other work on the machine only adds time to a
step (on this project's shared 2-core machine the median of the same layout moved by 20-40% between passes, its
fastest step by a few percent), and the cost model's own CPU figures are best-of timings too.

Collective: with several processes every process runs the same finalists in the same order.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import numpy as np

from jaxtrain.config import Config
from jaxtrain.planner.auto.space import Candidate
from jaxtrain.planner.cost.measure import back_and_forth
from jaxtrain.planner.search import meshes as search

PASSES = 2


def step_times(cfg: Config, cand: Candidate, devices: list, steps: int, executable=None) -> list[float]:
    """Seconds of each of ``steps`` train steps of ``cand`` after one warm-up, on a zero state and random tokens;
    ``executable``: the search's (step, compiled), else compiled here. The state is freed before returning."""
    import jax

    c = cand.apply(cfg)
    if executable is None:
        built = search._step(c, cand.shape, devices)
        executable = (built, search.compile_train_step(built)[0])
    step, train = executable
    lay = step.layout

    def zeros(a, sharding):
        return jax.make_array_from_callback(a.shape, sharding, lambda idx: np.zeros(a.shape, a.dtype)[idx])

    state = jax.tree.map(zeros, lay.abstract_state, lay.state_sharding)
    tokens = np.random.default_rng(0).integers(0, cfg.model.vocab_size, lay.batch_shape, dtype=np.int32)
    batch = jax.make_array_from_callback(lay.batch_shape, lay.batch_sharding, lambda idx: tokens[idx])
    times = []
    for _ in range(steps + 1):
        t0 = time.perf_counter()
        state, metrics = train(state, batch)
        jax.block_until_ready(metrics)
        times.append(time.perf_counter() - t0)
    jax.block_until_ready(state)
    del state
    return times[1:]


def measure(cfg: Config, cands: Sequence[Candidate], devices: list, steps: int, executables: dict | None = None,
            log: Callable[[str], None] = lambda msg: None, passes: int = PASSES) -> dict[Candidate, float]:
    """Each of ``cands`` -> the fastest of its ``steps`` timed steps, run in ``passes`` passes (module docstring),
    every other one in the reverse order. ``executables``: candidate -> the search's (step, compiled), reused where
    there (and compiled once here where not, kept for the later passes)."""
    executables = {} if executables is None else executables
    times: dict = {c: [] for c in cands}
    log(f"mesh.auto trial: {len(cands)} finalists, {steps} timed steps each after a warm-up, in {passes} passes "
        "back and forth")
    for p, cand in back_and_forth(cands, passes):
        share = steps // passes + (p < steps % passes)
        if share:
            if cand not in executables:
                built = search._step(cand.apply(cfg), cand.shape, devices)
                executables[cand] = (built, search.compile_train_step(built)[0])
            times[cand] += step_times(cfg, cand, devices, share, executables[cand])
    out = {c: min(t) for c, t in times.items()}
    for i, cand in enumerate(cands, 1):
        log(f"mesh.auto trial [{i}/{len(cands)}] {cand.label}: {out[cand] * 1e3:.1f} ms a step (fastest of "
            f"{steps}, median {np.median(times[cand]) * 1e3:.1f} ms)")
    return out
