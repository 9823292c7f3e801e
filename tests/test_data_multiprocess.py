"""A weighted mixture of shard directories gives the same batches to 1 and 2 processes and after a resume onto
another device count (slow pass: real multi-process runs through launch/local.sh): the logged losses agree."""

import numpy as np
import pytest

from jaxtrain import data as data_lib
from jaxtrain_testing import F32, launch_local, logged_losses, run_cli


@pytest.mark.slow
def test_mixture_same_batches_for_1_and_2_processes_and_after_resume_on_other_devices(tmp_path):
    docs = data_lib.embedded_corpus().split(b"\0")
    for i, part in enumerate((docs[: len(docs) // 2], docs[len(docs) // 2:])):
        (tmp_path / f"t{i}").mkdir()
        for j in range(0, len(part), 40):
            (tmp_path / f"t{i}" / f"{j:05d}.txt").write_bytes(b"\n".join(part[j:j + 40]))
        r = run_cli("prepare", str(tmp_path / f"t{i}"), "--out", str(tmp_path / f"s{i}"), "--shard-tokens", "100000",
                    "--no-progress")
        assert r.returncode == 0, r.stderr
    mix = [f"data.mixture=[{{source: '{tmp_path / 's0'}', weight: 3}}, {{source: '{tmp_path / 's1'}', weight: 1}}]",
           "data.seq_len=64", "train.global_batch=8", "checkpoint.every=2", *F32]
    one = tmp_path / "one"
    ref = run_cli("train", f"run.dir={one}", "runtime.cpu_devices=4", "mesh.ici.data=2", "mesh.ici.fsdp=2", *mix,
                  "train.steps=6")
    assert ref.returncode == 0, ref.stderr[-3000:]
    two = tmp_path / "two"
    proc = launch_local(2, "train", f"run.dir={two}", "runtime.cpu_devices=2", "mesh.dcn.data=2", "mesh.ici.fsdp=2",
                        *mix, "train.steps=4")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    expected, got = logged_losses(one), logged_losses(two)
    np.testing.assert_allclose([got[s] for s in range(1, 5)], [expected[s] for s in range(1, 5)], rtol=1e-4)
    # The 2-process checkpoint resumes in 1 process on 2 devices (another device count and mesh): steps 5 and 6
    # read the batches the reference read.
    resumed = run_cli("train", f"run.dir={two}", "runtime.cpu_devices=2", "mesh.ici.fsdp=2", *mix, "train.steps=6")
    assert resumed.returncode == 0 and "resumed from" in resumed.stderr, resumed.stderr[-3000:]
    got = logged_losses(two)
    np.testing.assert_allclose([got[s] for s in (5, 6)], [expected[s] for s in (5, 6)], rtol=1e-4)
