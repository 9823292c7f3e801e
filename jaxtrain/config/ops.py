"""The operations sections of the config tree: multi-process start-up (``dist``), the health check (``check``) and
run-time observation (``observe``), with their validation. ``jaxtrain.config`` holds them in its ``Config`` and calls
:func:`validate_ops` once, from its own ``validate``. No JAX here either.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from jaxtrain.config import locations
from jaxtrain.errors import ConfigError


@dataclass
class DistConfig:
    # host:port of process 0's coordination service. Unset: this, num_processes and process_id are taken from
    # JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID, else from Slurm inside `srun`, else a single
    # process. All three or none.
    coordinator: str | None = None
    num_processes: int | None = None  # processes in the job (one per node, or one per GPU)
    process_id: int | None = None  # this process's index, 0 .. num_processes - 1
    init_timeout_s: int | None = None  # seconds for every process to join (names the missing); None: JAX's 300
    heartbeat_timeout_s: int | None = None  # a process silent this long is declared dead; None: JAX's default, 100
    # GPU ordinals (after CUDA_VISIBLE_DEVICES) this process drives; None: JAX_LOCAL_DEVICE_IDS, else derived from
    # Slurm's task layout, else all (see jaxtrain.cluster.distributed; `python -m jaxtrain env` shows the result).
    local_device_ids: list | None = None
    bind_address: str | None = None  # process 0 listens here (host:port); None: JAX_COORDINATOR_BIND_ADDRESS, [::]


@dataclass
class CheckConfig:
    # `python -m jaxtrain check`: collective bandwidth and per-device matmul health check.
    # Message sizes per device; None: [0.25, 4, 16] MiB on CPU; on GPU the one size an axis's link is judged at
    # (1 ms at the link's rate, rounded up to a power of two: NVLink 4 512 MiB, 400 Gb/s NIC 64 MiB).
    sizes_mb: list | None = None
    iters: int = 5  # timed repetitions of each collective and matmul
    matmul_size: int | None = None  # None: 1024 (float32) on CPU, 8192 (bfloat16) on GPU
    min_busbw_gbps: float = 0.0  # fail if an axis's bus bandwidth at the largest size is below this (0: no bound)
    min_matmul_fraction: float = 0.5  # fail if a device's matmul rate is below this fraction of the median
    # Hardware file (name, e.g. h100-8x, or path) for absolute bounds; None: the shipped file listing the devices' exact
    # kind (none: measured, reported, nobody excluded). A named file listing other kinds exits 2.
    hardware: str | None = None
    min_peak_fraction: float = 0.5  # fail a device whose bf16 matmul reaches less than this fraction of peak_flops
    min_link_fraction: float = 0.5  # fail an axis whose bus bandwidth is below this fraction of its link's rate
    bound_misfit_fraction: float = 0.5  # a bound missed on more nodes than this share does not fit: reported only
    max_exclude_fraction: float = 0.5  # exclude at most this share of the nodes (rounded down); more failing: none
    # The network NCCL must use between nodes (read from NCCL's INIT/NET debug lines, docs/health-check.md): ib
    # (InfiniBand or RoCE verbs) or efa (AWS EFA through aws-ofi-nccl): a node on TCP sockets fails, named with the
    # likely cause; auto: what the node's /sys/class/infiniband lists (an efa driver: efa, another device: ib, none:
    # nothing required); socket: nothing required (a cluster without RDMA). Always reported; on CPU, not applicable.
    fabric: Literal["auto", "ib", "efa", "socket"] = "auto"


@dataclass
class ObserveConfig:
    # Prometheus /metrics: None = off; 0 = any free port (logged). Each process serves port + offset: "process"
    # (its process index: several processes on one machine), "local" (its index among the processes of its host:
    # the same port on every node with one process per node), "none".
    prometheus_port: int | None = None
    prometheus_address: str = "127.0.0.1"  # loopback; 0.0.0.0 lets a cluster's Prometheus scrape it
    prometheus_port_offset: Literal["process", "local", "none"] = "process"  # added to the port (above)
    # After a run that reached train.steps the endpoint serves this long more, with jaxtrain_up 0, so that the last
    # values (final save, goodput, last warning) are scraped; not after an error or a signal's stop (quick exit).
    # Seconds; the default is about two scrape intervals (prometheus.yml: 15 s); 0: none.
    prometheus_linger_s: float = 30.0
    # Every N steps the processes swap their own-time figures (host work outside waits for the devices and peers;
    # through the coordination service, not the devices) and process 0 warns about a process whose own time
    # exceeds straggler_ratio x the median. 0: off.
    straggler_every: int = 100
    straggler_ratio: float = 1.5  # a process whose own time per step exceeds this x the median is named
    # Every N steps a small all-reduce per mesh axis measures its bus bandwidth against the link's expected rate
    # (from `hardware`, else the shipped hardware file of these devices); below min_bandwidth_fraction it warns.
    # 0: off.
    collective_probe_every: int = 0
    probe_mb: float | None = None  # message per device; None: 1 MiB on CPU, 256 MiB on GPUs
    min_bandwidth_fraction: float = 0.7  # warn below this fraction of the link's expected rate
    hardware: str | None = None  # hardware file (name or path) with the link rates; None: matched by device kind
    # A jax.profiler trace of steps [START, END] into run.dir/profile/process_<i>, on the processes listed in
    # profile_processes (None: all). SIGUSR1 to a process traces its next signal_profile_steps steps.
    profile_steps: list | None = None
    profile_processes: list | None = None  # process indices that trace; None: all
    signal_profile_steps: int = 5  # steps traced after a SIGUSR1
    # MoE models (docs/moe.md): warn when one expert of a layer takes at least moe_collapse_share of the layer's
    # tokens in moe_collapse_steps steps in a row (routing collapse; the uniform share is top_k / experts).
    # None: halfway between the uniform share and 1.
    moe_collapse_share: float | None = None
    moe_collapse_steps: int = 20  # consecutive steps at or above moe_collapse_share before the warning; 0: off


# ---------------------------------------------------------------------------------------------------------------
# Validation helpers (shared with jaxtrain.config)


def require(ok: bool, msg: str) -> None:
    if not ok:
        raise ConfigError(msg)


def positive(name: str, value: float) -> None:
    require(value > 0, f"{name}={value} must be > 0")


def fraction(name: str, value: float) -> None:
    require(0 <= value <= 1, f"{name}={value} must be in [0, 1]")


def not_negative(name: str, value: float, note: str = "") -> None:
    require(value >= 0, f"{name}={value} must be >= 0{note}")


def validate_ops(dist: DistConfig, ck: CheckConfig, observe: ObserveConfig) -> None:
    """Check the three sections; raise :class:`ConfigError` naming the first bad value."""
    given = [n for n in ("coordinator", "num_processes", "process_id") if getattr(dist, n) is not None]
    require(len(given) in (0, 3), f"dist.{', dist.'.join(given)} given without the others: set dist.coordinator, "
                                   "dist.num_processes and dist.process_id together, or none of them")
    if dist.coordinator is not None and dist.num_processes is not None and dist.process_id is not None:
        locations.host_port(dist.coordinator, "dist.coordinator")
        positive("dist.num_processes", dist.num_processes)
        require(0 <= dist.process_id < dist.num_processes,
                 f"dist.process_id={dist.process_id} must be in [0, dist.num_processes={dist.num_processes})")
    for key in ("init_timeout_s", "heartbeat_timeout_s"):  # None: JAX's own default
        require(getattr(dist, key) is None or getattr(dist, key) > 0, f"dist.{key}={getattr(dist, key)} must be > 0")
    if dist.local_device_ids is not None:
        ids = dist.local_device_ids
        require(bool(ids) and all(isinstance(i, int) and i >= 0 for i in ids) and len(set(ids)) == len(ids),
                 f"dist.local_device_ids={ids} must be a list of distinct GPU ordinals >= 0, e.g. [0,1,2,3]")
    if dist.bind_address is not None:
        locations.host_port(dist.bind_address, "dist.bind_address")
    if ck.sizes_mb is not None:
        require(bool(ck.sizes_mb) and all(isinstance(v, (int, float)) and v > 0 for v in ck.sizes_mb),
                 f"check.sizes_mb={ck.sizes_mb} must be a non-empty list of sizes > 0")
    positive("check.iters", ck.iters)
    if ck.matmul_size is not None:
        positive("check.matmul_size", ck.matmul_size)
    for name in ("min_peak_fraction", "min_link_fraction", "min_matmul_fraction", "bound_misfit_fraction",
                 "max_exclude_fraction"):
        fraction(f"check.{name}", getattr(ck, name))
    not_negative("check.min_busbw_gbps", ck.min_busbw_gbps)
    _validate_observe(observe)


def _validate_observe(o: ObserveConfig) -> None:
    if o.prometheus_port is not None:
        require(0 <= o.prometheus_port <= 65535, f"observe.prometheus_port={o.prometheus_port} must be a "
                "TCP port in [0, 65535] (0: any free port)")
    require(o.prometheus_linger_s >= 0, f"observe.prometheus_linger_s={o.prometheus_linger_s} must be >= 0 "
            "(seconds; 0: stop serving at once)")
    require(bool(o.prometheus_address), "observe.prometheus_address must not be empty (127.0.0.1 or 0.0.0.0)")
    not_negative("observe.straggler_every", o.straggler_every, " (0: off)")
    require(o.straggler_ratio > 1, f"observe.straggler_ratio={o.straggler_ratio} must be > 1 (e.g. 1.5)")
    not_negative("observe.collective_probe_every", o.collective_probe_every, " (0: off)")
    require(o.probe_mb is None or o.probe_mb > 0, f"observe.probe_mb={o.probe_mb} must be > 0")
    fraction("observe.min_bandwidth_fraction", o.min_bandwidth_fraction)
    ps = o.profile_steps
    require(ps is None or (len(ps) == 2 and all(isinstance(v, int) for v in ps) and 1 <= ps[0] <= ps[1]),
            f"observe.profile_steps={ps} must be [START, END] with 1 <= START <= END, e.g. [10, 12]")
    pp = o.profile_processes
    require(pp is None or all(isinstance(v, int) and v >= 0 for v in pp),
            f"observe.profile_processes={pp} must be a list of process indices >= 0, e.g. [0]")
    require(o.signal_profile_steps > 0,
            f"observe.signal_profile_steps={o.signal_profile_steps} must be > 0")
    share = o.moe_collapse_share
    require(share is None or 0 < share <= 1, f"observe.moe_collapse_share={share} must be in (0, 1] (or null)")
    not_negative("observe.moe_collapse_steps", o.moe_collapse_steps, " (0: off)")
