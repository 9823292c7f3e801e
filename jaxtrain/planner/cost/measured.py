"""Measured rates of a shipped GPU: ``jaxtrain/configs/hardware/measured/<hardware>.yaml``, read here.

A hardware file carries datasheet figures; the step model then takes ``peak x compute_efficiency`` for every FLOP.
Where a GPU of that kind has been measured, a file of the same name under ``measured/`` gives what was seen, each
with where it came from (machine, date, command, the docs/results.md section that records it):

- ``matmul``: dense matmul FLOP/s per compute dtype (``bfloat16``, ``float8``; null: not measured);
- ``attention``: fused attention FLOP/s per kernel and head dim, forward and forward + backward (the backward counted
  as 2.5x the forward's FLOPs, as ``jaxtrain.kernels.bench.flash`` counts it);
- ``hbm_bandwidth``: bytes/s (null: not measured; the datasheet's stands in).

The cost model (``model.compute_seconds``) then prices each kind of work at its own measured rate. The figures apply to
the shipped description as it is: a calibration that replaced its matmul rate (``check``'s, on those devices) wins.
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass

from jaxtrain.config import Config
from jaxtrain.config.hardware import Hardware, load_hardware
from jaxtrain.config.schema import SHIPPED_DIR, load_yaml
from jaxtrain.errors import ConfigError

MEASURED_DIR = os.path.join(SHIPPED_DIR, "hardware", "measured")
DTYPES = ("bfloat16", "float8")
TOP_KEYS = ("hardware", "machine", "date", "source", "matmul", "attention", "attention_command", "hbm_bandwidth")
ATTENTION_KEYS = ("impl", "head_dim", "heads", "kv_heads", "fwd", "fwd_bwd")


@dataclass(frozen=True)
class AttentionRate:
    impl: str  # cudnn, triton, pallas, xla
    head_dim: int
    fwd: float  # FLOP/s of the forward (causal FLOPs: half the S x S matmuls)
    fwd_bwd: float  # FLOP/s of forward + backward, the backward counted as 2.5x the forward


@dataclass(frozen=True)
class Measured:
    """One measured file: its rates and their provenance."""

    hardware: str
    machine: str
    date: str
    source: str
    matmul: dict[str, float]  # compute dtype -> FLOP/s; a dtype not measured is absent
    matmul_what: dict[str, str]  # compute dtype -> what was timed and the command
    attention: tuple[AttentionRate, ...]
    attention_command: str
    hbm_bandwidth: float | None

    def attention_rate(self, impl: str, head_dim: int) -> AttentionRate | None:
        """The measured rate of ``impl`` at ``head_dim``, or None where that pair was not measured."""
        return next((a for a in self.attention if a.impl == impl and a.head_dim == head_dim), None)

    @property
    def provenance(self) -> str:
        return f"measured on {self.machine}, {self.date} ({self.source})"


def _rate(value, where: str) -> float | None:
    """A FLOP/s or bytes/s figure: a finite number > 0, or null (not measured)."""
    if value is None:
        return None
    try:
        number = float(value)
    except (TypeError, ValueError):
        number = math.nan
    if not math.isfinite(number) or number <= 0:
        raise ConfigError(f"{where}={value!r} must be a rate > 0 (e.g. 605.0e+12) or null (not measured)")
    return number


def parse(path: str) -> Measured:
    """The measured file at ``path``, checked: ConfigError (one line) naming the file, the key and what is valid."""
    raw = load_yaml(path, "measured hardware file")
    where = f"measured hardware file {path!r}"
    unknown = sorted(set(raw) - set(TOP_KEYS))
    if unknown:
        raise ConfigError(f"{where} has unknown keys: {', '.join(map(str, unknown))}; valid: {', '.join(TOP_KEYS)}")
    missing = [k for k in ("hardware", "machine", "date", "source", "matmul") if not raw.get(k)]
    if missing:
        raise ConfigError(f"{where} lacks {', '.join(missing)} (each figure needs its machine, date and source)")
    matmul, what = {}, {}
    if not isinstance(raw["matmul"], dict) or set(raw["matmul"]) - set(DTYPES):
        raise ConfigError(f"{where}: matmul must map compute dtypes ({', '.join(DTYPES)}) to figures")
    for dtype, entry in raw["matmul"].items():
        if entry is None:
            continue
        if not isinstance(entry, dict) or not entry.get("command") or "rate" not in entry:
            raise ConfigError(f"{where}: matmul.{dtype} needs rate and command (what measured it), or null")
        rate = _rate(entry["rate"], f"{where}: matmul.{dtype}.rate")
        if rate is not None:
            matmul[dtype] = rate
            what[dtype] = f"{entry.get('what', '')}: {entry['command']}".lstrip(": ")
    attention = []
    for i, row in enumerate(raw.get("attention") or []):
        if not isinstance(row, dict) or set(row) != set(ATTENTION_KEYS):
            raise ConfigError(f"{where}: attention[{i}] must have exactly the keys {', '.join(ATTENTION_KEYS)}")
        if not isinstance(row["head_dim"], int) or row["head_dim"] <= 0:
            raise ConfigError(f"{where}: attention[{i}].head_dim={row['head_dim']!r} must be a whole number > 0")
        fwd, both = (_rate(row[k], f"{where}: attention[{i}].{k}") for k in ("fwd", "fwd_bwd"))
        if fwd is None or both is None:
            raise ConfigError(f"{where}: attention[{i}] needs both fwd and fwd_bwd rates")
        attention.append(AttentionRate(str(row["impl"]), row["head_dim"], fwd, both))
    if attention and not raw.get("attention_command"):
        raise ConfigError(f"{where}: attention rates need attention_command (what measured them)")
    return Measured(str(raw["hardware"]), str(raw["machine"]), str(raw["date"]), str(raw["source"]), matmul, what,
                    tuple(attention), str(raw.get("attention_command") or ""),
                    _rate(raw.get("hbm_bandwidth"), f"{where}: hbm_bandwidth"))


@functools.cache
def _shipped(name: str) -> Measured | None:
    path = os.path.join(MEASURED_DIR, f"{name}.yaml")
    if not os.path.isfile(path):
        return None
    measured = parse(path)
    if measured.hardware != name:
        raise ConfigError(f"measured hardware file {path!r} says hardware {measured.hardware!r}; its name is {name!r}")
    return measured


def for_hardware(hw: Hardware) -> Measured | None:
    """The measured rates of the shipped description ``hw`` is (by name), or None: none shipped, or ``hw``'s matmul
    rate is no longer the file's (a calibration replaced it: then its figures are the measured ones)."""
    measured = _shipped(hw.name) if hw.name and os.sep not in hw.name else None
    if measured is None or _datasheet_peak(hw.name) != hw.peak_flops:
        return None
    return measured


