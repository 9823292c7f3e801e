"""Emulated CPU runs are never silently wrong through gloo (jax-ml/jax#40830: gloo's reduce-scatter intermittently
corrupts the end of rank 0's chunk from ~4 MiB). One process keeps its collectives in-process (it initialises no
jax.distributed); several processes must go through gloo, so the training step must not need the affected
collective, and a run with large per-device chunks must still match one process."""

import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from jaxtrain.config import load_config
from jaxtrain.train import step as step_lib
from jaxtrain_testing import FAST, REPO, logged_losses, run_cli


@pytest.mark.parametrize("microbatches", [1, 2])
def test_the_cpu_train_step_has_no_reduce_scatter(tmp_path, microbatches):
    """XLA:CPU reduces fsdp gradients with all-reduce (then slices); a reduce-scatter appearing here would route
    gradients through gloo's faulty path in multi-process CPU jobs."""
    cfg = load_config(None, [f"run.dir={tmp_path}", *FAST, "mesh.ici.fsdp=8", f"train.microbatches={microbatches}"])
    ts = step_lib.setup(cfg, jax.devices()[:8])
    step, _, _ = ts.compile(ts.layout.abstract_state)
    hlo = step.as_text()
    assert "all-gather" in hlo and "all-reduce" in hlo  # the fsdp collectives are there...
    assert "reduce-scatter" not in hlo  # ...but not the one gloo corrupts


# d_model 1024, d_ff 4096: each MLP kernel's fsdp=8 shard is 2 x 1024 x 4096 x 4 / 8 = 4 MiB, where gloo fails.
LARGE = [*FAST, "model.d_model=1024", "model.d_ff=4096", "model.n_layers=2", "model.n_heads=8", "model.n_kv_heads=8",
         "data.seq_len=64", "train.global_batch=8", "train.steps=3", "train.eval_every=0", "train.log_every=1",
         "checkpoint.every=0"]


@pytest.mark.slow
def test_two_processes_with_large_chunks_match_one(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(PYTHONPATH=REPO + os.pathsep + env.get("PYTHONPATH", ""), PYTHON=sys.executable)
    two = tmp_path / "two"
    proc = subprocess.run([os.path.join(REPO, "launch/local.sh"), "2", "train", f"run.dir={two}",
                           "runtime.cpu_devices=4", "mesh.dcn.fsdp=2", "mesh.ici.fsdp=4", *LARGE],
                          capture_output=True, text=True, cwd=REPO, env=env, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    one = tmp_path / "one"
    ref = run_cli("train", f"run.dir={one}", "runtime.cpu_devices=8", "mesh.ici.fsdp=8", *LARGE, timeout=1200)
    assert ref.returncode == 0, ref.stderr
    got, want = logged_losses(two), logged_losses(one)
    np.testing.assert_allclose([got[s] for s in (1, 2, 3)], [want[s] for s in (1, 2, 3)], rtol=1e-4)
