"""Local (emergency) checkpoints: every ``checkpoint.local_every`` steps each process writes its own shards of the
train state to a host-local directory (``checkpoint.local_dir``, e.g. /dev/shm or local NVMe), and sends the same
bytes to one peer process, ``(i + 1) % n``, which keeps them as its *peer copy*; losing one host loses nothing.

Layout on disk, per process ``i``: ``<local_dir>/process_<i>/<step>/`` holding ``own.bin`` (this process's blob),
``peer.bin`` (process ``i - 1``'s blob; absent with one process) and ``meta.json`` (step, fingerprint, sizes and
CRC-32 of both files). A step is written into ``<step>.tmp`` and renamed when complete, so a step directory that
exists is complete; the newest ``LOCAL_KEEP`` are kept.

A blob is ``[8-byte little-endian length L][L bytes of JSON: data iterator state][the shard bytes]``. The shard
bytes are each leaf's shards (in tree order) that this process's devices hold, each distinct index once (replicated
copies inside the process once), in the order of :func:`own_indices`: any process derives any other's layout from
the shardings alone, so the blob needs no manifest. A state replicated *across* processes is stored by each of them:
every process can then rebuild its own devices' shards from its own bytes, without another collective.

The peer copy rides JAX's own interconnect: the blobs, padded to the largest, form a global ``(n_processes,
max_bytes)`` uint8 array with one device per process, shifted by one with ``lax.ppermute`` (NCCL on GPUs, gloo on
CPU). Restoring, a process whose own copy is missing gets it back from its peer by the reverse shift.

Restore rule (:func:`usable_step`): a local step is usable iff for every process ``j``, ``j``'s own copy or its peer
``(j + 1) % n``'s copy of ``j`` is complete; the newest usable local step is restored when it is newer than the newest
persistent step. Local steps of another mesh, process count, state shapes or checkpoint directory (the fingerprint
in ``meta.json``) are ignored.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import struct
import threading
import time
import zlib
from typing import Any

import jax
import numpy as np

from jaxtrain.checkpoint.orbax_io import leaf_name

LOCAL_KEEP = 2  # local steps kept per process: the newest, and the one before it while the newest is written
META_CAP = 1 << 16  # room reserved in every blob for the JSON (the data iterator state is ~100 bytes)
OWN, PEER, META_FILE = "own.bin", "peer.bin", "meta.json"


# ---------------------------------------------------------------------------------------------------------------
# Layout: derived from shardings alone, identical on every process


def _index(idx: tuple, shape: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    """A shard's index (a tuple of slices) as (start, stop) per dimension."""
    return tuple((s.indices(n)[0], s.indices(n)[1]) for s, n in zip(idx, shape, strict=True)) if shape else ()


def own_indices(sharding, shape: tuple[int, ...], process: int) -> list[tuple[tuple[tuple[int, int], ...], Any]]:
    """[(index as (start, stop) pairs, first device of ``process`` holding it)] for each distinct shard index held by
    ``process``'s devices, in device-id order: the order of that process's shards in its blob."""
    out: dict[tuple, Any] = {}
    for device, idx in sorted(sharding.devices_indices_map(shape).items(), key=lambda kv: kv[0].id):
        if device.process_index == process:
            out.setdefault(_index(idx, shape), device)
    return list(out.items())


def shard_bytes(leaves: list, process: int) -> int:
    """Bytes of ``process``'s shards of ``leaves`` (arrays or ShapeDtypeStructs with shardings)."""
    total = 0
    for leaf in leaves:
        for index, _ in own_indices(leaf.sharding, tuple(leaf.shape), process):
            total += int(np.prod([b - a for a, b in index], dtype=np.int64)) * np.dtype(leaf.dtype).itemsize
    return total


