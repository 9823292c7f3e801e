"""One module per ``python -m jaxtrain`` subcommand: ``add_arguments(parser)`` and ``run(args) -> int``."""
