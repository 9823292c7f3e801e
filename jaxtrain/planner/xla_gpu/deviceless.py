"""The train step compiled by XLA:GPU for GPUs that are not here: the planner's figures from the GPU's own compiler.

JAX compiles for a GPU topology without a GPU where a CUDA plugin is installed (``jax[cuda12]``, or ``.[gpu]``):
``jax.experimental.topologies.get_topology_desc(gpu, "cuda", target_config=TEXT, topology="1xNxG")`` gives N hosts
of G devices of the kind the target config (``jaxtrain/configs/gpu_targets/*.txtpb``, named by a hardware file's
``gpu_target``) describes, and a jitted step over them compiles with XLA:GPU: its memory analysis, fusions, cuDNN
and Triton custom calls, buffer assignment and collectives are the GPU's, not XLA:CPU's.

Each compile runs in its own process (``python -m jaxtrain.planner.xla_gpu.child``): a crash in the compiler
(jax 0.11 segfaulted on some pipelines, docs/gpu.md) ends that process, not the plan, and the CUDA plugin gets the
environment it needs to start without a GPU (``JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 JAX_PLATFORMS=cpu``) there only,
never in a training process. The Python that compiles: ``JAXTRAIN_GPU_COMPILER`` (a path to a Python with a CUDA jax
plugin and jaxtrain's dependencies, or ``off``), else this one if it has the plugin.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import json
import os
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from typing import Literal

from jaxtrain.config import Config, dump_yaml
from jaxtrain.config.hardware import Hardware, gpu_target_device_kind, gpu_targets
from jaxtrain.errors import ConfigError, one_line
from jaxtrain.parallel.dims import MeshShape
from jaxtrain.planner.search import meshes as search

ENV_VAR = "JAXTRAIN_GPU_COMPILER"
# What the CUDA plugin needs to start on a machine without a GPU: skip its driver and library version checks (they
# call cuInit, which fails without a driver), and give JAX the CPU backend only.
DEVICELESS_ENV = {"JAX_SKIP_CUDA_CONSTRAINTS_CHECK": "1", "JAX_PLATFORMS": "cpu"}
PLUGINS = ("jax_plugins.xla_cuda12", "jax_plugins.xla_cuda13")
TIMEOUT_S = 1800.0  # one compile; the 70B pipelines took 16-25 s on an idle 2-core machine, 100 s loaded
# Without autotuning (--xla_gpu_autotune_level=0) some GEMMs find no Triton config without a device ("No supported
# config found"); cuBLAS custom calls instead compile everywhere (within 0.2% of the memory where both compile).
NO_TRITON_GEMM = "--xla_gpu_enable_triton_gemm=false"


Attention = Literal["xla", "cudnn", "pallas", "triton", "auto"]  # config.tree.ModelConfig.attention


class GpuCompileError(RuntimeError):
    """The XLA:GPU compile of a layout failed or crashed; the message is one line."""


@dataclass(frozen=True)
class Compiler:
    """A Python that can compile for GPUs without one: its path and what it says of itself."""

    python: str
    jax_version: str
    plugin: str  # e.g. "jax_cuda12_plugin 0.11.2"

    @property
    def label(self) -> str:
        return f"jax {self.jax_version}, {self.plugin}" + ("" if self.python == sys.executable else
                                                           f", {self.python}")


_PROBE = ("import importlib.metadata as m, importlib.util as u, json, jax\n"
          f"p = [n for n in {PLUGINS!r} if u.find_spec(n)]\n"
          "d = {'jax_cuda12_plugin', 'jax_cuda13_plugin', 'jax-cuda12-plugin', 'jax-cuda13-plugin'}\n"
          "v = [f'{x.metadata[\"Name\"]} {x.version}' for x in m.distributions() if x.metadata['Name'] in d]\n"
          "print('PROBE ' + json.dumps({'jax': jax.__version__, 'plugin': (v or p or [''])[0]}))\n")


def find_compiler() -> tuple[Compiler | None, str]:
    """(the GPU compiler, "") or (None, why there is none): ``JAXTRAIN_GPU_COMPILER`` names a Python (or ``off``);
    unset, this Python if a CUDA jax plugin is installed. Each Python is asked for its jax and plugin once."""
    return _find(os.environ.get(ENV_VAR, "").strip())


@functools.cache
def _find(named: str) -> tuple[Compiler | None, str]:
    if named.lower() in ("off", "0", "none", "false"):
        return None, f"{ENV_VAR}={named}"
    if not named and not any(_has_module(p) for p in PLUGINS):
        return None, (f"no CUDA jax plugin in this Python (pip install '.[gpu]', or set {ENV_VAR} to a Python that "
                      "has one)")
    python = named or sys.executable
    try:
        proc = subprocess.run([python, "-c", _PROBE], env=_child_env(), capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired) as e:
        return None, f"{ENV_VAR}={python}: {one_line(e)}"
    found = [line[6:] for line in proc.stdout.splitlines() if line.startswith("PROBE ")]
    if proc.returncode or not found:
        return None, f"{python} cannot import jax: {_last_error(proc.stderr)}"
    info = json.loads(found[0])
    if not info["plugin"]:
        return None, f"{python} has jax {info['jax']} but no CUDA plugin (jax[cuda12] or jax[cuda13])"
    return Compiler(python, info["jax"], info["plugin"]), ""


def _has_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def _child_env(extra_flags: str = "") -> dict[str, str]:
    """The environment of a compile process: this one's, the deviceless settings, this jaxtrain first on the path,
    and XLA_FLAGS without the flags the planner set for its own XLA:CPU compiles."""
    from jaxtrain.cluster import process

    env = {**os.environ, **DEVICELESS_ENV}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join([root, *filter(None, [os.environ.get("PYTHONPATH")])])
    flags = process.user_xla_flags()
    if "--xla_gpu_autotune_level=0" in flags and NO_TRITON_GEMM not in flags:
        flags.append(NO_TRITON_GEMM)
    env["XLA_FLAGS"] = " ".join([*flags, *extra_flags.split()])
    return env


def _last_error(stderr: str) -> str:
    """The line of a failed compile's output that says why: the last exception line, else the last line."""
    lines = [x.strip() for x in stderr.splitlines() if x.strip()]
    named = [x for x in lines if x.split(":")[0].endswith(("Error", "Exception")) or x.startswith("ERROR ")]
    return " ".join((named or lines or ["no output"])[-1].removeprefix("ERROR ").split())[:500]


