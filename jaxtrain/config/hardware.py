"""Hardware descriptions: one YAML file per node type (``jaxtrain/configs/hardware/*.yaml``, package data), each
number with its datasheet source. The one table of device peak rates: MFU and the planner both read it here.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

from jaxtrain.config.schema import SHIPPED_DIR, find_yaml, load_typed, shipped
from jaxtrain.errors import ConfigError

# JAX's GPU allocator takes this fraction of HBM unless XLA_PYTHON_CLIENT_MEM_FRACTION says otherwise: a step must
# fit in that pool, not in the whole HBM.
JAX_DEFAULT_MEM_FRACTION = 0.75


@dataclass(frozen=True)
class Hardware:
    """One device's rates and the node it sits in. Bandwidths are per device and per direction (bytes/s)."""

    peak_flops: float  # dense bf16 FLOP/s of one device
    hbm_bytes: float
    hbm_bandwidth: float
    devices_per_node: int
    intra_node_bandwidth: float
    inter_node_bandwidth: float
    compute_efficiency: float
    name: str = ""
    device: str = ""
    # The exact jax.Device.device_kind strings this file describes (CUDA's device name, what nvidia-smi shows): a
    # PCIe, NVL or Grace-Hopper part reports another string and is not covered by an SXM node's file.
    device_kinds: list[str] = field(default_factory=list)
    device_kind: str = ""  # one more exact kind (a measured description's, or a one-kind file's)
    mem_fraction: float = 1.0  # the part of hbm_bytes a step may use (allocator pool)
    # Fixed cost of one collective, whatever its size. Measured for the CPU at hand; 0 (bandwidth only) for the
    # shipped GPU files, which carry datasheet numbers only.
    collective_latency: float = 0.0
    # Two more measured figures, for the CPU at hand (``measure.measure_sized``) or from a calibration file; empty / 0
    # in the shipped files: the matmul rate by rows per device, as (rows, rate / the rate at
    # ``calibration.REFERENCE_ROWS``) ascending, and the fixed seconds of one layer's forward + backward iteration.
    matmul_rows: tuple[tuple[float, float], ...] = ()
    layer_overhead_s: float = 0.0
    # The compute efficiency of the model's own step, (remat policy, tensor, efficiency): measured on the CPU at hand
    # (``measure.measure_model``), replacing ``compute_efficiency`` for the policies it names (``cost.efficiency``).
    model_efficiency: tuple[tuple[str, int, float], ...] = ()
    # The XLA GPU target config (``jaxtrain/configs/gpu_targets/<gpu_target>.txtpb``) that a deviceless XLA:GPU
    # compile for this hardware uses (``planner/xla_gpu/deviceless.py``); "" for hardware without one (CPUs, a
    # measured file).
    gpu_target: str = ""
    # Dense FP8 (e4m3/e5m2) tensor-core FLOP/s of one device, for model.fp8's matmuls; 0: no FP8 tensor cores
    # (A100, CPUs: model.fp8 is refused there, or emulated at the bf16/f32 rate on CPUs).
    fp8_peak_flops: float = 0.0

    @property
    def kinds(self) -> tuple[str, ...]:
        """Every device kind this description covers, exactly as JAX reports it."""
        return tuple(self.device_kinds) + ((self.device_kind,) if self.device_kind else ())

    def covers(self, device_kind: str) -> bool:
        """Whether ``device_kind`` (``jax.Device.device_kind``) is one of :attr:`kinds`, compared exactly."""
        return device_kind in self.kinds

    @property
    def usable_bytes(self) -> float:
        return self.hbm_bytes * self.mem_fraction


def known_hardware() -> list[str]:
    """Names of the shipped hardware descriptions (``h100-8x``, ...)."""
    return list(shipped("hardware"))


def load_hardware(name: str) -> Hardware:
    """A shipped hardware description by name (``h100-8x``) or a path to a YAML file of the same form."""
    path = find_yaml(name, "hardware", "hardware")
    if not os.path.isfile(path):
        raise ConfigError(f"unknown hardware {name!r}; known: {', '.join(known_hardware())} (or a path to a .yaml "
                          "file)")
    hw = load_typed(path, Hardware, "hardware file")
    stem = os.path.splitext(os.path.basename(path))[0]
    hw = Hardware(**{**hw.__dict__, "name": hw.name or stem, "device": hw.device or stem})
    numbers = ("peak_flops", "hbm_bytes", "hbm_bandwidth", "intra_node_bandwidth", "inter_node_bandwidth",
               "compute_efficiency", "devices_per_node")
    bad = [k for k in numbers if getattr(hw, k) <= 0]
    if bad:
        raise ConfigError(f"hardware file {path!r}: {', '.join(bad)} must be > 0")
    if hw.gpu_target and hw.gpu_target not in gpu_targets():
        raise ConfigError(f"hardware file {path!r}: gpu_target {hw.gpu_target!r} is not a shipped GPU target config; "
                          f"shipped: {', '.join(gpu_targets())}")
    return hw


GPU_TARGETS_DIR = os.path.join(SHIPPED_DIR, "gpu_targets")


def gpu_targets() -> dict[str, str]:
    """The shipped XLA GPU target configs by name (``h100`` -> its ``.txtpb`` path): what a hardware file's
    ``gpu_target`` names (XLA's public specs, trimmed; each file's header says which)."""
    return {f[:-6]: os.path.join(GPU_TARGETS_DIR, f) for f in sorted(os.listdir(GPU_TARGETS_DIR))
            if f.endswith(".txtpb")}


def gpu_target_device_kind(name: str) -> str:
    """The device kind a deviceless compile for the shipped target ``name`` gives its devices (the config's
    ``device_description_str``), e.g. "NVIDIA H100 80GB HBM3"."""
    with open(gpu_targets()[name]) as f:
        found = re.search(r'^device_description_str:\s*"([^"]*)"', f.read(), re.M)
    if found is None:
        raise ConfigError(f"GPU target config {name!r} has no device_description_str")
    return found.group(1)


def for_device_kind(device_kind: str) -> Hardware | None:
    """The shipped description that lists ``device_kind`` exactly (e.g. "NVIDIA H100 80GB HBM3" -> h100-8x; "NVIDIA
    H100 PCIe", "NVIDIA GH200 480GB" -> None), or None (e.g. CPU). No substring matching: a part with another
    form factor has other links and rates."""
    for name in known_hardware():
        hw = load_hardware(name)
        if hw.covers(device_kind):
            return hw
    return None


def known_device_kinds() -> list[str]:
    """The device kinds the shipped descriptions cover, for messages."""
    return [kind for name in known_hardware() for kind in load_hardware(name).kinds]


def peak_flops(device_kind: str) -> float | None:
    """Peak dense bf16 FLOP/s of one device of this kind, or None when no shipped description knows it."""
    hw = for_device_kind(device_kind)
    return hw.peak_flops if hw else None


def gpu_mem_fraction() -> float:
    """The HBM fraction JAX's allocator will own on the training machine (XLA_PYTHON_CLIENT_MEM_FRACTION or 0.75)."""
    raw = os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION")
    try:
        value = float(raw) if raw else JAX_DEFAULT_MEM_FRACTION
    except ValueError:
        raise ConfigError(f"XLA_PYTHON_CLIENT_MEM_FRACTION={raw!r} is not a number in (0, 1]") from None
    if not 0 < value <= 1:
        raise ConfigError(f"XLA_PYTHON_CLIENT_MEM_FRACTION={raw!r} must be in (0, 1]")
    return value
