"""Multi-controller initialisation (``jax.distributed``): before any other JAX use.

jaxtrain resolves every argument of ``jax.distributed.initialize`` itself and passes them all, with JAX's cluster
auto-detection switched off (``cluster_detection_method="deactivate"``). Reason: JAX runs its detection whenever
any of coordinator, process count, process id or ``local_device_ids`` is unset, and its Slurm detection then sets
``local_device_ids=[SLURM_LOCALID]`` (``jax/_src/clusters/cluster.py``, jax 0.10.2 and 0.11.2): with one task per
node each process drives GPU 0 only (jax-ml/jax#16788, AI-Hypercomputer/maxtext#3433); with Slurm binding one GPU
per task (``--gpus-per-task=1``) task i asks for GPU ordinal i of the one it sees (jax-ml/jax#28194, #23452).

Where each setting comes from, first match wins (``python -m jaxtrain env`` prints the result and its sources):

coordinator, num_processes, process_id (all three from one place):
  1. the config: ``dist.coordinator``, ``dist.num_processes``, ``dist.process_id``;
  2. the environment: ``JAX_COORDINATOR_ADDRESS``, ``JAX_NUM_PROCESSES``, ``JAX_PROCESS_ID`` (what
     ``launch/local.sh`` and the Kubernetes manifest set);
  3. Slurm, inside an ``srun`` step with more than one task: JAX's own rule (``slurm_cluster.py``): the first host
     of ``SLURM_STEP_NODELIST``, port ``JAX_COORDINATOR_PORT`` or 61440 + ``SLURM_JOB_ID`` % 4096;
     ``SLURM_STEP_NUM_TASKS`` processes, id ``SLURM_PROCID``;
  4. a single process, which starts no coordination service (no coordinator).
local_device_ids (GPU ordinals as this process's CUDA numbers them, i.e. after ``CUDA_VISIBLE_DEVICES``):
  1. the config: ``dist.local_device_ids``;
  2. the environment: ``JAX_LOCAL_DEVICE_IDS`` (JAX's own variable, comma-separated);
  3. Slurm, from this node's task count T and the count V of ``CUDA_VISIBLE_DEVICES`` entries (see
     :func:`_slurm_local_devices`): one task per node uses all V; T tasks sharing the node's V GPUs take V/T each
     (``--ntasks-per-node=8 --gpus-per-node=8``: task i drives GPU i); tasks that Slurm bound to their own GPUs
     use all they see;
  4. none: every device the process sees.
A single process does not initialise ``jax.distributed`` at all: nothing listens on the network, and its CPU
devices exchange data in-process. Once ``jax.distributed`` is initialised, XLA:CPU routes even one process's
collectives through gloo, which is slower (see benchmarks/cpu_collectives.py) and whose large reduce-scatters
intermittently return wrong values (jax-ml/jax#40830). Preemption of a single process is a local signal flag
(``checkpoint_io.PreemptionWatch``); several processes use JAX's preemption service so that all stop at the same step.
CPU processes of a multi-process job exchange data with gloo.

Where process 0's coordination service listens: ``dist.bind_address``, else ``JAX_COORDINATOR_BIND_ADDRESS`` (which
``launch/local.sh`` sets to 127.0.0.1:port: all its processes share one host), else every interface, ``[::]:port``
(JAX's own default, ``jax/_src/distributed.py``). Not the coordinator's host name: Debian/Ubuntu images map their own
host name to 127.0.1.1 (loopback), where no other node can reach it, and a Kubernetes pod would have to resolve its
own DNS name before it could listen at all.

Start-up: before ``jax.distributed.initialize``, the workers report to process 0 on the coordinator's port (a roll
call, :func:`_roll_call`), which then hands the port to JAX's service. JAX itself aborts every process at its
deadline ("RegisterTask ... DEADLINE_EXCEEDED", exit 134, jax 0.10.2) without saying who was missing; the roll call
names the processes that never joined (a one-line DistributedError, exit 1), and a job whose processes disagree on
its size or share an id. ``dist.init_timeout_s`` / ``dist.heartbeat_timeout_s`` default to JAX's own (300 / 100 s).
"""

from __future__ import annotations

import importlib.metadata
import inspect
import os
import re
import socket
import sys
import time
from dataclasses import dataclass, field

