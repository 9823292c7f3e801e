"""plan's checkpoint figures (jaxtrain/planner/storage.py): the bytes each host writes, against what Orbax really
writes (du of a saved step); the save-time warning at hand-worked thresholds; the command line's bad values.

Orbax compresses arrays with zstd, and the figure is the bytes before it (an upper bound): a saved step of random
normal values took 0.94 x them in float32 (9.21 MB on disk for 9.84 MB) and 0.78 x with bfloat16 parameters (3.85
of 4.92 MB: bfloat16's 7 mantissa bits leave the exponent byte more of the total), so the data files are held to
[0.7, 1.0] x the figure, and the whole step (metadata, the OCDBT manifests, the JSON item) to at most the figure +
128 kB.
"""

import json
import os
import subprocess

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxtrain.checkpoint import format as checkpoint_format
from jaxtrain.config import hardware, load_config
from jaxtrain.parallel.layout import Layout
from jaxtrain.parallel.mesh import build_mesh
from jaxtrain.planner import storage
from jaxtrain.planner.search import report
from jaxtrain_testing import F32, FAST, launch_local, run_cli

COMPRESSED, METADATA = (0.7, 1.0), 128_000


def _du(path) -> int:
    """Apparent bytes of the files under ``path`` (du -b: what was written, not the blocks allocated)."""
    return int(subprocess.run(["du", "-b", "-s", str(path)], capture_output=True, text=True,
                              check=True).stdout.split()[0])


def _replica_parallel() -> bool:
    return storage.orbax_replica_parallel(os.environ.get("JAX_PLATFORMS", ""))


def _random_state(layout, seed=0):
    """A state of ``layout`` whose floating leaves hold random normal values (zeros, e.g. fresh AdamW moments, would
    compress to almost nothing and say little about a trained state's size)."""
    rng = np.random.default_rng(seed)

    def fill(a):
        if jax.dtypes.issubdtype(a.dtype, np.floating):
            return jax.device_put(rng.standard_normal(a.shape).astype(a.dtype), a.sharding)
        return a

    return jax.tree.map(fill, layout.init_state())


def test_who_writes_a_replicated_shard_hand_worked():
    """dcn data 2 x ici fsdp 4 (node 0: devices 0-3, node 1: 4-7). An [8, 6] float32 array over fsdp: 4 shards of
    [2, 6] (48 bytes), each held once on each node. Replica 0 of each shard is on node 0, so without replica-parallel
    node 0 writes all 192 bytes; with it each copy writes half a shard: 96 bytes a node. A [3] float32 replicated on
    all 8 devices has no dimension divisible by 8: 12 bytes from node 0 either way."""
    cfg = load_config(None, ["runtime.cpu_devices=8", *FAST, "mesh.dcn.data=2", "mesh.ici.fsdp=4"])
    mesh, shape = build_mesh(cfg, jax.devices()[:8])
    nodes = dict(zip(mesh.devices.flat, shape.node_of(np.arange(8)).tolist(), strict=True))
    matrix = jax.ShapeDtypeStruct((8, 6), np.float32, sharding=NamedSharding(mesh, P("fsdp", None)))
    vector = jax.ShapeDtypeStruct((3,), np.float32, sharding=NamedSharding(mesh, P()))
    assert storage.leaf_bytes_per_node(matrix, nodes, 2, replica_parallel=False).tolist() == [192, 0]
    assert storage.leaf_bytes_per_node(matrix, nodes, 2, replica_parallel=True).tolist() == [96, 96]
    for rp in (False, True):
        assert storage.leaf_bytes_per_node(vector, nodes, 2, replica_parallel=rp).tolist() == [12, 0]
    # JAX's own replica numbering agrees: every shard's replica 0 sits on node 0.
    real = jax.device_put(np.zeros((8, 6), np.float32), matrix.sharding)
    assert {nodes[s.device] for s in real.addressable_shards if s.replica_id == 0} == {0}
    assert {nodes[s.device] for s in real.addressable_shards if s.replica_id == 1} == {1}


