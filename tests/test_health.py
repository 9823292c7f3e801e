"""The health check's bounds: exact device-kind matching, the verdict over nodes (misfit bounds, exclusion cap,
unknown kinds), host grouping of mesh axes, buffer sizes, and the on-device value check. The end-to-end `check`
runs live in test_multihost.py."""

import os

import jax
import numpy as np
import pytest
from jax.sharding import Mesh

from jaxtrain.config import hardware
from jaxtrain.errors import ConfigError
from jaxtrain.health import check as health
from jaxtrain.health.verdict import (
    BOUND,
    RELATIVE,
    WRONG,
    Finding,
    axis_crosses_hosts,
    decide,
    estimate_seconds,
    judged_size_bytes,
    matmul_findings,
)


@pytest.mark.parametrize("kind, name", [
    ("NVIDIA H100 80GB HBM3", "h100-8x"),  # SXM5
    ("NVIDIA H100 PCIe", None), ("NVIDIA H100 NVL", None), ("NVIDIA H800", None),
    ("NVIDIA H200", "h200-8x"), ("NVIDIA H200 141GB HBM3e", "h200-8x"),
    ("NVIDIA H200 NVL", None), ("NVIDIA GH200 480GB", None), ("NVIDIA GH200 144G HBM3e", None),
    ("NVIDIA A100-SXM4-80GB", "a100-8x"),
    ("NVIDIA A100-SXM4-40GB", None), ("NVIDIA A100 80GB PCIe", None),
    ("NVIDIA B200", "b200-8x"), ("NVIDIA GB200", None),
    ("H100", None), ("nvidia h200", None), ("cpu", None),  # exact strings only, no substrings, case counts
])
def test_hardware_files_match_exact_device_kinds(kind, name):
    hw = hardware.for_device_kind(kind)
    assert (hw.name if hw else None) == name


def test_every_shipped_kind_belongs_to_one_file():
    kinds = hardware.known_device_kinds()
    assert len(kinds) == len(set(kinds)) >= len(hardware.known_hardware())
    assert all(hardware.load_hardware(name).kinds for name in hardware.known_hardware())


@pytest.mark.parametrize("name", hardware.known_hardware())
def test_each_hardware_file_covers_the_device_kind_of_its_gpu_target(name):
    """A deviceless XLA:GPU compile for the file's GPU target config gives devices of the config's
    device_description_str; the file must recognise them (h200-8x did not: XLA says "NVIDIA H200 141GB HBM3e")."""
    hw = hardware.load_hardware(name)
    assert hw.gpu_target and hw.covers(hardware.gpu_target_device_kind(hw.gpu_target))


def test_an_unknown_gpu_target_is_one_line(tmp_path):
    own = tmp_path / "own.yaml"
    own.write_text(open(hardware.shipped("hardware")["h100-8x"]).read().replace("gpu_target: h100", "gpu_target: h900"))
    with pytest.raises(ConfigError, match=r"gpu_target 'h900' is not a shipped GPU target config; shipped: a100, "
                                          r"b200, h100, h200"):
        hardware.load_hardware(str(own))


def test_a_named_hardware_file_must_list_the_devices_kind(make_config, tmp_path):
    with pytest.raises(ConfigError, match=r"check.hardware='h100-8x' describes 'NVIDIA H100 80GB HBM3' devices but "
                                          r"this job has 'NVIDIA H100 PCIe'"):
        health._hardware(make_config("check.hardware=h100-8x"), "NVIDIA H100 PCIe")
    assert health._hardware(make_config(), "NVIDIA H100 PCIe") is None  # unset: unknown kind, no bounds
    own = tmp_path / "pcie.yaml"  # a user's file for the PCIe part
    own.write_text("device_kinds: ['NVIDIA H100 PCIe']\npeak_flops: 756.0e+12\nhbm_bytes: 80.0e+9\nhbm_bandwidth: "
                   "2.0e+12\ndevices_per_node: 8\nintra_node_bandwidth: 32.0e+9\ninter_node_bandwidth: 25.0e+9\n"
                   "compute_efficiency: 0.5\n")
    assert health._hardware(make_config(f"check.hardware={own}"), "NVIDIA H100 PCIe").intra_node_bandwidth == 32e9


HOSTS = ["n1", "n2", "n3", "n4"]
LINK = "all-reduce over axis data (check.min_link_fraction=0.5 of h100-8x's inter-node link)"


def _decide(findings, known=True, misfit=0.5, cap=0.5, hosts=HOSTS):
    return decide(hosts, findings, known_hardware=known, misfit_fraction=misfit, max_exclude_fraction=cap)


