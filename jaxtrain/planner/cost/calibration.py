"""Calibration: what ``jaxtrain check`` measured on the devices at hand, saved for the planner.

``check`` writes ``run.dir/calibration.json``; ``plan --calibration FILE`` and ``mesh.auto`` read it (``train``
finds it in its run directory) and replace the hardware description's datasheet figures by the measured ones:

- ``peak_flops``: the median matmul rate of the step's compute dtype (the cost model then takes
  ``compute_efficiency`` of it, as it does of the CPU's measured rate);
- ``intra_node_bandwidth`` / ``inter_node_bandwidth``: the slowest all-reduce bus bandwidth over the mesh axes that
  stay inside a host / cross hosts (a ring's per-device rate each way, nccl-tests' busbw);
- ``collective_latency``: the largest fixed cost per collective, from the times of two message sizes
  (t = latency + size / rate); only where the check ran two sizes or more.

Two figures no datasheet has, measured on the devices at hand (``measure.measure_sized``; ``mesh.auto`` on CPU
takes them itself, a file may carry them as ``matmul_rows`` and ``layer_overhead_s``): the matmul rate by rows per
device (a small microbatch's matmuls run slower than big ones) and the fixed cost of one layer's iteration, forward
and backward, at negligible FLOPs (per microbatch, whatever its size): ``Hardware.matmul_rows`` and
``Hardware.layer_overhead_s``.

The file is JSON, one object (reading and writing it needs no JAX; only the measurement does)::

    {"version": 1, "device_kind": "...", "platform": "gpu", "devices": 64, "hosts": 8,
     "matmul_gflops": {"bfloat16": 712000.0},
     "axes": {"fsdp": {"devices": 8, "crosses_hosts": false, "busbw_gbps": 370.0, "latency_s": 2.1e-05}, ...},
     "origin": {"machine": "NVIDIA H100 80GB HBM3", "processes": 64, "local_devices": 1, "host": "node-001",
                "jax": "0.11.2", "jaxlib": "0.11.2", "date": "2026-12-05T02:10:00Z", "command": "jaxtrain check ..."}}

**What it is applied to** (:func:`fit`, against a :class:`Devices`: the devices a plan or ``mesh.auto`` is for). A
calibration describes the devices it was measured on, so it is used only where it fits them:

- the same device kind, machine (:func:`machine`: on CPUs the processor model and the CPUs this process may use,
  which every emulated device shares; on accelerators the device kind) and count (devices, hosts and devices per
  process): every figure applies;
- the same kind and machine, another count: only the figures that do not depend on the count apply: the matmul rate
  (on CPUs scaled by the devices per process it was measured with over those planned for: emulated devices share
  the host's cores, and ``check`` writes each device's share) and the matmul rate by rows; the links and the fixed
  cost per collective were measured over other rings and are left to the hardware figures; the note says so;
- another device kind or machine, or a file without ``origin`` (written before calibrations recorded it): nothing
  applies; the run directory's file is left out with a note naming what differs, a file named by ``--calibration``
  is refused (exit 2).
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform as platform_lib
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass

from jaxtrain.config.hardware import Hardware
from jaxtrain.errors import ConfigError

REFERENCE_ROWS = 512  # the rows of measure.measure_cpu's matmul (peak_flops): the table's rates are relative to it

FILE = "calibration.json"  # in run.dir, written by `check`
VERSION = 1
FIGURES = ("peak_flops", "intra_node_bandwidth", "inter_node_bandwidth", "collective_latency")


def latency_and_rate(points: Sequence[tuple[float, float]]) -> tuple[float | None, float]:
    """(fixed seconds per collective or None, bytes/s) from (message bytes, seconds) at one or more sizes: the line
    t = latency + bytes / rate through the smallest and the largest message (latency clipped at 0); with one size
    the rate is bytes / t and the latency unknown."""
    points = sorted(points)
    (s0, t0), (s1, t1) = points[0], points[-1]
    if s1 == s0 or t1 <= t0:
        return None, s1 / t1
    rate = (s1 - s0) / (t1 - t0)
    return max(0.0, t0 - s0 / rate), rate


def axis_entry(devices: int, crosses_hosts: bool, busbw_gbps: float, latency_s: float | None) -> dict:
    return {"devices": devices, "crosses_hosts": crosses_hosts, "busbw_gbps": busbw_gbps, "latency_s": latency_s}


def cpu_model() -> str:
    """The processor's model name (``/proc/cpuinfo``'s first "model name", else the platform's word for it)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform_lib.processor() or platform_lib.machine() or "unknown CPU"