def test_orbax_replica_parallel_default_follows_jax_platforms():
    assert storage.orbax_replica_parallel("") and storage.orbax_replica_parallel("cpu")
    assert not storage.orbax_replica_parallel("cuda") and not storage.orbax_replica_parallel("CUDA,cpu")
    assert not storage.orbax_replica_parallel("gpu")


@pytest.mark.parametrize("overrides", [
    ["mesh.ici.data=2", "mesh.ici.fsdp=4", *FAST],
    ["mesh.ici.fsdp=2", "mesh.ici.tensor=2", "mesh.ici.data=2", "model.param_dtype=bfloat16"],
])
def test_checkpoint_bytes_match_a_real_save(tmp_path, overrides):
    """One process: the figure equals the state's bytes (each array once, in its dtype) and the saved step's data
    files come within Orbax's compression of it."""
    cfg = load_config(None, ["runtime.cpu_devices=8", *overrides])
    layout = Layout.build(cfg, jax.devices()[:8])
    state = _random_state(layout)
    logical = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state))
    figure = storage.bytes_per_node(layout.abstract_state, layout.mesh, layout.shape, _replica_parallel())
    assert figure.tolist() == [logical]
    checkpoint_format.write(str(tmp_path), 1, state, {})
    data = _du(tmp_path / "1" / "state" / "ocdbt.process_0")
    assert COMPRESSED[0] * logical <= data <= COMPRESSED[1] * logical, (data, logical)
    assert _du(tmp_path / "1") <= logical + METADATA


@pytest.mark.slow
def test_bytes_per_host_match_two_processes_saving(tmp_path):
    """Two processes (dcn data 2 x ici fsdp 4: the state replicated across them) train 2 steps and save: each
    process's OCDBT data files come within Orbax's compression of the bytes the plan gives that host."""
    args = ["mesh.dcn.data=2", "mesh.ici.fsdp=4", *F32, "train.steps=2", "checkpoint.every=2"]
    proc = launch_local(2, "train", f"run.dir={tmp_path}", "runtime.cpu_devices=4", *args)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    cfg = load_config(None, ["runtime.cpu_devices=8", *args])
    layout = Layout.build(cfg, jax.devices()[:8])
    figure = storage.bytes_per_node(layout.abstract_state, layout.mesh, layout.shape, _replica_parallel())
    logical = sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(layout.abstract_state))
    assert figure.sum() == logical and figure.min() > 0  # replica-parallel: both hosts write
    step = tmp_path / "checkpoints" / "2" / "state"
    for host in (0, 1):
        data = _du(step / f"ocdbt.process_{host}")
        assert COMPRESSED[0] * figure[host] <= data <= COMPRESSED[1] * figure[host], (host, data, figure)


def test_save_warning_thresholds_hand_worked():
    """3 GB from the busiest host, saves every 100 steps of 2 s: 200 s between saves, 20 s allowed at share 0.1.
    At 0.15 GB/s the save takes 3e9 / 1.5e8 = 20 s: not more than allowed, no warning; at 0.1 GB/s 30 s: warned,
    and checkpoint.every must reach 30 / 0.1 / 2 = 150 steps. With share 0.2 (40 s) 30 s passes; checkpoint.every=0
    (a save at the end only) never warns."""
    hosts = [3_000_000_000, 1_000_000_000]
    at = storage.save_figures(hosts, 100, 2.0, storage.Storage(0.15e9, 0.1), False)
    assert at["save_seconds"] == 20.0 and at["interval_seconds"] == 200.0 and not at["too_slow"]
    assert at["bytes"] == 4_000_000_000 and at["max_bytes_per_host"] == 3_000_000_000
    assert storage.warning("fsdp8", at, 100) is None
    slow = storage.save_figures(hosts, 100, 2.0, storage.Storage(0.1e9, 0.1), False)
    assert slow["save_seconds"] == 30.0 and slow["too_slow"]
    text = storage.warning("fsdp8", slow, 100)
    assert text.startswith("warning: fsdp8: ") and "30 s at 0.1 GB/s" in text and "at least 150" in text
    assert not storage.save_figures(hosts, 100, 2.0, storage.Storage(0.1e9, 0.2), False)["too_slow"]
    never = storage.save_figures(hosts, 0, 2.0, storage.Storage(0.1e9, 0.1), False)
    assert never["interval_seconds"] is None and not never["too_slow"]
    assert storage.save_figures(hosts, 100, 2.0, storage.Storage(None, 0.1), False)["save_seconds"] is None