def fingerprint(tree: Any, directory: str) -> str:
    """What a local step must match to be restored: process count, each leaf's name, shape, dtype and shard layout
    (device, process and index of every shard: the mesh and partitioning as they place bytes), and the persistent
    checkpoint directory (another run's local steps in the same local_dir)."""
    parts: list = [jax.process_count(), os.path.abspath(directory)]
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        shape = tuple(leaf.shape)
        placed = sorted((d.id, d.process_index, _index(idx, shape))
                        for d, idx in leaf.sharding.devices_indices_map(shape).items())
        parts.append([leaf_name(path), list(shape), str(np.dtype(leaf.dtype)), placed])
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:32]


# ---------------------------------------------------------------------------------------------------------------
# Blobs


def pack(state: Any, extra: dict) -> np.ndarray:
    """This process's blob (uint8, 1-D) of ``state``: the device-to-host copy happens here, so the caller may donate
    the state's buffers once it returns."""
    me = jax.process_index()
    chosen = []
    for leaf in jax.tree_util.tree_leaves(state):
        by_device = {s.device: s.data for s in leaf.addressable_shards}
        chosen += [by_device[device] for _, device in own_indices(leaf.sharding, tuple(leaf.shape), me)]
    host = jax.device_get(chosen)
    head = json.dumps(extra).encode()
    if len(head) > META_CAP - 8:
        raise ValueError(f"local checkpoint metadata of {len(head)} bytes exceeds {META_CAP - 8}")
    parts = [np.frombuffer(struct.pack("<Q", len(head)) + head, np.uint8)]
    parts += [np.ascontiguousarray(h).reshape(-1).view(np.uint8) for h in host]
    return np.concatenate(parts)


def unpack(blob: np.ndarray, abstract_state: Any, process: int | None = None) -> tuple[dict, dict]:
    """(extra JSON, {(leaf number, index): host array}) of ``process``'s blob (default: this process)."""
    process = jax.process_index() if process is None else process
    (n,) = struct.unpack("<Q", blob[:8].tobytes())
    extra = json.loads(blob[8:8 + n].tobytes().decode())
    shards, at = {}, 8 + n
    for k, leaf in enumerate(jax.tree_util.tree_leaves(abstract_state)):
        dtype = np.dtype(leaf.dtype)
        for index, _ in own_indices(leaf.sharding, tuple(leaf.shape), process):
            shape = tuple(b - a for a, b in index)
            size = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
            if at + size > blob.size:
                raise ValueError(f"local checkpoint blob is {blob.size} bytes, too short for its layout")
            shards[(k, index)] = blob[at:at + size].view(dtype).reshape(shape)
            at += size
    return extra, shards


def assemble(shards: dict, abstract_state: Any) -> Any:
    """The global state from this process's unpacked shards, each device's shard put on that device."""
    leaves, treedef = jax.tree_util.tree_flatten(abstract_state)
    out = []
    for k, leaf in enumerate(leaves):
        shape = tuple(leaf.shape)
        arrays = [jax.device_put(shards[(k, _index(idx, shape))], device)
                  for device, idx in leaf.sharding.addressable_devices_indices_map(shape).items()]
        out.append(jax.make_array_from_single_device_arrays(shape, leaf.sharding, arrays))
    return jax.tree_util.tree_unflatten(treedef, out)


# ---------------------------------------------------------------------------------------------------------------
# The peer exchange: one device per process, ppermute along the process axis

_SHIFTS: dict = {}
# Bytes per exchange: a process's blob holds all its devices' shards, so it goes through the one device in pieces.
CHUNK = 1 << 28