from jaxtrain.config.ops import DistConfig
from jaxtrain.errors import ConfigError, DistributedError, one_line

SLURM_BASE_PORT = 65535 - 2**12 + 1  # = 61440, JAX's slurm_cluster.py: port = base + job id % 4096


@dataclass(frozen=True)
class Settings:
    """Exactly what this process passes to ``jax.distributed.initialize``, and where each value came from."""

    coordinator: str | None  # host:port of process 0's coordination service; None: a single process, none
    num_processes: int
    process_id: int
    local_device_ids: tuple[int, ...] | None  # None: every device the process sees
    platform: str  # JAX_PLATFORMS, or what JAX picks from the installed plugins
    bind_address: str | None  # where process 0's coordination service listens (None: single process, no service)
    sources: dict = field(default_factory=dict)  # setting -> where it came from, in words

    @property
    def source(self) -> str:
        """Where the process group settings came from: "config" | "environment" | "slurm" | "single"."""
        return self.sources["coordinator"].split(":")[0].split(" ")[0]

    @property
    def expected_processes(self) -> int:
        return self.num_processes

    def as_dict(self) -> dict:
        return {"coordinator": self.coordinator, "num_processes": self.num_processes, "process_id": self.process_id,
                "local_device_ids": None if self.local_device_ids is None else list(self.local_device_ids),
                "platform": self.platform, "coordinator_bind_address": self.bind_address, "sources": self.sources}


def _env_int(environ, name: str) -> int:
    value = environ[name].strip()
    if not value.isdigit():
        raise ConfigError(f"environment variable {name}={environ[name]!r} must be a non-negative integer")
    return int(value)


def _id_list(text: str, what: str) -> tuple[int, ...]:
    parts = [p.strip() for p in text.split(",")]
    if not parts or not all(p.isdigit() for p in parts) or len(set(parts)) != len(parts):
        raise ConfigError(f"{what}={text!r} must be distinct comma-separated GPU ordinals, e.g. 0,1,2,3")
    return tuple(int(p) for p in parts)


def first_slurm_host(nodelist: str) -> str:
    """The first host of a Slurm node list ('n[001-004,9],m2' -> 'n001'), as JAX's slurm_cluster.py parses it."""
    m = re.match(r"([^,\[]*)(?:\[([^,\-\]]*))?", nodelist)
    assert m is not None  # the pattern matches any string, if only with empty groups
    return m.group(1) + (m.group(2) or "")


def _tasks_per_node(spec: str) -> list[int]:
    """Expand Slurm's tasks-per-node list ('8(x2),4' -> [8, 8, 4])."""
    counts = []
    for part in spec.split(","):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if m is None:
            raise ConfigError(f"cannot read Slurm's tasks-per-node list {spec!r}")
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    return counts


def _slurm_tasks_on_this_node(environ) -> int:
    """T: the step's tasks on this node (SLURM_STEP_TASKS_PER_NODE, indexed by SLURM_NODEID when it varies)."""
    spec = environ.get("SLURM_STEP_TASKS_PER_NODE") or environ.get("SLURM_TASKS_PER_NODE")
    if not spec:
        return 1
    counts = _tasks_per_node(spec)
    if len(set(counts)) == 1:
        return counts[0]
    node = _env_int(environ, "SLURM_NODEID") if "SLURM_NODEID" in environ else 0
    return counts[min(node, len(counts) - 1)]


def visible_gpu_count(environ) -> int | None:
    """V: the GPUs CUDA_VISIBLE_DEVICES lets this process see (None: unset, CUDA shows all of the machine's)."""
    value = environ.get("CUDA_VISIBLE_DEVICES")
    if value is None:
        return None
    if value.strip() in ("", "NoDevFiles"):  # Slurm writes NoDevFiles for a GRES without device files
        return 0
    return len([p for p in value.split(",") if p.strip()])