@functools.cache
def _datasheet_peak(name: str) -> float:
    return load_hardware(name).peak_flops  # read once: the cost model asks per candidate


def measured_rates(cfg: Config, hw: Hardware, attention: str) -> dict[str, tuple[float, str]] | None:
    """{part: (FLOP/s, where it comes from)} for ``cfg``'s step on ``hw`` where ``hw`` has measured rates
    (``measured.for_hardware``), else None. Parts: "matmul" (the compute dtype's), "matmul_fp8" (with model.fp8 on
    FP8 hardware), "attention_fwd" and "attention_fwd_bwd" (the kernel the run uses at its head dim; forward +
    backward counted as ``model.FWD_BWD_ATTENTION`` forwards). Not measured: the datasheet peak x compute_efficiency."""
    measured = for_hardware(hw)
    if measured is None:
        return None
    eff = hw.compute_efficiency
    datasheet = f"datasheet x efficiency {eff:g}"

    def pick(got: float | None, peak: float) -> tuple[float, str]:
        return (got, "measured") if got else (peak * eff, datasheet)

    rates = {"matmul": pick(measured.matmul.get("bfloat16"), hw.peak_flops)}
    if cfg.model.fp8 != "none" and hw.fp8_peak_flops > 0:
        rates["matmul_fp8"] = pick(measured.matmul.get("float8"), hw.fp8_peak_flops)
    kernel = measured.attention_rate(attention, cfg.model.resolved_head_dim)
    where = f"measured: {attention}, head dim {cfg.model.resolved_head_dim}"
    rates["attention_fwd"] = (kernel.fwd, where) if kernel else (hw.peak_flops * eff, datasheet)
    rates["attention_fwd_bwd"] = (kernel.fwd_bwd, where) if kernel else (hw.peak_flops * eff, datasheet)
    return rates
