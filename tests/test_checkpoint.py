"""Checkpoints: exact resume after SIGKILL, elastic resume onto another mesh, preemption, faults, bad input."""

import os
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from jaxtrain.config import ConfigError
from jaxtrain.train import loop
from jaxtrain.train import step as step_lib
from jaxtrain_testing import REPO, logged_losses, run_cli

# Small and float32 so that runs are quick and comparisons exact.
SMALL = ["model.dtype=float32", "model.param_dtype=float32", "data.seq_len=64", "train.global_batch=8",
         "train.eval_every=0", "train.eval_batches=1", "train.warmup_steps=5", "train.decay_steps=60",
         "train.log_every=1"]


def _env():
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    return env


def start_and_wait_for_step(args, step, timeout=120):
    """Start `python -m jaxtrain train ARGS`; return (process, lines read) once `step` has been logged."""
    proc = subprocess.Popen([sys.executable, "-m", "jaxtrain", "train", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, cwd=REPO, env=_env())
    lines, deadline = [], time.time() + timeout
    while time.time() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        if line.startswith("step ") and int(line.split()[1].split("/")[0]) >= step:
            return proc, lines
    proc.kill()
    raise AssertionError("step never logged:\n" + "".join(lines))


@pytest.mark.slow
def test_sigkill_then_resume_is_bit_exact(tmp_path):
    common = [*SMALL, "runtime.cpu_devices=2", "mesh.ici.fsdp=2", "train.steps=24", "checkpoint.every=5"]
    ref = run_cli("train", f"run.dir={tmp_path / 'ref'}", *common)
    assert ref.returncode == 0, ref.stderr

    run_dir = tmp_path / "killed"
    proc, _ = start_and_wait_for_step([f"run.dir={run_dir}", *common], 12)
    proc.kill()
    proc.wait()
    resumed = run_cli("train", f"run.dir={run_dir}", *common)
    assert resumed.returncode == 0, resumed.stderr
    restored = int(resumed.stderr.split("resumed from ")[1].split("\n")[0].rsplit("/", 1)[1])
    assert 5 <= restored <= 12 and restored % 5 == 0
    first_logged = int(resumed.stdout.split("step ")[1].split("/")[0])
    assert first_logged == restored + 1
    expected, got = logged_losses(tmp_path / "ref"), logged_losses(run_dir)
    assert sorted(got) == list(range(1, 25))  # the steps the killed run logged after its checkpoint were dropped
    assert {s: got[s] for s in range(restored + 1, 25)} == {s: expected[s] for s in range(restored + 1, 25)}


@pytest.mark.slow
def test_elastic_resume(tmp_path):
    from jaxtrain.config import load_config

    def cfg(run, *extra):
        return load_config(None, [f"run.dir={tmp_path / run}", *SMALL, "checkpoint.every=10", *extra])

    full = loop.train(cfg("full", "train.steps=30", "mesh.ici.fsdp=8"), devices=jax.devices()[:8])
    first = loop.train(cfg("elastic", "train.steps=20", "mesh.ici.fsdp=8"), devices=jax.devices()[:8])
    assert max(first.losses) == 20
    second = loop.train(cfg("elastic", "train.steps=30", "mesh.ici.fsdp=2", "mesh.ici.tensor=2"),
                             devices=jax.devices()[:4])
    assert second.start_step == 20 and sorted(second.losses) == list(range(21, 31))
    np.testing.assert_allclose([second.losses[s] for s in range(21, 31)], [full.losses[s] for s in range(21, 31)],
                               rtol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_saves_the_current_step_and_exits_75(tmp_path, sig):
    run_dir = tmp_path / "run"
    args = [f"run.dir={run_dir}", *SMALL, "train.steps=500", "checkpoint.every=1000"]
    proc, _ = start_and_wait_for_step(args, 4)
    sent = time.time()
    proc.send_signal(sig)
    out, _ = proc.communicate(timeout=60)
    elapsed = time.time() - sent
    assert proc.returncode == 75, out  # EXIT_PREEMPTED: stopped before train.steps; 0 would mean finished
    assert elapsed < 10
    stopped = int(out.split("stopped by a signal after step ")[1].split(";")[0])
    assert f"checkpoint saved to {run_dir / 'checkpoints'}/{stopped}" in out
    said = "interrupted (SIGINT)" if sig == signal.SIGINT else "terminated (SIGTERM)"
    assert f"{said}: saving step {stopped}, then stopping" in out, out
    assert sorted(int(p) for p in os.listdir(run_dir / "checkpoints")) == [stopped]

    again = run_cli("train", *args[:-2], f"train.steps={stopped + 2}")
    assert again.returncode == 0, again.stderr
    assert int(again.stdout.split("step ")[1].split("/")[0]) == stopped + 1


@pytest.mark.slow
def test_an_interrupted_save_is_never_restored(tmp_path):
    run_dir = tmp_path / "run"
    args = [f"run.dir={run_dir}", *SMALL, "checkpoint.every=5"]
    assert run_cli("train", *args, "train.steps=10").returncode == 0
    # What a crash mid-write leaves: Orbax's temporary directory for the next step, half written.
    partial = run_dir / "checkpoints" / "15.orbax-checkpoint-tmp-1234"
    (partial / "state").mkdir(parents=True)
    (partial / "state" / "junk").write_bytes(b"\0" * 100)
    resumed = run_cli("train", *args, "train.steps=12")
    assert resumed.returncode == 0, resumed.stderr
    assert "resumed from " + str(run_dir / "checkpoints" / "10") in resumed.stderr


@pytest.mark.slow
def test_kill_during_a_large_async_save_falls_back_to_the_previous_checkpoint(tmp_path):
    run_dir = tmp_path / "run"
    # ~50M parameters: with AdamW a 600 MB state whose write takes seconds.
    big = ["model.d_model=1024", "model.d_ff=4096", "model.n_layers=4", "model.vocab_size=256",
           "train.global_batch=2", "data.seq_len=16", "model.dtype=float32", "train.eval_every=0",
           "train.eval_batches=1", "checkpoint.every=2", "train.log_every=1", "train.steps=100", f"run.dir={run_dir}"]
    proc, _ = start_and_wait_for_step(big, 3)  # step 2's save is written in the background now or soon
    ckpts = run_dir / "checkpoints"
    deadline = time.time() + 60
    while time.time() < deadline and not any(p.name.startswith("4.orbax-checkpoint-tmp") for p in ckpts.iterdir()):
        time.sleep(0.01)
    proc.kill()
    proc.wait()
    names = sorted(p.name for p in ckpts.iterdir())
    assert any(n.startswith("4.orbax-checkpoint-tmp") for n in names), names  # killed mid-write
    resumed = run_cli("train", *big[:-2], f"run.dir={run_dir}", "train.steps=3")
    assert resumed.returncode == 0, resumed.stderr
    assert f"resumed from {ckpts}/2" in resumed.stderr


@pytest.mark.slow
def test_bad_resume_inputs_exit_2_and_leave_checkpoints_alone(tmp_path):
    run_dir = tmp_path / "run"
    args = [f"run.dir={run_dir}", *SMALL, "checkpoint.every=5", "train.steps=10"]
    assert run_cli("train", *args).returncode == 0
    ckpts = run_dir / "checkpoints"

    def snapshot():
        return {str(p): (p.stat().st_size, p.stat().st_mtime_ns) for p in ckpts.rglob("*")}

    before = snapshot()
    cases = {
        "model.d_ff=256": "does not fit this model: model.blocks.mlp.down.kernel has shape (4, 384, 128) there but "
                          "(4, 256, 128) here",
        "checkpoint.resume=7": "checkpoint.resume=7: no such step",
        "checkpoint.resume=never": "checkpoint.resume=never but",
        "train.steps=8": "beyond train.steps=8",
        f"checkpoint.dir={tmp_path / 'a_file' / 'ckpt'}": "cannot be created",
    }
    (tmp_path / "a_file").write_text("not a directory")
    for override, message in cases.items():
        proc = run_cli("train", *args, override)
        assert proc.returncode == 2, (override, proc.stderr)
        assert message in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, (override, proc.stderr)
    assert "steps there: [5, 10]" in run_cli("train", *args, "checkpoint.resume=7").stderr
    assert snapshot() == before


@pytest.mark.slow
def test_disk_full_during_a_save_stops_at_once_and_keeps_earlier_checkpoints(tmp_path):
    run_dir = tmp_path / "run"
    args = [f"run.dir={run_dir}", *SMALL, "checkpoint.every=5", "model.d_model=256", "model.d_ff=768"]
    assert run_cli("train", *args, "train.steps=5", "checkpoint.async_save=false").returncode == 0
    # A file-size limit makes the kernel refuse large writes with EFBIG, as a full disk refuses them with ENOSPC.
    # The asynchronous save of step 10 fails in Orbax's background threads.
    proc = subprocess.Popen(["bash", "-c", 'ulimit -f 2000; exec "$@"', "_", sys.executable, "-m", "jaxtrain", "train",
                             *args, "train.steps=40"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=REPO, env=_env())
    steps, saved_at = [], None
    for line in proc.stdout:
        if line.startswith("step "):
            steps.append(int(line.split()[1].split("/")[0]))
            if steps[-1] == 10:
                saved_at = time.time()
    err = proc.stderr.read()
    proc.wait(timeout=300)
    assert proc.returncode == 1, err[-2000:]
    assert saved_at is not None and time.time() - saved_at < 60  # no wait in Orbax's barrier
    assert max(steps) <= 12, steps  # stopped at the first step after the failure was known, not at the next save
    last = err.strip().splitlines()[-1]
    assert last.startswith("error: a checkpoint save in") and "File too large" in last
    steps_on_disk = sorted(p.name for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit())
    assert steps_on_disk == ["5"]
    resumed = run_cli("train", *args, "train.steps=6")
    assert resumed.returncode == 0 and f"resumed from {run_dir / 'checkpoints'}/5" in resumed.stderr


@pytest.mark.slow
def test_init_from_loads_parameters_with_a_fresh_optimizer(tmp_path):
    from jaxtrain.config import load_config

    src = tmp_path / "pretrain"
    base = [*SMALL, "mesh.ici.fsdp=1"]
    loop.train(load_config(None, [f"run.dir={src}", *base, "train.steps=5"]), devices=jax.devices()[:1])
    cfg = load_config(None, [f"run.dir={tmp_path / 'finetune'}", *base, "train.steps=1",
                             f"checkpoint.init_from={src / 'checkpoints'}"])
    trainer = step_lib.setup(cfg, jax.devices()[:1])
    from jaxtrain.checkpoint import format as ckpt

    plan = ckpt.choose_restore(cfg, trainer.layout.abstract_state)
    assert plan.kind == "params" and plan.step == 5
    state, start, _ = ckpt.restore(plan, trainer.layout.abstract_state, trainer.layout.init_state)
    full, _, _ = ckpt.restore(ckpt.RestoreSource("resume", str(src / "checkpoints"), 5), trainer.layout.abstract_state,
                              trainer.layout.init_state)
    assert start == 0 and int(state["opt"]["step"][...]) == 0 and int(full["opt"]["step"][...]) == 5
    for a, b in zip(jax.tree.leaves(state["model"]), jax.tree.leaves(full["model"])):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    fresh = trainer.layout.init_state()
    mu = [x for x in jax.tree.leaves(state["opt"]["opt_state"]) if x.ndim > 1]
    assert all(not np.any(np.asarray(x)) for x in mu)  # zero moments
    first = (np.asarray(jax.tree.leaves(tree["model"])[0]) for tree in (fresh, state))
    assert not np.array_equal(*first)
    with pytest.raises(ConfigError, match="holds no complete checkpoint"):
        ckpt.choose_restore(load_config(None, [f"run.dir={tmp_path / 'x'}", *base,
                                             f"checkpoint.init_from={tmp_path}"]), trainer.layout.abstract_state)


@pytest.mark.slow
def test_acceptance_sigkill_after_step_45_of_120_on_fsdp8(tmp_path):
    common = ["model.dtype=float32", "model.param_dtype=float32", "runtime.cpu_devices=8", "mesh.ici.fsdp=8",
              "train.steps=120", "checkpoint.every=10", "train.log_every=1"]
    ref = run_cli("train", f"run.dir={tmp_path / 'ref'}", *common, timeout=900)
    assert ref.returncode == 0, ref.stderr
    run_dir = tmp_path / "killed"
    proc, _ = start_and_wait_for_step([f"run.dir={run_dir}", *common], 45, timeout=600)
    proc.kill()
    proc.wait()
    resumed = run_cli("train", f"run.dir={run_dir}", *common, timeout=900)
    assert resumed.returncode == 0, resumed.stderr
    first = int(resumed.stdout.split("step ")[1].split("/")[0])
    assert first in (31, 41)  # the last complete checkpoint, 40 (or 30 if 40's write was still in flight)
    expected, got = logged_losses(tmp_path / "ref"), logged_losses(run_dir)
    assert {s: got[s] for s in range(first, 121)} == {s: expected[s] for s in range(first, 121)}


def _named_leaves(tree):
    """{"opt.opt_state....mu.embed.embedding": numpy array} of a state tree or of Orbax's raw read of one."""
    def name(path):
        keys = (str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in path)
        return ".".join(k for k in keys if k not in ("value", ".value"))

    return {name(p): np.asarray(x) for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def test_resume_restores_adamw_moments_and_continues_bit_exact(tmp_path):
    """Six steps in one run, and the same six as three (saved at step 3) plus a second ``train`` call on that
    run.dir: the second call restores step 3's whole state, AdamW's moments included, as the uninterrupted run
    saved it, and logs the same losses bit for bit (one CPU device, float32: the run is deterministic)."""
    import orbax.checkpoint as ocp

    from jaxtrain.checkpoint import format as ckpt
    from jaxtrain.config import load_config

    def cfg(run, steps):
        return load_config(None, [f"run.dir={tmp_path / run}", *SMALL, "mesh.ici.fsdp=1", "data.threads=0",
                                  "data.seq_len=32", "train.global_batch=4", f"train.steps={steps}",
                                  "checkpoint.every=3"])

    one_device = jax.devices()[:1]
    full = loop.train(cfg("full", 6), devices=one_device)
    first = loop.train(cfg("resumed", 3), devices=one_device)
    assert sorted(full.losses) == [1, 2, 3, 4, 5, 6] and sorted(first.losses) == [1, 2, 3]

    # What the second call restores (its own path: choose_restore, then restore) against the uninterrupted run's
    # step 3 as written, read by Orbax alone.
    ts = step_lib.setup(cfg("resumed", 6), one_device)
    source = ckpt.choose_restore(ts.cfg, ts.layout.abstract_state)
    assert (source.kind, source.step) == ("resume", 3)
    state, start, data_state = ckpt.restore(source, ts.layout.abstract_state, ts.layout.init_state)
    assert start == 3 and data_state["next_index"] == 3
    restored = _named_leaves(state)
    saved = _named_leaves(ocp.PyTreeCheckpointer().restore(str(tmp_path / "full" / "checkpoints" / "3" / "state")))
    assert sorted(restored) == sorted(saved)
    moments = [n for n in saved if ".mu." in n or ".nu." in n]
    assert len(moments) >= 2 and all(np.any(saved[n]) for n in moments)  # three updates: non-zero moments
    for name in saved:
        np.testing.assert_array_equal(restored[name], saved[name], err_msg=name)

    resumed = loop.train(cfg("resumed", 6), devices=one_device)
    assert resumed.start_step == 3 and sorted(resumed.losses) == [4, 5, 6]
    assert {**first.losses, **resumed.losses} == full.losses  # Python floats of float32 values: bit equality
    assert logged_losses(tmp_path / "resumed") == logged_losses(tmp_path / "full")


@pytest.mark.parametrize("every, keep, expected", [(0, 3, [7]), (2, 2, [6, 7]),
                                                     pytest.param(3, 5, [3, 6, 7], marks=pytest.mark.slow)])
def test_save_schedule_and_retention(tmp_path, every, keep, expected):
    from jaxtrain.config import load_config

    cfg = load_config(None, [f"run.dir={tmp_path}", *SMALL, "train.steps=7", "mesh.ici.fsdp=1",
                             f"checkpoint.every={every}", f"checkpoint.keep={keep}"])
    loop.train(cfg, devices=jax.devices()[:1])
    assert sorted(int(p.name) for p in (tmp_path / "checkpoints").iterdir()) == expected
