"""Compiling for GPUs without one (jaxtrain.planner.xla_gpu.deviceless): finding the compiler, failures in one line, and
the plan's table and JSON with XLA:GPU's figures beside the CPU-derived ones; slow: every layout of
tools/gpu_layouts.py marked ``ci`` (the README's and docs' layouts, 1B to 70B, every axis and both pipeline
schedules) compiled by XLA:GPU for its hardware file's GPU and node count, each in its own process, with the attention
that will run, and its program checked (planner/xla_gpu/program.py).

The slow test needs a GPU compiler: a Python with a CUDA jax plugin, named by JAXTRAIN_GPU_COMPILER (docs/testing.md:
the 1.6 GB it needs beside jax is not installed by .ci/run); it skips without one.
"""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest

from jaxtrain.config import load_config
from jaxtrain.config.hardware import load_hardware
from jaxtrain.errors import ConfigError
from jaxtrain.parallel.dims import MeshShape
from jaxtrain.planner.cost.collectives import Collective
from jaxtrain.planner.search import meshes as search
from jaxtrain.planner.search import report
from jaxtrain.planner.xla_gpu import deviceless as xla_gpu

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_spec = importlib.util.spec_from_file_location("gpu_layouts", os.path.join(REPO, "tools", "gpu_layouts.py"))
gpu_layouts = sys.modules["gpu_layouts"] = importlib.util.module_from_spec(_spec)  # dataclasses look it up there
_spec.loader.exec_module(gpu_layouts)


def test_the_compiler_can_be_switched_off_and_says_why_it_is_missing(monkeypatch):
    monkeypatch.setenv(xla_gpu.ENV_VAR, "off")
    assert xla_gpu.find_compiler() == (None, f"{xla_gpu.ENV_VAR}=off")
    monkeypatch.setenv(xla_gpu.ENV_VAR, "/nonexistent/python")
    compiler, why = xla_gpu.find_compiler()
    assert compiler is None and why.startswith(f"{xla_gpu.ENV_VAR}=/nonexistent/python: ")


def test_a_failed_compile_is_one_line(tmp_path):
    """This Python's jax has no CUDA backend (the test environment): the compile process fails for real and the
    planner gets one line saying why, not a traceback."""
    if any(xla_gpu._has_module(p) for p in xla_gpu.PLUGINS):
        pytest.skip("this Python has a CUDA plugin: the compile would not fail")
    import jax

    compiler = xla_gpu.Compiler(sys.executable, jax.__version__, "none")
    cfg = load_config(None, [f"run.dir={tmp_path}"])
    with pytest.raises(xla_gpu.GpuCompileError, match=r"^XLA:GPU compile failed: \S") as info:
        xla_gpu.compile_layout(compiler, MeshShape.resolve(cfg.mesh, 8).apply(cfg), "h100", 1, 8, timeout=300)
    assert "\n" not in str(info.value) and "Traceback" not in str(info.value)
    with pytest.raises(ConfigError, match=r"gpu_target 'h900' is not a shipped GPU target config"):
        xla_gpu.compile_layout(compiler, cfg, "h900", 1, 8)


def _row(comp: search.Compiled):
    cfg = load_config(None, ["mesh.ici.fsdp=8"])
    return search.candidate_result(cfg, MeshShape.resolve(cfg.mesh, 8), load_hardware("h100-8x"), comp)


