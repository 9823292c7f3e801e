"""Candidate meshes, pruning, and compiling the real train step for each (``jaxtrain.train.step.setup``).

A compiled program depends only on the axis sizes (data, stage, fsdp, tensor); how each axis splits into intra-node
(ici) and inter-node (dcn) parts only changes which physical devices its logical ids are, so it is compiled once per
sizes and costed for every split.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from jaxtrain.config import Config
from jaxtrain.config.hardware import Hardware
from jaxtrain.errors import ConfigError
from jaxtrain.parallel import pipeline, pipeline_1f1b
from jaxtrain.parallel.dims import MESH_AXES, Axis, MeshShape, ParallelDims
from jaxtrain.planner.cost.collectives import KINDS, Collective
from jaxtrain.planner.cost.hlo import UnknownLoop
from jaxtrain.planner.cost.model import estimate, pipeline_schedule
from jaxtrain.planner.cost.passes import collectives


def _factorizations(n: int, parts: int) -> list[tuple[int, ...]]:
    """Every ordered tuple of ``parts`` positive integers whose product is ``n``."""
    if parts == 1:
        return [(n,)]
    return [(d, *rest) for d in range(1, n + 1) if n % d == 0 for rest in _factorizations(n // d, parts - 1)]


def devices_per_node(n_devices: int, nodes: int) -> int:
    if nodes < 1:
        raise ConfigError(f"--nodes={nodes} must be >= 1")
    if n_devices < 1:
        raise ConfigError(f"cannot plan for {n_devices} devices")
    if n_devices % nodes:
        raise ConfigError(f"{n_devices} device(s) cannot be split evenly into {nodes} node(s)")
    return n_devices // nodes


def enumerate_shapes(cfg: Config, n_devices: int, nodes: int) -> list[MeshShape]:
    """All meshes over ``n_devices`` on ``nodes`` nodes that the model and batch allow (:func:`search_shapes`).
    Raises ConfigError saying why when nothing is valid."""
    return search_shapes(cfg, n_devices, nodes)[0]


def search_shapes(cfg: Config, n_devices: int, nodes: int) -> tuple[list[MeshShape], dict[str, list[MeshShape]]]:
    """(valid meshes, {why rejected: the meshes rejected so}) over ``n_devices`` on ``nodes`` nodes.

    Each node's devices form the ici part, factorised over data, stage, fsdp, context and tensor (its product is the
    devices per node), and the dcn parts over data, stage, fsdp and context multiply to the node count; context > 1
    only where the batch is split to one sequence per group (:data:`CONTEXT_AFTER_BATCH`). Tensor parallelism stays
    inside a node (dcn tensor = 1): its per-layer activation all-reduces would otherwise cross the network. A pipeline
    (stage > 1) needs ``train.microbatches`` a multiple of the stages and ``model.n_layers`` a multiple of stages x
    ``train.virtual_stages`` (``ParallelDims.check``); with the default single microbatch every stage > 1
    mesh is rejected (:func:`pipeline_note` says so). Raises ConfigError saying why when nothing is valid.
    """
    per_node = devices_per_node(n_devices, nodes)
    shapes: list[MeshShape] = []
    rejected: dict[str, list[MeshShape]] = {}
    for ici in _factorizations(per_node, len(MESH_AXES)):
        for dcn_dsf in _factorizations(nodes, len(MESH_AXES) - 1):
            shape = MeshShape(ici=ici, dcn=(*dcn_dsf, 1))
            try:
                ParallelDims(cfg, shape).check()
            except ConfigError as e:
                rejected.setdefault(str(e), []).append(shape)
                continue
            if shape.size(Axis.CONTEXT) > 1 and ParallelDims(cfg, shape).rows_per_group > 1:
                rejected.setdefault(CONTEXT_AFTER_BATCH, []).append(shape)
                continue
            shapes.append(shape)
    if not shapes:
        why = "; ".join(f"{s[0].label}: {msg}" for msg, s in list(rejected.items())[:3])
        raise ConfigError(f"no valid mesh over {n_devices} device(s) on {nodes} node(s): {why}")
    return shapes, rejected


# Splitting the sequence costs a K/V ring per layer; splitting the batch further costs no attention traffic and
# frees the same activation memory. So the search splits sequences only once every data-parallel group holds one.
CONTEXT_AFTER_BATCH = ("context > 1 only where each data-parallel group holds one sequence per microbatch (split the "
                       "batch over data or fsdp first; more microbatches also leave fewer)")


def pipeline_note(cfg: Config, rejected: dict[str, list[MeshShape]], planned: list[MeshShape]) -> str | None:
    """A line for the plan's notes when no pipeline (stage > 1) mesh is planned though some were considered: how
    many, and the first reason (most often ``train.microbatches=1``), so that the user learns what to set."""
    if any(s.size(Axis.STAGE) > 1 for s in planned):
        return None
    staged = [(msg, s) for msg, group in rejected.items() for s in group if s.size(Axis.STAGE) > 1]
    if not staged:
        return None
    # The example: a reason that rejected only pipelines (the microbatches, the layer split), if there is one.
    only_pipelines = {msg for msg, group in rejected.items() if all(s.size(Axis.STAGE) > 1 for s in group)}
    msg, first = next(((m, s) for m, s in staged if m in only_pipelines), staged[0])
    # Stage counts the layer stack splits into: for those the microbatch count is what is missing.
    stages = sorted({n for _, s in staged if cfg.model.n_layers % ((n := s.size(Axis.STAGE))
                                                                   * cfg.train.virtual_stages) == 0})
    hint, k = "", math.lcm(*stages) if stages else 0
    if stages and any(cfg.train.microbatches % n for n in stages) and _microbatches_help(cfg, first, k, msg):
        hint = (f" Set train.microbatches to a multiple of the stages ({k} covers "
                f"{', '.join(map(str, stages))}) to plan pipelines.")
    return (f"no pipeline mesh (stage > 1) was planned: all {len(staged)} were rejected, e.g. {first.label}: "
            f"{msg}.{hint}")


def _microbatches_help(cfg: Config, shape: MeshShape, microbatches: int, reason: str) -> bool:
    """Whether ``shape``'s refusal (``reason``) goes with ``microbatches`` (it stays for chat data, say)."""
    more = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, microbatches=microbatches))
    try:
        ParallelDims(more, shape).check()
    except ConfigError as e:
        return str(e) != reason
    return True


