"""The health check's decisions as pure functions over what was measured: no devices, no collectives.

:func:`decide` turns per-node findings into the job's verdict: which bounds do not fit this hardware (missed on more
than ``check.bound_misfit_fraction`` of the nodes: reported, nobody excluded), which nodes fail, and which are
excluded (at most ``check.max_exclude_fraction`` of the nodes, none when the device kind is in no hardware file).
:func:`axis_crosses_hosts` says whether a mesh axis runs over the intra-node link (every group of devices along it on
one host) or across hosts; :func:`matmul_findings` judges every device's matmul against the job's median and the
peak; :func:`judged_size_bytes` and :func:`estimate_seconds` size the collectives and the check's time.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field

import numpy as np

from jaxtrain.cluster.links import BUS_FACTOR

# Kinds of finding; only a BOUND can be judged a misfit. FABRIC: an InfiniBand or EFA node whose NCCL fell back to
# TCP sockets (jaxtrain.health.fabric), a node's fault however many nodes share it.
BOUND, RELATIVE, WRONG, FABRIC = "bound", "relative", "wrong", "fabric"


@dataclass(frozen=True)
class Finding:
    """One node missing one check. ``check`` names the check in the same words on every node (so misses of the same
    bound group together), ``detail`` says what was measured there."""

    host: str
    check: str
    kind: str  # BOUND (an absolute rate from the hardware file or check.min_busbw_gbps), RELATIVE, WRONG or FABRIC
    detail: str


@dataclass
class Decision:
    """The job's verdict: ``failed`` (exit 1), the hosts to exclude, the bounds judged not to fit, and notes."""

    failed: bool
    exclude: list[str]
    failures: list[Finding]  # the findings that count (misfits removed)
    misfits: list[str] = field(default_factory=list)  # one line per bound that does not fit this hardware
    notes: list[str] = field(default_factory=list)


def decide(hosts: list[str], findings: list[Finding], *, known_hardware: bool, misfit_fraction: float,
           max_exclude_fraction: float) -> Decision:
    """The verdict over the job's ``hosts`` (each node once) from every node's ``findings``.

    A BOUND check missed on more than ``misfit_fraction`` of the nodes does not fit this hardware (a PCIe part or a
    slower fabric than the file's): it is reported and dropped, it excludes nobody. The other findings fail the
    check; their nodes are excluded unless the device kind is in no hardware file (``known_hardware`` False) or they
    are more than ``floor(max_exclude_fraction * len(hosts))`` nodes (a fault that widespread is the fabric's, the
    driver's or the bound's, not a node's: the check fails and nobody is excluded).
    """
    n = len(hosts)
    missed: dict[str, set[str]] = {}
    for f in findings:
        if f.kind == BOUND:
            missed.setdefault(f.check, set()).add(f.host)
    misfit = {check for check, where in missed.items() if len(where) > misfit_fraction * n}
    misfits = [f"{check}: missed on {len(missed[check])} of {n} node(s), more than check.bound_misfit_fraction="
               f"{misfit_fraction}: the bound does not fit this hardware; nobody is excluded for it"
               for check in sorted(misfit)]
    failures = [f for f in findings if not (f.kind == BOUND and f.check in misfit)]
    failing = sorted({f.host for f in failures}, key=hosts.index)
    notes: list[str] = []
    exclude: list[str] = []
    cap = math.floor(max_exclude_fraction * n + 1e-9)
    if failing and not known_hardware:
        notes.append("the devices' kind is in no hardware file: measured and reported, nobody is excluded")
    elif len(failing) > cap:
        notes.append(f"{len(failing)} of {n} node(s) failed ({', '.join(failing)}), more than check.max_exclude_"
                     f"fraction={max_exclude_fraction} allows ({cap}): nobody is excluded")
    else:
        exclude = failing
    return Decision(failed=bool(failures), exclude=exclude, failures=failures, misfits=misfits, notes=notes)


