"""``python -m jaxtrain plan [--config PATH] [key=value ...] [--hardware NAME] [--nodes N[,N...]] [--json | --wide]
[--tokens T [--gpu-hour-cost P]] [--write-bandwidth GB/s] [--save-share F]``."""

import argparse
import json
import math

from jaxtrain.commands import add_config_arguments


def add_arguments(p):
    p.description = (
        "Compile the train step ahead of time for each candidate mesh (abstract shapes, nothing allocated) and "
        "report memory per device, the collectives and their bytes, and an estimated step time; meshes that fit "
        "first, then fastest first. Mesh overrides on the command line (mesh.ici.* / mesh.dcn.*) plan that one mesh; "
        "otherwise every valid factorisation of the devices over data, stage, fsdp and tensor (tensor within a node; "
        "pipeline stages only with train.microbatches a multiple of them).")
    p.add_argument("--hardware", help="plan for this hardware (a shipped name: a100-8x, b200-8x, h100-8x, h200-8x; "
                                      "or a .yaml path) on emulated CPU devices; default: the devices at hand (on "
                                      "CPU, measured rates)")
    p.add_argument("--nodes", type=node_counts, default=[1],
                   help="number of nodes (default 1); with --hardware the device count is nodes x devices per node. "
                        "Several, comma-separated (4,8,16,32), with --tokens: the plan for each and the days and cost "
                        "of the token budget across them")
    p.add_argument("--tokens", type=_positive("--tokens"), help="token budget (e.g. 2e12): print, per candidate and "
                                                                "node count, the days to train it and the scaling "
                                                                "efficiency from node count to node count")
    p.add_argument("--gpu-hour-cost", type=_positive("--gpu-hour-cost", zero=True),
                   help="price per device-hour (with --tokens): adds the cost of the budget")
    p.add_argument("--efficiency", type=float, help="fraction of peak FLOP/s the compute reaches (default: the "
                                                    "hardware file's compute_efficiency)")
    p.add_argument("--mem-fraction", type=float, help="fraction of HBM a step may use (default: "
                                                      "XLA_PYTHON_CLIENT_MEM_FRACTION, else JAX's 0.75)")
    p.add_argument("--calibration", help="what `jaxtrain check` measured (its run.dir/calibration.json): those "
                                         "figures replace the hardware file's (default: run.dir's, if any)")
    p.add_argument("--write-bandwidth", type=_positive("--write-bandwidth"), metavar="GB/S",
                   help="the rate one host writes a checkpoint at, in GB/s (decimal; on a shared file system its "
                        "aggregate divided by the hosts writing at once): adds each layout's save time, slowest host, "
                        "and a warning where it exceeds --save-share of the interval between saves (checkpoint.every "
                        "x the step). E.g. 1.68, one local disk as measured (docs/checkpoints.md#where-checkpoints-"
                        "live-on-a-cluster); default: sizes only")
    p.add_argument("--save-share", type=_share, default=None, metavar="F",
                   help="the share of the checkpoint interval a save may take before the plan warns (with "
                        "--write-bandwidth; default 0.1): a save still writing when the next is due blocks training")
    p.add_argument("--json", action="store_true", help="print JSON (every figure, per collective) instead of the table")
    p.add_argument("--wide", action="store_true", help="add memory and per-kind collective columns to the table")
    add_config_arguments(p)


def node_counts(text: str) -> list[int]:
    """``--nodes`` "4,8,16,32" -> [4, 8, 16, 32] (ascending, each once); argparse's one-line error otherwise."""
    try:
        counts = sorted({int(part) for part in text.split(",")})
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected node counts, e.g. 8 or 4,8,16") from None
    if counts[0] < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: node counts must be >= 1")
    return counts


def _positive(flag: str, zero: bool = False):
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not math.isfinite(value) or value < 0 or (value == 0 and not zero):
            raise argparse.ArgumentTypeError(f"{text!r}: expected a finite number {'>= 0' if zero else '> 0'}")
        return value

    return parse


