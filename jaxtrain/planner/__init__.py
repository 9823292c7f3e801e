"""Plan a mesh before paying for it: memory, collectives and an estimated step time for each candidate mesh.

For every candidate layout the real train step is lowered and compiled ahead of time for that many devices
(emulated CPU devices will do) from abstract shapes, so nothing is allocated. From the compiled program:

- memory per device: parameter and optimizer-state shards (exact, from the abstract state's shardings) and the
  compiler's temporary buffers (``Compiled.memory_analysis()``);
- collectives (``Compiled.as_text()``): kind, bytes, and the mesh axes their replica groups span, multiplied by the
  trip counts of the loops they run in, with the effect of XLA:GPU's collective passes that XLA:CPU does not run;
- for GPUs that are not here, where a CUDA jax plugin is installed: the same step compiled by XLA:GPU for them
  (``xla_gpu.deviceless``), whose memory and collectives replace the CPU-derived ones, and what its program must hold
  (``xla_gpu.program``: the attention kernel, no S x S scores, no float32 GEMM in 16-bit runs, the collectives);
- an estimated step time: model FLOPs over (peak x efficiency), ring communication time per link class (NVLink
  within a node, the network between nodes), and the memory-bound optimizer update.

Packages, in the order a plan uses them (each imports only those before it): ``cost`` (the compiled program read as
data: ``hlo``, ``collectives``, ``passes``, the GPU collective passes; ``model``, bytes per link and time per part;
``measure``, the devices at hand; ``calibration``, what the health check measured), ``search`` (``target``, what the
plan is for: hardware, devices, nodes, the config as it runs there, the meshes; ``meshes``, candidate meshes,
pruning, compiling; ``report``, table and JSON), then ``auto`` (``mesh.auto``'s choice of a layout: ``choose``,
``space``, ``figures``, ``trial``, ``compile_cache``, ``report``) and ``xla_gpu`` (``deviceless`` and the process it
starts, ``child``, compile for GPUs without one; ``program`` checks the GPU program, ``fp8_gemms`` its float8
GEMMs). This module is ``jaxtrain plan``'s entry point.

May import: errors, config, cluster, models, parallel and train (the step it compiles); never the loop's I/O. The
packages' own docstrings say which of them each may import (tests/test_structure.py FLOORS).
"""

from __future__ import annotations

import json
import sys

from jaxtrain.config import Config


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def main(cfg: Config, overrides: list[str], *, hardware_name: str | None = None, nodes: int | None = None,
         efficiency: float | None = None, mem_fraction: float | None = None, as_json: bool = False,
         calibration_path: str | None = None) -> int:
    """``jaxtrain plan mesh.auto=true``: the layout ``mesh.auto`` would choose for ``cfg`` (loaded from the command
    line's ``overrides``, which say which mesh sizes are given) on the hardware named, or the devices at hand;
    print its report or JSON. Returns the exit status. Plans of given meshes: ``jaxtrain.commands.plan``."""
    assert cfg.mesh.auto, "planner.main plans mesh.auto=true; commands/plan.py plans given meshes"
    from jaxtrain.planner.search import target as target_lib

    target = target_lib.resolve(cfg, overrides, hardware_name=hardware_name, nodes=nodes, efficiency=efficiency,
                                mem_fraction=mem_fraction)
    from jaxtrain.cluster import process as runtime
    from jaxtrain.planner.auto import choose as auto
    from jaxtrain.planner.auto import compile_cache
    from jaxtrain.planner.auto import report as auto_report
    from jaxtrain.planner.search import report

    runtime.quiet_logs()
    # Measured figures (`check`'s calibration file: --calibration, else run.dir's) replace the hardware file's.
    if hardware_name is None and target.devices[0].platform == "cpu":
        # train's figures: the same choice
        cal = auto.hardware_for(target.cfg, target.devices, calibration_path, target.nodes, progress=log,
                                cache_dir=compile_cache.plan_cache_dir(target.cfg.runtime.compile_cache))
        target.hw = cal.hw
        target.notes.append(cal.note("the devices at hand (measured by plan)"))
    else:
        apply_calibration(target, hardware_name is not None, calibration_path)
    gpu = gpu_compiler(target, cfg) if hardware_name else None
    # The layout train would choose (docs/auto-layout.md). plan writes into no run directory (run.dir is the default
    # job's unless given): its readings go into this user's cache, keyed by everything they depend on, so every
    # later plan finds them.
    res = auto.search_layout(target.cfg, target.devices, target.hw, target.nodes, progress=log,
                             cache_dir=compile_cache.plan_cache_dir(target.cfg.runtime.compile_cache), gpu=gpu,
                             attention=target.attention)
    warnings = report.gpu_warnings([r.result for r in res.compiled if r.result is not None])
    print(json.dumps({"notes": target.notes, **auto_report.to_json(res), "warnings": warnings}, indent=1)
          if as_json else "\n".join([*(f"note: {n}" for n in target.notes), auto_report.format_result(res),
                                     *warnings]))
    return 0


def apply_calibration(target, on_hardware: bool, calibration_path: str | None) -> None:
    """``target``'s hardware figures replaced by ``check``'s measured ones (``--calibration``, else run.dir's
    calibration.json) where they fit the devices planned for (the hardware file's with ``on_hardware``, else the
    devices at hand), and a note saying which were used."""
    from jaxtrain.planner.cost import calibration

    devices = (calibration.Devices.of_hardware(target.hw, target.nodes) if on_hardware else
               calibration.Devices.at_hand(target.devices))
    cal = calibration.for_plan(target.hw, calibration_path, target.cfg.run.dir, target.cfg.model.dtype, devices)
    target.hw = cal.hw
    target.notes.append(cal.note(f"the hardware file {target.hw.name}" if on_hardware else
                                 "the devices at hand (measured by plan)"))


def gpu_compiler(target, cfg: Config):
    """The GPU's own compiler for ``target`` where it is installed (``xla_gpu/deviceless.py``), for ``cfg``'s
    attention as given (before the target resolved it), or None; its note joins the target's."""
    from jaxtrain.planner.xla_gpu import deviceless as xla_gpu

    gpu, note = xla_gpu.for_plan(target.hw, target.nodes, cfg.model.attention)
    target.notes.append(note)
    return gpu