def _slurm_local_devices(environ) -> tuple[tuple[int, ...] | None, str]:
    """local_device_ids for this Slurm task, and why."""
    tasks = _slurm_tasks_on_this_node(environ)
    local = _env_int(environ, "SLURM_LOCALID")
    visible = visible_gpu_count(environ)
    on_node = environ.get("SLURM_GPUS_ON_NODE", "").strip()
    on_node = int(on_node) if on_node.isdigit() else None
    where = f"slurm: {tasks} task(s) on this node, CUDA_VISIBLE_DEVICES={environ.get('CUDA_VISIBLE_DEVICES')!r}"
    if visible is None:  # no GPU GRES: CUDA shows the whole machine
        if tasks == 1:
            return None, f"{where}: one task per node uses every GPU it sees"
        return (local,), f"{where}: task SLURM_LOCALID={local} drives GPU {local}"
    if visible == 0:
        return None, f"{where}: no GPU visible"
    if tasks == 1:
        return tuple(range(visible)), f"{where}: one task per node uses all {visible}"
    bound = on_node is not None and visible < on_node  # Slurm gave each task its own GPUs (--gpus-per-task, --gpu-bind)
    if bound or visible < tasks:
        if not bound and on_node is not None and visible == on_node:
            raise ConfigError(f"{tasks} Slurm tasks on this node share {visible} GPU(s) (SLURM_GPUS_ON_NODE="
                              f"{on_node}): run at most one task per GPU, e.g. --ntasks-per-node={visible}")
        return tuple(range(visible)), f"{where}: Slurm bound this task's GPUs; it uses all {visible} it sees"
    if visible % tasks:
        raise ConfigError(f"{tasks} Slurm tasks on this node cannot share {visible} visible GPUs evenly "
                          f"(CUDA_VISIBLE_DEVICES={environ['CUDA_VISIBLE_DEVICES']!r}); use --ntasks-per-node=1 or "
                          f"--ntasks-per-node={visible} with --gpus-per-node={visible}")
    per = visible // tasks
    ids = tuple(range(local * per, (local + 1) * per))
    return ids, f"{where}: task SLURM_LOCALID={local} of {tasks} drives GPU(s) {','.join(map(str, ids))}"


def _platform(environ) -> tuple[str, str]:
    if environ.get("JAX_PLATFORMS"):
        return environ["JAX_PLATFORMS"], "environment: JAX_PLATFORMS"
    installed = {d.metadata["Name"].lower() for d in importlib.metadata.distributions() if d.metadata["Name"]}
    plugins = sorted(n for n in installed if re.fullmatch(r"jax[-_]cuda\d+[-_]plugin", n))
    if plugins:  # JAX tries the GPU plugin first and falls back to the CPU (with a warning) when it finds no GPU
        return "cuda,cpu", f"installed: {plugins[0]} (JAX_PLATFORMS unset: CUDA if a GPU is found, else CPU)"
    return "cpu", "installed: no JAX GPU plugin"