def test_a_bound_every_node_misses_does_not_fit_the_hardware():
    # A RoCE fabric under the file's 400 Gb/s: every node misses the same inter-node bound.
    d = _decide([Finding(h, LINK, BOUND, "12 GB/s") for h in HOSTS])
    assert not d.failed and d.exclude == [] and d.failures == []
    assert d.misfits == [f"{LINK}: missed on 4 of 4 node(s), more than check.bound_misfit_fraction=0.5: the bound "
                         "does not fit this hardware; nobody is excluded for it"]
    # Most (3 of 4 > half) is a misfit too; half is not: those two nodes fail and are excluded (cap: 2 of 4).
    assert not _decide([Finding(h, LINK, BOUND, "") for h in HOSTS[:3]]).failed
    half = _decide([Finding(h, LINK, BOUND, "") for h in HOSTS[1:3]])
    assert half.failed and half.exclude == ["n2", "n3"] and not half.misfits
    # bound_misfit_fraction=1: every miss counts (then the cap decides: 4 > 2, nobody is excluded).
    strict = _decide([Finding(h, LINK, BOUND, "") for h in HOSTS], misfit=1.0)
    assert strict.failed and strict.exclude == [] and "4 of 4 node(s) failed" in strict.notes[0]


def test_a_misfit_bound_does_not_hide_another_nodes_real_fault():
    findings = [Finding(h, LINK, BOUND, "") for h in HOSTS] + [Finding("n3", "matmul values", WRONG, "error 1e-1")]
    d = _decide(findings)
    assert d.failed and d.exclude == ["n3"] and [f.check for f in d.failures] == ["matmul values"]
    assert len(d.misfits) == 1


def test_wrong_values_and_relative_misses_are_never_a_misfit():
    wrong = _decide([Finding(h, "all-gather over axis fsdp (values)", WRONG, "") for h in HOSTS])
    assert wrong.failed and wrong.exclude == [] and not wrong.misfits  # 4 > cap 2: nobody excluded
    relative = _decide([Finding("n2", "matmul rate against the median", RELATIVE, "")])
    assert relative.failed and relative.exclude == ["n2"]


def test_exclusion_never_takes_more_than_the_configured_share():
    slow = [Finding(h, f"matmul peak {i}", BOUND, "") for i, h in enumerate(HOSTS[:3])]  # 3 different bounds
    assert _decide(slow).exclude == []  # 3 of 4 > floor(0.5 * 4)
    assert _decide(slow, cap=0.75).exclude == ["n1", "n2", "n3"]
    assert _decide(slow[:1], cap=0.2).exclude == []  # floor(0.8) = 0
    assert _decide(slow[:1], cap=0.25).exclude == ["n1"]
    one_node = decide(["solo"], [Finding("solo", "matmul values", WRONG, "")], known_hardware=True,
                      misfit_fraction=0.5, max_exclude_fraction=0.5)
    assert one_node.failed and one_node.exclude == []  # half of one node is none


def test_an_unknown_device_kind_excludes_nobody():
    d = _decide([Finding("n2", "matmul values", WRONG, "")], known=False)
    assert d.failed and d.exclude == [] and "in no hardware file" in d.notes[0]


def test_matmul_is_judged_against_the_jobs_median_and_the_peak():
    # One process per GPU: each process sees one device, the median is the job's (gathered) one.
    rows = [(f"n{i // 2}", f"gpu{i}", 700e3, 1e-3) for i in range(8)]
    rows[5] = ("n2", "gpu5", 300e3, 1e-3)
    rows[6] = ("n3", "gpu6", 700e3, 0.5)
    median, found = matmul_findings(rows, tolerance=2e-2, min_fraction_of_median=0.5, floor_gflops=400e3,
                                    floor_words="peak")
    assert median == 700e3
    assert {(f.host, f.kind) for f in found} == {("n2", RELATIVE), ("n2", BOUND), ("n3", WRONG)}


def test_axes_are_judged_by_the_hosts_their_devices_sit_on():
    # 2 nodes x 8 GPUs, one process per GPU (process p on host p // 8), mesh data=2 x fsdp=8 over the processes.
    procs = np.arange(16).reshape(2, 8)
    hosts = np.vectorize(lambda p: f"node{p // 8}")(procs)
    assert axis_crosses_hosts(hosts, 0) and not axis_crosses_hosts(hosts, 1)  # fsdp: NVLink; data: the NIC
    # The same processes as fsdp=16 (one axis over both nodes) cross hosts; per process they would not be told apart.
    assert axis_crosses_hosts(hosts.reshape(1, 16), 1)
    # data=4 x tensor=4 on the 2 nodes: tensor stays inside a node, data crosses.
    grid = hosts.reshape(4, 4)
    assert not axis_crosses_hosts(grid, 1) and axis_crosses_hosts(grid, 0)


