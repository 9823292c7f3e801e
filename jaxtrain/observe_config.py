"""The ``observe`` config section: watching a running job (``jaxtrain.observe``; README "Watching a job").

Its own module so that ``config.py`` stays within the size limit; like ``config.py`` it imports no JAX. The values
are checked when the section is built (``__post_init__``), so a bad one fails as a ConfigError before any device
work, like every other config value.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass
class ObserveConfig:
    # Prometheus /metrics: None = off; 0 = any free port (logged). Each process serves port + offset: "process"
    # (its process index: several processes on one machine), "local" (its index among the processes of its host:
    # the same port on every node with one process per node), "none".
    prometheus_port: int | None = None
    prometheus_address: str = "127.0.0.1"  # loopback; 0.0.0.0 lets a cluster's Prometheus scrape it
    prometheus_port_offset: Literal["process", "local", "none"] = "process"
    # Every N steps the processes swap their host-time figures (through the coordination service, not the devices)
    # and process 0 warns about a process whose host time exceeds straggler_ratio x the median. 0: off.
    straggler_every: int = 100
    straggler_ratio: float = 1.5
    # Every N steps a small all-reduce per mesh axis measures its bus bandwidth against the link's expected rate
    # (from `hardware`, else the shipped hardware file of these devices); below min_bandwidth_fraction it warns.
    collective_probe_every: int = 0  # 0: off
    probe_mb: float | None = None  # message per device; None: 1 MiB on CPU, 256 MiB on GPUs
    min_bandwidth_fraction: float = 0.7
    hardware: str | None = None  # hardware file (name or path) with the link rates; None: matched by device kind
    # A jax.profiler trace of steps [START, END] into run.dir/profile/process_<i>, on the processes listed in
    # profile_processes (None: all). SIGUSR1 to a process traces its next signal_profile_steps steps.
    profile_steps: list | None = None
    profile_processes: list | None = None
    signal_profile_steps: int = 5

    def __post_init__(self):
        from jaxtrain.config import ConfigError

        def require(ok: bool, msg: str) -> None:
            if not ok:
                raise ConfigError(msg)

        if self.prometheus_port is not None:
            require(0 <= self.prometheus_port <= 65535, f"observe.prometheus_port={self.prometheus_port} must be a "
                    "TCP port in [0, 65535] (0: any free port)")
        require(bool(self.prometheus_address), "observe.prometheus_address must not be empty (127.0.0.1 or 0.0.0.0)")
        require(self.straggler_every >= 0, f"observe.straggler_every={self.straggler_every} must be >= 0 (0: off)")
        require(self.straggler_ratio > 1, f"observe.straggler_ratio={self.straggler_ratio} must be > 1 (e.g. 1.5)")
        require(self.collective_probe_every >= 0,
                f"observe.collective_probe_every={self.collective_probe_every} must be >= 0 (0: off)")
        require(self.probe_mb is None or self.probe_mb > 0, f"observe.probe_mb={self.probe_mb} must be > 0")
        require(0 <= self.min_bandwidth_fraction <= 1,
                f"observe.min_bandwidth_fraction={self.min_bandwidth_fraction} must be in [0, 1]")
        ps = self.profile_steps
        require(ps is None or (len(ps) == 2 and all(isinstance(v, int) for v in ps) and 1 <= ps[0] <= ps[1]),
                f"observe.profile_steps={ps} must be [START, END] with 1 <= START <= END, e.g. [10, 12]")
        pp = self.profile_processes
        require(pp is None or all(isinstance(v, int) and v >= 0 for v in pp),
                f"observe.profile_processes={pp} must be a list of process indices >= 0, e.g. [0]")
        require(self.signal_profile_steps > 0,
                f"observe.signal_profile_steps={self.signal_profile_steps} must be > 0")
