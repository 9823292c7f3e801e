"""Local (emergency) checkpoints (jaxtrain/checkpoint/local.py, docs/checkpoints.md).

Fast: a sharded state's shards packed into one process's blob and back, bit-exact, each distinct shard once; the
rule that decides which local step every process can restore; a local step written, listed and read back (and one
whose bytes changed, or of another layout, refused); the config checks.

Slow (``-m slow``): 2 processes (launch/local.sh) with the state sharded across them (mesh.dcn.fsdp=2, the layout
Orbax's emergency manager cannot serve), a process SIGKILLed at a seeded random step, restarted: it resumes from the
newest local step, bit-equal to the uninterrupted run; then the same fault state with the killed process's local
directory deleted (its host lost): it resumes from the peer copy. ``JAXTRAIN_FAULT_SEED=<seed>`` replays.
"""

import os
import re
import shutil
import signal
import subprocess

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from test_mp_faults import TINY, _inject, _rng, _start_local, _survivors_exit, job_env  # noqa: F401 (fixture)

from jaxtrain import rundir
from jaxtrain.checkpoint import local as cl
from jaxtrain.errors import ConfigError
from jaxtrain_testing import REPO


def _state():
    """A small train-state-like tree on a (data=2, fsdp=4) mesh of 8 devices: sharded, partly sharded (replicated
    over ``data``), fully replicated, a scalar, bfloat16 and int32 leaves."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "fsdp"))
    rng = np.random.default_rng(0)

    def put(x, spec):
        return jax.device_put(x, NamedSharding(mesh, spec))

    return {
        "model": {"w": put(rng.standard_normal((16, 12), np.float32), P("fsdp", None)),
                  "b": put(rng.standard_normal((12,), np.float32), P()),
                  "e": put(jnp.asarray(rng.standard_normal((8, 4)), jnp.bfloat16), P(("data", "fsdp"), None))},
        "opt": {"count": put(np.int32(7), P()), "mu": put(rng.standard_normal((16, 12), np.float32), P(None, "data"))},
    }


def _abstract(state):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)


def _bits_equal(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        assert x.sharding == y.sharding and x.dtype == y.dtype
        assert np.asarray(x).tobytes() == np.asarray(y).tobytes()


def test_pack_unpack_round_trips_bit_exact_with_each_shard_once():
    state = _state()
    blob = cl.pack(state, {"step": 3, "data_iterator": {"next_index": 3}})
    leaves = jax.tree.leaves(state)
    head = len(b'{"step": 3, "data_iterator": {"next_index": 3}}')
    # Distinct shards once: w 16x12 f32 (4 row blocks), b 12 f32 (once, not 8 times), e 8x4 bf16 (8 blocks),
    # count, mu 16x12 f32 (2 column blocks): each leaf's bytes exactly once on one process.
    assert cl.shard_bytes(leaves, 0) == 16 * 12 * 4 + 12 * 4 + 8 * 4 * 2 + 4 + 16 * 12 * 4
    assert blob.size == 8 + head + cl.shard_bytes(leaves, 0)
    assert cl.shard_bytes(leaves, 1) == 0  # no devices on a process 1 here
    extra, shards = cl.unpack(blob, _abstract(state))
    assert extra == {"step": 3, "data_iterator": {"next_index": 3}}
    _bits_equal(cl.assemble(shards, _abstract(state)), state)
    # Padding after the bytes (as the peer exchange delivers them) does not matter; a short blob is refused.
    _, shards = cl.unpack(np.concatenate([blob, np.zeros(100, np.uint8)]), _abstract(state))
    _bits_equal(cl.assemble(shards, _abstract(state)), state)
    with pytest.raises(ValueError, match="too short"):
        cl.unpack(blob[:-1], _abstract(state))


def test_exchange_in_chunks_delivers_the_blob(monkeypatch):
    """One process: the shift is the identity, so what comes back is the blob, padded to ``size``, however it is cut
    into pieces (the multi-process exchange itself is in the slow test)."""
    blob = np.random.default_rng(1).integers(0, 256, 1000, dtype=np.uint8)
    for chunk in (7, 1000, 1 << 28):
        monkeypatch.setattr(cl, "CHUNK", chunk)
        got = cl.exchange(blob, 1005, 1)
        assert got.size == 1005 and got[:1000].tobytes() == blob.tobytes() and not got[1000:].any()


def test_fingerprint_follows_the_layout_shapes_and_run():
    state = _state()
    fp = cl.fingerprint(state, "/r/checkpoints")
    assert fp == cl.fingerprint(_abstract(state), "/r/checkpoints")  # derivable from the abstract state
    assert fp != cl.fingerprint(state, "/other/checkpoints")
    mesh = state["model"]["w"].sharding.mesh
    moved = {**state, "model": {**state["model"], "w": jax.device_put(state["model"]["w"], NamedSharding(mesh, P()))}}
    assert fp != cl.fingerprint(moved, "/r/checkpoints")


def test_usable_step_rule():
    u = cl.usable_step
    assert u([set()], [set()]) is None
    assert u([{2, 4}], [set()]) == 4  # one process: its own copy
    assert u([{2, 4}, {2, 4}], [{2, 4}, {2, 4}]) == 4
    # Process 1 lost its host: its own copy (and its copy of process 0) gone; process 2... here n=2: process 0
    # holds process 1's copy as its peer copy, process 0's own copy is intact.
    assert u([{2, 4}, set()], [{2, 4}, set()]) == 4
    # Neither process 1's own copy nor its peer's (process 0 holds process 1's) of step 4: step 2.
    assert u([{2, 4}, {2}], [{2}, {2, 4}]) == 2
    # n=3: process 1 lost; process 2 holds 1's copy of 4, but not of 6; process 0's own 6 is there.
    own, peer = [{4, 6}, set(), {4, 6}], [{4, 6}, set(), {4}]
    assert u(own, peer) == 4
    assert u([{4}, {4}, {4}], [set(), set(), set()]) == 4
    assert u([{4}, set(), {4}], [{4}, set(), set()]) is None


def test_local_steps_are_written_atomically_listed_kept_and_read_back(tmp_path):
    state, abstract = _state(), _abstract(_state())
    saver = cl.LocalSaver(str(tmp_path / "local"), str(tmp_path / "ck"))
    for step in (1, 2, 3):
        assert saver.save(step, state, {"next_index": step}) >= 0
    saver.wait()
    root = tmp_path / "local" / "process_0"
    assert sorted(os.listdir(root)) == ["2", "3"]  # the newest LOCAL_KEEP; no tmp left
    (root / "4.tmp").mkdir()  # an unfinished write: never listed
    fp = cl.fingerprint(abstract, str(tmp_path / "ck"))
    steps, notes = cl.list_steps(str(tmp_path / "local"), fp)
    assert sorted(steps) == [2, 3] and steps[3]["own_ok"] and not steps[3]["peer_ok"] and not notes
    restored, data = cl.restore(str(tmp_path / "local"), str(tmp_path / "ck"), 3, abstract)
    assert data == {"next_index": 3}
    _bits_equal(restored, state)
    # Bytes changed on disk (same size): the CRC refuses the copy, so step 3 is not usable, step 2 is.
    blob = np.fromfile(root / "3" / cl.OWN, np.uint8)
    blob[-1] ^= 1
    blob.tofile(root / "3" / cl.OWN)
    steps, _ = cl.list_steps(str(tmp_path / "local"), fp)
    assert not steps[3]["own_ok"] and cl.usable_step(*cl.gather_listing(steps)) == 2
    # Another run (checkpoint.dir) or layout: ignored, with a note.
    steps, notes = cl.list_steps(str(tmp_path / "local"), cl.fingerprint(abstract, str(tmp_path / "other")))
    assert not steps and len(notes) == 2 and "another mesh" in notes[0]
    cl.LocalSaver(str(tmp_path / "local"), str(tmp_path / "ck"))  # the next run's saver clears unfinished writes
    assert sorted(os.listdir(root)) == ["2", "3"]


def test_choose_takes_a_newer_local_step_and_falls_back_when_it_cannot_be_read(tmp_path):
    from jaxtrain.checkpoint.format import RestoreSource

    state, abstract = _state(), _abstract(_state())
    local, ck = str(tmp_path / "local"), str(tmp_path / "ck")
    saver = cl.LocalSaver(local, ck)
    for step in (2, 3):
        saver.save(step, state, {"next_index": step})
    saver.wait()
    fresh = RestoreSource("fresh")
    source = cl.choose(local, ck, abstract, fresh, max_step=10)
    assert (source.step, source.fallback, source.directory) == (3, fresh, os.path.join(local, "process_0"))
    assert cl.choose(local, ck, abstract, fresh, max_step=2).step == 2  # not beyond train.steps
    persistent = RestoreSource("resume", ck, 3)
    assert cl.choose(local, ck, abstract, persistent, max_step=10) is persistent  # not newer: the persistent one
    assert cl.choose(local, str(tmp_path / "other"), abstract, fresh, max_step=10) is fresh  # another run's
    same, (restored, step, data) = cl.restore_source(source, abstract)
    assert same is source and step == 3 and data == {"next_index": 3}
    _bits_equal(restored, state)
    os.truncate(os.path.join(local, "process_0", "3", cl.OWN), 10)  # changed after it was chosen
    assert cl.restore_source(source, abstract) == (fresh, None)


@pytest.mark.parametrize("overrides, message", [
    (["checkpoint.local_every=2"], "checkpoint.local_every=2 needs checkpoint.local_dir"),
    (["checkpoint.local_every=-1", "checkpoint.local_dir=/dev/shm/x"], "checkpoint.local_every=-1 must be >= 0"),
    (["checkpoint.local_every=6", "checkpoint.every=6", "checkpoint.local_dir=/dev/shm/x"],
     "checkpoint.local_every=6 must be < checkpoint.every=6"),
])
def test_config_validation(make_config, overrides, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        make_config(*overrides)


def test_config_accepts_local_checkpoints(make_config):
    c = make_config("checkpoint.local_every=2", "checkpoint.every=6", "checkpoint.local_dir=/dev/shm/x").checkpoint
    assert (c.local_every, c.local_dir) == (2, "/dev/shm/x")
    assert make_config("checkpoint.local_every=5", "checkpoint.every=0", "checkpoint.local_dir=/x").checkpoint


# ---------------------------------------------------------------------------------------------------------------
# Slow: 2 processes, a process killed, restarted from the local (or peer) copy


def _listing(local_dir, n):
    """(own, peer) step sets of every process, read from the files (as each process would list its own)."""
    per = [cl.list_steps(local_dir, None, process=i)[0] for i in range(n)]
    return ([{s for s, m in p.items() if m["own_ok"]} for p in per],
            [{s for s, m in p.items() if m["peer_ok"]} for p in per])


@pytest.mark.slow
def test_a_killed_process_resumes_from_local_then_from_the_peer_copy(tmp_path, job_env):  # noqa: F811
    from jaxtrain.checkpoint import format as ckpt

    rng, n, every, local_every = _rng("local-kill-2"), 2, 6, 2
    run, local, out = tmp_path / "run", tmp_path / "local", tmp_path / "fault.out"
    args = ["train", f"run.dir={run}", *TINY, "runtime.cpu_devices=2", "mesh.ici.fsdp=2", "mesh.dcn.fsdp=2",
            f"checkpoint.every={every}", f"checkpoint.local_every={local_every}", f"checkpoint.local_dir={local}"]
    job = _start_local(n, [*args, "train.steps=5000"], out, job_env)
    try:
        victim, _, survivors, at = _inject(rng, run, n, out, signal.SIGKILL, job)
        _survivors_exit(survivors, at, out)
        assert job.wait(timeout=120) != 0
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    before = {r["step"]: r["loss"] for r in rundir.read_metrics(run)}
    persistent = max(ckpt.existing_steps(str(run / "checkpoints")), default=0)
    aside = tmp_path / "aside"
    shutil.copytree(run, aside / "run")
    shutil.copytree(local, aside / "local")
    for case in ("local", "peer"):
        if case == "peer":  # the same fault state, the killed process's host (and its local directory) lost
            shutil.rmtree(run)
            shutil.rmtree(local)
            shutil.copytree(aside / "run", run)
            shutil.copytree(aside / "local", local)
            shutil.rmtree(local / f"process_{victim}")
        expected = cl.usable_step(*_listing(str(local), n))
        expected = expected if expected and expected > persistent else persistent
        resumed = subprocess.run([os.path.join(REPO, "launch/local.sh"), str(n), *args,
                                  f"train.steps={max(before) + 1}"], capture_output=True, text=True, cwd=REPO,
                                 env=job_env, timeout=600)
        text = resumed.stdout + resumed.stderr
        assert resumed.returncode == 0, text[-3000:]
        found = re.search(r"resumed from (\S+)/(\d+)\n", text)
        restored = int(found.group(2)) if found else 0
        assert restored == expected, (case, restored, expected, text[-3000:])
        if restored > persistent:
            assert str(local) in found.group(1) and f"restoring local step {restored}" in text
            assert case == "local" or f"[{victim}] take their shards from their peer's copy" in text, text[-3000:]
        after = {r["step"]: r["loss"] for r in rundir.read_metrics(run)}
        overlap = [s for s in sorted(before) if restored < s <= max(after)]
        assert overlap or max(before) == restored  # nothing to recompute when the fault came right after a save
        assert [after[s] for s in overlap] == [before[s] for s in overlap]  # bit-exact
        lost = max(before) - restored
        summary = rundir.read_summary(str(run))
        assert summary is not None and summary.lost_work["steps"] == lost, summary
        # At most local_every steps since the newest local save began, plus that save and the one before it
        # (the write of one is in flight while the next waits for it), plus the step logged late.
        assert lost <= 2 * local_every + 1, (lost, restored, max(before))
        print(f"{case}: resumed from step {restored}; work lost: {lost} step(s) with local checkpoints every "
              f"{local_every} (from {'the peer copy' if case == 'peer' else 'local'}); without them (persistent "
              f"step {persistent}, checkpoint.every={every}): work lost: {max(before) - persistent} step(s)")
