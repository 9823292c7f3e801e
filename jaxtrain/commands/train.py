"""``python -m jaxtrain train [--config PATH] [key=value ...]``."""

from jaxtrain.config import load_config
from jaxtrain.commands import add_config_arguments


def add_arguments(p):
    p.description = ("Train a model. Overrides are dotted key=value pairs, e.g. train.steps=100 mesh.ici.fsdp=8 "
                     "runtime.cpu_devices=8. Running the same command again resumes from the latest checkpoint.")
    add_config_arguments(p)


def run(args) -> int:
    cfg = load_config(args.config, args.overrides)
    from jaxtrain import runtime, train  # JAX starts only once the config is known to be good

    runtime.quiet_logs()
    runtime.configure(cfg)
    train.train(cfg)
    return 0
