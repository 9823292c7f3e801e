"""Token sources and Grain pipelines.

A source is one long 1-D token stream (one file, or the shards of a directory or glob read as their concatenation in
sorted order, memory-mapped); its tail (``data.eval_fraction``) is held out for evaluation. Training examples are
non-overlapping windows of ``seq_len + 1`` tokens (inputs and shifted targets), shuffled by ``train.seed`` and
repeated. A mixture interleaves the shuffled windows of several sources in proportion to their weights (Grain's
``MapDataset.mix``: a fixed pattern, exact over each period of the integer proportions). The global batch of step
``s`` is elements ``[s*B, (s+1)*B)`` of that stream, whatever the number of processes or the mesh; a process reads
only rows ``[lo, hi)`` of it, the rows its devices hold.

Chat data (``data.format=chat``, jaxtrain/data/chat.py) arrives as ready rows of ``seq_len + 1`` token words whose
high bits carry the loss mask, document starts and padding (:data:`NO_LOSS`, :data:`DOC_START`, :data:`PAD`); token
files never set them.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from jaxtrain import rundir
from jaxtrain.config import DataConfig
from jaxtrain.errors import ConfigError, one_line

EOS = 0  # byte-level documents are separated by NUL, which text does not contain
# Flag bits of a token word in a batch (int32): the token id is the low 28 bits. NO_LOSS: this token is not a
# training target (a prompt or padding token of chat data); DOC_START: this token starts a new document (packing);
# PAD: this position is padding, no token at all (chat rows' tails): never a target, never routed to an expert.
PAD = 1 << 28
DOC_START = 1 << 29
NO_LOSS = 1 << 30
TOKEN_BITS = PAD - 1
INDEX = "index.json"  # what `prepare` writes next to its shards

if TYPE_CHECKING:  # imported where used: the train command imports it while its step compiles (jaxtrain/train/loop.py)
    import grain


@dataclass(frozen=True)
class Tokens:
    """A token stream split into train and eval parts (1-D, or 2-D ready rows [n, seq_len + 1] of chat data).
    ``vocab_size``: smallest vocabulary that covers it."""

    train: np.ndarray | Stream
    eval: np.ndarray | Stream
    vocab_size: int


@dataclass(frozen=True)
class Mixture:
    """Sources drawn in proportion to ``weights`` (one per part)."""

    parts: list[Tokens]
    weights: list[float]
    names: list[str] = field(default_factory=list)

    @property
    def vocab_size(self) -> int:
        return max(p.vocab_size for p in self.parts)


class Stream:
    """Shards read as one 1-D token stream, memory-mapped lazily (a shard is opened when a window first touches it).
    Slicing with a step-1 slice gives another Stream (a view); ``np.asarray`` reads it."""

    def __init__(self, paths: list[str], dtypes: list[str], lengths: list[int], start: int = 0,
                 stop: int | None = None):
        self.paths, self.dtypes, self.lengths = paths, dtypes, lengths
        self.offsets = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)])
        self.start, self.stop = start, int(self.offsets[-1]) if stop is None else stop
        self._maps: dict[int, np.ndarray] = {}
        self.dtype = np.dtype(dtypes[0]) if dtypes else np.dtype("uint16")

    def __len__(self) -> int:
        return self.stop - self.start

    def _shard(self, i: int) -> np.ndarray:
        if i not in self._maps:
            path = self.paths[i]
            self._maps[i] = (RemoteShard(path, self.dtypes[i], self.lengths[i]) if rundir.is_remote(path)  # type: ignore
                             else np.load(path, mmap_mode="r") if path.endswith(".npy")
                             else np.memmap(path, dtype=self.dtypes[i], mode="r"))
        return self._maps[i]

    def __getitem__(self, key):
        if not isinstance(key, slice) or key.step not in (None, 1):
            raise TypeError("a Stream takes step-1 slices only")
        a, b, _ = key.indices(len(self))
        view = Stream(self.paths, self.dtypes, self.lengths, self.start + a, self.start + max(a, b))
        view._maps = self._maps  # views share the open shards: a window's read opens at most the shards it spans
        return view

    def __array__(self, dtype=None, copy=None):
        lo, hi = self.start, self.stop
        first = int(np.searchsorted(self.offsets, lo, side="right")) - 1
        pieces = []
        i = max(first, 0)
        while lo < hi:
            end = min(hi, int(self.offsets[i + 1]))
            pieces.append(self._shard(i)[lo - self.offsets[i]: end - self.offsets[i]])
            lo, i = end, i + 1
        out = np.concatenate(pieces) if pieces else np.zeros(0, self.dtype)
        return out.astype(dtype) if dtype is not None else out

    def chunks(self, size: int = 1 << 26):
        """The stream's tokens in pieces of at most ``size`` (for one pass over a large stream)."""
        for lo in range(0, len(self), size):
            yield np.asarray(self[lo: lo + size])