def exchange(blob: np.ndarray, size: int, shift: int) -> np.ndarray:
    """Process ``i`` sends ``blob`` (padded to ``size`` bytes, the same on every process) to process ``(i + shift) %
    n`` and returns the blob it received. A collective: every process calls it at the same point."""
    from jax.sharding import NamedSharding, PartitionSpec

    n, me = jax.process_count(), jax.process_index()
    devices = [min((d for d in jax.devices() if d.process_index == p), key=lambda d: d.id) for p in range(n)]
    mesh = jax.sharding.Mesh(np.array(devices), ("process",))
    chunk = min(size, CHUNK)
    key = (chunk, shift, tuple(d.id for d in devices))
    if key not in _SHIFTS:
        perm = [(j, (j + shift) % n) for j in range(n)]
        f = jax.shard_map(lambda x: jax.lax.ppermute(x, "process", perm), mesh=mesh,
                          in_specs=PartitionSpec("process"), out_specs=PartitionSpec("process"))
        _SHIFTS[key] = jax.jit(f)
    sharding = NamedSharding(mesh, PartitionSpec("process"))
    received = np.zeros(size, np.uint8)
    for at in range(0, size, chunk):  # (1, chunk) rows: one per process, ``process`` i's on its first device
        row = np.zeros((1, chunk), np.uint8)
        piece = blob[at:at + chunk]
        row[0, :piece.size] = piece
        x = jax.make_array_from_single_device_arrays((n, chunk), sharding, [jax.device_put(row, devices[me])])
        got = np.asarray(_SHIFTS[key](x).addressable_shards[0].data)[0]
        received[at:at + chunk] = got[:min(chunk, size - at)]
    return received


def blob_size(tree: Any) -> int:
    """The padded size of every process's blob in the exchange (derived, the same on every process)."""
    leaves = jax.tree_util.tree_leaves(tree)
    return META_CAP + max(shard_bytes(leaves, p) for p in range(jax.process_count()))


# ---------------------------------------------------------------------------------------------------------------
# On disk


def process_dir(local_dir: str, process: int | None = None) -> str:
    return os.path.join(os.path.abspath(local_dir), f"process_{jax.process_index() if process is None else process}")


def _read_checked(path: str, size: int | None, crc: int | None) -> np.ndarray | None:
    try:
        data = np.fromfile(path, np.uint8)
    except OSError:
        return None
    if size is None or data.size != size or zlib.crc32(data.data) != crc:
        return None
    return data


def list_steps(local_dir: str, fp: str | None, load: bool = False, process: int | None = None,
               only: int | None = None) -> tuple[dict[int, dict], list[str]]:
    """({step: meta} of this process's (or ``process``'s) complete local steps whose fingerprint is ``fp`` (None:
    any), notes on those skipped). ``meta["own_ok"]``/``["peer_ok"]``: that file is there with its size and CRC;
    ``load``: the blobs are kept in ``meta["blobs"]``; ``only``: that step alone is read."""
    root, found, notes = process_dir(local_dir, process), {}, []
    names = sorted((int(x) for x in (os.listdir(root) if os.path.isdir(root) else []) if x.isdigit()), reverse=True)
    for step in names if only is None else [s for s in names if s == only]:
        path = os.path.join(root, str(step))
        try:
            with open(os.path.join(path, META_FILE)) as f:
                meta = json.load(f)
        except (OSError, ValueError):
            notes.append(f"{path}: no readable {META_FILE}")
            continue
        if fp is not None and meta.get("fingerprint") != fp:
            notes.append(f"{path}: written for another mesh, process count, state or checkpoint.dir")
            continue
        blobs = {}
        for name, key in ((OWN, "own"), (PEER, "peer")):
            data = _read_checked(os.path.join(path, name), meta.get(f"{key}_size"), meta.get(f"{key}_crc"))
            meta[f"{key}_ok"] = data is not None
            blobs[key] = data
        if load:
            meta["blobs"] = blobs
        found[step] = meta
    return found, notes


def usable_step(own: list[set[int]], peer: list[set[int]]) -> int | None:
    """The newest step every process can restore: for each process ``j``, ``j`` holds its own copy or process
    ``(j + 1) % n`` holds ``j``'s as its peer copy (``peer[i]``: the steps process ``i`` holds process ``i - 1``'s
    copy of). None when there is none. A pure function of the gathered listings."""
    n = len(own)
    steps = set().union(*own, *peer) if n else set()
    good = [s for s in steps if all(s in own[j] or (n > 1 and s in peer[(j + 1) % n]) for j in range(n))]
    return max(good) if good else None


