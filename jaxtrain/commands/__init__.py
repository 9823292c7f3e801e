"""The command line's subcommands, one module each (``python -m jaxtrain <name>``): ``add_arguments(parser)`` and
``run(args) -> int``. A command parses its arguments, loads the config and calls into the packages that do the work;
it holds no logic of its own beyond that wiring, and imports what it needs inside ``run`` so that ``--help`` and a
bad argument answer before JAX starts.

May import: any package of jaxtrain (commands sit at the top; nothing imports them but ``jaxtrain.cli``).
"""


def add_config_arguments(p, default: str = "the built-in tiny config, = configs/tiny.yaml"):
    """``--config PATH`` and ``key=value`` overrides, as every config-driven command takes them."""
    p.add_argument("--config", help=f"YAML config file (default: {default})")
    p.add_argument("overrides", nargs="*", metavar="key=value")


def start(args):
    """The validated config of a config-driven command, with JAX configured for it (devices, processes)."""
    from jaxtrain.cluster.distributed import cpu_device_count  # no JAX: the environment, the installed plugins
    from jaxtrain.config import load_config

    cfg = load_config(args.config, args.overrides, num_devices=cpu_device_count)
    from jaxtrain.cluster import process as runtime  # JAX starts only once the config is known to be good

    runtime.quiet_logs()
    runtime.configure(cfg)
    return cfg