@dataclass
class GpuReading:
    """One layout's XLA:GPU compile: the planner's reading and what was checked of the program."""

    compiled: search.Compiled
    device_kind: str
    topology: str
    attention: str  # the attention the program runs (model.attention resolved for the layout on GPUs)
    stand_in: str  # "" or what was compiled in another's place, and why
    attention_calls: dict[str, int]
    violations: list[str]
    flags: str  # XLA flags added for this compile ("" for none)


def compile_layout(compiler: Compiler, cfg: Config, gpu_target: str, nodes: int, per_node: int, *,
                   hlo_path: str | None = None, timeout: float = TIMEOUT_S) -> GpuReading:
    """``cfg``'s train step (its mesh pinned: ``MeshShape.apply``; ``model.attention`` as the user set it) compiled
    by XLA:GPU for ``nodes`` x ``per_node`` GPUs of ``gpu_target``, in a process of its own; its HLO written to
    ``hlo_path`` if given. GpuCompileError (one line) when it fails or crashes."""
    if gpu_target not in gpu_targets():
        raise ConfigError(f"gpu_target {gpu_target!r} is not a shipped GPU target config; shipped: "
                          f"{', '.join(gpu_targets())}")
    try:
        return _run(compiler, cfg, gpu_target, nodes, per_node, hlo_path, timeout, "")
    except GpuCompileError as e:
        if "No supported config found" not in str(e):
            raise
        return _run(compiler, cfg, gpu_target, nodes, per_node, hlo_path, timeout, NO_TRITON_GEMM)


