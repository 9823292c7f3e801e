"""``python -m jaxtrain env [--config PATH] [key=value ...] [--json]``: what ``jax.distributed`` would be given, and
whether the node's NVIDIA driver runs the installed JAX CUDA plugin (``jaxtrain.cluster.gpu_env``)."""

import json
import os
import socket

from jaxtrain.commands import add_config_arguments


def add_arguments(p):
    p.description = ("Print what this process would pass to jax.distributed.initialize (coordinator, process count "
                     "and id, local device ids, platform, coordinator bind address) and where each value came from "
                     "(config, environment, Slurm), without starting JAX. Run it inside the job (e.g. `srun python "
                     "-m jaxtrain env`) when a job sees the wrong devices. It also prints the NVIDIA driver's "
                     "release and CUDA version, the installed JAX CUDA plugin and one line saying whether they fit "
                     "(and what to install when not), which of jaxtrain's packages are missing (the other "
                     "commands refuse to start without them) or installed in other versions, and the NCCL transport "
                     "(IB, EFA, sockets) the last `jaxtrain check` on this node read from NCCL's INIT/NET lines "
                     "(not applicable without GPUs), with the node's RDMA devices, /dev/infiniband and net plugins.")
    add_config_arguments(p)
    p.add_argument("--json", action="store_true", help="one JSON object (keys: coordinator, num_processes, "
                   "process_id, local_device_ids, platform, coordinator_bind_address, sources, host, "
                   "cuda_visible_devices, driver_release, driver_cuda, driver_source, jax, cuda_plugins, gpu_fits, "
                   "gpu_verdict, missing_packages, other_versions, nccl_transport, nccl_transport_words, "
                   "nccl_log, rdma_devices, dev_infiniband, nccl_net_plugins)")


def run(args) -> int:
    from jaxtrain.cluster import distributed, gpu_env
    from jaxtrain.config import load_config

    cfg = load_config(args.config, args.overrides)
    settings = distributed.resolve(cfg.dist)
    out = settings.as_dict() | {"host": socket.gethostname(),
                                "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES")}
    gpu = gpu_env.report()
    out |= gpu
    from jaxtrain.cluster import packages

    found = packages.check()
    out |= {"missing_packages": [r.text for r in found.missing],
            "other_versions": {r.name: f"{version} (needs {r.specifier})" for r, version in found.other_versions}}
    from jaxtrain.cluster.links import node_name
    from jaxtrain.health import fabric

    gpu_job = bool(gpu["cuda_plugins"]) and bool(gpu["driver_release"]) and out["platform"] != "cpu"
    out |= fabric.env_report(cfg.run.dir, node_name(), gpu_job, fabric.probe())
    if args.json:
        print(json.dumps(out, sort_keys=True))
        return 0
    ids = out["local_device_ids"]
    rows = [("host", out["host"], "socket.gethostname()"),
            ("CUDA_VISIBLE_DEVICES", out["cuda_visible_devices"] or "(unset)", "environment")]
    rows += [(key, "every visible device" if key == "local_device_ids" and ids is None else
              ",".join(map(str, ids)) if key == "local_device_ids" else
              "none" if key == "coordinator" and out[key] is None else
              "JAX default" if out[key] is None else out[key], settings.sources[key])
             for key in ("coordinator", "num_processes", "process_id", "local_device_ids", "platform",
                         "coordinator_bind_address")]
    plugins = ", ".join(f"{name} {version}" for name, version in gpu["cuda_plugins"].items())
    rows += [("NVIDIA driver", gpu["driver_release"] or "-", gpu["driver_source"]),
             ("driver CUDA version", gpu["driver_cuda"] or "-", gpu["driver_source"]),
             ("JAX CUDA plugin", plugins or "none", f"installed packages, jax {gpu['jax']}")]
    width = max(len(r[0]) for r in rows)
    value_width = max(len(str(r[1])) for r in rows)
    for key, value, source in rows:
        print(f"{key:<{width}}  {str(value):<{value_width}}  ({source})")
    print(("GPU: " if gpu["gpu_fits"] else "GPU MISMATCH: ") + gpu["gpu_verdict"])
    print(packages.missing_message(found) if found.missing else "packages: every one jaxtrain needs is installed")
    if found.other_versions:
        print(packages.versions_message(found))
    rdma = ", ".join(out["rdma_devices"]) or "none in /sys/class/infiniband"
    print(f"NCCL transport: {out['nccl_transport_words']}; RDMA devices: {rdma}; /dev/infiniband: "
          f"{'present' if out['dev_infiniband'] else 'no uverbs'}; NCCL net plugins: "
          f"{', '.join(out['nccl_net_plugins']) or 'none'}")
    return 0
