"""Command line: ``python -m jaxtrain {train,prepare} ...``.

User mistakes (ConfigError) end with one line on stderr and exit status 2, before anything is written.
"""

from __future__ import annotations

import argparse
import sys

from jaxtrain.config import ConfigError, load_config


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, not argparse's usage block
        print(f"error: {message} (see {self.prog} --help)", file=sys.stderr)
        raise SystemExit(2)


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m jaxtrain", description="Train sharded Flax transformers on JAX.")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True

    t = sub.add_parser("train", help="train a model (defaults: the tiny model on the embedded corpus)",
                       description="Train a model. Overrides are dotted key=value pairs, e.g. train.steps=100 "
                                   "mesh.ici.fsdp=8 runtime.cpu_devices=8.")
    t.add_argument("--config", help="YAML config file (default: the built-in tiny config, = configs/tiny.yaml)")
    t.add_argument("overrides", nargs="*", metavar="key=value")

    pr = sub.add_parser("prepare", help="tokenise text files into a token file for data.source",
                        description="Tokenise text files (byte-level, or with a local tokenizer.json) into a .bin or "
                                    ".npy token file plus a .json sidecar, for data.source=PATH.")
    pr.add_argument("inputs", nargs="+", help="text files, one document each")
    pr.add_argument("--out", required=True, help="output path ending in .bin (uint16/uint32 memmap) or .npy")
    pr.add_argument("--tokenizer", help="a Hugging Face tokenizer.json (needs the 'tokenizers' package)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "train":
            cfg = load_config(args.config, args.overrides)
            from jaxtrain import runtime, train  # JAX is imported only after the config is known to be good

            runtime.quiet_logs()
            runtime.configure(cfg)
            train.train(cfg)
        elif args.command == "prepare":
            from jaxtrain import data

            meta = data.prepare(args.inputs, args.out, args.tokenizer)
            print(f"wrote {meta['tokens']:,} tokens ({meta['dtype']}, vocabulary {meta['vocab_size']}) to {args.out}")
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except Exception as e:
        from jaxtrain.checkpoint import CheckpointError

        if not isinstance(e, CheckpointError):
            raise
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0
