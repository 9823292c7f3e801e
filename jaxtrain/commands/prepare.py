"""``python -m jaxtrain prepare INPUTS... --out PATH [--tokenizer tokenizer.json] [--workers N] ...``."""

import os


def add_arguments(p):
    p.description = ("Tokenise text (.txt: a document per file; .jsonl: a document per line, its --text-field; "
                     ".parquet: a document per row of the --text-field column; or directories and globs of them), "
                     "byte-level or with a local tokenizer.json, streamed and in parallel, into a directory of token "
                     "shards with an index.json (or one .bin/.npy file with a .json sidecar) for data.source=PATH.")
    p.add_argument("inputs", nargs="+", help="text, .jsonl or .parquet files, directories or globs of them")
    p.add_argument("--out", required=True,
                   help="a new directory (shards + index.json), or a path ending in .bin (raw memmap) or .npy")
    p.add_argument("--tokenizer", help="a Hugging Face tokenizer.json or its directory (needs 'tokenizers')")
    p.add_argument("--text-field", default="text", help="the text field of .jsonl lines / column of .parquet files")
    p.add_argument("--workers", type=int, default=len(os.sched_getaffinity(0)),
                   help="tokenising processes (default: the cores this process may use); the output is the same")
    p.add_argument("--shard-tokens", type=int, default=1 << 27, help="tokens per shard at most (default 2^27)")
    p.add_argument("--no-progress", action="store_true", help="no progress line on stderr")


def run(args) -> int:
    from jaxtrain import data

    meta = data.prepare(args.inputs, args.out, args.tokenizer, text_field=args.text_field, workers=args.workers,
                        shard_tokens=args.shard_tokens, progress=not args.no_progress)
    shards = f" in {len(meta['shards'])} shard(s)" if "shards" in meta else ""
    print(f"wrote {meta['tokens']:,} tokens of {meta['documents']:,} documents ({meta['dtype']}, vocabulary "
          f"{meta['vocab_size']}){shards} to {args.out}")
    return 0