@pytest.mark.slow
def test_plan_cli_reports_and_warns(tmp_path):
    """``plan --json --write-bandwidth``: every host's bytes sum to the state's; a bandwidth far too low for a save
    every step warns, a huge one does not."""
    common = ["runtime.cpu_devices=8", "mesh.ici.data=2", "mesh.ici.fsdp=4", *FAST, "checkpoint.every=1",
              f"run.dir={tmp_path}"]
    proc = run_cli("plan", "--json", "--write-bandwidth", "1000", *common)
    assert proc.returncode == 0, proc.stderr[-2000:]
    [row] = json.loads(proc.stdout)["candidates"]
    cfg = load_config(None, common)
    abstract = Layout.build(cfg, jax.devices()[:8]).abstract_state
    logical = sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(abstract))
    ck = row["checkpoint"]
    assert ck["bytes_per_host"] == [logical] and ck["write_bandwidth"] == 1e12 and ck["warning"] is None
    assert ck["save_seconds"] == pytest.approx(logical / 1e12)
    # The table's checkpoint columns, and where the longest mesh label leaves no room for them, a note instead.
    hw = hardware.load_hardware("h100-8x")
    def header(text):
        return next(line for line in text.splitlines() if line.startswith("#  mesh")).split()

    text = report.format_report(cfg, hw, 8, 1, {"candidates": [row], "pruned": []})
    assert header(text)[-2:] == ["ckpt/host", "save"] and "do not fit" not in text
    long = dict(row, label="data2 stage2 fsdp2 | dcn data2 stage2 fsdp2", bubble_fraction=0.1)
    text = report.format_report(cfg, hw, 64, 8, {"candidates": [long, row], "pruned": []})
    assert "ckpt/host" not in header(text) and "(ckpt/host, save) do not fit in 120 columns" in text
    assert max(map(len, text.splitlines())) <= report.WIDTH
    slow = run_cli("plan", "--write-bandwidth", "0.001", "--save-share", "0.5", *common)
    assert slow.returncode == 0, slow.stderr[-2000:]
    assert "warning: data2 fsdp4: a checkpoint save writes" in slow.stdout and "more than 0.5 of" in slow.stdout
    assert "ckpt/host" in slow.stdout and " !" in slow.stdout


@pytest.mark.parametrize("args, expected", [
    (["--write-bandwidth", "0"], "argument --write-bandwidth: '0': expected a finite number > 0"),
    (["--write-bandwidth", "-2"], "argument --write-bandwidth: '-2': expected a finite number > 0"),
    (["--write-bandwidth", "fast"], "argument --write-bandwidth: 'fast': expected a finite number > 0"),
    (["--write-bandwidth", "inf"], "argument --write-bandwidth: 'inf': expected a finite number > 0"),
    (["--write-bandwidth", "2", "--save-share", "0"], "argument --save-share: '0': expected a share"),
    (["--write-bandwidth", "2", "--save-share", "1.5"], "argument --save-share: '1.5': expected a share"),
    (["--save-share", "0.2"], "--save-share 0.2 needs --write-bandwidth"),
    (["--write-bandwidth", "2", "mesh.auto=true"], "--write-bandwidth does not apply with mesh.auto"),
])
def test_bad_storage_values_exit_2_with_one_line(args, expected):
    proc = run_cli("plan", *args, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in proc.stderr
    assert expected in lines[0]
