"""The terms of ``mesh.auto``'s search (:mod:`jaxtrain.planner.auto.choose`): the candidate layouts (a mesh, a remat
policy, a microbatch count, a pipeline schedule), each one's closed-form figures before compiling (a
:class:`Row`), and what a search returns (:class:`AutoResult`). The search, its compile cache
(:mod:`.compile_cache`) and its report (:mod:`.auto_report`) all speak these.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from jaxtrain.config import Config
from jaxtrain.config.hardware import Hardware
from jaxtrain.errors import ConfigError
from jaxtrain.parallel.dims import MESH_AXES, Axis, MeshShape
from jaxtrain.planner.cost import memory
from jaxtrain.planner.cost import model as cost
from jaxtrain.planner.search import meshes as search

REMATS = ("none", "save_matmuls", "full")
MAX_COMPILES = 6  # a bound on the search's time; the table says when it stopped a search
# A candidate whose closed-form memory is over this many budgets is not compiled: the closed forms came within
# 0.85-1.53 of XLA:GPU's compiled figure on Mixtral, Qwen3-MoE and DeepSeek-V3 (docs/planning.md), so it would not
# fit; without this, DeepSeek-V3's search spent four of its six compiles on layouts guessed at 2-70x the budget.
GUESS_OVER = 2.0


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
    return keep_given(cfg, out, n_devices, nodes)


def keep_given(cfg: Config, cands: list[Candidate], n_devices: int, nodes: int) -> list[Candidate]:
    """The candidates with the sizes ``mesh.auto_keep`` holds (``cfg.mesh.kept()``: those set on the command line
    beside ``mesh.auto=true``); ConfigError (one line, exit 2) naming them and the sizes valid layouts take when
    none has them."""
    kept = cfg.mesh.kept()

    def size(c: Candidate, part: str, ax: str) -> int:
        return (c.shape.ici if part == "ici" else c.shape.dcn)[MESH_AXES.index(ax)]

    out = [c for c in cands if all(size(c, part, ax) == v for (part, ax), v in kept.items())]
    if not out:
        given = " ".join(f"mesh.{part}.{ax}={v}" for (part, ax), v in kept.items())
        valid = "; ".join(f"mesh.{part}.{ax} takes {', '.join(map(str, sorted({size(c, part, ax) for c in cands})))}"
                          for part, ax in kept)
        raise ConfigError(f"mesh.auto: no valid layout over {n_devices} device(s) on {nodes} node(s) has the sizes "
                          f"given ({given}; mesh.auto keeps the sizes set beside it); valid layouts: {valid}; change "
                          "or drop them")
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


def closed_form(cfg: Config, cand: Candidate, hw: Hardware, attention: str | None = None,
                compiler: str = "xla-cpu") -> Row:
    """``cand``'s row before compiling: state and memory bounds, compute time (a lower bound on the step) and a
    guess of the step with communication and the optimizer update (``cost``'s closed forms); ``attention``: the
    kernel the run uses, where ``cfg`` compiles a stand-in; ``compiler``: whose memory figures the search ranks by
    (``memory.COMPILERS``: XLA:GPU's where it compiles for the GPUs)."""
    c = cand.apply(cfg)
    state = memory.state_bytes_lower(c, cand.shape)
    lower_act, act = memory.activation_bytes(c, cand.shape, compiler)
    compute = cost.compute_seconds(c, cand.shape, hw, attention)
    update = cost.optimizer_bytes_moved(state / 3, 2 * state / 3) / cost.hbm_bandwidth(hw)
    guess = state + memory.gradient_bytes(c, cand.shape) + act  # memory.memory_estimate, its parts reused
    return Row(cand, state + lower_act, guess, compute, compute + cost.comm_seconds(c, cand.shape, hw) + update)


@dataclass
class AutoResult:
    """A search's outcome: the choice, the runner-up and why, every candidate's row, and what the search cost."""

    choice: Row
    runner_up: Row | None
    why: list[str]  # the choice against the runner-up and against faster layouts that do not fit
    rows: list[Row]  # every candidate, compiled ones first (ranked)
    budget: float
    seconds: float
    compiles: int
    cache_hits: int
    pruned: int  # state alone over the budget
    bounded: int  # not compiled: dominated, no faster than the runner-up even with no communication, or guessed
    # far over the budget (choose.GUESS_OVER)
    capped: int  # not compiled: MAX_COMPILES readings (compiled or cached) reached
    fitting: list[Row] = field(default_factory=list)  # compiled, fit, not dominated: ranked by estimate
    estimated: Row | None = None  # the estimate's choice, where a trial then chose (maybe another)
    trial: list[Row] = field(default_factory=list)  # the finalists the trial measured, fastest first

    @property
    def compiled(self) -> list[Row]:
        return [r for r in self.rows if r.result is not None]
