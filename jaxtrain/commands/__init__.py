"""One module per ``python -m jaxtrain`` subcommand: ``add_arguments(parser)`` and ``run(args) -> int``."""


def add_config_arguments(p, default: str = "the built-in tiny config, = configs/tiny.yaml"):
    """``--config PATH`` and ``key=value`` overrides, as every config-driven command takes them."""
    p.add_argument("--config", help=f"YAML config file (default: {default})")
    p.add_argument("overrides", nargs="*", metavar="key=value")


def start(args):
    """The validated config of a config-driven command, with JAX configured for it (devices, processes)."""
    from jaxtrain.config import load_config

    cfg = load_config(args.config, args.overrides)
    from jaxtrain import runtime  # JAX starts only once the config is known to be good

    runtime.quiet_logs()
    runtime.configure(cfg)
    return cfg