def _run(compiler: Compiler, cfg: Config, gpu_target: str, nodes: int, per_node: int, hlo_path: str | None,
         timeout: float, flags: str) -> GpuReading:
    with tempfile.TemporaryDirectory(prefix="jaxtrain-xla-gpu-") as tmp:
        config_path, request = os.path.join(tmp, "config.yaml"), os.path.join(tmp, "request.json")
        with open(config_path, "w") as f:
            f.write(dump_yaml(cfg))
        with open(request, "w") as f:
            json.dump({"config": config_path, "gpu_target": gpu_target, "nodes": nodes, "per_node": per_node,
                       "hlo": hlo_path}, f)
        try:
            proc = subprocess.run([compiler.python, "-m", "jaxtrain.planner.xla_gpu.child", request],
                                  env=_child_env(flags), capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            raise GpuCompileError(f"XLA:GPU compile did not finish within {timeout:.0f} s") from None
    found = [line[7:] for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode < 0:
        name = signal.Signals(-proc.returncode).name
        raise GpuCompileError(f"the XLA:GPU compiler crashed ({name}); last output: {_last_error(proc.stderr)}")
    if proc.returncode or not found:
        raise GpuCompileError(f"XLA:GPU compile failed: {_last_error(proc.stderr)}")
    return _reading(json.loads(found[0]), flags)


def _reading(d: dict, flags: str) -> GpuReading:
    import numpy as np

    from jaxtrain.planner.cost.collectives import Collective
    from jaxtrain.planner.cost.hlo import UnknownLoop

    colls = [Collective(k, b, n, np.asarray(g, dtype=np.int64).reshape(len(g), -1), op)
             for k, b, n, g, op in d["collectives"]]
    loops = [UnknownLoop(name, op, holds_collectives=h) for name, op, h in d["unknown_loops"]]
    comp = search.Compiled(d["params_bytes"], d["opt_bytes"], d["temp_bytes"], d["memory_bytes"], colls, loops,
                           d["compile_s"])
    return GpuReading(comp, d["device_kind"], d["topology"], d["attention"], d["stand_in"], d["attention_calls"],
                      d["violations"], flags)


def reading_json(comp: search.Compiled) -> dict:
    """A reading as JSON (what the compile process prints): sizes, collectives, loops."""
    sizes = ("params_bytes", "opt_bytes", "temp_bytes", "memory_bytes", "compile_s")
    return {**{k: getattr(comp, k) for k in sizes},
            "collectives": [[c.kind, c.bytes, c.count, c.groups.tolist(), c.op_name] for c in comp.collectives],
            "unknown_loops": [[u.name, u.op_name, u.holds_collectives] for u in comp.unknown_loops]}


# ---------------------------------------------------------------------------------------------------------------
# In a plan: the GPU's figures first, the CPU-derived ones beside them


@dataclass
class PlanCompiler:
    """``plan --hardware``'s XLA:GPU compiles: ``read`` turns a CPU-derived reading into the GPU's (the CPU one kept
    under ``cpu_derived``), or keeps the CPU's, labelled, where the GPU compile fails."""

    compiler: Compiler
    gpu_target: str
    nodes: int
    per_node: int
    attention: Attention  # model.attention as the user set it ("auto": resolved per layout, as on the GPUs)

    @property
    def label(self) -> str:
        """What compiles the figures (part of the compile cache's key: compile_cache.cache_key)."""
        return f"{self.gpu_target} 1x{self.nodes}x{self.per_node}, {self.compiler.label}"

    def read(self, cfg: Config, shape: MeshShape, cpu: search.Compiled) -> search.Compiled:
        on_gpu = shape.apply(dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, attention=self.attention)))
        try:
            res = compile_layout(self.compiler, on_gpu, self.gpu_target, self.nodes, self.per_node)
        except (GpuCompileError, ConfigError) as e:
            return dataclasses.replace(cpu, extra={**cpu.extra, "figures": "xla-cpu", "xla_gpu_error": str(e)})
        by_kind: dict[str, int] = {}
        for c in cpu.collectives:
            by_kind[c.kind] = by_kind.get(c.kind, 0) + c.total_bytes
        return dataclasses.replace(res.compiled, extra={
            "figures": "xla-gpu",
            "cpu_derived": {"memory_bytes_per_device": cpu.memory_bytes, "temp": cpu.temp_bytes,
                            "collective_bytes": by_kind, "compile_seconds": cpu.compile_s},
            "xla_gpu": {"device_kind": res.device_kind, "topology": res.topology, "attention": res.attention,
                        "stand_in": res.stand_in, "attention_calls": res.attention_calls,
                        "violations": res.violations, "flags": res.flags, "compiler": self.compiler.label}})


def for_plan(hw: Hardware, nodes: int, attention: Attention) -> tuple[PlanCompiler | None, str]:
    """The XLA:GPU compiles of a plan for ``hw`` on ``nodes`` nodes, or None and a note saying why the figures are
    XLA:CPU's (no ``gpu_target``, no GPU compiler); the note for the plan either way."""
    if not hw.gpu_target:
        return None, (f"memory and collectives are CPU-derived (XLA:CPU, the GPU's collective passes re-applied): "
                      f"hardware {hw.name} names no gpu_target")
    compiler, why = find_compiler()
    kind = gpu_target_device_kind(hw.gpu_target)
    if compiler is None:
        return None, (f"memory and collectives are CPU-derived (XLA:CPU, the GPU's collective passes re-applied), "
                      f"not XLA:GPU's for {kind}: {why}")
    return PlanCompiler(compiler, hw.gpu_target, nodes, hw.devices_per_node, attention), (
        f"memory and collectives from XLA:GPU's compile of each layout for {nodes} x {hw.devices_per_node} {kind} "
        f"(deviceless, {compiler.label}); the CPU-derived figures beside them (cpu_derived in --json)")
