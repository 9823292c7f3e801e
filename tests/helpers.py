"""What tests share: the repository root, the fast float32 overrides, and running the real CLI in a subprocess.

Tests import these from here (``from helpers import run_cli``); conftest.py only configures JAX and fixtures.
"""

import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Small and float32, so that sharded and unsharded runs can be compared to 1e-4.
FAST = ["model.dtype=float32", "model.param_dtype=float32", "train.eval_batches=1", "data.threads=0"]


def run_cli(*args, cwd=None, timeout=300, env=None):
    """``python -m jaxtrain ARGS`` in a subprocess; returns CompletedProcess with text output."""
    env = dict(os.environ if env is None else env)
    env.pop("XLA_FLAGS", None)
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, "-m", "jaxtrain", *args], capture_output=True, text=True,
                          cwd=cwd or REPO, env=env, timeout=timeout)
