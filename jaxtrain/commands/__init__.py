"""One module per ``python -m jaxtrain`` subcommand: ``add_arguments(parser)`` and ``run(args) -> int``."""


def add_config_arguments(p, default: str = "the built-in tiny config, = configs/tiny.yaml"):
    """``--config PATH`` and ``key=value`` overrides, as every config-driven command takes them."""
    p.add_argument("--config", help=f"YAML config file (default: {default})")
    p.add_argument("overrides", nargs="*", metavar="key=value")
