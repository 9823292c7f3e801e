"""Which network transport NCCL uses on a node, read from NCCL's own INIT/NET debug lines, and why a node that
should use InfiniBand or EFA fell back to TCP sockets, read from the node's filesystem.

Where the lines come from (NCCL 2.30.7, NVIDIA/nccl master 2026-06; the same format strings in 2.21.5):

- ``src/init.cc``: ``INFO(NCCL_INIT, "Using network %s", comm->ncclNet->name)`` once per communicator: the network
  NCCL chose. Internal names: ``IB`` (``src/transport/net_ib/common.cc``; IB verbs over InfiniBand or RoCE) and
  ``Socket`` (``src/transport/net_socket.cc``). aws-ofi-nccl 1.21.1 (``src/nccl_ofi_interface_nvidia.cpp``) names
  itself ``Libfabric``; 1.11.0 and older, or ``NCCL_NET="AWS Libfabric"``, ``AWS Libfabric``; ``NCCL_NET=OFI``, ``OFI``.
- ``src/transport/net_ib/init.cc``: ``"NET/IB : Using%s %s; OOB %s:%s"``, one `` [d]dev:port/LL`` per device, LL
  ``IB`` or ``RoCE`` (``NCCL_IB_LLSTR``), else ``"NET/IB : No device found."``.
- ``src/transport/net_socket.cc``: ``"NET/Socket : Using%s"``, one `` [i]ifname:addr<port>`` per interface.
- aws-ofi-nccl prefixes its lines with ``"NET/OFI "`` (``include/nccl_ofi_log.h``); 1.21.1 ``src/nccl_ofi_net.cpp``
  says ``"Selected provider is %s, fabric is %s (found %d nics)"``, 1.7.4-1.9.1 ``"Selected Provider is %s (found
  %d nics)"``. The provider ``efa`` is EFA; ``tcp``/``sockets`` are libfabric over TCP.
- ``src/debug.cc``: every INFO line starts ``"<host>:<pid>:<tid> [<cudaDev>] NCCL INFO "``; ``NCCL_DEBUG_FILE``
  expands ``%h`` (host) and ``%p`` (pid). NCCL reads ``NCCL_DEBUG*`` once, at its first log call (its first
  communicator), so the check sets them before its first collective.

Everything here is a pure function of text and of directories passed in (``/sys``, ``/dev`` and the library
directories are arguments), so tests build fake trees.
"""

from __future__ import annotations

import glob
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

RDMA = ("ib", "efa")  # the transports a job can require
FABRICS = ("auto", "ib", "efa", "socket")  # check.fabric
OFI_NAMES = ("libfabric", "aws libfabric", "ofi")  # aws-ofi-nccl's names for itself (see the module docstring)
TCP_PROVIDERS = ("tcp", "sockets", "udp", "tcp;ofi_rxm")  # libfabric providers that are plain TCP/UDP
NAMES = {"ib": "InfiniBand verbs (NCCL's IB)", "efa": "AWS EFA via libfabric (aws-ofi-nccl)",
         "socket": "TCP sockets", "other": "another network", "none": "not read"}


@dataclass(frozen=True)
class Transport:
    """What NCCL used on one process: ``kind`` ib | efa | socket | other | none (no NCCL network line), the
    network's name as NCCL printed it, and its devices or provider in words."""

    kind: str
    net: str = ""
    detail: str = ""

    def words(self) -> str:
        return NAMES[self.kind] + (f" ({self.detail})" if self.detail else "")


_INFO = r"NCCL INFO "
_USING = re.compile(_INFO + r"Using network (.+?)\s*$", re.M)
_IB = re.compile(_INFO + r"NET/IB : Using(.*?); OOB", re.M)
_SOCKET = re.compile(_INFO + r"NET/Socket : Using(.*?)\s*$", re.M)
_OFI = re.compile(_INFO + r"NET/OFI Selected [Pp]rovider is ([^,\s]+)", re.M)


