"""Token sources and Grain pipelines.

A source is one long 1-D token stream; its tail (``data.eval_fraction``) is held out for evaluation. Training
examples are non-overlapping windows of ``seq_len + 1`` tokens (inputs and shifted targets), shuffled by
``train.seed`` and repeated. The global batch of step ``s`` is elements ``[s*B, (s+1)*B)`` of that stream, whatever
the number of processes or the mesh; a process reads only rows ``[lo, hi)`` of it, the rows its devices hold.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import grain
import numpy as np

from jaxtrain.config import DataConfig
from jaxtrain.errors import ConfigError, one_line

EOS = 0  # byte-level documents are separated by NUL, which text does not contain


@dataclass(frozen=True)
class Tokens:
    """A token stream split into train and eval parts. ``vocab_size``: smallest vocabulary that covers it."""

    train: np.ndarray
    eval: np.ndarray
    vocab_size: int


def embedded_corpus() -> bytes:
    """CPython's own documentation (the pydoc topics of the language reference), present wherever Python is."""
    from pydoc_data.topics import topics

    return b"\0".join(topics[k].encode("utf-8") for k in sorted(topics))


def synthetic_tokens(vocab_size: int, n: int, seed: int = 1234) -> np.ndarray:
    """A learnable stream: a random first-order Markov chain where each token has 4 likely successors."""
    rng = np.random.default_rng(seed)
    successors = rng.integers(0, vocab_size, size=(vocab_size, 4))
    choice = rng.integers(0, 4, size=n)
    out = np.empty(n, dtype=np.int32)
    tok = 0
    for i in range(n):
        tok = successors[tok, choice[i]]
        out[i] = tok
    return out


def _read_sidecar(path: str) -> dict:
    """The ``.json`` sidecar ``prepare`` writes next to a token file ({} if there is none)."""
    meta_path = path + ".json"
    if not os.path.exists(meta_path):
        return {}
    try:
        with open(meta_path, "rb") as f:
            meta = json.loads(f.read().decode("utf-8"))
    except (OSError, ValueError) as e:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise ConfigError(f"the sidecar {meta_path!r} of data.source is not valid JSON ({_short(e)}); fix or remove "
                          "it (it holds the vocab_size and dtype prepare wrote)") from None
    if not isinstance(meta, dict):
        raise ConfigError(f"the sidecar {meta_path!r} of data.source must hold a JSON object, "
                          f"got {type(meta).__name__}")
    for key, kind in (("vocab_size", int), ("dtype", str)):
        if key in meta and (not isinstance(meta[key], kind) or isinstance(meta[key], bool)):
            raise ConfigError(f"the sidecar {meta_path!r} has {key}={meta[key]!r}; expected a {kind.__name__}")
    return meta


def _short(e: Exception) -> str:
    return one_line(e, 200)


def _open_stream(cfg: DataConfig, meta: dict) -> np.ndarray:
    """The token file as a read-only array (memory-mapped); ConfigError for a file that is not one."""
    path = cfg.source
    if path.endswith(".npy"):
        try:
            stream = np.load(path, mmap_mode="r", allow_pickle=False)
        except (ValueError, OSError, EOFError) as e:
            raise ConfigError(f"data.source {path!r} is not a NumPy .npy array file ({_short(e)})") from None
        if stream.ndim != 1 or not np.issubdtype(stream.dtype, np.integer):
            raise ConfigError(f"data.source {path!r} must hold a 1-D integer array, "
                              f"got {stream.dtype} of shape {stream.shape}")
        return stream
    if "dtype" in meta and meta["dtype"] != cfg.token_dtype:
        raise ConfigError(f"data.token_dtype={cfg.token_dtype} but {path}.json says the file is "
                          f"{meta['dtype']}; set data.token_dtype={meta['dtype']}")
    size, item = os.path.getsize(path), np.dtype(cfg.token_dtype).itemsize
    if size == 0 or size % item:
        size_text = "is empty" if size == 0 else f"has {size} bytes, not a multiple of {item}"
        raise ConfigError(f"data.source {path!r} {size_text}: not a raw {cfg.token_dtype} token file "
                          "(data.token_dtype)")
    return np.memmap(path, dtype=cfg.token_dtype, mode="r")


