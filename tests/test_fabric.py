"""The NCCL transport read from NCCL's own INIT/NET debug lines, and the verdict on an InfiniBand or EFA node that
fell back to TCP sockets, with the cause read from fake /sys, /dev and library trees.

Every log line below is built from the C format string it comes from, copied verbatim with its source (NVIDIA/nccl
2.30.7 and 2.21.5, aws-ofi-nccl 1.21.1 and 1.7.4-aws), filled with the values a node would print; the prefix is
``src/debug.cc``'s ``"%s:%d:%d "`` (host, pid, tid) + ``"[%d] NCCL INFO "`` (CUDA device).
"""

import os

import jax
import pytest

from jaxtrain.health import check as health
from jaxtrain.health import fabric

PREFIX = "%s:%d:%d [%d] NCCL INFO "  # src/debug.cc (2.30.7; 2.21.5: the same in one format string)
USING_NETWORK = "Using network %s"  # src/init.cc:486 (2.30.7), :322 (2.21.5)
NET_IB = "NET/IB : Using%s %s; OOB %s:%s"  # src/transport/net_ib/init.cc:513 (2.30.7); net_ib.cc:538 (2.21.5)
NET_IB_NONE = "NET/IB : No device found."  # src/transport/net_ib/init.cc (2.30.7)
NET_SOCKET = "NET/Socket : Using%s"  # src/transport/net_socket.cc:77 (2.30.7), :62 (2.21.5)
OFI = "NET/OFI "  # aws-ofi-nccl include/nccl_ofi_log.h: NCCL_OFI_INFO's prefix
OFI_PROVIDER = "Selected provider is %s, fabric is %s (found %d nics)"  # aws-ofi-nccl 1.21.1 src/nccl_ofi_net.cpp:644
OFI_PROVIDER_OLD = "Selected Provider is %s (found %d nics)"  # aws-ofi-nccl v1.7.4-aws src/nccl_ofi_net.c:1069
IB_DEV = " [%d]%s:%d/%s"  # net_ib/init.cc: device index, name, port, NCCL_IB_LLSTR (IB | RoCE)
SOCK_DEV = " [%d]%s:%s"  # net_socket.cc: index, interface, ncclSocketToString's "%s<%s>" (address<port>)


def line(body: str, host: str = "gpu-a", pid: int = 4120) -> str:
    return PREFIX % (host, pid, pid + 68, 0) + body


def ib_line(link: str = "IB") -> str:
    devices = IB_DEV % (0, "mlx5_0", 1, link) + IB_DEV % (1, "mlx5_1", 1, link)
    return line(NET_IB % (devices, "[RO]", "eth0", "10.0.0.1<0>"))


SOCKET_LINE = line(NET_SOCKET % (SOCK_DEV % (0, "eth0", "10.0.0.1<0>")))
BOOT = line("cudaDriverVersion 12080")  # another INIT line: ignored

IB_LOG = "\n".join([BOOT, ib_line(), line(USING_NETWORK % "IB")]) + "\n"
ROCE_LOG = "\n".join([ib_line("RoCE"), line(USING_NETWORK % "IB")]) + "\n"
SOCKET_LOG = "\n".join([BOOT, line(NET_IB_NONE), SOCKET_LINE, line(USING_NETWORK % "Socket")]) + "\n"
EFA_LOG = "\n".join([line(OFI + OFI_PROVIDER % ("efa", "efa-direct", 4)), line(USING_NETWORK % "Libfabric")])
EFA_OLD_LOG = "\n".join([line(OFI + OFI_PROVIDER_OLD % ("efa", 4)), line(USING_NETWORK % "AWS Libfabric")])
OFI_TCP_LOG = "\n".join([line(OFI + OFI_PROVIDER % ("tcp", "10.0.0.0/16", 1)), line(USING_NETWORK % "Libfabric")])


@pytest.mark.parametrize("log, kind, detail", [
    (IB_LOG, "ib", "[0]mlx5_0:1/IB [1]mlx5_1:1/IB"),
    (ROCE_LOG, "ib", "[0]mlx5_0:1/RoCE [1]mlx5_1:1/RoCE"),
    (SOCKET_LOG, "socket", "[0]eth0:10.0.0.1<0>"),
    (EFA_LOG, "efa", "libfabric provider efa"),
    (EFA_OLD_LOG, "efa", "libfabric provider efa"),
    (OFI_TCP_LOG, "socket", "aws-ofi-nccl over libfabric's tcp provider"),
])
def test_the_transport_is_read_from_nccls_init_and_net_lines(log, kind, detail):
    t = fabric.parse_nccl_log(log)
    assert (t.kind, t.detail) == (kind, detail)


