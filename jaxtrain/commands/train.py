"""``python -m jaxtrain train [--config PATH] [key=value ...]``."""

from jaxtrain.commands import add_config_arguments, start


def add_arguments(p):
    p.description = ("Train a model. Overrides are dotted key=value pairs, e.g. train.steps=100 mesh.ici.fsdp=8 "
                     "runtime.cpu_devices=8. Running the same command again resumes from the latest checkpoint.")
    add_config_arguments(p)


def run(args) -> int:
    cfg = start(args)
    from jaxtrain import loop

    loop.train(cfg)
    return 0