def check_token_ids(stream: np.ndarray, source: str, vocab_size: int) -> None:
    """ConfigError naming the largest id when a token id lies outside [0, vocab_size): the embedding lookup would
    silently clamp it (XLA gathers clamp out-of-range indices), training on the wrong token. One pass over the
    file, in chunks (about 0.2 s per GB from the page cache; see docs/failures.md)."""
    chunk = 1 << 26
    hi = max(int(stream[i:i + chunk].max()) for i in range(0, len(stream), chunk))
    lo = min(int(stream[i:i + chunk].min()) for i in range(0, len(stream), chunk)) if stream.dtype.kind == "i" else 0
    if hi >= vocab_size:
        raise ConfigError(f"data.source {source!r} holds token id {hi} (its largest), which model.vocab_size="
                          f"{vocab_size} cannot represent; set model.vocab_size={hi + 1} or more")
    if lo < 0:
        raise ConfigError(f"data.source {source!r} holds the negative token id {lo}; token ids start at 0")


def load_tokens(cfg: DataConfig, vocab_size: int) -> Tokens:
    """Load ``cfg.source`` and split it; raise ConfigError if the model's vocabulary cannot represent it."""
    if cfg.source == "embedded":
        stream, needed = np.frombuffer(embedded_corpus(), dtype=np.uint8), 256
    elif cfg.source == "synthetic":
        stream, needed = synthetic_tokens(vocab_size, 1 << 20), vocab_size
    else:
        meta = _read_sidecar(cfg.source)
        stream = _open_stream(cfg, meta)
        needed = int(meta.get("vocab_size", 0))
    if needed > vocab_size:
        raise ConfigError(f"model.vocab_size={vocab_size} is smaller than the data's vocabulary ({needed} tokens); "
                          f"set model.vocab_size={needed} or more")
    if cfg.source not in ("embedded", "synthetic"):
        check_token_ids(stream, cfg.source, vocab_size)  # with or without a sidecar: nanoGPT's .bin have none
    n_eval = int(len(stream) * cfg.eval_fraction)
    min_len = 2 * (cfg.seq_len + 1)
    if n_eval < cfg.seq_len + 1 or len(stream) - n_eval < min_len:
        raise ConfigError(f"data.source {cfg.source!r} has {len(stream)} tokens, too few for data.seq_len="
                          f"{cfg.seq_len} with data.eval_fraction={cfg.eval_fraction}")
    return Tokens(train=stream[: len(stream) - n_eval], eval=stream[len(stream) - n_eval:], vocab_size=needed)


class Windows:
    """Random-access source of non-overlapping windows of ``seq_len + 1`` tokens, as int32."""

    def __init__(self, tokens: np.ndarray, seq_len: int):
        self.tokens, self.seq_len = tokens, seq_len

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // self.seq_len

    def __getitem__(self, i: int) -> np.ndarray:
        start = int(i) * self.seq_len
        return np.asarray(self.tokens[start: start + self.seq_len + 1], dtype=np.int32)


def _local_batches(examples: grain.MapDataset, global_batch: int, rows: tuple[int, int], num_batches: int):
    lo, hi = rows

    def read(step):
        base = int(step) * global_batch
        return np.stack([examples[base + r] for r in range(lo, hi)])

    return grain.MapDataset.range(num_batches).map(read)


def train_batches(tokens: Tokens, cfg: DataConfig, *, seed: int, global_batch: int, steps: int,
                  rows: tuple[int, int]) -> grain.IterDataset:
    """This process's rows of each step's global batch: an iterator of int32 [hi - lo, seq_len + 1].

    Row ``r`` of step ``s`` is example ``s * global_batch + r`` of the shuffled, repeated window stream.
    """
    examples = grain.MapDataset.source(Windows(tokens.train, cfg.seq_len)).shuffle(seed=seed).repeat()
    ds = _local_batches(examples, global_batch, rows, steps)
    return ds.to_iter_dataset(grain.ReadOptions(num_threads=cfg.threads, prefetch_buffer_size=cfg.prefetch))


