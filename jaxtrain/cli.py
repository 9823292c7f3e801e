"""Command line: ``python -m jaxtrain COMMAND ...``.

Each subcommand is a module with ``add_arguments(parser)`` and ``run(args) -> int``, imported only when chosen, so
that ``--help`` and config mistakes answer before JAX starts. Expected failures (``jaxtrain.errors``) end with one line
on stderr and their exit status (a user mistake: 2, before anything is written; a failed checkpoint write: 1).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import sys
import traceback

from jaxtrain.cluster import packages
from jaxtrain.errors import EXIT_STATUS, CheckpointError, ConfigError, one_line

# name -> (module, one-line help)
COMMANDS = {
    "train": ("jaxtrain.commands.train", "train a model (defaults: the tiny model on the embedded corpus)"),
    "prepare": ("jaxtrain.commands.prepare", "tokenise .txt, .jsonl, .parquet text into token shards for data.source"),
    "check": ("jaxtrain.commands.check", "health check: per-device matmul and collective bandwidth per mesh axis"),
    "plan": ("jaxtrain.commands.plan", "compile the step for candidate meshes; memory, collectives, est. step time"),
    "sweep": ("jaxtrain.commands.sweep", "short real runs over meshes from an experiment file, vs the plan"),
    "env": ("jaxtrain.commands.env", "what jax.distributed would get here (coordinator, process id, GPUs), from where"),
    "convert": ("jaxtrain.commands.convert",
                "Hugging Face checkpoints in (from-hf) and out (to-hf): Llama, Mistral, Qwen2/2.5, Qwen3, Mixtral"),
    "generate": ("jaxtrain.commands.generate", "generate text from a checkpoint (KV-cached, greedy or sampled)"),
}


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, not argparse's usage block
        print(f"error: {message} (see {self.prog} --help)", file=sys.stderr)
        raise SystemExit(2)


def main(argv: list[str] | None = None) -> int:
    with ipython_probe_skipped():
        return _main(argv)


@contextlib.contextmanager
def ipython_probe_skipped():
    """Flax imports IPython (when installed) only to ask whether it runs inside it, for colours in reprs: 0.3-1 s of
    start-up here (benchmarks/startup.py). A command run from the shell never does (IPython would be imported
    already), so while it runs ``import IPython`` fails fast (None in sys.modules), as if IPython were absent."""
    if "IPython" in sys.modules:
        yield
        return
    sys.modules["IPython"] = None
    try:
        yield
    finally:
        if "IPython" in sys.modules and sys.modules["IPython"] is None:
            del sys.modules["IPython"]


def _main(argv: list[str] | None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = _Parser(prog="python -m jaxtrain", description="Train sharded Flax transformers on JAX.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True
    chosen = argv[0] if argv and argv[0] in COMMANDS else None
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if name == chosen:
            importlib.import_module(module).add_arguments(p)
        else:  # only the chosen command's module is imported; others accept anything until chosen
            p.add_argument("rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    args = _parse(parser, argv)
    try:
        if args.command not in packages.COMMANDS_WITHOUT_CHECK:
            packages.require_runtime()  # every missing package named at once, before JAX or any of them is imported
        return importlib.import_module(COMMANDS[args.command][0]).run(args)
    except Exception as e:
        status = next((code for kind, code in EXIT_STATUS.items() if isinstance(e, kind)), None)
        if status is None:
            # A bug or a runtime failure (e.g. a lost peer): the traceback matters, and so does which process.
            traceback.print_exc()
            print(f"error: {_tag()}{type(e).__name__}: {one_line(e, 500)}", file=sys.stderr)
            return 1
        print(f"error: {_tag()}{e}", file=sys.stderr)
        if isinstance(e, CheckpointError) or (isinstance(e, ConfigError) and "orbax.checkpoint" in sys.modules):
            # Orbax's background threads would print asyncio tracebacks while the interpreter shuts down (a mistake
            # found after Orbax started, e.g. a damaged checkpoint named by checkpoint.resume), or wait minutes for
            # a peer's signal that a failed write never sends: stop now. Nothing of a refused run was written, and
            # earlier checkpoints of a failed one are complete on disk.
            _exit_now(status)
        return status


def _parse(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """``parser.parse_args(argv)``, except that ``key=value`` overrides may stand anywhere on the line: argparse
    gives a ``nargs="*"`` positional only the run of words before the first option, so ``convert from-hf SRC --out
    DIR key=value`` (the documented order) would leave ``key=value`` unrecognised. Those after an option join the
    others, in order (a later value of a key wins, as it does between the words of one run)."""
    args, extra = parser.parse_known_args(argv)
    if extra:
        misplaced = [a for a in extra if "=" in a and not a.startswith("-")]
        if not hasattr(args, "overrides") or len(misplaced) < len(extra):
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        args.overrides = [*args.overrides, *misplaced]
    return args


def _exit_now(code: int) -> None:
    """Exit without joining background threads or running exit handlers (output flushed first)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _tag() -> str:
    from jaxtrain.log import process_tag

    return process_tag()