def _share(text: str) -> float:
    """``--save-share``: a fraction in (0, 1]; argparse's one-line error otherwise."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a share of the checkpoint interval in (0, 1], e.g. 0.1")
    return value


def run(args) -> int:
    from jaxtrain import planner
    from jaxtrain.config import load_config
    from jaxtrain.errors import ConfigError

    if args.gpu_hour_cost is not None and args.tokens is None:
        raise ConfigError("--gpu-hour-cost needs --tokens (the token budget it prices)")
    if len(args.nodes) > 1 and args.tokens is None:
        raise ConfigError(f"--nodes {','.join(map(str, args.nodes))}: several node counts need --tokens (the days and "
                          "cost across them); plan one node count at a time otherwise")
    if args.tokens is not None and args.wide:
        raise ConfigError("--wide does not apply with --tokens (the budget table); --json has every figure")
    if args.save_share is not None and args.write_bandwidth is None:
        raise ConfigError(f"--save-share {args.save_share:g} needs --write-bandwidth (the rate the save time is "
                          "figured at)")
    cfg = load_config(args.config, args.overrides, num_devices=_device_count(args))
    if args.tokens is not None:
        return _budget(cfg, args)
    if cfg.mesh.auto:  # the layout train would choose (docs/auto-layout.md): mesh.auto's own report
        if args.write_bandwidth is not None:
            raise ConfigError("--write-bandwidth does not apply with mesh.auto (its report is the choice); plan the "
                              "chosen mesh with mesh.auto=false and its mesh.ici.* / mesh.dcn.* sizes")
        return planner.main(cfg, args.overrides, hardware_name=args.hardware, nodes=args.nodes[0],
                            efficiency=args.efficiency, mem_fraction=args.mem_fraction, as_json=args.json,
                            calibration_path=args.calibration)
    return _single(cfg, args)


def _device_count(args):
    """The devices a planned mesh must cover, where the command line fixes them before JAX starts: --hardware x one
    --nodes, else the CPU's (``runtime.cpu_devices`` x processes). Only a mesh given on the command line is held to
    them; without one every mesh of the devices is planned."""
    from jaxtrain.cluster.distributed import cpu_device_count
    from jaxtrain.config import hardware
    from jaxtrain.planner.search.target import mesh_given

    def count(cfg) -> int | None:
        if not mesh_given(args.overrides):
            return None
        if args.hardware is None:
            return cpu_device_count(cfg)
        return hardware.load_hardware(args.hardware).devices_per_node * args.nodes[0] if len(args.nodes) == 1 else None

    return count


def _storage(args):
    from jaxtrain.planner import storage

    return storage.Storage(None if args.write_bandwidth is None else args.write_bandwidth * storage.GB,
                           storage.DEFAULT_SAVE_SHARE if args.save_share is None else args.save_share)


def _plans(cfg, args, node_counts: list[int], pool: int | None) -> list:
    """[(target, plan result)] per node count: targets resolved first (a mistake in any answers before a compile),
    the measured figures applied, each planned, and each candidate's checkpoint size and save time added
    (planner/storage.py)."""
    import os

    from jaxtrain.cluster import process as runtime
    from jaxtrain.planner import apply_calibration, gpu_compiler, log, storage
    from jaxtrain.planner.search import meshes as search
    from jaxtrain.planner.search import target as target_lib

    targets = [target_lib.resolve(cfg, args.overrides, hardware_name=args.hardware, nodes=n,
                                  efficiency=args.efficiency, mem_fraction=args.mem_fraction, device_pool=pool)
               for n in node_counts]
    runtime.quiet_logs()
    for t in targets:  # measured figures (check's calibration file) replace the hardware file's
        apply_calibration(t, args.hardware is not None, args.calibration)
    # Orbax's replica-parallel writing: off on GPUs run by jaxtrain's launchers (JAX_PLATFORMS=cuda); for the
    # devices at hand, as this environment sets it.
    replica_parallel = False if args.hardware else storage.orbax_replica_parallel(os.environ.get("JAX_PLATFORMS", ""))
    plans = []
    for t in targets:
        gpu = gpu_compiler(t, cfg) if args.hardware else None
        log(f"planning {len(t.shapes)} mesh(es) over {t.n_devices} device(s) on {t.nodes} node(s) for {t.hw.name}"
            + (" (each compiled by XLA:CPU and by XLA:GPU)" if gpu else ""))
        result = search.plan(t.cfg, t.shapes, t.hw, t.devices, progress=log, gpu=gpu, attention=t.attention)
        storage.for_plan(t.cfg, result["candidates"], t.devices, _storage(args), replica_parallel)
        plans.append((t, result))
    return plans


def _single(cfg, args) -> int:
    """``plan`` of one node count: the ranked table (or JSON) of its meshes, with their checkpoints."""
    from jaxtrain.planner.search import report

    [(t, result)] = _plans(cfg, args, args.nodes, None)
    if args.json:
        print(json.dumps(report.to_json(t.hw, t.n_devices, t.nodes, result, t.notes), indent=1))
    else:
        print(report.format_report(t.cfg, t.hw, t.n_devices, t.nodes, result, wide=args.wide, notes=t.notes))
    return 0


def _budget(cfg, args) -> int:
    """``plan --tokens``: plan each node count, then one table of days and cost per candidate and node count."""
    from jaxtrain.config import hardware
    from jaxtrain.planner.search import report

    pool = hardware.load_hardware(args.hardware).devices_per_node * args.nodes[-1] if args.hardware else None
    plans = _plans(cfg, args, args.nodes, pool)
    targets = [t for t, _ in plans]
    first = targets[0]
    tokens_per_step = first.cfg.train.global_batch * first.cfg.data.seq_len
    rows = report.budget_rows([(t.nodes, t.n_devices, result) for t, result in plans], args.tokens,
                              tokens_per_step, args.gpu_hour_cost)
    if args.json:
        print(json.dumps({"tokens": args.tokens, "gpu_hour_cost": args.gpu_hour_cost, "budget": rows,
                          "plans": [report.to_json(t.hw, t.n_devices, t.nodes, result, t.notes)
                                    for t, result in plans]}, indent=1))
    else:
        print(report.format_budget(first.cfg, first.hw, args.tokens, args.gpu_hour_cost, rows))
        for note in dict.fromkeys(n for t in targets for n in t.notes):  # each once, in order
            print(f"note: {note}")
        for line in (w for _, result in plans for w in report.checkpoint_warnings(result["candidates"])):
            print(line)
    return 0