def test_using_network_decides_over_device_lines_and_without_it_the_device_line_does():
    # IB initialised its devices, yet the communicator ran on sockets (e.g. NCCL_NET=Socket): the choice counts.
    assert fabric.parse_nccl_log("\n".join([ib_line(), SOCKET_LINE, line(USING_NETWORK % "Socket")])).kind == "socket"
    # NCCL_DEBUG_SUBSYS=NET only (no INIT): the network whose devices were listed.
    assert fabric.parse_nccl_log(ib_line()).kind == "ib"
    assert fabric.parse_nccl_log(SOCKET_LINE).kind == "socket"


def test_no_network_line_is_not_read_never_guessed():
    assert fabric.parse_nccl_log(BOOT).kind == "none"
    assert fabric.parse_nccl_log("").kind == "none"
    assert fabric.merge([fabric.Transport("none"), fabric.Transport("none")]).kind == "none"


def test_a_node_with_one_process_on_sockets_is_on_sockets():
    ib, sock = fabric.parse_nccl_log(IB_LOG), fabric.parse_nccl_log(SOCKET_LOG)
    assert fabric.merge([ib, fabric.Transport("none"), sock]).kind == "socket"
    assert fabric.merge([fabric.Transport("none"), ib]).kind == "ib"


def fake_node(tmp_path, devices=(), uverbs=True, plugin=False):
    """A node's /sys (class/infiniband/<dev>/device/driver -> the driver), /dev and one library directory."""
    sys_root, dev_root, lib = tmp_path / "sys", tmp_path / "dev", tmp_path / "lib"
    (sys_root / "class" / "infiniband").mkdir(parents=True)
    lib.mkdir()
    for name, driver in devices:
        drivers = sys_root / "bus" / "pci" / "drivers" / driver
        drivers.mkdir(parents=True, exist_ok=True)
        (sys_root / "class" / "infiniband" / name / "device").mkdir(parents=True)
        (sys_root / "class" / "infiniband" / name / "device" / "driver").symlink_to(drivers)
    if uverbs:
        (dev_root / "infiniband").mkdir(parents=True)
        (dev_root / "infiniband" / "uverbs0").touch()
    if plugin:
        (lib / "libnccl-net-ofi.so").touch()
    return fabric.probe(str(sys_root), str(dev_root), [str(lib)], environ={})


SOCKET = fabric.parse_nccl_log(SOCKET_LOG)


def test_an_ib_job_on_sockets_with_no_hca_fails_naming_the_node_and_the_empty_sysfs(tmp_path):
    facts = fake_node(tmp_path)
    got = fabric.judge("gpu-b", "ib", SOCKET, facts, "/run/nccl/gpu-b.7.log")
    assert got == (f"node gpu-b: NCCL uses TCP sockets ([0]eth0:10.0.0.1<0>), not InfiniBand verbs (NCCL's IB) "
                   f"(check.fabric=ib); likely cause: no HCA visible: {tmp_path}/sys/class/infiniband is empty; "
                   "NCCL log /run/nccl/gpu-b.7.log")


def test_an_ib_job_whose_hca_is_not_mounted_into_the_container_says_so(tmp_path):
    facts = fake_node(tmp_path, [("mlx5_0", "mlx5_core")], uverbs=False)
    got = fabric.judge("gpu-c", "ib", SOCKET, facts)
    assert got.startswith("node gpu-c: NCCL uses TCP sockets")
    assert got.endswith(f"likely cause: device not mounted into the container: {tmp_path}/dev/infiniband missing "
                        f"although {tmp_path}/sys/class/infiniband lists mlx5_0")


def test_an_efa_job_without_the_plugin_names_the_missing_plugin(tmp_path):
    facts = fake_node(tmp_path, [("rdmap16s27", "efa")])
    got = fabric.judge("gpu-d", "efa", SOCKET, facts)
    assert got.endswith(f"likely cause: plugin missing: no libnccl-net*.so (aws-ofi-nccl) in {tmp_path}/lib")
    # With the plugin, the device and its mount there, the filesystem shows no cause: it says where to look.
    facts = fake_node(tmp_path / "ok", [("rdmap16s27", "efa")], plugin=True)
    assert "no cause on the filesystem" in fabric.judge("gpu-d", "efa", SOCKET, facts)
    # An EFA node on libfabric's tcp provider is on TCP as well.
    assert fabric.judge("gpu-d", "efa", fabric.parse_nccl_log(OFI_TCP_LOG), facts) is not None