def test_the_plan_shows_both_figures_and_each_violation():
    import numpy as np

    gathers = [Collective("all-gather", 1_000_000, 4, np.arange(8)[None, :])]
    gpu = search.Compiled(100, 200, 30_000_000_000, 30_000_000_300, gathers, [], 12.0, extra={
        "figures": "xla-gpu", "cpu_derived": {"memory_bytes_per_device": 45_000_000_300, "temp": 45e9,
                                              "collective_bytes": {"all-gather": 4_000_000}, "compile_seconds": 9.0},
        "xla_gpu": {"violations": ["precision: 1 float32 GEMM(s) where model.dtype=bfloat16, e.g. %dot.1: f32[8]"],
                    "stand_in": "", "attention": "cudnn"}})
    failed = search.Compiled(100, 200, 50_000_000_000, 50_000_000_300, gathers, [], 8.0, extra={
        "figures": "xla-cpu", "xla_gpu_error": "the XLA:GPU compiler crashed (SIGSEGV); last output: x"})
    rows = [_row(gpu), _row(failed)]
    assert rows[0]["memory_bytes_per_device"] == 30_000_000_300 and rows[0]["cpu_derived"]["temp"] == 45e9
    text = report.format_report(load_config(None, []), load_hardware("h100-8x"), 8, 1,
                                {"candidates": rows, "pruned": []})
    header = next(line for line in text.splitlines() if line.startswith("#"))
    assert header.split()[:6] == ["#", "mesh", "(ici", "|", "dcn)", "memory"] and "cpu-derived" in header
    table = [line.split() for line in text.split("\n\n")[1].splitlines()[2:]]
    assert [line[2:7] for line in table] == [["30", "GB", "45", "GB", "yes"], ["50", "GB", "(cpu)", "yes", "3.5"]]
    assert ("warning: fsdp8: XLA:GPU program: precision: 1 float32 GEMM(s) where model.dtype=bfloat16, e.g. "
            "%dot.1: f32[8]") in text
    assert ("warning: fsdp8: the XLA:GPU compiler crashed (SIGSEGV); last output: x (its figures are "
            "CPU-derived)") in text
    plain = report.format_report(load_config(None, []), load_hardware("h100-8x"), 8, 1,
                                 {"candidates": [_row(search.Compiled(1, 2, 3, 6, gathers, [], 1.0))], "pruned": []})
    assert "cpu-derived" not in plain  # a plan without XLA:GPU figures has no such column


COMPILER, WHY = xla_gpu.find_compiler()


@pytest.mark.slow
@pytest.mark.skipif(COMPILER is None, reason=f"no GPU compiler: {WHY}")
@pytest.mark.parametrize("layout", [x for x in gpu_layouts.LAYOUTS if x.ci], ids=lambda x: x.name)
def test_shipped_layout_compiles_for_its_gpu(layout):
    """The layout compiles with XLA:GPU for its hardware (auto attention: cuDNN, or the flash kernel where the
    sequence is split over context), and its program is what the config asks for."""
    hw = load_hardware(layout.hardware)
    cfg = load_config(layout.config, list(layout.overrides))
    shape = MeshShape.resolve(cfg.mesh, hw.devices_per_node * layout.nodes)
    res = xla_gpu.compile_layout(COMPILER, shape.apply(cfg), hw.gpu_target, layout.nodes, hw.devices_per_node)
    assert res.device_kind in hw.kinds
    assert res.attention == ("pallas" if shape.axis_sizes["context"] > 1 else "cudnn")
    assert res.violations == []
    assert res.compiled.memory_bytes > res.compiled.params_bytes + res.compiled.opt_bytes


@pytest.mark.slow
@pytest.mark.skipif(COMPILER is None, reason=f"no GPU compiler: {WHY}")
def test_the_auto_search_for_gpus_reads_xla_gpu_and_caches_it(tmp_path):
    """plan --hardware mesh.auto=true: each compiled candidate's figures are XLA:GPU's (the CPU-derived beside them),
    and a second search reads them from the compile cache, still XLA:GPU's."""
    import json

    from jaxtrain_testing import run_cli

    args = ["plan", "--hardware", "h100-8x", "mesh.auto=true", f"run.dir={tmp_path}", "model.attention=auto",
            "model.head_dim=32",
            "train.global_batch=8", "--json"]
    runs = []
    for _ in range(2):
        proc = run_cli(*args, timeout=3000, env={**os.environ, xla_gpu.ENV_VAR: COMPILER.python})
        assert proc.returncode == 0, proc.stderr[-2000:]
        runs.append(json.loads(proc.stdout))
    first, second = runs
    assert first["compiles"] >= 1 and second["compiles"] == 0 and second["cache_hits"] == first["compiles"]
    for res in runs:
        assert all(r["figures"] == "xla-gpu" and r["cpu_derived"]["memory_bytes_per_device"] > 0
                   for r in res["compiled"])
        assert res["warnings"] == []
    assert first["choice"] == second["choice"]
