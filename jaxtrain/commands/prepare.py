"""``python -m jaxtrain prepare FILES... --out PATH [--tokenizer tokenizer.json]``."""


def add_arguments(p):
    p.description = ("Tokenise text files (byte-level, or with a local tokenizer.json) into a .bin or .npy token "
                     "file plus a .json sidecar, for data.source=PATH.")
    p.add_argument("inputs", nargs="+", help="text files, one document each")
    p.add_argument("--out", required=True, help="output path ending in .bin (uint16/uint32 memmap) or .npy")
    p.add_argument("--tokenizer", help="a Hugging Face tokenizer.json (needs the 'tokenizers' package)")


def run(args) -> int:
    from jaxtrain import data

    meta = data.prepare(args.inputs, args.out, args.tokenizer)
    print(f"wrote {meta['tokens']:,} tokens ({meta['dtype']}, vocabulary {meta['vocab_size']}) to {args.out}")
    return 0
