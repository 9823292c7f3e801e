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
     "axes": {"fsdp": {"devices": 8, "crosses_hosts": false, "busbw_gbps": 370.0, "latency_s": 2.1e-05}, ...}}
"""

from __future__ import annotations

import dataclasses
import json
import os
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


def write(path: str, *, device_kind: str, platform: str, devices: int, hosts: int, matmul_gflops: dict[str, float],
          axes: dict[str, dict]) -> str:
    """Write the calibration file (directories made as needed); returns its path."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    body = {"version": VERSION, "device_kind": device_kind, "platform": platform, "devices": devices,
            "hosts": hosts, "matmul_gflops": matmul_gflops, "axes": axes}
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
class Calibrated:
    """The hardware with the measured figures in, and which figure came from where."""

    hw: Hardware
    measured: tuple[str, ...]  # names in FIGURES taken from the file
    source: str  # the file's path, or "" without one
    ignored: str = ""  # the run directory's calibration left out, and why (it measured other devices)

    def note(self, base: str) -> str:
        """One line for the plan: which figures are measured, which come from ``base`` (the hardware file's name,
        or "the devices at hand")."""
        rest = [f for f in FIGURES if f not in self.measured]
        if not self.measured:
            return (f"figures: all from {base} ({', '.join(FIGURES)}); `jaxtrain check run.dir=DIR` measures them "
                    f"and `plan --calibration DIR/{FILE}` uses them"
                    + (f"; {self.ignored}, not used" if self.ignored else ""))
        return (f"figures: measured by check ({self.source}): {', '.join(self.measured)}"
                + (f"; from {base}: {', '.join(rest)}" if rest else ""))


def for_plan(hw: Hardware, explicit: str | None, run_dir: str, compute_dtype: str) -> Calibrated:
    """The calibration a plan uses: ``explicit`` (``--calibration``; one measured on other devices exits 2), else
    the run directory's own if it measured devices ``hw`` describes; one of other devices (say CPUs, for a plan of
    H100s) is left out, and the note says so."""
    if explicit:
        return apply(hw, read(explicit), explicit, compute_dtype)
    path = in_run_dir(run_dir)
    if path is None:
        return Calibrated(hw, (), "")
    body = read(path)
    kind = body.get("device_kind", "")
    if hw.kinds and kind not in hw.kinds:
        return Calibrated(hw, (), "", ignored=f"{path} measured {kind!r} devices")
    return apply(hw, body, path, compute_dtype)


def apply(hw: Hardware, body: dict | None, source: str = "", compute_dtype: str = "bfloat16") -> Calibrated:
    """``hw`` with the measured figures of ``body`` (a :func:`read` calibration, or None: nothing changes).

    The device kind must be one ``hw`` describes (a calibration of other devices says nothing about these: exit 2).
    The matmul rate of ``compute_dtype`` is used when measured, else none (another dtype's rate would mislead)."""
    if body is None:
        return Calibrated(hw, (), "")
    kind = body.get("device_kind", "")
    if hw.kinds and kind not in hw.kinds:
        raise ConfigError(f"calibration {source!r} measured {kind!r} devices but the plan is for {hw.name} "
                          f"({', '.join(map(repr, hw.kinds))}); calibrate on the devices planned for")
    values: dict = {}
    rows = body.get("matmul_rows", {}).get(compute_dtype)
    if rows:  # [[rows, fraction of the largest-rows rate], ...], optional
        hw = sized(hw, tuple((float(r), float(f)) for r, f in rows), float(body.get("layer_overhead_s", 0.0)))
    rate = body["matmul_gflops"].get(compute_dtype)
    if rate:
        values["peak_flops"] = float(rate) * 1e9
    axes = body.get("axes", {})
    for field, crosses in (("intra_node_bandwidth", False), ("inter_node_bandwidth", True)):
        rates = [a["busbw_gbps"] for a in axes.values() if a["crosses_hosts"] == crosses and a["busbw_gbps"] > 0]
        if rates:  # the slowest axis of the class: a ring paces at it
            values[field] = min(rates) * 1e9
    latencies = [a["latency_s"] for a in axes.values() if a.get("latency_s") is not None]
    if latencies:
        values["collective_latency"] = max(latencies)
    measured = tuple(f for f in FIGURES if f in values)
    return Calibrated(dataclasses.replace(hw, **values), measured, source)


def sized(hw: Hardware, matmul_rows: tuple[tuple[float, float], ...], layer_overhead_s: float) -> Hardware:
    """``hw`` with the sized figures (``measure.measure_sized``) in, the table's rows ascending."""
    return dataclasses.replace(hw, matmul_rows=tuple(sorted(matmul_rows)), layer_overhead_s=layer_overhead_s)