class RemoteShard:
    """A raw token shard on an object store (``s3://``, ``gs://``; a ``prepare`` shard), read through TensorStore's
    own kvstore driver: each step-1 slice is one ranged GET of just its bytes (a window of ``seq_len + 1`` tokens),
    so nothing is downloaded ahead and no local copy is kept."""

    def __init__(self, url: str, dtype: str, length: int):
        import tensorstore as ts

        base, _, self.key = url.rpartition("/")
        self.url, self.dtype, self.length = url, np.dtype(dtype), length
        self._store = ts.KvStore.open(rundir.kvstore_spec(base)).result()

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, key: slice) -> np.ndarray:
        a, b, _ = key.indices(self.length)
        if b <= a:
            return np.zeros(0, self.dtype)
        item = self.dtype.itemsize
        got = self._store.read(self.key, byte_range=slice(a * item, b * item)).result()
        if got.state != "value" or len(got.value) != (b - a) * item:
            raise ConfigError(f"shard {self.url!r} could not be read (tokens {a}..{b}: {got.state}, "
                              f"{len(got.value)} bytes); it changed or vanished since its index was read")
        return np.frombuffer(got.value, self.dtype)


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


def _open_stream(path: str, cfg: DataConfig, meta: dict) -> np.ndarray:
    """The token file as a read-only array (memory-mapped); ConfigError for a file that is not one."""
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


def _chunks(stream, size: int = 1 << 26):
    if isinstance(stream, Stream):
        yield from stream.chunks(size)
    else:
        for i in range(0, len(stream), size):
            yield stream[i:i + size]


def check_token_ids(stream, source: str, vocab_size: int) -> None:
    """ConfigError naming the largest id when a token id lies outside [0, vocab_size): the embedding lookup would
    silently clamp it (XLA gathers clamp out-of-range indices), training on the wrong token. One pass over the
    file, in chunks (about 0.2 s per GB from the page cache; see docs/failures.md)."""
    hi, lo = 0, 0
    for chunk in _chunks(stream):
        hi = max(hi, int(chunk.max()))
        lo = min(lo, int(chunk.min())) if chunk.dtype.kind == "i" else lo
    if hi >= vocab_size:
        raise ConfigError(f"data.source {source!r} holds token id {hi} (its largest), which model.vocab_size="
                          f"{vocab_size} cannot represent; set model.vocab_size={hi + 1} or more")
    if lo < 0:
        raise ConfigError(f"data.source {source!r} holds the negative token id {lo}; token ids start at 0")


def tokenizer_json(path: str, what: str = "data.tokenizer") -> str:
    """The ``tokenizer.json`` a tokenizer path names (the file, or a directory holding it)."""
    file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
    if not os.path.isfile(file):
        raise ConfigError(f"{what}={path!r} is neither a tokenizer.json nor a directory holding one")
    return file