def axis_crosses_hosts(device_hosts: np.ndarray, axis: int) -> bool:
    """Whether mesh ``axis`` spans hosts: ``device_hosts`` is the mesh's device array with each device replaced by the
    name of its host; the axis crosses hosts when some group of devices along it (a collective's participants) sits
    on more than one host. With one process per GPU the processes of a node share its host name, so an axis over
    them is judged against the intra-node link."""
    lines = np.moveaxis(np.asarray(device_hosts), axis, -1).reshape(-1, device_hosts.shape[axis])
    return any(len(set(line.tolist())) > 1 for line in lines)


def matmul_findings(rows: list[tuple[str, str, float, float]], *, tolerance: float, min_fraction_of_median: float,
                    floor_gflops: float, floor_words: str) -> tuple[float, list[Finding]]:
    """Every device's matmul judged: ``rows`` are (host, device, GFLOP/s, max relative error) for all the job's
    devices. Returns the median rate and the findings: an error above ``tolerance`` (WRONG), a rate below
    ``min_fraction_of_median`` of the job's median (RELATIVE), below ``floor_gflops`` (BOUND; 0: no bound)."""
    median = statistics.median(r[2] for r in rows)
    out = []
    for host, dev, rate, err in rows:
        if err > tolerance:
            out.append(Finding(host, "matmul values", WRONG, f"device {dev}: matmul error {err:.1e} against the "
                                                             "float64 reference"))
        if rate < min_fraction_of_median * median:
            out.append(Finding(host, "matmul rate against the median", RELATIVE,
                               f"device {dev}: matmul {rate:.1f} GFLOP/s is below check.min_matmul_fraction="
                               f"{min_fraction_of_median} of the median {median:.1f}"))
        if rate < floor_gflops:
            out.append(Finding(host, f"matmul peak ({floor_words})", BOUND,
                               f"device {dev}: matmul {rate:.1f} GFLOP/s is below {floor_gflops:.1f}"))
    return median, out


# The judged (largest) message moves for at least this long at the link's full rate, so that a fixed cost per
# collective of ~50 us (launch and synchronisation) costs at most ~5% of the measured bandwidth.
JUDGED_TRANSFER_S = 1e-3


def judged_size_bytes(link_bytes_per_s: float) -> int:
    """The message per device a bound on a link of ``link_bytes_per_s`` (per direction) is judged at: the smallest
    power-of-two MiB that takes :data:`JUDGED_TRANSFER_S` at the link's rate (NVLink 4, 450 GB/s: 512 MiB; NDR
    400 Gb/s, 50 GB/s: 64 MiB)."""
    mib = max(1.0, link_bytes_per_s * JUDGED_TRANSFER_S / 2**20)
    return 2 ** math.ceil(math.log2(mib)) * 2**20


def estimate_seconds(axes: list[tuple[int, float, list[int]]], iters: int, compile_s: float,
                     matmul_size: int, peak_flops: float, devices_per_process: int) -> float:
    """The check's time on one node, from sizes and rates alone: ``axes`` are (devices along the axis, link rate in
    bytes/s, message sizes in bytes). Each (axis, size) compiles 6 programs (``compile_s`` each, an assumption):
    the 4 collectives and the value check for its 2 result shapes; each collective runs once checked and ``iters``
    times timed at the link's rate. Each of a process's devices runs ``iters`` x 3 rounds + 1 matmuls of
    ``matmul_size`` at ``peak_flops``. Not counted: start-up, NCCL's communicator set-up per device group, the host's
    float64 matmul reference, sub-checks."""
    total = 0.0
    for n, rate, sizes in axes:
        for size in sizes:
            total += 6 * compile_s + sum((1 + iters) * size * factor(n) / rate for factor in BUS_FACTOR.values())
    total += devices_per_process * (3 * iters + 1) * 2 * matmul_size**3 / peak_flops
    return total
