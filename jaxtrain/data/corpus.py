"""``python -m jaxtrain prepare``: text (.txt, .jsonl, .parquet; files, directories, globs) to token shards.

Streamed: the main process reads the inputs in blocks of about ``BLOCK_BYTES`` (whole lines, or a Parquet record
batch) and hands them to ``workers`` processes, at most two blocks per worker in flight, so memory stays bounded
whatever the input size; the token blocks come back in input order, so the output is the same for any worker count.
Each worker tokenises with the Hugging Face ``tokenizers`` library (single-threaded: the processes are the
parallelism) or byte-level. Documents (a .txt file, a .jsonl line, a Parquet row) are separated by the tokenizer's
end-of-text token (byte-level: NUL).

``--out DIR``: shards ``shard-00000.bin`` ... of at most ``shard_tokens`` tokens plus ``index.json`` (token count,
documents, tokenizer and its SHA-256, vocabulary size, dtype, each shard's tokens) that training checks. The shards
are written into ``DIR.partial`` (each as ``.tmp`` until full) and the directory is renamed to ``DIR`` only once the
index is in it: an interrupted run leaves no directory that looks complete. ``--out FILE.bin|.npy``: one token file
and its ``.json`` sidecar, written under a temporary name and renamed. An error or Ctrl-C removes what the run wrote
(``DIR.partial``, or the raw file); only a killed run leaves it, for the next run of the same ``--out`` to replace.
"""

from __future__ import annotations

import collections
import glob
import json
import multiprocessing
import os
import shutil
import sys
import time

import numpy as np

from jaxtrain.errors import ConfigError, one_line

BLOCK_BYTES = 1 << 21  # text per unit of work: large enough to amortise the hand-over, small enough to bound memory
SHARD_TOKENS = 1 << 27  # 128 Mi tokens per shard (256 MiB of uint16)
KINDS = {".txt": "text", ".jsonl": "jsonl", ".parquet": "parquet"}
BYTES_EOS = 0  # byte-level documents are separated by NUL (jaxtrain.data.tokens.EOS)

_tok = None  # the worker's tokenizer (set by _init_worker)


def _expand(inputs: list[str]) -> list[str]:
    """Input files in order: a file as given, a directory's .txt/.jsonl/.parquet files sorted, a glob's matches
    sorted; ConfigError for a name that gives none."""
    files = []
    for spec in inputs:
        if any(ch in spec for ch in "*?[") and not os.path.exists(spec):
            found = sorted(f for f in glob.glob(spec) if os.path.isfile(f))
            if not found:
                raise ConfigError(f"input {spec!r} matches no files")
            files += found
        elif os.path.isdir(spec):
            found = sorted(f for f in glob.glob(os.path.join(spec, "*")) if f.endswith(tuple(KINDS)))
            if not found:
                raise ConfigError(f"input file {spec!r} is a directory with no .txt, .jsonl or .parquet file in it")
            files += found
        else:
            from jaxtrain.config.locations import existing_file

            existing_file(spec, "input file")
            files.append(spec)
    return files


def _kind(path: str) -> str:
    return KINDS.get(os.path.splitext(path)[1], "text")  # any other name: one text document, as before


def _blocks(files: list[str], text_field: str):
    """(block, bytes read) in input order; a block is (kind, path, first line, payload, starts a document)."""
    for path in files:
        kind = _kind(path)
        if kind == "parquet":
            yield from _parquet_blocks(path, text_field)
            continue
        with open(path, "rb") as f:
            line, first = 1, True
            while True:
                chunk = f.read(BLOCK_BYTES)
                if not chunk and not first:
                    break
                chunk += f.readline()  # whole lines: never a cut inside a line (or a UTF-8 character)
                yield (kind, path, line, chunk, first), len(chunk)
                line += chunk.count(b"\n")
                first = False
                if not chunk:
                    break