def file_sha256(path: str) -> str:
    """Hex SHA-256 of a file's bytes (how an index names its tokenizer)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def read_index(directory: str) -> dict:
    """``prepare``'s index.json of a shard directory, its shards checked against their files: ConfigError for a
    shard that is missing or whose size differs from the index (an altered or partly copied directory)."""
    path = rundir.join(directory, INDEX)
    try:
        if rundir.is_remote(path):  # s3:// or gs:// through etils.epath (s3fs, gcsfs)
            from etils import epath

            index = json.loads(epath.Path(path).read_text())
        else:
            with open(path, encoding="utf-8") as f:
                index = json.load(f)
        shards, dtype = index["shards"], np.dtype(index["dtype"])
        assert isinstance(shards, list) and shards
    except (OSError, ValueError, KeyError, TypeError, AssertionError) as e:
        raise ConfigError(f"{path!r} is not a prepare index ({_short(e) or 'no shards'}); run prepare again") from None
    for shard in shards:
        file = rundir.join(directory, shard["file"])
        expected = int(shard["tokens"]) * dtype.itemsize
        size = _size(file)
        if size != expected:
            have = "is missing" if size is None else f"has {size} bytes"
            raise ConfigError(f"shard {file!r} {have} but {path} lists {shard['tokens']} {dtype} tokens "
                              f"({expected} bytes); the directory does not match its index: run prepare again")
    return index


def _size(file: str) -> int | None:
    """A file's size in bytes, local or on an object store; None when there is no such file."""
    if not rundir.is_remote(file):
        return os.path.getsize(file) if os.path.isfile(file) else None
    from etils import epath

    try:
        return int(epath.Path(file).stat().length)
    except FileNotFoundError:
        return None


def _shard_stream(spec: str, cfg: DataConfig, what: str) -> tuple[np.ndarray | Stream, int, bool]:
    """(stream, vocabulary the data needs or 0 if unknown, whether the ids still need a range check) of a file,
    a directory of shards or a glob."""
    if rundir.is_remote(spec) or os.path.isdir(spec):
        if rundir.is_remote(spec) or os.path.exists(os.path.join(spec, INDEX)):  # remote: prepare's output only
            index = read_index(spec)
            tok = cfg.tokenizer
            if tok is not None and index.get("tokenizer_sha256") != file_sha256(tokenizer_json(tok)):
                raise ConfigError(f"{what} {spec!r} was tokenised with {index.get('tokenizer')!r} "
                                  f"(sha256 {str(index.get('tokenizer_sha256'))[:12]}), not data.tokenizer={tok!r}; "
                                  "prepare the data with that tokenizer or set data.tokenizer to the one it names")
            files = [rundir.join(spec, s["file"]) for s in index["shards"]]
            lengths = [int(s["tokens"]) for s in index["shards"]]
            return Stream(files, [index["dtype"]] * len(files), lengths), int(index["vocab_size"]), False
        partial = sorted(glob.glob(os.path.join(spec, "*.tmp")))
        if partial:
            raise ConfigError(f"{what} {spec!r} holds {os.path.basename(partial[0])} and no {INDEX}: an "
                              "interrupted prepare; run it again")
        files = sorted(f for f in glob.glob(os.path.join(spec, "*")) if f.endswith((".bin", ".npy")))
        if not files:
            raise ConfigError(f"{what} {spec!r} is a directory without an {INDEX} or .bin/.npy token files")
    elif any(ch in spec for ch in "*?["):
        files = sorted(f for f in glob.glob(spec) if os.path.isfile(f) and not f.endswith((".json", ".tmp")))
        if not files:
            raise ConfigError(f"{what} {spec!r} matches no files")
    else:
        meta = _read_sidecar(spec)
        return _open_stream(spec, cfg, meta), int(meta.get("vocab_size", 0)), True
    dtypes, lengths = [], []
    for f in files:
        arr = _open_stream(f, cfg, _read_sidecar(f))
        dtypes.append(str(arr.dtype))
        lengths.append(len(arr))
    return Stream(files, dtypes, lengths), 0, True


