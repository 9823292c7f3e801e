"""``python -m jaxtrain plan [--config PATH] [key=value ...] [--hardware NAME] [--nodes N] [--json | --wide]``."""

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
    p.add_argument("--nodes", type=int, help="number of nodes (default 1); with --hardware the device count is "
                                             "nodes x devices per node")
    p.add_argument("--efficiency", type=float, help="fraction of peak FLOP/s the compute reaches (default: the "
                                                    "hardware file's compute_efficiency)")
    p.add_argument("--mem-fraction", type=float, help="fraction of HBM a step may use (default: "
                                                      "XLA_PYTHON_CLIENT_MEM_FRACTION, else JAX's 0.75)")
    p.add_argument("--calibration", help="what `jaxtrain check` measured (its run.dir/calibration.json): those "
                                         "figures replace the hardware file's (default: run.dir's, if any)")
    p.add_argument("--json", action="store_true", help="print JSON (every figure, per collective) instead of the table")
    p.add_argument("--wide", action="store_true", help="add memory and per-kind collective columns to the table")
    add_config_arguments(p)


def run(args) -> int:
    from jaxtrain import planner
    from jaxtrain.config import load_config

    cfg = load_config(args.config, args.overrides)
    return planner.main(cfg, args.overrides, hardware_name=args.hardware, nodes=args.nodes,
                        efficiency=args.efficiency, mem_fraction=args.mem_fraction, as_json=args.json, wide=args.wide,
                        calibration_path=args.calibration)
