"""prepare's throughput and memory on a generated .jsonl corpus, against the tokenizer's own batch speed.

    python3 benchmarks/prepare_bench.py [--size-mb 1024] [--workers 1,2] [--dir /tmp/prepare_bench]

Writes a ``--size-mb`` .jsonl of documents cut from CPython's bundled documentation (1-8 KB each) and a byte-level
BPE tokenizer.json (32k vocabulary) trained on that text (no hub is reachable), then prints:

- the ceiling: ``Tokenizer.encode_batch`` on the first 64 MB of the documents, already in memory, single-threaded
  (TOKENIZERS_PARALLELISM=false): MB/s per core; and with the library's own thread pool over every core;
- ``python -m jaxtrain prepare`` on the whole file for each worker count (a fresh process each): MB/s, MB/s per
  worker, its share of the per-core ceiling, and the peak RSS of the largest process (the main or a worker);
- the byte-level prepare with the most workers.

The machine's load (os.getloadavg) is printed with the figures: on a shared machine they are only as good as it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def make_corpus(path: str, size_mb: int) -> None:
    sys.path.insert(0, REPO)
    from jaxtrain.data.tokens import embedded_corpus

    text = embedded_corpus().decode("utf-8").replace("\0", "\n\n")
    import random

    rng = random.Random(0)
    target, written = size_mb << 20, 0
    with open(path + ".tmp", "w") as f:
        while written < target:
            n = rng.randint(1024, 8192)
            start = rng.randrange(0, len(text) - n)
            line = json.dumps({"id": written, "text": text[start:start + n]}) + "\n"
            f.write(line)
            written += len(line)
    os.replace(path + ".tmp", path)


def make_tokenizer(path: str) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    sys.path.insert(0, REPO)
    from jaxtrain.data.tokens import embedded_corpus

    docs = embedded_corpus().decode("utf-8").split("\0")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(docs, trainers.BpeTrainer(vocab_size=32000, special_tokens=["<|endoftext|>"],
                                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(path)


def ceiling(corpus: str, tokenizer: str, parallel: bool) -> float:
    """encode_batch MB/s over the first 64 MB of documents (in memory), in a fresh process."""
    code = f"""
import json, os, time
os.environ["TOKENIZERS_PARALLELISM"] = {"'true'" if parallel else "'false'"}
from tokenizers import Tokenizer
tok = Tokenizer.from_file({tokenizer!r})
docs, size = [], 0
with open({corpus!r}) as f:
    for line in f:
        docs.append(json.loads(line)["text"]); size += len(docs[-1].encode())
        if size > 64 << 20: break
tok.encode_batch(docs[:50])
t0 = time.perf_counter()
for i in range(0, len(docs), 512):
    tok.encode_batch(docs[i:i + 512], add_special_tokens=False)
print(size / (time.perf_counter() - t0) / 1e6)
"""
    return float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)


def run_prepare(corpus: str, out: str, tokenizer: str | None, workers: int) -> tuple[float, float, str]:
    """(seconds, peak RSS MB of the largest process, the command's last line)."""
    cmd = [sys.executable, "-m", "jaxtrain", "prepare", corpus, "--out", out, "--workers", str(workers),
           "--no-progress"] + (["--tokenizer", tokenizer] if tokenizer else [])
    env = dict(os.environ, PYTHONPATH=REPO)
    # A fresh wrapper process per run: its RUSAGE_CHILDREN peak is the largest process of this run's tree alone
    # (prepare's main process or one of its workers), in KiB on Linux.
    wrapper = ("import resource, subprocess, sys, time; t0 = time.perf_counter(); "
               "p = subprocess.run(sys.argv[1:], capture_output=True, text=True); "
               "print(p.returncode, time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss); "
               "print(p.stdout.strip() or p.stderr.strip())")
    proc = subprocess.run([sys.executable, "-c", wrapper, *cmd], capture_output=True, text=True, env=env)
    head, _, line = proc.stdout.partition("\n")
    rc, seconds, rss_kib = head.split()
    if rc != "0":
        raise SystemExit(line)
    return float(seconds), int(rss_kib) / 1024, line.strip()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size-mb", type=int, default=1024)
    p.add_argument("--workers", default=f"1,{len(os.sched_getaffinity(0))}")
    p.add_argument("--dir", default="/tmp/prepare_bench")
    args = p.parse_args()
    os.makedirs(args.dir, exist_ok=True)
    corpus = os.path.join(args.dir, f"corpus_{args.size_mb}mb.jsonl")
    tokenizer = os.path.join(args.dir, "tokenizer.json")
    if not os.path.exists(corpus):
        make_corpus(corpus, args.size_mb)
    if not os.path.exists(tokenizer):
        make_tokenizer(tokenizer)
    size = os.path.getsize(corpus) / 1e6
    cores = len(os.sched_getaffinity(0))
    print(f"corpus {corpus}: {size:,.0f} MB; tokenizer: byte-level BPE, 32k vocabulary; {cores} cores; "
          f"load average {os.getloadavg()[0]:.1f} at start")
    one = ceiling(corpus, tokenizer, parallel=False)
    every = ceiling(corpus, tokenizer, parallel=True)
    print(f"ceiling: encode_batch {one:.2f} MB/s on one core; {every:.2f} MB/s with its own threads on {cores} cores")
    for workers in [int(w) for w in args.workers.split(",")]:
        out = os.path.join(args.dir, f"out_w{workers}_{time.time_ns()}")
        seconds, rss, line = run_prepare(corpus, out, tokenizer, workers)
        rate = size / seconds
        print(f"prepare --workers {workers}: {seconds:.1f} s, {rate:.2f} MB/s, {rate / workers:.2f} MB/s per worker "
              f"({rate / workers / one:.0%} of the one-core ceiling), peak RSS {rss:.0f} MB; {line}")
        subprocess.run(["rm", "-rf", out])
    workers = max(int(w) for w in args.workers.split(","))
    out = os.path.join(args.dir, f"out_bytes_{time.time_ns()}")
    seconds, rss, line = run_prepare(corpus, out, None, workers)
    print(f"prepare byte-level --workers {workers}: {seconds:.1f} s, {size / seconds:.1f} MB/s, peak RSS {rss:.0f} MB")
    subprocess.run(["rm", "-rf", out])
    print(f"load average {os.getloadavg()[0]:.1f} at the end")


if __name__ == "__main__":
    main()