def given_shape(cfg: Config, n_devices: int, nodes: int) -> MeshShape:
    """The config's own mesh over ``n_devices`` (the -1 axis filled), checked against the node count."""
    shape = MeshShape.resolve(cfg.mesh, n_devices)
    ParallelDims(cfg, shape).check()
    devices_per_node(n_devices, nodes)
    if shape.num_nodes != nodes:
        raise ConfigError(f"mesh.dcn sizes multiply to {shape.num_nodes} but the plan is for {nodes} node(s); "
                          f"set --nodes {shape.num_nodes} or change mesh.dcn")
    return shape


# ---------------------------------------------------------------------------------------------------------------
# Compiling


@dataclass
class Compiled:
    """What one compile of the step gives, independent of how the axes split over nodes."""

    params_bytes: int
    opt_bytes: int
    temp_bytes: int
    memory_bytes: int  # arguments + temporaries + outputs not aliased to (donated) arguments
    collectives: list[Collective]
    unknown_loops: list[UnknownLoop]
    compile_s: float
    # What another reading adds to the plan's row (the XLA:GPU compile's: planner/xla_gpu/deviceless.py,
    # PlanCompiler.read).
    extra: dict = dataclasses.field(default_factory=dict)


def _step(cfg: Config, shape: MeshShape, devices: list):
    from jaxtrain.train.step import setup

    return setup(shape.apply(cfg), devices[:shape.num_devices])


def compile_train_step(step):
    """The train step of a ``step.Step`` compiled ahead of time from abstract shapes (nothing allocated), and the
    seconds it took; without the eval step, which the plan does not need (about a fifth of the compile time)."""
    compiled, _, seconds = step.compile(with_eval=False)
    return compiled, seconds


def compile_step(cfg: Config, shape: MeshShape, devices: list) -> Compiled:
    """Lower and compile the real train step for ``shape`` from abstract shapes (nothing is allocated)."""
    return _compile(_step(cfg, shape, devices))


def _compile(step) -> Compiled:
    return reading(step, *compile_train_step(step))


def reading(step, train, seconds: float) -> Compiled:
    """What the planner reads off ``train``, the compiled train step of ``step`` (memory, collectives)."""
    from jaxtrain.parallel.layout import compiled_need

    layout = step.layout
    params, opt = layout.state_bytes
    need, text = compiled_need(train), train.as_text()
    if need is None or text is None:  # a backend without them cannot be planned on
        raise RuntimeError("the compiled step offers no memory analysis or HLO text on this backend")
    # XLA:GPU's program (GPUs at hand, or a deviceless GPU compile) has run the collective passes the planner
    # re-creates for XLA:CPU's: read it as it states its collectives.
    colls, unknown = collectives(text, tuple(layout.shape.axis_sizes.values()), layout.param_axes,
                                 compiled_for_cpu=layout.platform == "cpu")
    return Compiled(params, opt, need.temporaries, need.total, colls, unknown, seconds)


# ---------------------------------------------------------------------------------------------------------------
# Planning