def resolve(dist: DistConfig, environ=os.environ) -> Settings:
    """Everything this process would pass to ``jax.distributed.initialize`` (see the module docstring)."""
    sources = {}
    names = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")
    present = [n for n in names if n in environ]
    slurm_tasks = environ.get("SLURM_STEP_NUM_TASKS", environ.get("SLURM_NTASKS", "1"))
    in_slurm_step = "SLURM_STEP_NODELIST" in environ
    if dist.coordinator is not None and dist.num_processes is not None and dist.process_id is not None:
        coordinator, n, i = dist.coordinator, dist.num_processes, dist.process_id
        for key in ("coordinator", "num_processes", "process_id"):
            sources[key] = f"config: dist.{key}"
    elif present:
        if len(present) != 3:
            missing = ", ".join(n for n in names if n not in environ)
            raise ConfigError(f"{', '.join(present)} set in the environment but not {missing}: set all three or none")
        n, i = _env_int(environ, "JAX_NUM_PROCESSES"), _env_int(environ, "JAX_PROCESS_ID")
        if i >= n:
            raise ConfigError(f"JAX_PROCESS_ID={i} must be below JAX_NUM_PROCESSES={n}")
        coordinator = environ["JAX_COORDINATOR_ADDRESS"]
        if ":" not in coordinator:
            raise ConfigError(f"JAX_COORDINATOR_ADDRESS={coordinator!r} must be host:port")
        for key, name in zip(("coordinator", "num_processes", "process_id"), names):
            sources[key] = f"environment: {name}"
    elif in_slurm_step and slurm_tasks.isdigit() and int(slurm_tasks) > 1:
        for name in ("SLURM_JOB_ID", "SLURM_PROCID", "SLURM_LOCALID"):
            if name not in environ:
                raise ConfigError(f"inside a Slurm step but {name} is not set; is this an srun step?")
        port = environ.get("JAX_COORDINATOR_PORT") or str(SLURM_BASE_PORT + _env_int(environ, "SLURM_JOB_ID") % 4096)
        coordinator = f"{first_slurm_host(environ['SLURM_STEP_NODELIST'])}:{port}"
        n, i = int(slurm_tasks), _env_int(environ, "SLURM_PROCID")
        port_from = "JAX_COORDINATOR_PORT" if environ.get("JAX_COORDINATOR_PORT") else "61440 + SLURM_JOB_ID % 4096"
        sources["coordinator"] = f"slurm: first host of SLURM_STEP_NODELIST, port {port_from}"
        sources["num_processes"] = "slurm: SLURM_STEP_NUM_TASKS" if "SLURM_STEP_NUM_TASKS" in environ \
            else "slurm: SLURM_NTASKS"
        sources["process_id"] = "slurm: SLURM_PROCID"
    else:
        coordinator, n, i = None, 1, 0
        sources.update(coordinator="single process: no coordination service is started",
                       num_processes="single process", process_id="single process")

    config_ids = getattr(dist, "local_device_ids", None)  # a key of DistConfig once config.py has it
    ids: tuple[int, ...] | None
    if config_ids is not None:
        ids = _id_list(",".join(map(str, config_ids)), "dist.local_device_ids")
        sources["local_device_ids"] = "config: dist.local_device_ids"
    elif environ.get("JAX_LOCAL_DEVICE_IDS"):
        ids = _id_list(environ["JAX_LOCAL_DEVICE_IDS"], "JAX_LOCAL_DEVICE_IDS")
        sources["local_device_ids"] = "environment: JAX_LOCAL_DEVICE_IDS"
    elif in_slurm_step and "SLURM_LOCALID" in environ:
        ids, sources["local_device_ids"] = _slurm_local_devices(environ)
    else:
        ids, sources["local_device_ids"] = None, "default: every device the process sees"

    platform, sources["platform"] = _platform(environ)
    bind = getattr(dist, "bind_address", None)
    if n == 1:
        bind, sources["coordinator_bind_address"] = None, "single process: no coordination service is started"
    elif bind is not None:
        sources["coordinator_bind_address"] = "config: dist.bind_address"
    elif environ.get("JAX_COORDINATOR_BIND_ADDRESS"):
        bind = environ["JAX_COORDINATOR_BIND_ADDRESS"]
        sources["coordinator_bind_address"] = "environment: JAX_COORDINATOR_BIND_ADDRESS"
    else:
        assert coordinator is not None  # several processes always have one
        bind = "[::]:" + coordinator.rpartition(":")[2]  # JAX's own default: every interface
        sources["coordinator_bind_address"] = "default: every interface, the coordinator's port (as JAX does)"
    return Settings(coordinator, n, i, ids, platform, bind, sources)


def cpu_device_count(cfg, environ=os.environ) -> int | None:
    """The job's device count where it is known before JAX starts: on the CPU platform (``JAX_PLATFORMS=cpu``, or no
    GPU plugin installed), ``runtime.cpu_devices`` (unset: what the mesh's fixed axes need) per process x the
    processes; None where JAX may pick GPUs, whose count is known once its backend is up."""
    from jaxtrain.parallel.dims import cpu_devices_per_process

    settings = resolve(cfg.dist, environ)
    if settings.platform != "cpu":
        return None
    return cpu_devices_per_process(cfg, settings.num_processes) * settings.num_processes


def jax_timeouts(dist: DistConfig) -> tuple[int, int]:
    """(init, heartbeat) timeouts in seconds: the config's, else ``jax.distributed.initialize``'s own defaults."""
    import jax

    params = inspect.signature(jax.distributed.initialize).parameters
    init = dist.init_timeout_s or params["initialization_timeout"].default
    heartbeat = dist.heartbeat_timeout_s or params["heartbeat_timeout_seconds"].default
    return int(init), int(heartbeat)


