"""``python -m jaxtrain sweep --config EXPERIMENT.yaml [--dir DIR] [key=value ...]``."""


def add_arguments(p):
    p.description = (
        "Train briefly once per mesh (or other overrides) listed in an experiment file, each run in its own process "
        "so that a failing shape is recorded and the sweep goes on; compare with the planner's prediction. Writes "
        "sweep.csv, sweep.md and sweep.png into the experiment's directory. Overrides given here apply to every run.")
    p.add_argument("--config", required=True, help="experiment file, e.g. configs/experiments/cpu8-tiny.yaml, or "
                                                   "a shipped name (cpu8-tiny)")
    p.add_argument("--dir", help="the sweep's directory (default: the experiment file's 'dir')")
    p.add_argument("--no-predict", action="store_true", help="skip the planner's predictions (measure only)")
    p.add_argument("overrides", nargs="*", metavar="key=value")


def run(args) -> int:
    from jaxtrain.sweep.spec import load_experiment

    exp = load_experiment(args.config, args.overrides, args.dir)
    from jaxtrain.cluster import process as runtime
    from jaxtrain.sweep.run import sweep

    runtime.quiet_logs()
    records, paths = sweep(exp, predict=not args.no_predict)
    failed = [r.name for r in records if r.status != "ok"]
    print(f"sweep {exp.name}: {len(records) - len(failed)} of {len(records)} run(s) ok"
          + (f", failed: {', '.join(failed)}" if failed else ""))
    for kind in ("csv", "md", "png"):
        if paths.get(kind):
            print(f"wrote {paths[kind]}")
    return 1 if records and len(failed) == len(records) else 0