def cpus() -> int:
    """The CPUs this process may run on (its affinity, which containers and ``taskset`` narrow)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def machine(platform: str, device_kind: str) -> str:
    """What a calibration's figures belong to: on CPUs the processor model and the CPUs the devices share; on
    accelerators the device kind (the GPU's own name), whatever host carries it."""
    return f"{cpu_model()}, {cpus()} CPUs" if platform == "cpu" else device_kind


def origin(platform: str, device_kind: str, *, processes: int, local_devices: int, host: str) -> dict:
    """The ``origin`` entry of a calibration measured here now (:func:`write`): the machine, the processes and
    devices per process, this host, the JAX versions, the date (UTC) and the command line."""
    import jax
    import jaxlib

    return {"machine": machine(platform, device_kind), "processes": processes, "local_devices": local_devices,
            "host": host, "jax": jax.__version__, "jaxlib": jaxlib.__version__,
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "command": " ".join(["jaxtrain" if a.endswith("__main__.py") else a for a in sys.argv])}


def write(path: str, *, device_kind: str, platform: str, devices: int, hosts: int, matmul_gflops: dict[str, float],
          axes: dict[str, dict], origin: dict | None = None) -> str:
    """Write the calibration file (directories made as needed); returns its path. ``origin``: :func:`origin`
    (None writes a file of unknown origin, as files written before it were: :func:`fit` applies nothing of it)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    body = {"version": VERSION, "device_kind": device_kind, "platform": platform, "devices": devices,
            "hosts": hosts, "matmul_gflops": matmul_gflops, "axes": axes}
    if origin is not None:
        body["origin"] = origin
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(body, f, indent=1)
    os.replace(tmp, path)  # never a half-written file for the planner to read
    return path


def read(path: str) -> dict:
    """The calibration file's contents; ConfigError (one line) when it is missing or not one."""
    try:
        with open(path) as f:
            body = json.load(f)
    except FileNotFoundError:
        raise ConfigError(f"calibration file {path!r} does not exist; `jaxtrain check run.dir=DIR` writes "
                          f"DIR/{FILE}") from None
    except (OSError, ValueError) as e:
        raise ConfigError(f"calibration file {path!r} is not readable JSON ({e})") from None
    if not isinstance(body, dict) or body.get("version") != VERSION or "matmul_gflops" not in body:
        raise ConfigError(f"calibration file {path!r} is not a version-{VERSION} calibration written by `jaxtrain "
                          "check`; run the check again")
    return body


def in_run_dir(run_dir: str) -> str | None:
    """``run_dir/calibration.json`` when it exists, else None."""
    path = os.path.join(run_dir, FILE)
    return path if os.path.isfile(path) else None


@dataclass(frozen=True)
class Devices:
    """What a calibration is applied to: the devices of a plan or of ``mesh.auto``'s search."""

    kind: str  # jax.Device.device_kind ("" where a hardware file lists none)
    devices: int
    machine: str | None  # :func:`machine` where the devices are the ones at hand; None: a hardware file's devices
    # None where not known (then not compared): the hosts of the devices at hand, a hardware file's processes
    hosts: int | None = None
    processes: int | None = None
    local: int | None = None  # devices per process (emulated CPU devices share one process's cores)

    @classmethod
    def at_hand(cls, devices: list) -> Devices:
        """``devices`` (JAX's): this machine's, their processes and this process's share of them."""
        first = devices[0]
        local = sum(d.process_index == first.process_index for d in devices)
        return cls(first.device_kind, len(devices), machine(first.platform, first.device_kind),
                   processes=len({d.process_index for d in devices}), local=local)

    @classmethod
    def of_hardware(cls, hw: Hardware, nodes: int) -> Devices:
        """``nodes`` nodes of the hardware file ``hw`` (not this machine: the kind, devices and hosts compared)."""
        return cls(hw.kinds[0] if hw.kinds else "", hw.devices_per_node * nodes, None, hosts=nodes)


SAME, COUNT, NONE = "same", "count", "none"  # what of a calibration applies: all, the count's free parts, nothing


def fit(body: dict, hw: Hardware, target: Devices | None) -> tuple[str, str]:
    """(``SAME`` / ``COUNT`` / ``NONE``, the words saying why) for the calibration ``body`` applied to ``target``
    (``hw``: its hardware figures; None: the device kind alone is compared, as before origins were recorded)."""
    kind = body.get("device_kind", "")
    planned = hw.kinds or ((target.kind,) if target and target.kind else ())
    if planned and kind not in planned:
        return NONE, (f"it measured {kind!r} devices, the plan is for {hw.name or 'other devices'} "
                      f"({', '.join(map(repr, planned))})")
    if target is None:
        return SAME, ""
    made = body.get("origin")
    if not isinstance(made, dict):
        return NONE, ("it does not say what it was measured on (written before calibrations recorded their origin); "
                      "`jaxtrain check run.dir=DIR` on the devices planned for remakes it")
    if target.machine is not None and made.get("machine") != target.machine:
        return NONE, f"it was measured on {made.get('machine')!r}, this machine is {target.machine!r}"
    was = {"devices": body.get("devices"), "hosts": body.get("hosts"), "processes": made.get("processes"),
           "devices per process": made.get("local_devices")}
    now = {"devices": target.devices, "hosts": target.hosts, "processes": target.processes,
           "devices per process": target.local}
    differ = [k for k, v in now.items() if v is not None and was[k] != v]
    if differ:
        return COUNT, "; ".join(f"{k}: {was[k]} measured, {now[k]} planned" for k in differ)
    return SAME, ""


@dataclass(frozen=True)
class Calibrated:
    """The hardware with the measured figures in, and which figure came from where."""

    hw: Hardware
    measured: tuple[str, ...]  # names in FIGURES taken from the file
    source: str  # the file's path, or "" without one
    ignored: str = ""  # the run directory's calibration left out, and why (it measured other devices)
    partly: str = ""  # what of the file was left out or scaled, and why (it measured another count of devices)

    def note(self, base: str) -> str:
        """One line for the plan: which figures are measured, which come from ``base`` (the hardware file's name,
        or "the devices at hand")."""
        rest = [f for f in FIGURES if f not in self.measured]
        if not self.measured:
            return (f"figures: all from {base} ({', '.join(FIGURES)}); `jaxtrain check run.dir=DIR` measures them "
                    f"and `plan --calibration DIR/{FILE}` uses them"
                    + (f"; {self.ignored}, not used" if self.ignored else "")
                    + (f"; {self.source}: {self.partly}" if self.partly else ""))
        return (f"figures: measured by check ({self.source}): {', '.join(self.measured)}"
                + (f"; from {base}: {', '.join(rest)}" if rest else "")
                + (f"; {self.partly}" if self.partly else ""))


def for_plan(hw: Hardware, explicit: str | None, run_dir: str, compute_dtype: str,
             target: Devices | None = None) -> Calibrated:
    """The calibration a plan for ``target`` uses (:func:`fit`): ``explicit`` (``--calibration``; one that does not
    fit exits 2), else the run directory's own where it fits; one that does not (another device kind or machine, no
    origin) is left out, and the note says why."""
    if explicit:
        return apply(hw, read(explicit), explicit, compute_dtype, target)
    path = in_run_dir(run_dir)
    if path is None:
        return Calibrated(hw, (), "")
    body = read(path)
    verdict, why = fit(body, hw, target)
    if verdict == NONE:
        return Calibrated(hw, (), "", ignored=f"{path}: {why}")
    return apply(hw, body, path, compute_dtype, target)


def apply(hw: Hardware, body: dict | None, source: str = "", compute_dtype: str = "bfloat16",
          target: Devices | None = None) -> Calibrated:
    """``hw`` with the measured figures of ``body`` (a :func:`read` calibration, or None: nothing changes) that fit
    ``target`` (:func:`fit`; None: the device kind alone is checked).

    A calibration that does not fit (another device kind or machine, no origin) says nothing about these devices:
    exit 2. Of one measured on another count, the matmul figures alone (module docstring). The matmul rate of
    ``compute_dtype`` is used when measured, else none (another dtype's rate would mislead)."""
    if body is None:
        return Calibrated(hw, (), "")
    verdict, why = fit(body, hw, target)
    if verdict == NONE:
        raise ConfigError(f"calibration {source!r} does not fit: {why}; calibrate on the devices planned for")
    values: dict = {}
    rows = body.get("matmul_rows", {}).get(compute_dtype)
    if rows:  # [[rows, fraction of the largest-rows rate], ...], optional
        hw = sized(hw, tuple((float(r), float(f)) for r, f in rows),
                   float(body.get("layer_overhead_s", 0.0)) if verdict == SAME else hw.layer_overhead_s)
    rate = body["matmul_gflops"].get(compute_dtype)
    scale, partly = 1.0, ""
    if verdict == COUNT:
        assert target is not None  # fit() compares counts only against a target
        was = int(body["origin"].get("local_devices") or 1)
        if body.get("platform") == "cpu" and target.local and was != target.local:
            scale = was / target.local  # each device's share of the host's cores
        partly = (f"the calibration measured another count of devices ({why}): its matmul rate is taken"
                  + (f" x{was}/{target.local} (emulated devices share the host's cores: each device's share)"
                     if scale != 1.0 else " (per device)")
                  + ", its links and collective latency are not (measured over other devices)")
    if rate:
        values["peak_flops"] = float(rate) * 1e9 * scale
    if verdict == SAME:
        axes = body.get("axes", {})
        for field, crosses in (("intra_node_bandwidth", False), ("inter_node_bandwidth", True)):
            rates = [a["busbw_gbps"] for a in axes.values() if a["crosses_hosts"] == crosses and a["busbw_gbps"] > 0]
            if rates:  # the slowest axis of the class: a ring paces at it
                values[field] = min(rates) * 1e9
        latencies = [a["latency_s"] for a in axes.values() if a.get("latency_s") is not None]
        if latencies:
            values["collective_latency"] = max(latencies)
    measured = tuple(f for f in FIGURES if f in values)
    return Calibrated(dataclasses.replace(hw, **values), measured, source, partly=partly)


def sized(hw: Hardware, matmul_rows: tuple[tuple[float, float], ...], layer_overhead_s: float) -> Hardware:
    """``hw`` with the sized figures (``measure.measure_sized``) in, the table's rows ascending."""
    return dataclasses.replace(hw, matmul_rows=tuple(sorted(matmul_rows)), layer_overhead_s=layer_overhead_s)