def _ranges(ids) -> str:
    """[1, 2, 3, 7] -> '1-3, 7'."""
    out: list[str] = []
    for i in sorted(ids):
        if out and out[-1].split("-")[-1] == str(i - 1):
            out[-1] = f"{out[-1].split('-')[0]}-{i}"
        else:
            out.append(str(i))
    return ", ".join(out)


_HELLO = "jaxtrain-join 1"  # the roll call's greeting and protocol version


def _listen(bind: str) -> socket.socket:
    host, _, port = bind.rpartition(":")
    host = host.strip("[]")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        sock = socket.socket(family, socket.SOCK_STREAM)
    except OSError:  # no IPv6 on this host: every IPv4 interface instead of [::]
        family, host = socket.AF_INET, ("0.0.0.0" if host == "::" else host)
        sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if family == socket.AF_INET6:
        sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)  # [::] takes IPv4 peers too, as gRPC's does
    sock.bind((host, int(port)))
    sock.listen(128)
    return sock


def _read_line(conn: socket.socket, timeout_s: float) -> str:
    conn.settimeout(timeout_s)
    data = b""
    while not data.endswith(b"\n") and len(data) < 4096:
        chunk = conn.recv(4096)
        if not chunk:
            break
        data += chunk
    return data.decode(errors="replace").strip()


def _roll_call_host(settings: Settings, timeout_s: int) -> None:
    """Process 0: wait on the coordinator's port until every worker has reported, then answer all and free the
    port for JAX's service. At the deadline: DistributedError naming the processes that never reported."""
    assert settings.bind_address is not None
    n, joined = settings.num_processes, {0: socket.gethostname()}
    conns: list[socket.socket] = []  # every worker's connection, answered together
    problem = None
    deadline = time.monotonic() + timeout_s
    with _listen(settings.bind_address) as server:
        while len(joined) < n and problem is None and time.monotonic() < deadline:
            server.settimeout(max(0.1, deadline - time.monotonic()))
            try:
                conn, _ = server.accept()
            except TimeoutError:
                break
            try:
                words = _read_line(conn, 5).split()
            except OSError:
                words = []
            if words[:2] != _HELLO.split() or len(words) != 5 or not (words[2] + words[3]).isdigit():
                conn.close()  # not a jaxtrain process (a port scan, a health probe): ignore it
                continue
            their_n, i, host = int(words[2]), int(words[3]), words[4]
            if their_n != n:
                problem = (f"process {i} on {host} says the job has {their_n} processes, process 0 on "
                           f"{joined[0]} says {n}: start every process with the same count")
            elif i in joined:
                problem = f"process id {i} was claimed twice, by {joined[i]} and by {host}: ids must be distinct"
            elif not 0 < i < n:
                problem = f"process {host} claims id {i}, outside 1..{n - 1}"
            conns.append(conn)
            joined.setdefault(i, host)
        if problem is None and len(joined) < n:
            missing = sorted(set(range(n)) - set(joined))
            problem = (f"process(es) {_ranges(missing)} of {n} never joined the job at {settings.coordinator} within "
                       f"dist.init_timeout_s={timeout_s} s (joined: {_ranges(joined)}); are they started, with the "
                       "same coordinator address, and can they reach it?")
        for conn in conns:
            try:
                conn.sendall(("go\n" if problem is None else f"abort {problem}\n").encode())
            except OSError:
                pass  # a worker that left: it fails on its own
            conn.close()
    if problem is not None:
        raise DistributedError(problem)


def _roll_call_worker(settings: Settings, timeout_s: int) -> None:
    """A worker: report to process 0 (retrying until it listens), then wait for its answer: go, or why not."""
    assert settings.coordinator is not None  # several processes always have one
    host, _, port = settings.coordinator.rpartition(":")
    tag = f"process {settings.process_id} of {settings.num_processes}"
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            conn = socket.create_connection((host.strip("[]"), int(port)), timeout=2)
            break
        except OSError as e:
            if time.monotonic() > deadline:
                raise DistributedError(
                    f"{tag} could not reach the coordinator {settings.coordinator} within dist.init_timeout_s="
                    f"{timeout_s} s ({e.strerror or e}); is process 0 running, and is the address right?") from None
            time.sleep(0.5)
    with conn:
        try:
            conn.sendall(f"{_HELLO} {settings.num_processes} {settings.process_id} {socket.gethostname()}\n".encode())
            # Process 0 answers by its own deadline, at most timeout_s after it began listening (before we connected).
            answer = _read_line(conn, timeout_s + 10)
        except OSError as e:
            raise DistributedError(f"{tag}: the coordinator {settings.coordinator} did not answer ({e})") from None
    if answer == "go":
        return
    if answer.startswith("abort "):
        raise DistributedError(answer[len("abort "):])
    raise DistributedError(f"{tag}: {settings.coordinator} is not a jaxtrain coordinator, or process 0 ended "
                           f"before the job formed (answer {answer[:80]!r})")