def test_an_efa_job_on_an_ib_only_node_has_no_efa_device(tmp_path):
    facts = fake_node(tmp_path, [("mlx5_0", "mlx5_core")])
    assert fabric.likely_causes("efa", facts)[0] == (f"no EFA device (driver efa) visible in {tmp_path}/sys/class/"
                                                     "infiniband")


def test_environment_switches_that_turn_rdma_off_are_named(tmp_path):
    fake_node(tmp_path, [("mlx5_0", "mlx5_core")])
    facts = fabric.probe(str(tmp_path / "sys"), str(tmp_path / "dev"), [],
                         environ={"NCCL_IB_DISABLE": "1", "NCCL_NET": "Socket"})
    assert fabric.likely_causes("ib", facts) == ["NCCL_IB_DISABLE=1 in the environment turns NCCL's IB off",
                                                 "NCCL_NET=Socket in the environment forces sockets"]


def test_rdma_nodes_pass_and_socket_or_unread_transports_fail_nobody(tmp_path):
    hca = fake_node(tmp_path, [("mlx5_0", "mlx5_core")])
    bare = fake_node(tmp_path / "bare")
    assert fabric.judge("n", "ib", fabric.parse_nccl_log(IB_LOG), hca) is None
    assert fabric.judge("n", "efa", fabric.parse_nccl_log(EFA_LOG), hca) is None
    assert fabric.judge("n", "socket", SOCKET, hca) is None  # a cluster without RDMA by intent
    assert fabric.judge("n", "ib", fabric.Transport("none"), hca) is None  # not read: reported, not failed
    # auto: required where the node lists an RDMA device, nothing required where it lists none.
    assert "(check.fabric=auto: the node lists ib devices)" in fabric.judge("n", "auto", SOCKET, hca)
    assert fabric.judge("n", "auto", SOCKET, bare) is None
    efa = fake_node(tmp_path / "efa", [("rdmap16s27", "efa")], plugin=True)
    assert fabric.required("auto", efa) == "efa"


def test_the_check_points_nccls_debug_file_into_the_run_dir_and_finds_it_again(tmp_path):
    env = fabric.debug_env(str(tmp_path), "gpu-a", 4120, {})
    assert env == {"NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT,NET",
                   "NCCL_DEBUG_FILE": f"{tmp_path}/nccl/gpu-a.4120.log"}
    os.makedirs(tmp_path / "nccl")
    (tmp_path / "nccl" / "gpu-a.4120.log").write_text(IB_LOG)
    (tmp_path / "nccl" / "gpu-a.999.log").write_text(SOCKET_LOG)  # another process's
    assert fabric.read_transport(fabric.log_files(env["NCCL_DEBUG_FILE"], 4120))[0].kind == "ib"
    # A user's own settings are kept, widened to INIT and NET; NCCL's %h.%p pattern is found by pid.
    env = fabric.debug_env(str(tmp_path), "x", 1, {"NCCL_DEBUG": "TRACE", "NCCL_DEBUG_SUBSYS": "COLL",
                                                   "NCCL_DEBUG_FILE": f"{tmp_path}/nccl/%h.%p.log"})
    assert env["NCCL_DEBUG"] == "TRACE" and env["NCCL_DEBUG_SUBSYS"] == "COLL,INIT,NET"
    assert fabric.log_files(env["NCCL_DEBUG_FILE"], 999) == [f"{tmp_path}/nccl/gpu-a.999.log"]


def test_env_reports_the_last_checks_transport_on_gpus_and_not_applicable_on_cpu(tmp_path):
    facts = fake_node(tmp_path, [("mlx5_0", "mlx5_core")])
    assert fabric.env_report(str(tmp_path), "gpu-a", False, facts)["nccl_transport"] == "not applicable"
    assert fabric.env_report(str(tmp_path), "gpu-a", True, facts)["nccl_transport"] == "not measured"
    os.makedirs(tmp_path / "nccl")
    (tmp_path / "nccl" / "gpu-a.4120.log").write_text(IB_LOG)
    got = fabric.env_report(str(tmp_path), "gpu-a", True, facts)
    assert got["nccl_transport"] == "ib" and got["rdma_devices"] == ["mlx5_0 (mlx5_core)"] and got["dev_infiniband"]


