"""The set-up section of ``benchmarks/gpu_check.sh``: ``python benchmarks/gpu_setup.py [--smoke]``.

Imports every module the other sections need and stops at once, naming all that are missing, with exit status 3
(the carried wheels are installed before this runs, on the same PYTHONPATH as the sections); then reports the
versions, the devices JAX sees, ``nvidia-smi``'s view and ``python -m jaxtrain env``'s driver/plugin verdict, as one
JSON line (``"kind": "setup"``). Without ``--smoke`` it also needs triton and jax-triton, and a GPU visible to JAX.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import subprocess
import sys

# Run as a script, Python puts benchmarks/ first on sys.path: put the checkout's root there (its jaxtrain is checked).
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

# What the sections import; jaxtrain (with its kernels) last.
NEEDED = ["jax", "jaxlib", "flax", "optax", "orbax.checkpoint", "grain", "tensorboardX", "numpy", "yaml",
          "safetensors", "ml_dtypes", "prometheus_client", "matplotlib", "pytest", "jaxtrain", "jaxtrain.kernels"]
GPU_ONLY = ["triton", "jax_triton"]
VERSIONS = ("jaxlib", "triton", "jax_triton", "flax", "optax", "orbax.checkpoint", "grain")


def missing_modules(names: list[str]) -> list[str]:
    """'name (why)' for each of ``names`` that does not import."""
    missing = []
    for name in names:
        try:
            importlib.import_module(name)
        except Exception as e:  # noqa: BLE001 - name every missing module, then stop
            first = str(e).splitlines()[0][:120] if str(e) else ""
            missing.append(f"{name} ({type(e).__name__}: {first})")
    return missing


def _command(argv: list[str], timeout: float = 30) -> str:
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=timeout).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python benchmarks/gpu_setup.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="on a CPU: neither triton nor a GPU is needed")
    args = p.parse_args(argv)
    missing = missing_modules(NEEDED + ([] if args.smoke else GPU_ONLY))
    if missing:
        print("set-up: missing " + "; ".join(missing) + " (carry their wheels: benchmarks/gpu_check.sh "
              "--fetch-wheels DIR on a machine with a registry, then --wheels DIR)", flush=True)
        return 3
    import jax

    versions = {"python": platform.python_version(), "jax": jax.__version__}
    for name in VERSIONS:
        try:
            versions[name] = importlib.import_module(name).__version__
        except Exception as e:  # noqa: BLE001 - a version is a report, not a need
            versions[name] = type(e).__name__
    devices = jax.devices()
    print(f"{', '.join(f'{k} {v}' for k, v in versions.items())}; backend {jax.default_backend()}, "
          f"{len(devices)} x {devices[0].device_kind}", flush=True)
    smi = _command(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"])
    env_lines = _command([sys.executable, "-m", "jaxtrain", "env", "--json"]).splitlines()
    env = json.loads(env_lines[-1]) if env_lines and env_lines[-1].startswith("{") else {}
    print(smi or "nvidia-smi: none", flush=True)
    print(f"GPU: {env.get('gpu_verdict', 'python -m jaxtrain env said nothing')}", flush=True)
    print(json.dumps(dict(kind="setup", versions=versions, backend=jax.default_backend(), devices=len(devices),
                          device_kind=devices[0].device_kind, nvidia_smi=smi.splitlines(),
                          **{k: env.get(k) for k in ("driver_release", "driver_cuda", "cuda_plugins", "gpu_fits",
                                                     "gpu_verdict")})), flush=True)
    if not args.smoke and devices[0].platform != "gpu":
        print(f"set-up: no GPU visible to JAX (backend {jax.default_backend()}): see the GPU line above", flush=True)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