def load_source(spec: str, cfg: DataConfig, vocab_size: int, what: str = "data.source") -> Tokens:
    """One source (a token file, a directory of shards or a glob, or embedded/synthetic) split into train and eval;
    ConfigError if the model's vocabulary cannot represent it or it is too short."""
    stream: np.ndarray | Stream
    if spec == "embedded":
        stream, needed, scan = np.frombuffer(embedded_corpus(), dtype=np.uint8), 256, False
    elif spec == "synthetic":
        stream, needed, scan = synthetic_tokens(vocab_size, 1 << 20), vocab_size, False
    else:
        stream, needed, scan = _shard_stream(spec, cfg, what)
    if needed > vocab_size:
        raise ConfigError(f"model.vocab_size={vocab_size} is smaller than the data's vocabulary ({needed} tokens); "
                          f"set model.vocab_size={needed} or more")
    if scan:  # an index vouches for its ids (prepare wrote them from a vocabulary of that size); anything else: read
        check_token_ids(stream, spec, vocab_size)  # with or without a sidecar: nanoGPT's .bin have none
    n_eval = int(len(stream) * cfg.eval_fraction)
    min_len = 2 * (cfg.seq_len + 1)
    if n_eval < cfg.seq_len + 1 or len(stream) - n_eval < min_len:
        raise ConfigError(f"{what} {spec!r} has {len(stream)} tokens, too few for data.seq_len="
                          f"{cfg.seq_len} with data.eval_fraction={cfg.eval_fraction}")
    return Tokens(train=stream[: len(stream) - n_eval], eval=stream[len(stream) - n_eval:], vocab_size=needed)


class Windows:
    """Random-access source of non-overlapping windows of ``seq_len + 1`` tokens, as int32."""

    def __init__(self, tokens: np.ndarray | Stream, seq_len: int):
        self.tokens, self.seq_len = tokens, seq_len

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // self.seq_len

    def __getitem__(self, i: int) -> np.ndarray:
        start = int(i) * self.seq_len
        return np.asarray(self.tokens[start: start + self.seq_len + 1], dtype=np.int32)


def _local_batches(examples: grain.MapDataset, global_batch: int, rows: tuple[int, int], num_batches: int):
    import grain

    lo, hi = rows

    def read(step):
        base = int(step) * global_batch
        return np.stack([examples[base + r] for r in range(lo, hi)])

    return grain.MapDataset.range(num_batches).map(read)


class Rows:
    """Random-access source of ready rows [n, seq_len + 1] (chat data), as int32."""

    def __init__(self, rows: np.ndarray | Stream):
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> np.ndarray:
        return np.asarray(self.rows[int(i)], dtype=np.int32)


def _examples(part, seq_len: int):
    return Rows(part) if getattr(part, "ndim", 1) == 2 else Windows(part, seq_len)


def train_batches(tokens: Tokens | Mixture, cfg: DataConfig, *, seed: int, global_batch: int, steps: int,
                  rows: tuple[int, int]) -> grain.IterDataset:
    """This process's rows of each step's global batch: an iterator of int32 [hi - lo, seq_len + 1].

    Row ``r`` of step ``s`` is example ``s * global_batch + r`` of the shuffled, repeated window stream (of a
    mixture: of the interleaving of its parts' shuffled, repeated streams, part ``i`` shuffled with ``seed + i``).
    """
    import grain

    if isinstance(tokens, Mixture):
        parts = [grain.MapDataset.source(_examples(p.train, cfg.seq_len)).shuffle(seed=seed + i).repeat()
                 for i, p in enumerate(tokens.parts)]
        examples = grain.MapDataset.mix(parts, tokens.weights)
    else:
        examples = grain.MapDataset.source(_examples(tokens.train, cfg.seq_len)).shuffle(seed=seed).repeat()
    ds = _local_batches(examples, global_batch, rows, steps)
    return ds.to_iter_dataset(grain.ReadOptions(num_threads=cfg.threads, prefetch_buffer_size=cfg.prefetch))


def eval_batches(tokens: Tokens | Mixture, cfg: DataConfig, *, global_batch: int, num_batches: int,
                 rows: tuple[int, int]) -> list[np.ndarray]:
    """The held-out batches (same every evaluation, unshuffled, wrapping around a short split; a mixture's parts
    interleaved by their weights)."""
    import grain

    if isinstance(tokens, Mixture):
        examples = grain.MapDataset.mix([grain.MapDataset.source(_examples(p.eval, cfg.seq_len)).repeat()
                                         for p in tokens.parts], tokens.weights)
    elif getattr(tokens.eval, "ndim", 1) == 2:
        examples = grain.MapDataset.source(Rows(tokens.eval)).repeat()
    else:
        examples = grain.MapDataset.source(Windows(tokens.eval, cfg.seq_len)).repeat()
    return list(_local_batches(examples, global_batch, rows, num_batches))