def parse_nccl_log(text: str) -> Transport:
    """The transport in one process's NCCL log (``NCCL_DEBUG=INFO``, ``NCCL_DEBUG_SUBSYS`` with INIT and NET).

    ``Using network`` (the choice NCCL made) decides; the last one counts (every communicator prints it). Without it
    (INIT not logged), the network whose device line is there decides: OFI before IB before Socket, NCCL's order of
    trying them. Nothing of these: kind ``none``, never a guess.
    """
    chosen = _USING.findall(text)
    net = chosen[-1] if chosen else ""
    ib, socket_, ofi = _IB.findall(text), _SOCKET.findall(text), _OFI.findall(text)
    name = net.lower()
    if name in OFI_NAMES or (not net and ofi):
        provider = ofi[-1] if ofi else ""
        if provider == "efa":
            return Transport("efa", net or "Libfabric", "libfabric provider efa")
        kind = "socket" if provider in TCP_PROVIDERS else "other"
        return Transport(kind, net or "Libfabric", f"aws-ofi-nccl over libfabric's {provider or 'unnamed'} provider")
    if name == "ib" or (not net and ib):
        devices = " ".join(ib[-1].split()) if ib else ""
        return Transport("ib", net or "IB", devices.replace("[RO]", "").strip())
    if name == "socket" or (not net and socket_):
        return Transport("socket", net or "Socket", " ".join(socket_[-1].split()) if socket_ else "")
    if net:
        return Transport("other", net, f"NCCL network {net!r}")
    return Transport("none")


def merge(transports: list[Transport]) -> Transport:
    """One node's transport from its processes' (each GPU process has its own log): the one they agree on; a
    socket among them wins (the slow one decides a collective's speed); otherwise the first that was read."""
    read = [t for t in transports if t.kind != "none"]
    if not read:
        return Transport("none")
    return next((t for t in read if t.kind == "socket"), read[0])


@dataclass(frozen=True)
class Facts:
    """What a node's filesystem says about its fabric: RDMA devices in sysfs (name, kernel driver), whether the
    verbs device files are there, the NCCL net plugins found, and where each was looked for."""

    devices: tuple[tuple[str, str], ...]  # (e.g. "mlx5_0", "mlx5_core") or ("rdmap16s27", "efa")
    class_dir: str  # <sys>/class/infiniband
    dev_dir: str  # <dev>/infiniband
    uverbs: bool  # <dev>/infiniband/uverbs* present: the container can open the HCAs
    plugins: tuple[str, ...]  # libnccl-net*.so paths
    lib_dirs: tuple[str, ...]
    env: tuple[tuple[str, str], ...]  # the NCCL variables that turn a network off or pick one

    @property
    def expected(self) -> str:
        """What ``check.fabric=auto`` requires: efa if an RDMA device runs the efa driver, ib if any other does,
        else socket (nothing required)."""
        drivers = {driver for _, driver in self.devices}
        return "efa" if "efa" in drivers else "ib" if self.devices else "socket"


DEFAULT_LIB_DIRS = ("/usr/lib", "/usr/lib64", "/usr/local/lib", "/usr/lib/x86_64-linux-gnu",
                    "/usr/lib/aarch64-linux-gnu", "/opt/amazon/ofi-nccl/lib", "/opt/aws-ofi-nccl/lib")


def probe(sys_root: str = "/sys", dev_root: str = "/dev", lib_dirs: list[str] | None = None,
          environ: Mapping[str, str] | None = None) -> Facts:
    """The node's fabric facts. ``lib_dirs`` None: ``LD_LIBRARY_PATH``'s directories and the usual system and
    aws-ofi-nccl ones (NCCL finds its plugin with ``dlopen("libnccl-net.so")`` or ``NCCL_NET_PLUGIN``'s name)."""
    env_vars: Mapping[str, str] = os.environ if environ is None else environ
    class_dir = os.path.join(sys_root, "class", "infiniband")
    names = sorted(os.listdir(class_dir)) if os.path.isdir(class_dir) else []
    devices = tuple((n, os.path.basename(os.path.realpath(os.path.join(class_dir, n, "device", "driver"))))
                    for n in names)
    dev_dir = os.path.join(dev_root, "infiniband")
    uverbs = bool(glob.glob(os.path.join(dev_dir, "uverbs*")))
    if lib_dirs is None:
        lib_dirs = [d for d in env_vars.get("LD_LIBRARY_PATH", "").split(":") if d] + list(DEFAULT_LIB_DIRS)
    plugins = tuple(p for d in lib_dirs for p in sorted(glob.glob(os.path.join(d, "libnccl-net*.so*"))))
    env = tuple((k, env_vars[k]) for k in ("NCCL_IB_DISABLE", "NCCL_NET", "NCCL_NET_PLUGIN") if k in env_vars)
    return Facts(devices, class_dir, dev_dir, uverbs, plugins, tuple(lib_dirs), env)