def initialize(dist: DistConfig, settings: Settings) -> None:
    """Join (or form) the job's process group, then check the devices it got.

    Raises DistributedError if peers do not arrive in time (naming them), ConfigError if this process's GPUs are not
    the ones ``settings.local_device_ids`` asked for.
    """
    import jax

    if jax.distributed.is_initialized():
        return
    if settings.num_processes == 1:
        # No process group: nothing listens, and CPU collectives stay in-process (not gloo; see the docstring).
        if settings.local_device_ids is not None:
            jax.config.update("jax_cuda_visible_devices", ",".join(map(str, settings.local_device_ids)))
        verify_devices(settings)
        return
    init_s, heartbeat_s = jax_timeouts(dist)
    print(f"[process {settings.process_id}/{settings.num_processes}] joining the job at {settings.coordinator}; "
          f"all {settings.num_processes} processes must join within dist.init_timeout_s={init_s} s",
          file=sys.stderr, flush=True)
    if settings.process_id == 0:
        _roll_call_host(settings, init_s)
    else:
        _roll_call_worker(settings, init_s)
    # CPU devices of different processes talk through gloo (no effect on GPU backends, which use NCCL).
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    try:
        jax.distributed.initialize(
            coordinator_address=settings.coordinator, num_processes=settings.num_processes,
            process_id=settings.process_id,
            local_device_ids=None if settings.local_device_ids is None else list(settings.local_device_ids),
            cluster_detection_method="deactivate",  # every value is resolved above; JAX must not override any
            coordinator_bind_address=settings.bind_address,
            initialization_timeout=init_s, heartbeat_timeout_seconds=heartbeat_s)
    except Exception as e:  # JAX raises various errors here; all mean the group did not form
        raise DistributedError(f"process {settings.process_id} of {settings.num_processes} could not join the job "
                               f"at {settings.coordinator} within dist.init_timeout_s={init_s} s (are "
                               f"all processes started, with the same coordinator?): "
                               f"{one_line(e, 200)}") from None
    verify_devices(settings)


def verify_devices(settings: Settings, expected_kind: str | None = None) -> None:
    """After initialisation: the GPUs this process and the job got are the ones asked for, or ConfigError (exit 2).

    Checks the local device count against ``local_device_ids``, the global count against processes x local count
    (both Slurm layouts give every process the same number), and, with ``expected_kind`` (the hardware file's
    device, e.g. "H100"), that every device's kind contains it. No-op on CPU devices, which ignore the ids.
    """
    import jax

    local = jax.local_devices()
    if local[0].platform == "cpu":
        return
    tag = f"process {jax.process_index()} on {socket.gethostname()}"
    if settings.local_device_ids is not None and len(local) != len(settings.local_device_ids):
        raise ConfigError(f"{tag} has {len(local)} {local[0].platform} device(s) but local_device_ids="
                          f"{list(settings.local_device_ids)} ({settings.sources['local_device_ids']}) asked for "
                          f"{len(settings.local_device_ids)}")
    if jax.device_count() != len(local) * jax.process_count():
        raise ConfigError(f"the job has {jax.device_count()} devices but {jax.process_count()} processes x "
                          f"{len(local)} local devices = {len(local) * jax.process_count()}: the processes see "
                          "different numbers of GPUs; check the Slurm GPU request (--gpus-per-node) per node")
    if expected_kind:
        wrong = sorted({d.device_kind for d in jax.devices() if expected_kind.lower() not in d.device_kind.lower()})
        if wrong:
            raise ConfigError(f"the hardware file describes {expected_kind} but the job has {', '.join(wrong)} "
                              "devices; pick the hardware file of these GPUs")
