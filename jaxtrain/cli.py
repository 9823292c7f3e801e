"""Command line: ``python -m jaxtrain COMMAND ...``.

Each subcommand is a module with ``add_arguments(parser)`` and ``run(args) -> int``, imported only when chosen, so
that ``--help`` and config mistakes answer before JAX starts. User mistakes (ConfigError) end with one line on
stderr and exit status 2, before anything is written; a failed checkpoint write exits 1.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import traceback

from jaxtrain.config import ConfigError

# name -> (module, one-line help)
COMMANDS = {
    "train": ("jaxtrain.commands.train", "train a model (defaults: the tiny model on the embedded corpus)"),
    "prepare": ("jaxtrain.commands.prepare", "tokenise text files into a token file for data.source"),
    "check": ("jaxtrain.commands.check", "health check: per-device matmul and collective bandwidth per mesh axis"),
    "plan": ("jaxtrain.commands.plan", "compile the step for candidate meshes; memory, collectives, est. step time"),
    "sweep": ("jaxtrain.commands.sweep", "short real runs over meshes from an experiment file, vs the plan"),
    "env": ("jaxtrain.commands.env", "what jax.distributed would get here (coordinator, process id, GPUs), from where"),
    "convert": ("jaxtrain.commands.convert", "Hugging Face Llama checkpoints in (from-hf) and out (to-hf)"),
    "generate": ("jaxtrain.commands.generate", "generate text from a checkpoint (KV-cached, greedy or sampled)"),
}


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, not argparse's usage block
        print(f"error: {message} (see {self.prog} --help)", file=sys.stderr)
        raise SystemExit(2)


def main(argv: list[str] | None = None) -> int:
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
    args = parser.parse_args(argv)
    try:
        return importlib.import_module(COMMANDS[args.command][0]).run(args)
    except ConfigError as e:
        print(f"error: {_tag()}{e}", file=sys.stderr)
        if "orbax.checkpoint" in sys.modules:
            # A mistake found after Orbax started (e.g. a damaged checkpoint named by checkpoint.resume): its
            # background threads would print asyncio tracebacks while the interpreter shuts down. Nothing of this run
            # was written, so there is nothing to finish: leave with the one line.
            _exit_now(2)
        return 2
    except Exception as e:
        from jaxtrain.checkpoint import CheckpointError
        from jaxtrain.distributed import DistributedError

        expected: tuple[type[BaseException], ...] = (CheckpointError, DistributedError)
        if "jaxtrain.train" in sys.modules:  # a run that cannot make progress (non-finite steps): one line, exit 1
            expected += (sys.modules["jaxtrain.train"].NonFiniteError,)
        if not isinstance(e, expected):
            # A bug or a runtime failure (e.g. a lost peer): the traceback matters, and so does which process.
            traceback.print_exc()
            print(f"error: {_tag()}{type(e).__name__}: {' '.join(str(e).split())[:500]}", file=sys.stderr)
            return 1
        print(f"error: {_tag()}{e}", file=sys.stderr)
        if isinstance(e, CheckpointError):
            # Orbax's write threads may still wait minutes for a peer's signal that a failed write never sends, and
            # the interpreter would join them before exiting: stop now (earlier checkpoints are complete on disk).
            _exit_now(1)
        return 1


def _exit_now(code: int) -> None:
    """Exit without joining background threads or running exit handlers (output flushed first)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _tag() -> str:
    if "jaxtrain.runtime" in sys.modules:
        return sys.modules["jaxtrain.runtime"].process_tag()
    return ""