def likely_causes(expected: str, facts: Facts) -> list[str]:
    """Why a node that should use ``expected`` (ib | efa) runs on sockets, from its filesystem facts, most basic
    first; none found: one line saying where to look instead."""
    env = dict(facts.env)
    causes = []
    if expected == "ib" and env.get("NCCL_IB_DISABLE", "0") not in ("0", ""):
        causes.append(f"NCCL_IB_DISABLE={env['NCCL_IB_DISABLE']} in the environment turns NCCL's IB off")
    if env.get("NCCL_NET", "").lower() == "socket":
        causes.append(f"NCCL_NET={env['NCCL_NET']} in the environment forces sockets")
    wanted = [n for n, driver in facts.devices if expected != "efa" or driver == "efa"]
    if not wanted:
        what = "no EFA device (driver efa)" if expected == "efa" else "no HCA"
        causes.append(f"{what} visible: {facts.class_dir} is {'empty' if os.path.isdir(facts.class_dir) else 'missing'}"
                      if not facts.devices else f"{what} visible in {facts.class_dir}")
    elif not facts.uverbs:
        causes.append(f"device not mounted into the container: {facts.dev_dir} "
                      f"{'has no uverbs*' if os.path.isdir(facts.dev_dir) else 'missing'} although {facts.class_dir} "
                      f"lists {', '.join(wanted)}")
    if expected == "efa" and not facts.plugins:
        causes.append(f"plugin missing: no libnccl-net*.so (aws-ofi-nccl) in {':'.join(facts.lib_dirs)}")
    plugin = " and the net plugin" if expected == "efa" else ""
    return causes or [f"no cause on the filesystem (RDMA device, /dev/infiniband{plugin} present): read NCCL's "
                      "NET lines in the log"]


def required(fabric: str, facts: Facts) -> str:
    """The transport ``check.fabric`` requires on this node: ib or efa, or socket (nothing required)."""
    return facts.expected if fabric == "auto" else fabric


def fallback(fabric: str, transport: Transport, facts: Facts, log: str = "") -> str | None:
    """Why the node fails (None: it passes): it should use InfiniBand or EFA (``check.fabric``, or for ``auto``
    the node's own RDMA devices) but its NCCL runs on TCP sockets. A transport not read fails nobody."""
    need = required(fabric, facts)
    if need not in RDMA or transport.kind != "socket":
        return None
    why = "; ".join(likely_causes(need, facts))
    source = f"check.fabric={fabric}" + (f": the node lists {need} devices" if fabric == "auto" else "")
    return (f"NCCL uses {transport.words()}, not {NAMES[need]} ({source}); likely cause: {why}"
            + (f"; NCCL log {log}" if log else ""))


def judge(host: str, fabric: str, transport: Transport, facts: Facts, log: str = "") -> str | None:
    """:func:`fallback` as the one line that names the node."""
    why = fallback(fabric, transport, facts, log)
    return None if why is None else f"node {host}: {why}"


LOG_DIR = "nccl"  # under run.dir: one NCCL log per process, <node>.<pid>.log


def debug_env(run_dir: str, node: str, pid: int, environ: Mapping[str, str]) -> dict[str, str]:
    """The ``NCCL_DEBUG*`` values that make NCCL write this process's INIT/NET lines into ``run_dir/nccl`` (set them
    before NCCL's first communicator). A user's ``NCCL_DEBUG=TRACE`` and ``NCCL_DEBUG_FILE`` are kept; a
    ``NCCL_DEBUG_SUBSYS`` list gains INIT and NET. The file is named here (``node.pid``) rather than with NCCL's
    ``%h.%p``, whose host part NCCL cuts at the first dot and rewrites: the check must find the file again."""
    out = {"NCCL_DEBUG": environ.get("NCCL_DEBUG", "") if environ.get("NCCL_DEBUG", "").upper() == "TRACE"
           else "INFO"}
    subsys = environ.get("NCCL_DEBUG_SUBSYS", "")
    if not subsys or subsys.startswith("^"):  # "^X" means all but X: replaced, INIT or NET could be the X
        out["NCCL_DEBUG_SUBSYS"] = "INIT,NET"
    else:
        have = {s.strip().upper() for s in subsys.split(",")}
        out["NCCL_DEBUG_SUBSYS"] = subsys if "ALL" in have else ",".join([subsys] + sorted({"INIT", "NET"} - have))
    out["NCCL_DEBUG_FILE"] = environ.get("NCCL_DEBUG_FILE") or os.path.join(run_dir, LOG_DIR, f"{node}.{pid}.log")
    return out


