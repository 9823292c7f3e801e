"""Faults injected for real: damaged checkpoints, non-finite steps, a second job on one run.dir, memory that cannot
fit, parameters restored onto another mesh. (Bad command-line input: test_bad_inputs.py; failed writes:
test_checkpoint.py.)"""

import functools
import glob
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from jaxtrain import rundir
from jaxtrain.checkpoint import format as ckpt
from jaxtrain.config import ConfigError, load_config
from jaxtrain.train import guards, loop
from jaxtrain.train import step as step_lib
from jaxtrain_testing import REPO, logged_losses, run_cli

SMALL = ["model.dtype=float32", "model.param_dtype=float32", "data.seq_len=64", "train.global_batch=8",
         "train.eval_every=0", "train.eval_batches=1", "train.warmup_steps=5", "train.decay_steps=60",
         "train.log_every=1", "data.threads=0", "mesh.ici.fsdp=1"]


def _cfg(run_dir, *extra):
    return load_config(None, [f"run.dir={run_dir}", *SMALL, *extra])


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A run of 10 steps with checkpoints at 5 and 10 (in-process, one device)."""
    run = tmp_path_factory.mktemp("faults") / "base"
    loop.train(_cfg(run, "train.steps=10", "checkpoint.every=5"), devices=jax.devices()[:1])
    return run


def _largest_array_file(step_dir):
    return max(glob.glob(os.path.join(step_dir, "state", "**", "d", "*"), recursive=True), key=os.path.getsize)


def _overwrite_middle(path):
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        f.write(np.random.default_rng(0).bytes(1000))


def _alter_saved_checksum(step_dir):
    # What bytes overwritten inside an incompressible (stored) zstd block do: every array decodes, one holds other
    # values than were saved. Where such bytes land depends on the file's layout, so the test changes the record.
    path = os.path.join(step_dir, "meta", "metadata")
    meta = json.load(open(path))
    name = sorted(meta["fingerprint"])[0]
    meta["fingerprint"][name] = (meta["fingerprint"][name] + 1) % 2**32
    json.dump(meta, open(path, "w"))


DAMAGE = {
    "array file truncated": (lambda d: os.truncate(_largest_array_file(d), 1000), "its arrays do not restore"),
    "array file overwritten in the middle": (lambda d: _overwrite_middle(_largest_array_file(d)),
                                             "its arrays do not restore"),
    "values differ from those saved": (_alter_saved_checksum, "checksum mismatch"),
    "array metadata missing": (lambda d: os.remove(os.path.join(d, "state", "_METADATA")),
                               "state/_METADATA is missing"),
    "metadata not JSON": (lambda d: open(os.path.join(d, "meta", "metadata"), "w").write("{"),
                          "meta/metadata cannot be read"),
    "empty step directory": (lambda d: (shutil.rmtree(d), os.mkdir(d)), "the step directory is empty"),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_resume_auto_skips_a_damaged_newest_step_and_a_named_one_is_an_error(trained, tmp_path, damage, capsys):
    run = tmp_path / "run"
    shutil.copytree(trained, run)
    harm, what = DAMAGE[damage]
    harm(str(run / "checkpoints" / "10"))
    cfg = _cfg(run, "train.steps=12")
    ts = step_lib.setup(cfg, jax.devices()[:1])

    source = ckpt.choose_restore(ts.cfg, ts.layout.abstract_state)
    state, step, data_state = ckpt.restore(source, ts.layout.abstract_state, ts.layout.init_state)
    assert step == 5 and data_state["next_index"] == 5
    warnings = [line for line in capsys.readouterr().err.splitlines() if "skipping damaged" in line]
    assert len(warnings) == 1 and f"{run}/checkpoints/10" in warnings[0] and what in warnings[0], warnings
    # The values are step 5's, as read from the undamaged reference run.
    reference, _, _ = ckpt.restore(ckpt.RestoreSource("resume", str(trained / "checkpoints"), 5),
                                   ts.layout.abstract_state, ts.layout.init_state)
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(reference)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert os.path.isdir(run / "checkpoints" / "10")  # nothing deleted

    with pytest.raises(ConfigError, match=f"checkpoints/10 is damaged: .*{re.escape(what)}"):
        named = _cfg(run, "train.steps=12", "checkpoint.resume=10")
        src = ckpt.choose_restore(named, ts.layout.abstract_state)
        ckpt.restore(src, ts.layout.abstract_state, ts.layout.init_state)


def test_every_step_damaged_is_an_error_naming_each(trained, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(trained, run)
    for step in ("5", "10"):
        os.remove(run / "checkpoints" / step / "meta" / "metadata")
    ts = step_lib.setup(_cfg(run, "train.steps=12"), jax.devices()[:1])
    with pytest.raises(ConfigError, match=r"no checkpoint in .* can be restored: 10 \(meta/metadata is missing\); "
                                          r"5 \(meta/metadata is missing\)"):
        ckpt.choose_restore(ts.cfg, ts.layout.abstract_state)


@pytest.mark.slow
def test_cli_resume_past_a_damaged_step_and_a_torn_metrics_line(trained, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(trained, run)
    os.truncate(_largest_array_file(run / "checkpoints" / "10"), 1000)
    expected = logged_losses(run)
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 11, "loss": 2.5')  # a crash in the middle of a write
    config_before = (run / "config.yaml").read_bytes()
    metrics_before = (run / "metrics.jsonl").read_bytes()
    args = [f"run.dir={run}", *SMALL, "checkpoint.every=5"]

    named = run_cli("train", *args, "train.steps=12", "checkpoint.resume=10")
    assert named.returncode == 2 and "Traceback" not in named.stderr, named.stderr[-2000:]
    assert named.stderr.strip().splitlines()[-1].startswith(f"error: the checkpoint to resume {run}/checkpoints/10 "
                                                            "is damaged: its arrays do not restore")
    assert (run / "config.yaml").read_bytes() == config_before  # not rewritten before a restore succeeded
    assert (run / "metrics.jsonl").read_bytes() == metrics_before

    proc = run_cli("train", *args, "train.steps=12")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stderr.count("skipping damaged checkpoint") == 1
    assert f"resumed from {run}/checkpoints/5" in proc.stderr
    assert sorted(os.listdir(run / "checkpoints")) == ["10", "10.damaged", "12", "5"]  # kept aside, not deleted
    got = logged_losses(run)
    assert sorted(got) == list(range(1, 13))
    assert {s: got[s] for s in range(6, 11)} == {s: expected[s] for s in range(6, 11)}  # bit-exact resume


# Slow pass (keeps the default suite under 10 minutes); the loop's skipping of non-finite steps is tested by default.
@pytest.mark.slow
def test_a_non_finite_step_changes_nothing(tmp_path):
    ts = step_lib.setup(_cfg(tmp_path, "data.seq_len=32", "train.global_batch=4"), jax.devices()[:1])
    step, _, _ = ts.compile(ts.layout.abstract_state)
    batch = ts.layout.to_device(np.random.default_rng(0).integers(0, 256, (4, 33), dtype=np.int32))
    clean = ts.layout.init_state()
    clean, first = step(clean, batch)  # one good step: non-zero moments and counts to protect
    assert float(first["nonfinite_steps"]) == 0
    poisoned = jax.tree.map(lambda x: x, clean)
    table = poisoned["model"]["embed"]["embedding"]
    weight = float(table[...][3, 0])
    table[...] = table[...].at[3, 0].set(np.inf)  # one inf weight: the loss and every gradient become NaN
    poisoned_before = jax.tree.map(np.asarray, poisoned)
    after, m = step(poisoned, batch)
    assert not np.isfinite(float(m["loss"])) and float(m["nonfinite_steps"]) == 1
    counters = ("notfinite_count", "total_notfinite", "last_finite")  # apply_if_finite's own bookkeeping
    flat_after = jax.tree_util.tree_flatten_with_path(jax.tree.map(np.asarray, after))[0]
    for (path, a), b in zip(flat_after, jax.tree.leaves(poisoned_before), strict=True):
        name = jax.tree_util.keystr(path)
        if any(c in name for c in counters):
            continue
        if "step" in name and "opt_state" not in name:  # nnx's count of steps taken advances, optax's does not
            assert int(a) == int(b) + 1, name
            continue
        np.testing.assert_array_equal(a, b, err_msg=name)
    # optax's own counts (Adam's bias correction, the schedule) stay at the one good step.
    counts = [x for p, x in flat_after if "['count']" in jax.tree_util.keystr(p)
              and not any(c in jax.tree_util.keystr(p) for c in counters)]
    assert len(counts) >= 2 and all(int(c) == 1 for c in counts), counts
    # The learning rate each step reports is the schedule at the update it applies: the skipped step does not
    # advance it. Warmup 5 (SMALL): step 1 at lr/5, the skipped step 2 at 2 lr/5, and step 3, the second update
    # applied, at 2 lr/5 again (not 3 lr/5).
    lr, warmup = ts.cfg.train.lr, ts.cfg.train.warmup_steps
    table = after["model"]["embed"]["embedding"]
    table[...] = table[...].at[3, 0].set(weight)  # the weight back: step 3's loss is finite again
    _, third = step(after, batch)
    assert float(third["nonfinite_steps"]) == 0 and np.isfinite(float(third["loss"]))
    assert [float(x["learning_rate"]) for x in (first, m, third)] == pytest.approx([lr / warmup, 2 * lr / warmup,
                                                                          2 * lr / warmup], rel=1e-6)


def _schedule_lr(t, count):
    """The learning rate of the count-th applied update (1-based), from the formula: linear warmup to lr over
    warmup_steps, then a cosine from lr down to lr * min_lr_ratio at decay_steps, flat after."""
    if count <= t.warmup_steps:
        return t.lr * count / t.warmup_steps
    end = t.lr * t.min_lr_ratio
    progress = min(count - t.warmup_steps, t.decay_steps - t.warmup_steps) / (t.decay_steps - t.warmup_steps)
    return end + (t.lr - end) * 0.5 * (1 + math.cos(math.pi * progress))


class _PoisonedSteps:
    """A fresh run's train_batches iterator in which the batches of ``bad`` steps (1-based) hold only the token id
    vocab_size: outside the embedding table, whose lookup (jnp.take, mode "fill") gives NaN, so that each of those
    steps has a non-finite loss and every other step trains on its real batch."""

    def __init__(self, dataset, bad, vocab_size):
        self._it, self._bad, self._vocab, self._step = iter(dataset), bad, vocab_size, 0

    def __iter__(self):
        return self

    def __next__(self):
        batch = next(self._it)
        self._step += 1
        return np.full_like(batch, self._vocab) if self._step in self._bad else batch

    def get_state(self):
        return self._it.get_state()

    def set_state(self, state):
        raise AssertionError("a fresh run: nothing to resume")


def test_non_finite_steps_are_skipped_do_not_advance_the_schedule_and_stop_the_run_exactly(tmp_path, monkeypatch):
    """Two bad steps in a row (3, 4) are skipped and training goes on; the third in a row of the next streak (8, 9,
    10, ...) stops the run at step 10 with train.max_nonfinite_steps=3, naming step 8 as the first and step 7's as
    the state. The lr logged for each step is the schedule at the count of updates applied so far, plus one."""
    from jaxtrain import data as data_lib

    bad = {3, 4, 8, 9, 10, 11, 12}
    cfg = _cfg(tmp_path / "run", "data.seq_len=32", "train.global_batch=4", "train.steps=14", "train.warmup_steps=3",
               "train.decay_steps=10", "train.max_nonfinite_steps=3", "checkpoint.every=0")
    real = data_lib.train_batches
    monkeypatch.setattr(data_lib, "train_batches",
                        lambda *a, **k: _PoisonedSteps(real(*a, **k), bad, cfg.model.vocab_size))
    with pytest.raises(RuntimeError, match=r"training stopped: .*") as stopped:
        loop.train(cfg, devices=jax.devices()[:1])
    assert type(stopped.value).__name__ == "NonFiniteError"
    assert str(stopped.value).split(" (checkpoints in ")[0] == (
        "training stopped: 3 steps in a row (train.max_nonfinite_steps=3) had a non-finite loss or gradients, the "
        "first at step 8; their updates were skipped, so the state is that of step 7")
    records = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    assert [r["step"] for r in records] == list(range(1, 11))  # stopped at step 10, the third bad one in a row
    assert [r["nonfinite_steps"] for r in records] == [0, 0, 1, 2, 0, 0, 0, 1, 2, 3]
    assert [not np.isfinite(r["loss"]) for r in records] == [s in bad for s in range(1, 11)]
    applied = [sum(1 for s in range(1, step) if s not in bad) for step in range(1, 11)]  # updates before the step
    assert applied == [0, 1, 2, 2, 2, 3, 4, 5, 5, 5]
    assert [r["learning_rate"] for r in records] == pytest.approx([_schedule_lr(cfg.train, n + 1) for n in applied],
                                                                  rel=1e-6)
    # The figures differ where an off-by-one would show: warmup lr/3, 2lr/3, lr, then the cosine.
    assert len({round(_schedule_lr(cfg.train, c), 9) for c in range(1, 7)}) == 6


@pytest.mark.slow
def test_training_stops_after_max_nonfinite_steps_and_saves_only_finite_states(tmp_path):
    run = tmp_path / "run"
    # float16 activations overflow with weights this large: every step's loss is NaN from the first.
    proc = run_cli("train", f"run.dir={run}", "model.dtype=float16", "model.init_std=10.0", "data.seq_len=32",
                   "train.global_batch=4", "train.steps=50", "train.max_nonfinite_steps=3", "checkpoint.every=1",
                   "train.eval_every=0", "train.eval_batches=1", "data.threads=0")
    assert proc.returncode == 1, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: training stopped: 3 steps in a row (train.max_nonfinite_steps=3) had a non-finite "
                           "loss or gradients, the first at step 1;"), last
    assert "Traceback" not in proc.stderr
    records = [json.loads(line) for line in open(run / "metrics.jsonl")]
    assert [r["nonfinite_steps"] for r in records] == [1, 2, 3]  # every bad step logged, counted
    steps = sorted(int(p) for p in os.listdir(run / "checkpoints") if p.isdigit())
    assert steps and max(steps) <= 4
    ts = step_lib.setup(load_config(str(run / "config.yaml"), []), jax.devices()[:1])
    state, _, _ = ckpt.restore(ckpt.RestoreSource("resume", str(run / "checkpoints"), max(steps)),
                               ts.layout.abstract_state, ts.layout.init_state)
    fresh = ts.layout.init_state()  # same seed: the skipped steps left the initial parameters untouched
    for a, b in zip(jax.tree.leaves(state["model"]), jax.tree.leaves(fresh["model"])):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        assert np.isfinite(np.asarray(a)).all()


def test_run_lock_names_the_holder_and_takes_over_a_stale_one(tmp_path, capsys):
    run = tmp_path / "run"
    with rundir.RunLock(str(run)):
        holder = (run / rundir.LOCK).read_text()
        assert f"pid {os.getpid()}" in holder
        with pytest.raises(ConfigError, match=f"is in use by another job \\(host .*, pid {os.getpid()}, since "):
            rundir.RunLock(str(run)).__enter__()  # flock: a second open file conflicts even in one process
    assert not run.exists()  # made only for the lock, removed with it
    run.mkdir()
    (run / rundir.LOCK).write_text("host elsewhere, pid 999999, since 2026-01-01 00:00:00 UTC\n")
    with rundir.RunLock(str(run)):
        assert "took over the lock of a job that ended without releasing it (host elsewhere, pid 999999" in \
            capsys.readouterr().err
    assert os.listdir(run) == []


@pytest.mark.slow
def test_a_second_job_on_a_run_dir_exits_2_and_a_killed_holder_releases_it(tmp_path):
    run = tmp_path / "run"
    args = [sys.executable, "-m", "jaxtrain", "train", f"run.dir={run}", *SMALL, "train.steps=100000",
            "checkpoint.every=0"]
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    first = subprocess.Popen(args, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.time() + 300
        while not (run / rundir.LOCK).exists() and time.time() < deadline:
            time.sleep(0.2)
        t0 = time.time()
        second = run_cli("train", f"run.dir={run}", *SMALL, "train.steps=3")
        assert second.returncode == 2, second.stderr[-2000:]
        line = second.stderr.strip().splitlines()[-1]
        assert "is in use by another job (host " in line and f"pid {first.pid}, since " in line, line
        assert time.time() - t0 < 60  # before compiling anything
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    third = run_cli("train", f"run.dir={run}", *SMALL, "train.steps=2")
    assert third.returncode == 0, third.stderr[-2000:]
    assert "took over the lock of a job that ended without releasing it (host" in third.stderr
    assert not (run / rundir.LOCK).exists()


@pytest.mark.slow
def test_a_step_that_cannot_fit_exits_2_before_anything_is_allocated(tmp_path):
    # Tiny parameters, huge activations: 2048 sequences of 2048 tokens (scores alone 256 GiB).
    cfg = _cfg(tmp_path / "run", "train.global_batch=2048", "data.seq_len=2048")
    ts = step_lib.setup(cfg, jax.devices()[:1])
    compiled, _, _ = ts.compile(ts.layout.abstract_state)
    with pytest.raises(ConfigError) as e:
        guards.check_memory_fit(ts.layout, compiled, functools.partial(step_lib.compiled_with_microbatches, ts.layout))
    msg = str(e.value)
    mem = compiled.memory_analysis()
    assert f"temporaries {mem.temp_size_in_bytes / 2**30:.2f} GiB" in msg
    assert "train.microbatches=" in msg and "model.remat=full" in msg and "runtime.ignore_memory_check=true" in msg
    ignored = _cfg(tmp_path / "run", "train.global_batch=2048", "data.seq_len=2048", "runtime.ignore_memory_check=true")
    guards.check_memory_fit(step_lib.setup(ignored, jax.devices()[:1]).layout, compiled, None)  # told to go on
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("src_mesh, dst_mesh", [
    pytest.param((8, ["mesh.ici.fsdp=8"]), (4, ["mesh.ici.fsdp=2", "mesh.ici.tensor=2"]), marks=pytest.mark.slow),
    pytest.param((4, ["mesh.ici.fsdp=2", "mesh.ici.tensor=2"]), (8, ["mesh.ici.fsdp=8"]), marks=pytest.mark.slow),
])
def test_init_from_onto_another_mesh(tmp_path, src_mesh, dst_mesh):
    (n_src, src), (n_dst, dst) = src_mesh, dst_mesh
    base = [x for x in SMALL if not x.startswith("mesh.")]
    pre = load_config(None, [f"run.dir={tmp_path / 'pre'}", *base, *src, "train.steps=1"])
    src_ts = step_lib.setup(pre, jax.devices()[:n_src])
    saved = src_ts.layout.init_state()
    saver = ckpt.Checkpointer(pre, {"config": {}})
    saver.save(1, saved, {"next_index": 1})
    saver.close()

    cfg = load_config(None, [f"run.dir={tmp_path / 'fine'}", *base, *dst, "train.steps=1",
                             f"checkpoint.init_from={tmp_path / 'pre' / 'checkpoints'}"])
    ts = step_lib.setup(cfg, jax.devices()[:n_dst])
    source = ckpt.choose_restore(ts.cfg, ts.layout.abstract_state)
    state, start, _ = ckpt.restore(source, ts.layout.abstract_state, ts.layout.init_state)
    assert source.kind == "params" and start == 0
    for a, b, want in zip(jax.tree.leaves(state["model"]), jax.tree.leaves(saved["model"]),
                          jax.tree.leaves(ts.layout.abstract_state["model"])):
        assert a.sharding == want.sharding  # the current mesh's shardings, not the saving mesh's
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    step, _, _ = ts.compile(ts.layout.abstract_state)
    batch = ts.layout.to_device(np.zeros((cfg.train.global_batch, cfg.data.seq_len + 1), np.int32))
    _, m = step(state, batch)  # the step compiled for this mesh takes the restored state as it is
    assert np.isfinite(float(m["loss"]))


def test_a_state_with_non_finite_values_is_never_saved(tmp_path):
    cfg = _cfg(tmp_path / "run", "train.steps=3")
    ts = step_lib.setup(cfg, jax.devices()[:1])
    state = ts.layout.init_state()
    saver = ckpt.Checkpointer(ts.cfg, {"config": {}})
    saver.save(1, state, {"next_index": 1})
    table = state["model"]["embed"]["embedding"]
    table[...] = table[...].at[0, 0].set(np.nan)
    with pytest.raises(ckpt.CheckpointError, match="refusing to save step 2 .* holds non-finite values"):
        saver.save(2, state, {"next_index": 2})
    saver.close()
    assert sorted(os.listdir(tmp_path / "run" / "checkpoints")) == ["1"]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_checkpoint_fingerprint_matches_numpy_on_any_mesh(dtype):
    rng = np.random.default_rng(0)
    values = rng.normal(size=(64, 48)).astype(np.float32)
    x = jax.numpy.asarray(values, dtype=dtype)
    bits = np.asarray(x).view({"float32": np.uint32, "bfloat16": np.uint16, "float16": np.uint16}[dtype])
    expected = int(bits.astype(np.uint64).sum() % 2**32)  # NumPy reference: the wrapping sum of the bit patterns
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("a", "b"))
    for layout in (None, ("a", "b"), ("b", None)):
        spec = jax.sharding.PartitionSpec(*layout) if layout else None
        y = x if layout is None else jax.device_put(x, jax.sharding.NamedSharding(mesh, spec))
        finite, sums = ckpt.fingerprint({"w": y, "step": jax.numpy.int32(7)})
        assert finite and sums == {"w": expected, "step": 7}
    finite, _ = ckpt.fingerprint({"w": x.at[5, 5].set(np.nan)})
    assert not finite


def test_goodput_counts_the_work_a_fault_lost_in_its_own_bucket():
    from jaxtrain.observe.goodput import Goodput

    g = Goodput(start_time=time.time(), previous_last_step=7)  # the faulted invocation had logged step 7
    for step in range(5, 10):  # restored from step 4: steps 5-7 are recomputed, 8-9 are new
        g.step(step)
        time.sleep(0.01)
    lost = g.lost_work()
    assert lost["steps"] == 3 and lost["fault_after_step"] == 7
    totals = g.totals()
    assert lost["seconds"] == pytest.approx(totals["restarts"], abs=0.005) and 0.025 < lost["seconds"] < 1
    assert totals["productive"] > 0.015
    assert Goodput(previous_last_step=0).lost_work() == {"steps": 0, "seconds": 0.0, "fault_after_step": 0}
