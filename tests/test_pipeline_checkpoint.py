"""Checkpoints and processes across pipeline layouts: the layer stack is stored in one layout (model order), so a
checkpoint written with stages resumes without them or with another stage count, and two processes that are the two
stages (mesh.dcn.stage=2) train like one device."""

import shutil

import jax
import numpy as np
import pytest

from jaxtrain.config import load_config
from jaxtrain.train import loop
from jaxtrain_testing import F32, launch_local, logged_losses, run_cli

# n_layers 8 splits into 4 stages x 2 virtual stages; microbatches 4 is a multiple of 4 stages.
PIPE = ["model.dtype=float32", "model.param_dtype=float32", "model.n_layers=8", "data.seq_len=64",
        "train.global_batch=32", "train.microbatches=4", "train.eval_every=0", "train.eval_batches=1",
        "train.warmup_steps=2", "train.log_every=1"]


@pytest.mark.slow
def test_checkpoints_cross_schedules_and_stage_counts(tmp_path):
    """A checkpoint stores the layer stack in model order whatever wrote it (the 1F1B schedule's chunks exist inside
    the step only): 4 steps on 2 stages, by GPipe or by 1F1B, resume under the other schedule on 4 stages (x tensor
    2) and without a pipeline (fsdp 8), each with the uninterrupted GPipe run's next losses."""
    def cfg(run, *extra):
        return load_config(None, [f"run.dir={tmp_path / run}", *PIPE, "checkpoint.every=4", *extra])

    two_stages = ["mesh.ici.stage=2", "mesh.ici.fsdp=4", "train.virtual_stages=2"]
    four_stages = ["mesh.ici.stage=4", "mesh.ici.fsdp=1", "mesh.ici.tensor=2"]
    one_f_one_b = "train.pipeline_schedule=1f1b"
    full = loop.train(cfg("full", "train.steps=8", *two_stages), devices=jax.devices()[:8])
    first = loop.train(cfg("1f1b", "train.steps=4", *two_stages, one_f_one_b), devices=jax.devices()[:8])
    np.testing.assert_allclose([first.losses[s] for s in range(1, 5)], [full.losses[s] for s in range(1, 5)],
                               rtol=1e-4)
    gpipe = loop.train(cfg("gpipe", "train.steps=4", *two_stages), devices=jax.devices()[:8])
    assert sorted(gpipe.losses) == [1, 2, 3, 4]
    for name, written_by, mesh in [("1f1b-to-gpipe4", "1f1b", four_stages),
                                   ("1f1b-to-none", "1f1b", ["mesh.ici.stage=1", "mesh.ici.fsdp=8"]),
                                   ("gpipe-to-1f1b4", "gpipe", [*four_stages, one_f_one_b])]:
        shutil.copytree(tmp_path / written_by, tmp_path / name)
        resumed = loop.train(cfg(name, "train.steps=8", *mesh), devices=jax.devices()[:8])
        assert resumed.start_step == 4 and sorted(resumed.losses) == [5, 6, 7, 8]
        np.testing.assert_allclose([resumed.losses[s] for s in range(5, 9)], [full.losses[s] for s in range(5, 9)],
                                   rtol=1e-4, err_msg=name)


@pytest.mark.slow
@pytest.mark.parametrize("virtual", [1, 2])
def test_two_processes_as_two_stages_match_one_device(tmp_path, virtual):
    steps = ["train.steps=8", "train.warmup_steps=2"]
    one = run_cli("train", f"run.dir={tmp_path / 'one'}", "runtime.cpu_devices=1", "mesh.ici.fsdp=1", *F32, *PIPE,
                  *steps)
    assert one.returncode == 0, one.stderr
    two = launch_local(2, "train", f"run.dir={tmp_path / 'two'}", "runtime.cpu_devices=4", "mesh.dcn.stage=2",
                       "mesh.ici.fsdp=4", f"train.virtual_stages={virtual}", *F32, *PIPE, *steps)
    assert two.returncode == 0, two.stdout[-3000:] + two.stderr[-3000:]
    assert "stage2(dcn)" in two.stdout or "dcn stage2" in two.stdout, two.stdout[-2000:]
    expected, got = logged_losses(tmp_path / "one"), logged_losses(tmp_path / "two")
    np.testing.assert_allclose([got[s] for s in range(1, 9)], [expected[s] for s in range(1, 9)], rtol=1e-4)
