"""Tile skipping with document masking on the embedded corpus: how many causal tiles each flash kernel computes.

    python benchmarks/tile_skip.py [--seq 4096]

Windows and segment ids as jaxtrain's training makes them (byte-level, NUL-separated documents; a segment ends with
its NUL); the kernels' benchmark (``jaxtrain.kernels.bench.flash.tile_skip_report``) counts the tiles. The documents are
read here, not in the kernels, which import nothing else of jaxtrain. No GPU needed.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from jaxtrain.data import EOS, embedded_corpus  # noqa: E402
from jaxtrain.kernels.bench import flash as bench  # noqa: E402


def corpus_segments(seq: int) -> np.ndarray:
    """Segment ids int32 [windows, seq] of the embedded corpus cut into training windows of ``seq`` tokens."""
    tokens = np.frombuffer(embedded_corpus(), np.uint8).astype(np.int32)
    n = (len(tokens) - 1) // seq
    inputs = np.stack([tokens[i * seq: i * seq + seq] for i in range(n)])  # Windows(seq)[i][:-1]
    is_eos = (inputs == EOS).astype(np.int32)
    doc_lengths = np.diff(np.flatnonzero(np.concatenate([[1], tokens == EOS, [1]])))
    print(f"embedded corpus: {len(tokens)} tokens, {len(doc_lengths)} documents (median length "
          f"{int(np.median(doc_lengths))}, mean {doc_lengths.mean():.0f}), {n} windows of {seq}")
    return np.cumsum(is_eos, axis=1) - is_eos  # as step.document_segments


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(prog="python benchmarks/tile_skip.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--seq", type=int, default=4096, help="window length (default 4096)")
    args = p.parse_args(argv)
    if args.seq < 1:
        raise SystemExit(f"tile_skip.py: --seq {args.seq} must be a positive sequence length")
    return bench.tile_skip_report(corpus_segments(args.seq))


if __name__ == "__main__":
    main()
