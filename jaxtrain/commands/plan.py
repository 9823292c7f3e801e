"""``python -m jaxtrain plan [--config PATH] [key=value ...] [--hardware NAME] [--nodes N[,N...]] [--json | --wide]
[--tokens T [--gpu-hour-cost P]]``."""

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
    cfg = load_config(args.config, args.overrides, num_devices=_device_count(args))
    if args.tokens is not None:
        return _budget(cfg, args)
    return planner.main(cfg, args.overrides, hardware_name=args.hardware, nodes=args.nodes[0],
                        efficiency=args.efficiency, mem_fraction=args.mem_fraction, as_json=args.json, wide=args.wide,
                        calibration_path=args.calibration)


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


def _budget(cfg, args) -> int:
    """``plan --tokens``: plan each node count (targets resolved first, so that a mistake in any answers before a
    compile), then one table of days and cost per candidate and node count."""
    from jaxtrain.cluster import process as runtime
    from jaxtrain.config import hardware
    from jaxtrain.planner import log
    from jaxtrain.planner.search import meshes as search
    from jaxtrain.planner.search import report
    from jaxtrain.planner.search import target as target_lib

    pool = hardware.load_hardware(args.hardware).devices_per_node * args.nodes[-1] if args.hardware else None
    targets = [target_lib.resolve(cfg, args.overrides, hardware_name=args.hardware, nodes=n,
                                  efficiency=args.efficiency, mem_fraction=args.mem_fraction, device_pool=pool)
               for n in args.nodes]
    runtime.quiet_logs()
    from jaxtrain.planner.cost import calibration

    for t in targets:  # measured figures replace the hardware file's, as in a single plan
        cal = calibration.for_plan(t.hw, args.calibration, t.cfg.run.dir, t.cfg.model.dtype,
                                   calibration.Devices.of_hardware(t.hw, t.nodes) if args.hardware else
                                   calibration.Devices.at_hand(t.devices))
        t.hw = cal.hw
        t.notes.append(cal.note(f"the hardware file {t.hw.name}" if args.hardware else
                                "the devices at hand (measured by plan)"))
    plans = []
    for t in targets:
        gpu = None
        if args.hardware:  # the GPU's own compiler where it is installed (planner/xla_gpu/deviceless.py)
            from jaxtrain.planner.xla_gpu import deviceless as xla_gpu

            gpu, note = xla_gpu.for_plan(t.hw, t.nodes, cfg.model.attention)
            t.notes.append(note)
        log(f"planning {len(t.shapes)} mesh(es) over {t.n_devices} device(s) on {t.nodes} node(s) for {t.hw.name}")
        plans.append((t, search.plan(t.cfg, t.shapes, t.hw, t.devices, progress=log, gpu=gpu,
                                     attention=t.attention)))
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
    return 0