def gather_listing(steps: dict[int, dict]) -> tuple[list[set[int]], list[set[int]]]:
    """(own, peer) listings of every process, gathered from each process's :func:`list_steps`."""
    k = 4 * LOCAL_KEEP  # more than a process keeps; a leftover beyond it is older and not needed
    mine = np.full((2, k), -1, np.int64)
    own = sorted((s for s, m in steps.items() if m["own_ok"]), reverse=True)[:k]
    peer = sorted((s for s, m in steps.items() if m["peer_ok"]), reverse=True)[:k]
    mine[0, :len(own)], mine[1, :len(peer)] = own, peer
    if jax.process_count() == 1:
        rows = mine[None]
    else:
        from jax.experimental import multihost_utils

        rows = np.asarray(multihost_utils.process_allgather(mine)).reshape(-1, 2, k)
    return [{int(s) for s in r[0] if s >= 0} for r in rows], [{int(s) for s in r[1] if s >= 0} for r in rows]


class LocalSaver:
    """Saves local steps: the host copy and the peer exchange in :meth:`save` (the caller waits), the file writes
    in a background thread (the next save waits for it; a failure is raised at the next save or :meth:`wait`)."""

    def __init__(self, local_dir: str, persistent_dir: str):
        self.root, self.persistent_dir = process_dir(local_dir), persistent_dir
        os.makedirs(self.root, exist_ok=True)
        for name in os.listdir(self.root):  # writes a killed run left unfinished (only this process writes here)
            if name.endswith(".tmp"):
                shutil.rmtree(os.path.join(self.root, name), ignore_errors=True)
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._fp: str | None = None
        self._size = self._peer_size = 0

    def save(self, step: int, state: Any, data_iterator_state: dict) -> float:
        """Start saving ``step``; returns the seconds the caller was held."""
        t0 = time.perf_counter()
        if self._fp is None:  # derived once: the state's shardings do not change during a run
            self._fp, self._size = fingerprint(state, self.persistent_dir), blob_size(state)
            previous = (jax.process_index() - 1) % jax.process_count()
            self._peer_size = shard_bytes(jax.tree_util.tree_leaves(state), previous)  # its blob's shard bytes
        self.wait()
        blob = pack(state, {"step": step, "data_iterator": data_iterator_state})
        peer = exchange(blob, self._size, 1) if jax.process_count() > 1 else None
        if peer is not None:
            (n,) = struct.unpack("<Q", peer[:8].tobytes())
            peer = peer[:8 + n + self._peer_size]
        self._thread = threading.Thread(target=self._write, args=(step, blob, peer), daemon=True,
                                        name="jaxtrain-local-checkpoint")
        self._thread.start()
        return time.perf_counter() - t0

    def _write(self, step: int, blob: np.ndarray, peer: np.ndarray | None) -> None:
        try:
            final, tmp = os.path.join(self.root, str(step)), os.path.join(self.root, f"{step}.tmp")
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(tmp)
            meta: dict = {"step": step, "fingerprint": self._fp, "process": jax.process_index(),
                          "processes": jax.process_count()}
            for name, key, data in ((OWN, "own", blob), (PEER, "peer", peer)):
                if data is None:
                    continue
                with open(os.path.join(tmp, name), "wb") as f:
                    f.write(data.data)
                    f.flush()
                    os.fsync(f.fileno())  # local NVMe: the rename below must not precede the bytes
                meta[f"{key}_size"], meta[f"{key}_crc"] = int(data.size), zlib.crc32(data.data)
            with open(os.path.join(tmp, META_FILE), "w") as f:
                json.dump(meta, f)
            shutil.rmtree(final, ignore_errors=True)  # a step of an earlier, abandoned attempt
            os.rename(tmp, final)
            steps = sorted(int(x) for x in os.listdir(self.root) if x.isdigit())
            for old in steps[:-LOCAL_KEEP]:
                shutil.rmtree(os.path.join(self.root, str(old)), ignore_errors=True)
        except BaseException as e:  # raised in the loop's thread by raise_if_failed
            self._error = e

    def raise_if_failed(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self.raise_if_failed()


def saver(cfg, persistent_dir: str) -> LocalSaver | None:
    """The run's local saver, or None when ``checkpoint.local_every`` is 0 (then the loop does nothing per step)."""
    c = cfg.checkpoint
    return LocalSaver(c.local_dir, persistent_dir) if c.local_every and c.local_dir else None


def choose(local_dir: str | None, persistent_dir: str, abstract_state: Any, source, max_step: int):
    """``source`` (the persistent choice, a ``checkpoint.RestoreSource``), or the newest local step every process
    can restore when it is newer (a collective: every process calls it); logs which, and why."""
    from jaxtrain import log

    assert local_dir, "config validation requires checkpoint.local_dir with checkpoint.local_every"
    fp = fingerprint(abstract_state, persistent_dir)
    steps, notes = list_steps(local_dir, fp)
    own, peer = gather_listing({s: m for s, m in steps.items() if s <= max_step})
    step = usable_step(own, peer)
    persistent_step = source.step if source.kind == "resume" else 0
    if notes and jax.process_index() == 0:
        log.info(f"local checkpoints ignored: {notes[0]}" + (f" (and {len(notes) - 1} more)" if notes[1:] else ""))
    if step is None or step <= persistent_step:
        if any(own) or any(peer):
            log.info(f"restoring the persistent step {persistent_step or 'none'}: no usable local step is newer "
                     f"(local steps held: {sorted(set().union(*own, *peer))})")
        return source
    missing = [j for j in range(len(own)) if step not in own[j]]
    log.info(f"restoring local step {step} (newer than persistent step {persistent_step or 'none'})"
             + (f"; process(es) {missing} take their shards from their peer's copy" if missing else ""))
    # checkpoint.py imports this module: a RestoreSource made from the given one, not by importing its class.
    return dataclasses.replace(source, kind="resume", directory=process_dir(local_dir), step=step, older=(),
                               fallback=source, run_key=persistent_dir)


def restore_source(source, abstract_state: Any) -> tuple[Any, tuple | None]:
    """(source, (state, step, data iterator state)) of the local step ``source`` (from :func:`choose`), or
    (its persistent fallback, None) when some process cannot read its copy (all processes agree)."""
    from jaxtrain import log
    from jaxtrain.checkpoint.orbax_io import everyone_ok, reason

    state, data, error = None, None, None
    try:
        state, data = restore(os.path.dirname(source.directory), source.run_key, source.step, abstract_state)
    except Exception as e:  # a file that changed since it was listed, a short blob
        error = e
    if everyone_ok(error is None):
        return source, (state, source.step, data)
    why = reason(error) if error else "on another process"
    fb = source.fallback
    where = f"{fb.directory}/{fb.step}" if fb.kind != "fresh" else "nothing (a fresh start)"
    log.info(f"warning: local step {source.step} cannot be restored ({why}); restoring {where} instead")
    return source.fallback, None


def restore(local_dir: str, persistent_dir: str, step: int, abstract_state: Any) -> tuple[Any, dict]:
    """(state, data iterator state) of local ``step`` (chosen by :func:`choose`; a collective)."""
    fp = fingerprint(abstract_state, persistent_dir)
    steps, _ = list_steps(local_dir, fp, load=True, only=step)
    meta = steps.get(step, {})
    own_blob = meta.get("blobs", {}).get("own")
    n = jax.process_count()
    if n > 1:
        own, _ = gather_listing(steps)
        if any(step not in o for o in own):  # someone lacks its own copy: every peer sends back what it holds
            held = meta.get("blobs", {}).get("peer")
            back = exchange(held if held is not None else np.zeros(0, np.uint8), blob_size(abstract_state), -1)
            if own_blob is None:
                own_blob = back
    if own_blob is None:
        raise ValueError(f"local step {step}: no copy of process {jax.process_index()}'s shards")
    extra, shards = unpack(own_blob, abstract_state)
    if extra.get("step") != step:
        raise ValueError(f"local step {step}: its blob says step {extra.get('step')}")
    return assemble(shards, abstract_state), extra["data_iterator"]
