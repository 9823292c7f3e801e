"""The driver / JAX CUDA plugin verdict (jaxtrain.cluster.gpu_env) as a pure function of driver and plugins, and
``python -m jaxtrain env`` on this CPU machine: as it is (no driver), and with a driver's two faces put in place
(a libcuda.so.1 answering cuDriverGetVersion, compiled here, and an nvidia-smi printing a real header)."""

import json
import os
import shutil
import subprocess

import pytest

from jaxtrain.cluster.gpu_env import Driver, verdict
from jaxtrain_testing import run_cli

NO_DRIVER = Driver(None, None, "no libcuda.so.1 and no nvidia-smi")
R535 = Driver((12, 2), "535.183.01", "libcuda + nvidia-smi")
R550 = Driver((12, 4), "550.54.14", "libcuda + nvidia-smi")
R580 = Driver((13, 0), "580.65.06", "libcuda + nvidia-smi")
R470 = Driver((11, 4), "470.256.02", "nvidia-smi")
JAX = "0.11.2"


@pytest.mark.parametrize("driver, plugins, fits, words", [
    (NO_DRIVER, {}, True, ["no NVIDIA driver on this node", "JAX runs on CPU"]),
    (NO_DRIVER, {13: JAX}, False, ["no NVIDIA driver", "jax-cuda13-plugin 0.11.2 is installed"]),
    # The case: the CUDA 13 plugin on a CUDA 12 driver.
    (R550, {13: JAX}, False, ["jax-cuda13-plugin 0.11.2 needs driver >= 580 (CUDA 13), this node has 550 "
                              "(CUDA 12.4): install .[gpu]"]),
    (R535, {13: JAX}, False, ["needs driver >= 580", "has 535 (CUDA 12.2): install .[gpu]"]),
    (R550, {12: JAX}, True, ["jax-cuda12-plugin 0.11.2 runs on this node's driver 550 (CUDA 12.4)"]),
    (R580, {13: JAX}, True, ["jax-cuda13-plugin 0.11.2 runs", "580 (CUDA 13.0)"]),
    (R580, {12: JAX}, True, ["jax-cuda12-plugin"]),  # a newer driver runs older CUDA majors
    (R470, {12: JAX}, False, ["jax-cuda12-plugin 0.11.2 needs driver >= 525 (CUDA 12), this node has 470 "
                              "(CUDA 11.4): upgrade the driver to >= 525"]),
    (R550, {}, False, ["driver 550 (CUDA 12.4) but no JAX CUDA plugin", "install .[gpu]"]),
    (R580, {}, False, ["install .[gpu-cuda13]"]),
    (R550, {12: JAX, 13: JAX}, False, ["jax-cuda12-plugin 0.11.2 and jax-cuda13-plugin 0.11.2 are both installed",
                                       "pip install -e '.[gpu]'"]),
    (R550, {12: "0.11.1"}, False, ["jax-cuda12-plugin 0.11.1 does not match jax 0.11.2", ".[gpu]"]),
    (Driver((12, 4), None, "libcuda"), {13: JAX}, False, ["this node has CUDA 12.4: install .[gpu]"]),
])
def test_verdict(driver, plugins, fits, words):
    ok, line = verdict(driver, plugins, JAX)
    assert ok is fits
    assert "\n" not in line
    for w in words:
        assert w in line, line


def test_env_without_a_driver():
    proc = run_cli("env", "--json", timeout=120, env=dict(os.environ, PATH="/usr/bin:/bin"))
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["driver_cuda"] is None and out["driver_release"] is None
    assert out["gpu_verdict"].startswith("no NVIDIA driver on this node")


NVIDIA_SMI = """#!/bin/sh
cat <<'EOF'
Tue Dec  1 21:00:00 2026
+-----------------------------------------------------------------------------------------+
| NVIDIA-SMI 550.54.14              Driver Version: 550.54.14      CUDA Version: 12.4     |
|-----------------------------------------+------------------------+----------------------+
EOF
"""

LIBCUDA = "int cuDriverGetVersion(int *v) { *v = 12040; return 0; }\n"


@pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler for the stand-in libcuda.so.1")
def test_env_reads_libcuda_and_nvidia_smi(tmp_path):
    (tmp_path / "libcuda.c").write_text(LIBCUDA)
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(tmp_path / "libcuda.so.1"), str(tmp_path / "libcuda.c")],
                   check=True)
    smi = tmp_path / "nvidia-smi"
    smi.write_text(NVIDIA_SMI)
    smi.chmod(0o755)
    env = dict(os.environ, PATH=f"{tmp_path}:/usr/bin:/bin", LD_LIBRARY_PATH=str(tmp_path))
    proc = run_cli("env", timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert any(line.split()[:3] == ["NVIDIA", "driver", "550.54.14"] for line in lines), proc.stdout
    assert any(line.split()[:4] == ["driver", "CUDA", "version", "12.4"] for line in lines), proc.stdout
    assert "(libcuda + nvidia-smi)" in proc.stdout
    # This machine has no JAX CUDA plugin: the verdict says what to install for a CUDA 12 driver.
    verdicts = [line for line in lines if line.startswith(("GPU: ", "GPU MISMATCH: "))]
    assert verdicts == ["GPU MISMATCH: this node has an NVIDIA driver 550 (CUDA 12.4) but no JAX CUDA plugin: "
                        "JAX runs on CPU; install .[gpu]"]