def _parquet_blocks(path: str, text_field: str):
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ConfigError("Parquet inputs need pyarrow: pip install pyarrow") from None
    try:
        pf = pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises ArrowInvalid (and others) for a file that is not Parquet
        raise ConfigError(f"input file {path!r} is not a Parquet file ({one_line(e, 120)})") from None
    names = pf.schema_arrow.names
    if text_field not in names:
        raise ConfigError(f"parquet file {path!r} has no column {text_field!r} (--text-field); its columns: "
                          f"{', '.join(names)}")
    size, rows = os.path.getsize(path), max(pf.metadata.num_rows, 1)
    per_row = max(size // rows, 1)
    for batch in pf.iter_batches(batch_size=max(BLOCK_BYTES // per_row, 1), columns=[text_field]):
        texts = batch.column(0).to_pylist()
        yield ("parquet", path, 0, texts, True), len(texts) * per_row


def _init_worker(tokenizer: str | None) -> None:
    global _tok
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread per worker process: the processes are the parallelism
    _tok = None
    if tokenizer is not None:
        from tokenizers import Tokenizer

        _tok = Tokenizer.from_file(tokenizer)


def _texts(block, field: str) -> tuple[list, int]:
    """(documents of the block as str, or bytes byte-level, and the number of those that start a document)."""
    kind, path, line, payload, starts = block
    if kind == "parquet":
        docs = [t for t in payload if t is not None]
        return ([d.encode("utf-8") for d in docs] if _tok is None else docs), len(docs)
    if kind == "text":
        if _tok is None:
            return [payload], int(starts)
        try:
            return [payload.decode("utf-8")], int(starts)
        except UnicodeDecodeError as e:
            where = line + payload[:e.start].count(b"\n")
            raise ConfigError(f"input file {path!r} is not UTF-8 text (line {where}), which --tokenizer needs; "
                              "without --tokenizer any bytes are taken") from None
    docs = []
    for i, raw in enumerate(payload.splitlines()):
        if not raw.strip():
            continue
        try:
            record = json.loads(raw)
        except ValueError as e:
            raise ConfigError(f"{path}:{line + i} is not JSON ({one_line(e, 100)})") from None
        text = record.get(field) if isinstance(record, dict) else None
        if not isinstance(text, str):
            raise ConfigError(f"{path}:{line + i} has no string field {field!r} (--text-field)")
        docs.append(text.encode("utf-8") if _tok is None else text)
    return docs, len(docs)


def _encode(job) -> tuple[np.ndarray, int]:
    """(uint32 tokens, documents started) of one block; each document that starts in it is preceded by ``sep``."""
    block, sep, field = job
    docs, n_docs = _texts(block, field)
    if _tok is None:
        ids = [np.frombuffer(d, dtype=np.uint8).astype(np.uint32) for d in docs]
    else:
        ids = [np.asarray(e.ids, dtype=np.uint32) for e in _tok.encode_batch(docs, add_special_tokens=False)]
    starts = [True] * len(docs) if block[0] != "text" else [bool(block[4])]
    pieces = []
    for doc, start in zip(ids, starts):
        if start and sep is not None:
            pieces.append(np.array([sep], np.uint32))
        pieces.append(doc)
    return (np.concatenate(pieces) if pieces else np.zeros(0, np.uint32)), n_docs


class _Shards:
    """Token shards of at most ``limit`` tokens, each written as ``NAME.tmp`` and renamed when full or closed."""

    def __init__(self, directory: str, dtype: str, limit: int, single: str | None = None,
                 owns_directory: bool = False):
        self.directory, self.dtype, self.limit, self.single = directory, dtype, limit, single
        self.owns_directory = owns_directory  # created for this output: discard() removes it whole
        self.shards: list[dict] = []
        self.file = None
        self.count = 0

    def _open(self):
        name = self.single or f"shard-{len(self.shards):05d}.bin"
        self.path = os.path.join(self.directory, name)
        self.file, self.count = open(self.path + ".tmp", "wb"), 0
        self.shards.append({"file": name, "tokens": 0})

    def _close(self):
        if self.file is not None:
            self.file.close()
            os.replace(self.path + ".tmp", self.path)
            self.shards[-1]["tokens"] = self.count
            self.file = None

    def write(self, ids: np.ndarray) -> None:
        ids = ids.astype(self.dtype)
        while len(ids):
            if self.file is None:
                self._open()
            room = self.limit - self.count
            assert self.file is not None
            self.file.write(ids[:room].tobytes())
            self.count += min(room, len(ids))
            ids = ids[room:]
            if self.count >= self.limit:
                self._close()

    def discard(self) -> None:
        """Remove what this writer wrote (its directory, if it made it; else its own files), after an error."""
        if self.file is not None:
            self.file.close()
            self.file = None
        if self.owns_directory:
            shutil.rmtree(self.directory, ignore_errors=True)
            return
        for shard in self.shards:
            path = os.path.join(self.directory, shard["file"])
            for name in (path, path + ".tmp"):
                if os.path.exists(name):
                    os.remove(name)

    def finish(self) -> list[dict]:
        if self.file is None and not self.shards:
            self._open()  # an empty input still gives one (empty) shard
        self._close()
        return self.shards


class _Progress:
    def __init__(self, total: int, enabled: bool):
        self.total, self.enabled, self.t0, self.last, self.done, self.tokens = total, enabled, time.time(), 0.0, 0, 0

    def update(self, nbytes: int, ntokens: int, final: bool = False) -> None:
        self.done, self.tokens = self.done + nbytes, self.tokens + ntokens
        now = time.time()
        if not self.enabled or (now - self.last < 1 and not final):
            return
        self.last = now
        rate = self.done / max(now - self.t0, 1e-9)
        eta = (self.total - self.done) / rate if rate > 0 else float("inf")
        pct = 100 * self.done / max(self.total, 1)
        end = "\n" if final else ("\r" if sys.stderr.isatty() else "\n")
        print(f"prepare: {self.done / 1e6:,.1f}/{self.total / 1e6:,.1f} MB ({pct:.0f}%) {rate / 1e6:.1f} MB/s, "
              f"{self.tokens:,} tokens, ETA {eta:.0f} s", end=end, file=sys.stderr, flush=True)


def _tokenizer(path: str | None) -> tuple[str | None, int, int | None, str | None]:
    """(tokenizer.json path or None, vocabulary size, end-of-text id or None, SHA-256 or None)."""
    if path is None:
        return None, 256, BYTES_EOS, None
    from jaxtrain.data.tokens import file_sha256, tokenizer_json

    file = tokenizer_json(path, "--tokenizer")
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise ConfigError("--tokenizer needs the 'tokenizers' package: pip install tokenizers") from None
    try:
        tok = Tokenizer.from_file(file)
    except Exception as e:  # the Rust side raises a plain Exception for any malformed file
        raise ConfigError(f"--tokenizer {path!r} is not a Hugging Face tokenizer.json ({one_line(e, 200)})") from None
    names = ["<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>"]
    config = os.path.join(os.path.dirname(file), "tokenizer_config.json")
    if os.path.isfile(config):  # the model's own eos first
        try:
            eos = json.load(open(config, encoding="utf-8")).get("eos_token")
            eos = eos.get("content") if isinstance(eos, dict) else eos
            names = [eos] + names if isinstance(eos, str) else names
        except ValueError:
            pass
    sep = next((tok.token_to_id(t) for t in names if tok.token_to_id(t) is not None), None)
    return file, tok.get_vocab_size(), sep, file_sha256(file)


def _check_out(out: str) -> bool:
    """Whether ``out`` is one token file (.bin/.npy) rather than a shard directory; ConfigError if unusable."""
    if os.path.exists(out):
        raise ConfigError(f"--out {out!r} already exists; choose a new path (existing data is never overwritten)")
    parent = os.path.dirname(os.path.abspath(out))
    if not os.path.isdir(parent) or not os.access(parent, os.W_OK | os.X_OK):
        why = "is not writable" if os.path.isdir(parent) else "is not an existing directory"
        raise ConfigError(f"--out {out!r}: its directory {parent!r} {why}")
    return out.endswith((".bin", ".npy"))


def prepare(inputs: list[str], out: str, tokenizer: str | None = None, *, text_field: str = "text",
            workers: int = 1, shard_tokens: int = SHARD_TOKENS, progress: bool = False) -> dict:
    """Tokenise ``inputs`` into ``out`` (a shard directory with index.json, or one .bin/.npy file with a .json
    sidecar); returns the index (or sidecar) dict. Byte-level without ``tokenizer`` (a tokenizer.json or its
    directory). The output does not depend on ``workers``. On any error (a malformed line, Ctrl-C) what this call
    wrote is removed again: nothing is left but what was on disk before."""
    files = _expand(inputs)
    single = _check_out(out)
    if workers < 1 or shard_tokens < 1:
        raise ConfigError(f"--workers={workers} and --shard-tokens={shard_tokens} must be >= 1")
    tok_file, vocab, sep, sha = _tokenizer(tokenizer)
    dtype = "uint16" if vocab <= 1 << 16 else "uint32"
    shards = _open_output(out, single, dtype, shard_tokens)
    try:
        sink = _Sink(shards, sep, _Progress(sum(os.path.getsize(f) for f in files), progress))
        jobs = sink.sized((block, sep, text_field) for block in _blocks(files, text_field))
        if workers == 1:
            _encode_here(jobs, tok_file, sink)
        else:
            _encode_in_pool(jobs, tok_file, workers, sink)
        sink.bar.update(0, 0, final=True)
        listed = shards.finish()
    except BaseException:
        shards.discard()
        raise
    meta = {"format": "jaxtrain-tokens/1", "dtype": dtype, "vocab_size": vocab,
            "tokenizer": tok_file and os.path.abspath(tok_file) or "bytes", "tokenizer_sha256": sha, "eos_id": sep,
            "tokens": sum(s["tokens"] for s in listed), "documents": sink.documents, "text_field": text_field,
            "inputs": [os.path.abspath(f) for f in files]}
    _publish(shards, out, single, meta)
    return meta


def _open_output(out: str, single: bool, dtype: str, shard_tokens: int) -> _Shards:
    """The shard writer: one raw file beside ``out`` (a .bin/.npy), or shards in a fresh ``out.partial/``."""
    if single:
        return _Shards(os.path.dirname(os.path.abspath(out)), dtype, 1 << 62, single=os.path.basename(out) + ".raw")
    work_dir = out.rstrip("/") + ".partial"
    if os.path.exists(work_dir):  # an interrupted (killed) prepare of this same --out: its partial output is void
        shutil.rmtree(work_dir)
    os.makedirs(work_dir)
    return _Shards(work_dir, dtype, shard_tokens, owns_directory=True)


def _publish(shards: _Shards, out: str, single: bool, meta: dict) -> None:
    """The finished output under its name: the token file and its sidecar, or the index then the directory's rename
    (``meta`` gains the shard list)."""
    from jaxtrain.data.tokens import INDEX

    if single:
        _finish_file(os.path.join(shards.directory, shards.shards[0]["file"]), out, meta["dtype"], meta["tokens"])
        _write_json(out + ".json", meta)
    else:
        _write_json(os.path.join(shards.directory, INDEX), {**meta, "shards": shards.shards})
        os.rename(shards.directory, out)
        meta["shards"] = shards.shards


class _Sink:
    """Token blocks, in input order, into the shards: a separator between documents (none before the first), the
    documents counted, the progress bar told each block's input bytes once it is written."""

    def __init__(self, shards: _Shards, sep: int | None, bar: _Progress):
        self.shards, self.sep, self.bar = shards, sep, bar
        self.documents, self.first = 0, True
        self.sizes: collections.deque[int] = collections.deque()

    def sized(self, jobs):
        """The jobs of ``((block, bytes read), sep, field)``, each block's byte count kept for the progress bar."""
        for (block, nbytes), sep, field in jobs:
            self.sizes.append(nbytes)
            yield block, sep, field

    def take(self, result: tuple[np.ndarray, int]) -> None:
        ids, n_docs = result
        if self.first and len(ids) and self.sep is not None:
            ids, self.first = ids[1:], False
        self.documents += n_docs
        self.shards.write(ids)
        self.bar.update(self.sizes.popleft(), len(ids))


def _encode_here(jobs, tok_file: str | None, sink: _Sink) -> None:
    """One process: this one tokenises, its TOKENIZERS_PARALLELISM restored afterwards."""
    old = os.environ.get("TOKENIZERS_PARALLELISM")
    _init_worker(tok_file)
    try:
        for job in jobs:
            sink.take(_encode(job))
    finally:
        if old is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = old


def _encode_in_pool(jobs, tok_file: str | None, workers: int, sink: _Sink) -> None:
    """``workers`` processes tokenise, at most two blocks each in flight; results are taken in input order."""
    # fork: cheap, and `python -m jaxtrain` (whose __main__ spawn would rerun) has no threads yet; a process
    # that already runs JAX's threads (a test, a notebook) spawns instead, since forking it may deadlock.
    context = multiprocessing.get_context("spawn" if "jax" in sys.modules else "fork")
    pool = context.Pool(workers, _init_worker, (tok_file,))
    pending: collections.deque = collections.deque()
    error = None
    try:
        for job in jobs:
            pending.append(pool.apply_async(_encode, (job,)))
            if len(pending) >= 2 * workers:  # bounded: never more than two blocks per worker in flight
                sink.take(_get(pending.popleft()))
        while pending:
            sink.take(_get(pending.popleft()))
    except ConfigError as e:
        error = e
    finally:
        pool.terminate()
        pool.join()
    if error is not None:
        # Raised once the pool is gone (no frame of the traceback holds it), so that its semaphores are freed
        # now and the one-line error stays the last line (no resource_tracker warning at exit).
        pending.clear()
        del pool
        raise error.with_traceback(None)


def _get(result):
    try:
        return result.get()
    except ConfigError:
        raise
    except Exception as e:  # a worker's error arrives as its exception; say it in one line
        raise ConfigError(f"prepare failed: {one_line(e, 200)}") from None


def _finish_file(raw: str, out: str, dtype: str, n: int) -> None:
    """The raw token file renamed to ``out`` (.bin), or copied under a .npy header (.npy), atomically."""
    if out.endswith(".bin"):
        os.replace(raw, out)
        return
    src = np.memmap(raw, dtype=dtype, mode="r") if n else np.zeros(0, dtype)
    tmp = out + ".tmp"
    with open(tmp, "wb") as f:
        np.lib.format.write_array_header_1_0(f, {"descr": np.dtype(dtype).str, "fortran_order": False,
                                                 "shape": (n,)})
        for i in range(0, n, 1 << 24):
            f.write(np.asarray(src[i:i + (1 << 24)]).tobytes())
    del src
    os.replace(tmp, out)
    os.remove(raw)


def _write_json(path: str, obj: dict) -> None:
    with open(path + ".tmp", "w") as f:
        json.dump(obj, f, indent=1)
    os.replace(path + ".tmp", path)