def eval_batches(tokens: Tokens, cfg: DataConfig, *, global_batch: int, num_batches: int,
                 rows: tuple[int, int]) -> list[np.ndarray]:
    """The held-out batches (same every evaluation, unshuffled, wrapping around a short split)."""
    examples = grain.MapDataset.source(Windows(tokens.eval, cfg.seq_len)).repeat()
    return list(_local_batches(examples, global_batch, rows, num_batches))


# ---------------------------------------------------------------------------------------------------------------
# `python -m jaxtrain prepare`


def prepare(inputs: list[str], out: str, tokenizer: str | None = None) -> dict:
    """Tokenise text files into ``out`` (raw .bin memmap, or .npy) plus ``out + '.json'`` metadata.

    Byte-level by default (vocabulary 256, documents separated by NUL); with ``tokenizer`` a local Hugging Face
    ``tokenizer.json`` (needs the ``tokenizers`` package), documents separated by its end-of-text token if it has one.
    """
    from jaxtrain.locations import existing_file

    for path in inputs:
        existing_file(path, "input file")
    if not out.endswith((".bin", ".npy")):
        raise ConfigError(f"--out {out!r} must end in .bin or .npy")
    if os.path.exists(out):
        raise ConfigError(f"--out {out!r} already exists; choose a new path (existing data is never overwritten)")
    parent = os.path.dirname(os.path.abspath(out))
    if not os.path.isdir(parent) or not os.access(parent, os.W_OK | os.X_OK):
        why = "is not writable" if os.path.isdir(parent) else "is not an existing directory"
        raise ConfigError(f"--out {out!r}: its directory {parent!r} {why}")
    if tokenizer is None:
        docs = [np.frombuffer(open(p, "rb").read(), dtype=np.uint8).astype(np.uint32) for p in inputs]
        sep: int | None
        vocab, sep, name = 256, EOS, "bytes"
    else:
        existing_file(tokenizer, "--tokenizer")
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise ConfigError("--tokenizer needs the 'tokenizers' package: pip install tokenizers") from None
        try:
            tok = Tokenizer.from_file(tokenizer)
        except Exception as e:  # the Rust side raises a plain Exception for any malformed file
            raise ConfigError(f"--tokenizer {tokenizer!r} is not a Hugging Face tokenizer.json ({_short(e)})") from None
        docs = []
        for p in inputs:
            try:
                with open(p, encoding="utf-8") as f:
                    docs.append(np.asarray(tok.encode(f.read()).ids, dtype=np.uint32))
            except UnicodeDecodeError as e:
                raise ConfigError(f"input file {p!r} is not UTF-8 text (byte {e.start}), which --tokenizer needs; "
                                  "without --tokenizer any bytes are taken") from None
        vocab = tok.get_vocab_size()
        sep = next((tok.token_to_id(t) for t in ("<|endoftext|>", "</s>", "<eos>") if tok.token_to_id(t) is not None),
                   None)
        name = os.path.abspath(tokenizer)
    pieces = []
    for i, doc in enumerate(docs):
        if i and sep is not None:
            pieces.append(np.array([sep], dtype=np.uint32))
        pieces.append(doc)
    stream = np.concatenate(pieces) if pieces else np.zeros(0, np.uint32)
    dtype = "uint16" if vocab <= 1 << 16 else "uint32"
    stream = stream.astype(dtype)
    tmp = out + ".tmp"
    if out.endswith(".npy"):
        with open(tmp, "wb") as f:
            np.save(f, stream)
    else:
        stream.tofile(tmp)
    os.replace(tmp, out)
    meta = {"vocab_size": vocab, "dtype": dtype, "tokens": int(len(stream)), "tokenizer": name, "inputs": inputs}
    with open(out + ".json", "w") as f:
        json.dump(meta, f, indent=1)
    return meta
