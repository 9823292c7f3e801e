"""``python -m jaxtrain plan [--config PATH] [key=value ...] [--hardware NAME] [--nodes N] [--json]``."""

import dataclasses
import json
import os
from jaxtrain.commands import add_config_arguments


def add_arguments(p):
    p.description = (
        "Compile the train step ahead of time for each candidate mesh (abstract shapes, nothing allocated) and "
        "report memory per device, the collectives and their bytes, and an estimated step time, fastest first. "
        "Mesh overrides on the command line (mesh.ici.* / mesh.dcn.*) plan that one mesh; otherwise every valid "
        "factorisation of the devices over data, fsdp and tensor (tensor within a node) is planned.")
    p.add_argument("--hardware", help="plan for this hardware (configs/hardware/NAME.yaml, or a .yaml path) on "
                                      "emulated CPU devices; default: the devices at hand (on CPU, measured rates)")
    p.add_argument("--nodes", type=int, help="number of nodes (default 1); with --hardware the device count is "
                                             "nodes x devices per node")
    p.add_argument("--efficiency", type=float, help="fraction of peak FLOP/s the compute reaches (default: the "
                                                    "hardware file's compute_efficiency)")
    p.add_argument("--mem-fraction", type=float, help="fraction of HBM a step may use (default: "
                                                      "XLA_PYTHON_CLIENT_MEM_FRACTION, else JAX's 0.75)")
    p.add_argument("--json", action="store_true", help="print JSON instead of the table")
    add_config_arguments(p)


def mesh_given(overrides: list[str]) -> bool:
    """Whether the command line sets a mesh size (then only that mesh is planned)."""
    return any(o.partition("=")[0].strip().startswith(("mesh.ici.", "mesh.dcn.")) for o in overrides)


def run(args) -> int:
    from jaxtrain.config import ConfigError, load_config, resolved_cpu_devices

    cfg = load_config(args.config, args.overrides)
    nodes = 1 if args.nodes is None else args.nodes
    if nodes < 1:
        raise ConfigError(f"--nodes={nodes} must be >= 1")
    for name in ("efficiency", "mem_fraction"):
        value = getattr(args, name)
        if value is not None and not 0 < value <= 1:
            raise ConfigError(f"--{name.replace('_', '-')}={value} must be in (0, 1]")

    from jaxtrain import plan

    hw = None
    if args.hardware:
        hw = plan.load_hardware(args.hardware)  # before JAX starts: a bad name answers at once
        n_devices = hw.devices_per_node * nodes
        if cfg.runtime.cpu_devices not in (None, n_devices):
            raise ConfigError(f"runtime.cpu_devices={cfg.runtime.cpu_devices} contradicts --hardware {args.hardware} "
                              f"--nodes {nodes} ({n_devices} devices); drop it")
        hw = dataclasses.replace(hw, mem_fraction=args.mem_fraction or plan.gpu_mem_fraction())
        cfg = _as_on_gpu(cfg)
        shapes = _shapes(plan, cfg, args.overrides, n_devices, nodes)

    if hw is not None:
        # Nothing compiled here ever runs, so skip LLVM's optimisations of the CPU code: about a third of the compile
        # time, and the HLO (collectives) and buffer assignment (memory) do not depend on it. Not for the devices
        # at hand: their rates are measured by running code.
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0"
                                   " --xla_llvm_disable_expensive_passes=true").strip()
    import jax

    from jaxtrain import runtime

    runtime.quiet_logs()
    if hw is not None:
        jax.config.update("jax_num_cpu_devices", n_devices)
        devices = jax.devices("cpu")[:n_devices]
    else:
        jax.config.update("jax_num_cpu_devices", resolved_cpu_devices(cfg))
        devices = jax.devices()
        n_devices = len(devices)
        if nodes == 1 and jax.process_count() > 1:
            nodes = jax.process_count()
        shapes = _shapes(plan, cfg, args.overrides, n_devices, nodes)
        hw = _hardware_at_hand(plan, devices, args.mem_fraction)
    if args.efficiency:
        hw = dataclasses.replace(hw, compute_efficiency=args.efficiency)

    plan.log(f"planning {len(shapes)} mesh(es) over {n_devices} device(s) on {nodes} node(s) for {hw.name}")
    result = plan.plan(cfg, shapes, hw, devices, progress=plan.log)
    if args.json:
        print(json.dumps({"hardware": plan.hardware_dict(hw), "devices": n_devices, "nodes": nodes, **result},
                         indent=1))
    else:
        print(plan.format_report(cfg, hw, n_devices, nodes, result))
    return 0


def _as_on_gpu(cfg):
    """The config with "auto" choices resolved as on the GPU, not as on the CPU that compiles the plan.

    dtype auto -> bfloat16. attention auto -> cuDNN's fused kernel on GPU, which the CPU cannot compile; its stand-in
    is jaxtrain's Pallas flash kernel (interpreted on CPU), whose memory, like cuDNN's, grows with the sequence,
    not its square as the XLA reference's scores do. Collectives are the same either way.
    """
    from jaxtrain.config import ConfigError, validate

    model = cfg.model
    if model.dtype == "auto":
        model = dataclasses.replace(model, dtype="bfloat16")
    if model.attention == "auto":
        model = dataclasses.replace(model, attention="pallas")
        try:
            validate(dataclasses.replace(cfg, model=model))
        except ConfigError:  # e.g. a head dim the flash kernel does not take: auto would be XLA's reference too
            model = dataclasses.replace(model, attention="xla")
    return dataclasses.replace(cfg, model=model)


def _shapes(plan, cfg, overrides, n_devices, nodes):
    if mesh_given(overrides):
        return [plan.given_shape(cfg, n_devices, nodes)]
    return plan.enumerate_shapes(cfg, n_devices, nodes)


def _hardware_at_hand(plan, devices, mem_fraction):
    """CPU: measured. Accelerators: the shipped description whose device_kind matches, with the real memory."""
    from jaxtrain.config import ConfigError

    dev = devices[0]
    if dev.platform == "cpu":
        return plan.measure_cpu(devices)
    for name in plan.known_hardware():
        hw = plan.load_hardware(name)
        if hw.device_kind and hw.device_kind.lower() in dev.device_kind.lower():
            stats = dev.memory_stats() or {}
            if "bytes_limit" in stats:  # the allocator's pool, already net of the memory fraction
                return dataclasses.replace(hw, hbm_bytes=float(stats["bytes_limit"]), mem_fraction=mem_fraction or 1.0)
            return dataclasses.replace(hw, mem_fraction=mem_fraction or plan.gpu_mem_fraction())
    raise ConfigError(f"no hardware description matches device kind {dev.device_kind!r}; pass --hardware "
                      f"({', '.join(plan.known_hardware())})")