def log_files(debug_file: str, pid: int) -> list[str]:
    """The files ``NCCL_DEBUG_FILE`` (a pattern with NCCL's ``%h``, ``%p``, ``%%``) names for process ``pid``."""
    pattern = re.sub(r"%(.)", lambda m: {"h": "*", "p": str(pid), "%": "%"}.get(m[1], glob.escape(m[0])),
                     debug_file)
    return sorted(glob.glob(pattern))


def read_transport(paths: list[str]) -> tuple[Transport, str]:
    """The transport the NCCL logs at ``paths`` (one process's, or one node's) show, and the file that showed it."""
    found = [(parse_nccl_log(Path(p).read_text(errors="replace")), p) for p in paths]
    node = merge([t for t, _ in found])
    return node, next((p for t, p in found if t == node), paths[0] if paths else "")


def node_logs(run_dir: str, node: str) -> list[str]:
    """The NCCL logs the check wrote on ``node`` (every process of it, every run), newest last."""
    paths = glob.glob(os.path.join(glob.escape(os.path.join(run_dir, LOG_DIR)), f"{glob.escape(node)}.*.log"))
    return sorted(paths, key=os.path.getmtime)


def env_report(run_dir: str, node: str, gpu: bool, facts: Facts) -> dict:
    """What ``jaxtrain env`` says of the fabric on ``node``: the transport the check's NCCL logs in ``run_dir``
    show (``not applicable`` without GPUs, ``not measured`` before a check ran here), in words, its log, and the
    filesystem facts (RDMA devices with their drivers, /dev/infiniband, NCCL net plugins)."""
    out = {"rdma_devices": [f"{name} ({driver})" for name, driver in facts.devices],
           "dev_infiniband": facts.uverbs, "nccl_net_plugins": list(facts.plugins), "nccl_log": None}
    if not gpu:
        return out | {"nccl_transport": "not applicable",
                      "nccl_transport_words": "not applicable: no GPU (CPU collectives run over gloo, not NCCL)"}
    logs = node_logs(run_dir, node)
    transport, log = read_transport(logs[-1:])  # the newest process's: what the last check saw
    if transport.kind == "none":
        where = log or os.path.join(run_dir, LOG_DIR)
        return out | {"nccl_transport": "not measured", "nccl_log": log or None,
                      "nccl_transport_words": f"not measured: no NCCL network line in {where} (run `python -m "
                      "jaxtrain check` with this config: it writes NCCL's INIT/NET log there)"}
    return out | {"nccl_transport": transport.kind, "nccl_transport_words": f"{transport.words()} (from {log})",
                  "nccl_log": log}


NOT_APPLICABLE = ("fabric: not applicable: CPU devices, collectives run over gloo, not NCCL (check.fabric is read "
                  "on GPUs)")


def start_logging(run_dir: str, node: str) -> str:
    """Point this process's NCCL at ``run_dir/nccl`` (:func:`debug_env`), before its first communicator; returns
    the ``NCCL_DEBUG_FILE`` pattern."""
    env = debug_env(run_dir, node, os.getpid(), os.environ)
    os.makedirs(os.path.dirname(os.path.abspath(env["NCCL_DEBUG_FILE"])), exist_ok=True)
    os.environ.update(env)
    return env["NCCL_DEBUG_FILE"]


def node_lines(rows: list[list]) -> list[str]:
    """One line per node from every process's ``[host, kind, net, detail, log]``: its processes merged
    (:func:`merge`), the log that showed it; a transport not read says why it may not have been."""
    nodes: dict[str, list[tuple[Transport, str]]] = {}
    for host, kind, net, detail, path in rows:
        nodes.setdefault(host, []).append((Transport(kind, net, detail), path))
    lines = []
    for host, found in nodes.items():
        node = merge([t for t, _ in found])
        path = next((p for t, p in found if t == node), found[0][1])
        unread = (": NCCL wrote no network line (no collective crossed devices, or NCCL started before the check "
                  "set NCCL_DEBUG; NCCL before 2.30 buffers its debug file)") if node.kind == "none" else ""
        lines.append(f"fabric: node {host}: {node.words()}{unread} [{path}]")
    return lines