def test_buffers_are_sized_by_the_link_the_bound_is_judged_on():
    assert judged_size_bytes(450e9) == 512 * 2**20  # NVLink 4 (h100-8x, h200-8x)
    assert judged_size_bytes(50e9) == 64 * 2**20  # NDR 400 Gb/s per GPU
    assert judged_size_bytes(900e9) == 1024 * 2**20  # NVLink 5 (b200-8x)
    assert health.default_sizes(True, 50e9) == [64 * 2**20] and health.default_sizes(True, None) == [256 * 2**20]
    # At 8 GPUs: fsdp=8 over NVLink and data over the NIC, 5 iterations, 1 s per compile: time is compiles.
    h100 = hardware.load_hardware("h100-8x")
    axes = [(8, h100.intra_node_bandwidth, health.default_sizes(True, h100.intra_node_bandwidth)),
            (8, h100.inter_node_bandwidth, health.default_sizes(True, h100.inter_node_bandwidth))]
    t = estimate_seconds(axes, iters=5, compile_s=1.0, matmul_size=8192, peak_flops=h100.peak_flops,
                         devices_per_process=8)
    assert 12 < t < 12.5  # 12 compiles + ~0.1 s of transfers + ~0.1 s of matmuls


@pytest.mark.parametrize("op", ["all-reduce", "all-gather", "reduce-scatter", "all-to-all"])
def test_the_values_check_on_the_devices_catches_a_wrong_result(op):
    mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("node", "local"))
    buffer = health.AxisBuffer(mesh, "local", 2**16)
    small = buffer.measure(op, 2**12, iters=1, sync=False)  # a prefix of the buffer
    assert small.correct and small.n == 2 and small.size_bytes == 2**12
    assert buffer.measure(op, 2**16, iters=1, sync=False).correct
    buffer.x = buffer.x.at[3 * buffer.count].add(1.0)  # the last device's first element off by one
    assert not buffer.measure(op, 2**16, iters=1, sync=False).correct
    assert not buffer.measure(op, 2**12, iters=1, sync=False).correct


@pytest.mark.parametrize("key", ["bound_misfit_fraction", "max_exclude_fraction"])
def test_verdict_shares_are_validated_once_at_config_time(make_config, key):
    with pytest.raises(ConfigError, match=rf"^check\.{key}=1\.5 must be in \[0, 1\]$"):
        make_config(f"check.{key}=1.5")
    assert getattr(make_config(f"check.{key}=1").check, key) == 1.0


@pytest.mark.slow  # ~4 s of CPU (16 collective compiles)
def test_check_writes_a_calibration_the_planner_reads(make_config, capsys):
    """check on 8 CPU devices (fsdp8) saves its median matmul rate (per device: emulated devices share the cores),
    the fsdp axis' all-reduce bus bandwidth and latency; the plan takes those figures and says they are measured."""
    from jaxtrain.planner.cost import calibration
    from jaxtrain.planner.cost.measure import measure_cpu

    cfg = make_config("check.sizes_mb=[0.0625,1]", "check.iters=2", "check.matmul_size=128")
    nccl_vars = {k: v for k, v in os.environ.items() if k.startswith("NCCL_")}
    health.run(cfg)
    assert {k: v for k, v in os.environ.items() if k.startswith("NCCL_")} == nccl_vars  # CPU: NCCL left alone
    path = calibration.in_run_dir(cfg.run.dir)
    out = capsys.readouterr().out
    assert path is not None and f"calibration (matmul rate, each axis' bus bandwidth and latency) written to {path}" \
        in out
    # No NCCL on CPU: the transport is not applicable, in one line, never a made-up one (test_fabric: the GPU path).
    assert [ln for ln in out.splitlines() if ln.startswith("fabric")] == [
        "fabric: not applicable: CPU devices, collectives run over gloo, not NCCL (check.fabric is read on GPUs)"]
    body = calibration.read(path)
    assert body["device_kind"] == "cpu" and body["devices"] == 8 and set(body["axes"]) == {"fsdp"}
    fsdp = body["axes"]["fsdp"]
    assert fsdp["devices"] == 8 and not fsdp["crosses_hosts"] and fsdp["busbw_gbps"] > 0
    # What it was measured on, compared where it is applied (test_auto_layout: what of it applies where).
    here = calibration.Devices.at_hand(jax.devices())
    assert body["origin"]["machine"] == here.machine and body["origin"]["local_devices"] == 8
    assert body["origin"]["processes"] == 1 and body["origin"]["jax"] == jax.__version__
    cal = calibration.apply(measure_cpu(jax.devices(), seconds=0.05), body, path, "float32", here)
    assert cal.hw.peak_flops == body["matmul_gflops"]["float32"] * 1e9
    assert cal.hw.intra_node_bandwidth == fsdp["busbw_gbps"] * 1e9
    assert "peak_flops, intra_node_bandwidth" in cal.note("the devices at hand")