def test_on_cpu_the_check_says_in_one_line_the_transport_is_not_applicable(make_config, capsys):
    cfg = make_config()
    assert jax.devices()[0].platform == "cpu"
    job = health._Job(cfg, None, None, jax.devices()[0], None, ["cpu-host"], None)
    assert health._check_fabric(job, None) == []
    out = capsys.readouterr().out.strip().splitlines()
    assert out == ["fabric: not applicable: CPU devices, collectives run over gloo, not NCCL (check.fabric is read "
                   "on GPUs)"]


def test_a_bad_fabric_is_one_line_and_exit_2(tmp_path):
    # A process of its own: the CLI leaves through os._exit on a ConfigError once Orbax is imported (cli.py), which
    # would end a test worker that imported it earlier.
    from jaxtrain_testing import run_cli

    proc = run_cli("check", "check.fabric=rdma", f"run.dir={tmp_path}")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == ["error: check.fabric='rdma' is not valid; choose one of auto, ib, "
                                                "efa, socket"]


def test_the_checks_fabric_step_fails_an_ib_node_whose_nccl_log_says_sockets(make_config, tmp_path, capsys):
    """The check's own step on a log this process 'wrote' (NCCL's format), judged against this machine's real /sys
    and /dev (no HCA here); its finding fails the job's verdict and names the node."""
    from jaxtrain.health.verdict import FABRIC, decide

    cfg = make_config("check.fabric=ib")
    pattern = fabric.debug_env(str(tmp_path), "cpu-host", os.getpid(), {})["NCCL_DEBUG_FILE"]
    os.makedirs(tmp_path / "nccl")
    with open(pattern, "w") as f:
        f.write(SOCKET_LOG)
    job = health._Job(cfg, None, None, jax.devices()[0], None, ["cpu-host"], None)
    [finding] = health._check_fabric(job, pattern)
    assert (finding.host, finding.kind) == ("cpu-host", FABRIC)
    assert finding.detail.startswith("NCCL uses TCP sockets ([0]eth0:10.0.0.1<0>), not InfiniBand verbs (NCCL's IB) "
                                     "(check.fabric=ib); likely cause: ")
    assert f"NCCL log {pattern}" in finding.detail
    assert f"fabric: node cpu-host: TCP sockets ([0]eth0:10.0.0.1<0>) [{pattern}]" in capsys.readouterr().out
    decision = decide(["cpu-host", "other"], [finding], known_hardware=True, misfit_fraction=0.5,
                      max_exclude_fraction=0.5)
    assert decision.failed and decision.exclude == ["cpu-host"]


def test_start_logging_sets_nccls_variables_in_this_process_and_makes_the_directory(tmp_path, monkeypatch):
    for key, value in {"NCCL_DEBUG": "WARN", "NCCL_DEBUG_SUBSYS": "", "NCCL_DEBUG_FILE": ""}.items():
        monkeypatch.setenv(key, value)  # restored after the test
    path = fabric.start_logging(str(tmp_path / "run"), "gpu-a")
    assert path == f"{tmp_path}/run/nccl/gpu-a.{os.getpid()}.log" and (tmp_path / "run" / "nccl").is_dir()
    assert (os.environ["NCCL_DEBUG"], os.environ["NCCL_DEBUG_SUBSYS"], os.environ["NCCL_DEBUG_FILE"]) == (
        "INFO", "INIT,NET", path)


def test_node_lines_merge_a_nodes_processes_and_say_when_nothing_was_read():
    rows = [["gpu-a", "ib", "IB", "[0]mlx5_0:1/IB", "/r/a.1.log"],
            ["gpu-a", "socket", "Socket", "[0]eth0", "/r/a.2.log"], ["gpu-b", "none", "", "", "/r/b.3.log"]]
    lines = fabric.node_lines(rows)
    assert lines[0] == "fabric: node gpu-a: TCP sockets ([0]eth0) [/r/a.2.log]"
    assert lines[1].startswith("fabric: node gpu-b: not read: NCCL wrote no network line") and len(lines) == 2
