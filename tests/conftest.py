"""Tests run on 8 emulated CPU devices; each test picks the first N it needs."""

import os
import sys

import jax

jax.config.update("jax_num_cpu_devices", 8)

import pytest  # noqa: E402

from jaxtrain.config import load_config  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Small and float32, so that sharded and unsharded runs can be compared to 1e-4.
FAST = ["model.dtype=float32", "model.param_dtype=float32", "train.eval_batches=1", "data.threads=0"]


@pytest.fixture
def make_config(tmp_path):
    def make(*overrides):
        return load_config(None, [f"run.dir={tmp_path / 'run'}", *FAST, *overrides])

    return make


def run_cli(*args, cwd=None, timeout=300):
    """``python -m jaxtrain ARGS`` in a subprocess; returns CompletedProcess with text output."""
    import subprocess

    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, "-m", "jaxtrain", *args], capture_output=True, text=True,
                          cwd=cwd or REPO, env=env, timeout=timeout)