def candidate_result(cfg: Config, shape: MeshShape, hw: Hardware, comp: Compiled, attention: str | None = None) -> dict:
    """One row of the plan (the JSON contract's keys plus details); ``attention``: the kernel the run uses, where
    the compiled step has a stand-in (cost.compute_seconds)."""
    est, summary = estimate(cfg, shape, hw, comp.collectives, comp.params_bytes, comp.opt_bytes, attention)
    stages, micro, virtual, bubble = pipeline_schedule(cfg, shape)
    by_kind = {k: 0 for k in KINDS}
    for c in comp.collectives:
        by_kind[c.kind] += c.total_bytes
    one_f_one_b = stages > 1 and cfg.train.pipeline_schedule == "1f1b"
    return {
        "mesh": shape.as_dict(),
        "label": shape.label + (" 1f1b" if one_f_one_b else ""),
        "schedule": cfg.train.pipeline_schedule if stages > 1 else None,
        "memory_bytes_per_device": comp.memory_bytes,
        "memory": {"params": comp.params_bytes, "optimizer": comp.opt_bytes, "temp": comp.temp_bytes,
                   "usable": hw.usable_bytes},
        "collective_bytes": by_kind,
        "intra_node_bytes_per_device": est.ici_bytes,
        "inter_node_bytes_per_device": est.dcn_bytes,
        "collectives": summary,
        "est_step_seconds": est.serial_s,
        "est_step_seconds_overlap": est.overlap_s,
        "time": {"compute": est.compute_s, "intra_node": est.ici_s, "inter_node": est.dcn_s,
                 "optimizer": est.optimizer_s},
        "fits": comp.memory_bytes <= hw.usable_bytes,
        # Pipeline (stage > 1; without one: bubble 0, one virtual stage). Every device of a stage compiles to the
        # same program, so the per-device temporaries (memory.temp: activations kept for the backward, the
        # pipeline's buffers) times the stage's devices are the stage's.
        "bubble_fraction": bubble,
        "microbatches": micro,
        "virtual_stages": virtual,
        "pipeline": {"stages": stages, "iterations": 0 if stages == 1 else
                     (pipeline_1f1b if one_f_one_b else pipeline).iterations(stages, micro, virtual),
                     "permute_bytes_per_device": {"intra_node": est.permute_ici_bytes,
                                                  "inter_node": est.permute_dcn_bytes},
                     "temp_bytes_per_stage": comp.temp_bytes * (shape.num_devices // stages)},
        "compile_seconds": comp.compile_s,
        "unknown_trip_count_loops": [{"name": u.name, "op_name": u.op_name, "holds_collectives": u.holds_collectives}
                                     for u in comp.unknown_loops],
        **comp.extra,
    }


def rank(candidates: list[dict]) -> list[dict]:
    """Meshes that fit first, then by estimated step time (no overlap)."""
    return sorted(candidates, key=lambda r: (not r["fits"], r["est_step_seconds"]))


def plan(cfg: Config, shapes: list[MeshShape], hw: Hardware, devices: list,
         progress: Callable[[str], None] = lambda msg: None, gpu=None, attention: str | None = None) -> dict:
    """Compile each distinct axis-size combination once and report every shape, ranked by :func:`rank`.

    A shape whose parameter and optimizer shards alone exceed the usable memory is not compiled (it cannot fit
    whatever the activations) and is listed under ``pruned``. ``gpu``: a ``xla_gpu.PlanCompiler`` whose XLA:GPU
    compile of each layout replaces the CPU-derived figures (kept beside them). ``attention``: the kernel the run
    uses where ``cfg`` compiles a stand-in (``target.Target.attention``), for the step time.
    """
    def read(c: Config, shape: MeshShape, step) -> Compiled:
        comp = _compile(step)
        return comp if gpu is None else gpu.read(c, shape, comp)

    by_sizes: dict[tuple[int, ...], list[MeshShape]] = {}
    for s in shapes:
        by_sizes.setdefault(tuple(s.axis_sizes.values()), []).append(s)
    results, pruned = [], []
    for i, group in enumerate(by_sizes.values(), 1):
        step = _step(cfg, group[0], devices)
        params, opt = step.layout.state_bytes
        if params + opt > hw.usable_bytes:
            for s in group:
                pruned.append({"mesh": s.as_dict(), "label": s.label, "state_bytes_per_device": params + opt,
                               "reason": f"parameters + optimizer state alone take {params + opt:,} bytes per "
                                         f"device > {hw.usable_bytes:,.0f} usable"})
            progress(f"[{i}/{len(by_sizes)}] {group[0].label}: pruned, state alone does not fit")
            continue
        t0 = time.perf_counter()
        comp = read(cfg, group[0], step)
        sizes_text = " ".join(f"{ax}={n}" for ax, n in group[0].axis_sizes.items())
        progress(f"[{i}/{len(by_sizes)}] {sizes_text}: compiled in {time.perf_counter() - t0:.1f} s")
        results += [candidate_result(cfg, s, hw, comp, attention) for s in group]
        if group[0].size(Axis.STAGE) > 1 and cfg.train.pipeline_schedule == "gpipe" and \
                comp.memory_bytes > hw.usable_bytes:
            # GPipe keeps every microbatch's stage inputs: where that does not fit, plan the 1F1B schedule too,
            # whose stage inputs are bounded by the stages (the ranking then puts it first if it fits).
            one_f_one_b = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, pipeline_schedule="1f1b"))
            t0 = time.perf_counter()
            comp = read(one_f_one_b, group[0], _step(one_f_one_b, group[0], devices))
            progress(f"[{i}/{len(by_sizes)}] {sizes_text} 1f1b (GPipe does not fit): compiled in "
                     f"{time.perf_counter() - t0:.1f} s")
            results += [candidate_result(one_f_one_b, s, hw, comp, attention) for s in group]
    return {"candidates": rank(results), "pruned": pruned}
