"""Token sources of many shards and weighted mixtures (jaxtrain/data/tokens.py): a directory or glob reads as the
concatenation of its shards, prepare's index is checked against the files and the tokenizer, mixtures draw in
proportion to their weights, and the global batch of a step does not depend on how rows are split over processes
nor on where the iterator was resumed."""

import json
import os

import numpy as np
import pytest

from jaxtrain import data as data_lib
from jaxtrain.config import load_config
from jaxtrain.errors import ConfigError

SEQ = 16


def _shards(directory, sizes, start=0, dtype="uint16"):
    """Raw shards 0..n holding the consecutive ids start, start+1, ... (so a window names where it came from)."""
    os.makedirs(directory, exist_ok=True)
    ids = np.arange(start, start + sum(sizes)) % 60000
    offset = 0
    for i, n in enumerate(sizes):
        ids[offset:offset + n].astype(dtype).tofile(os.path.join(directory, f"part-{i:03d}.bin"))
        offset += n
    return ids


def _cfg(*overrides):
    return load_config(None, [f"data.seq_len={SEQ}", "data.threads=0", "model.vocab_size=60000", *overrides]).data


def test_a_directory_and_a_glob_read_as_one_stream_across_shard_boundaries(tmp_path):
    ids = _shards(tmp_path / "d", [1000, 37, 2000, 963])
    for spec in (str(tmp_path / "d"), str(tmp_path / "d" / "part-*.bin")):
        tokens = data_lib.load_tokens(_cfg(f"data.source={spec}"), 60000)
        assert isinstance(tokens.train, data_lib.Stream) and len(tokens.train) + len(tokens.eval) == len(ids)
        np.testing.assert_array_equal(np.asarray(tokens.train), ids[: len(tokens.train)])
        np.testing.assert_array_equal(np.asarray(tokens.eval), ids[len(tokens.train):])
        w = data_lib.Windows(tokens.train, SEQ)
        for i in (0, 62, 63, 64, len(w) - 1):  # window 62 spans the 1000/37 boundary, 64 the 1037/3037 one
            np.testing.assert_array_equal(w[i], ids[i * SEQ: i * SEQ + SEQ + 1])


def test_an_index_is_checked_against_its_shards_and_tokenizer(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    text = tmp_path / "t.jsonl"
    text.write_text("".join(json.dumps({"text": f"document {i} " * 40}) + "\n" for i in range(60)))
    out = tmp_path / "shards"
    data_lib.prepare([str(text)], str(out), shard_tokens=3000)
    index = json.loads((out / "index.json").read_text())
    assert len(index["shards"]) > 2 and index["tokenizer"] == "bytes" and index["vocab_size"] == 256
    tokens = data_lib.load_tokens(_cfg(f"data.source={out}"), 256)
    assert len(tokens.train) + len(tokens.eval) == index["tokens"]
    # Nothing is read or opened at load (the index vouches for the ids); a window opens the shards it spans.
    assert tokens.train._maps == {}
    data_lib.Windows(tokens.train, SEQ)[0]
    assert set(tokens.train._maps) == {0}
    # A model vocabulary smaller than the index's.
    with pytest.raises(ConfigError, match="model.vocab_size=200 is smaller than the data's vocabulary \\(256"):
        data_lib.load_tokens(_cfg(f"data.source={out}"), 200)
    # A tokenizer other than the one the index names.
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({"[UNK]": 0, "document": 1}, unk_token="[UNK]"))
    tok.save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(ConfigError, match="was tokenised with 'bytes'.*not data.tokenizer="):
        data_lib.load_tokens(_cfg(f"data.source={out}", f"data.tokenizer={tmp_path / 'tokenizer.json'}"), 256)
    # A shard cut short (a partial copy) or missing.
    shard = out / index["shards"][1]["file"]
    shard.write_bytes(shard.read_bytes()[:-2])
    with pytest.raises(ConfigError, match="has 5998 bytes but .* lists 3000 uint16 tokens"):
        data_lib.load_tokens(_cfg(f"data.source={out}"), 256)
    shard.unlink()
    with pytest.raises(ConfigError, match="is missing but"):
        data_lib.load_tokens(_cfg(f"data.source={out}"), 256)


def test_raw_shards_are_range_checked_and_bad_mixtures_exit(tmp_path):
    ids = _shards(tmp_path / "d", [500, 500])
    with pytest.raises(ConfigError, match=f"holds token id {ids.max()} \\(its largest\\)"):
        data_lib.load_tokens(_cfg(f"data.source={tmp_path / 'd'}"), 900)
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "shard-00000.bin.tmp").write_bytes(b"\0\0")
    with pytest.raises(ConfigError, match="an interrupted prepare"):
        data_lib.load_tokens(_cfg(f"data.source={tmp_path / 'empty'}"), 60000)
    bad = {"weight 0": ("[{source: embedded, weight: 0}]", "data.mixture\\[0\\].weight=0 must be a number > 0"),
           "negative": ("[{source: embedded, weight: 1}, {source: embedded, weight: -2}]",
                        "data.mixture\\[1\\].weight=-2 must be"),
           "no files": (f"[{{source: '{tmp_path}/nothing-*.bin', weight: 1}}]", "matches no files"),
           "shape": ("[{source: embedded}]", "must be a mapping \\{source: PATH, weight: W\\}")}
    for value, message in bad.values():
        with pytest.raises(ConfigError, match=message):
            load_config(None, [f"data.mixture={value}"])
    with pytest.raises(ConfigError, match="both set"):
        load_config(None, ["data.source=synthetic", "data.mixture=[{source: embedded, weight: 1}]"])


def _mixture(tmp_path, weights):
    """A mixture of len(weights) sources whose ids lie in disjoint ranges (source i: i*10000 + ...)."""
    entries = []
    for i, w in enumerate(weights):
        _shards(tmp_path / f"s{i}", [4000 + 1000 * i], start=i * 10000)
        entries.append(f"{{source: '{tmp_path / f's{i}'}', weight: {w}}}")
    return _cfg(f"data.mixture=[{', '.join(entries)}]")


def test_mixture_proportions_within_one_percent_over_10000_sequences(tmp_path):
    weights = [0.6, 0.3, 0.1]
    cfg = _mixture(tmp_path, weights)
    tokens = data_lib.load_tokens(cfg, 60000)
    assert isinstance(tokens, data_lib.Mixture)
    batches = list(data_lib.train_batches(tokens, cfg, seed=0, global_batch=100, steps=100, rows=(0, 100)))
    source = np.concatenate(batches)[:, 0] // 10000
    shares = np.bincount(source, minlength=3) / len(source)
    assert len(source) == 10000
    np.testing.assert_allclose(shares, weights, atol=0.01)
    # Each part is its own shuffled, repeated window stream: every part's windows are whole.
    rows = np.concatenate(batches)
    np.testing.assert_array_equal(np.diff(rows, axis=1), 1)


def test_mixture_batches_do_not_depend_on_the_row_split_and_resume_continues_the_stream(tmp_path):
    cfg = _mixture(tmp_path, [2, 1])
    tokens = data_lib.load_tokens(cfg, 60000)
    whole = list(data_lib.train_batches(tokens, cfg, seed=3, global_batch=8, steps=6, rows=(0, 8)))
    halves = [list(data_lib.train_batches(tokens, cfg, seed=3, global_batch=8, steps=6, rows=r))
              for r in ((0, 4), (4, 8))]
    for s in range(6):
        np.testing.assert_array_equal(np.concatenate([halves[0][s], halves[1][s]]), whole[s])
    it = iter(data_lib.train_batches(tokens, cfg, seed=3, global_batch=8, steps=6, rows=(0, 2)))
    for _ in range(3):
        next(it)
    state = it.get_state()
    resumed = iter(data_lib.train_batches(tokens, cfg, seed=3, global_batch=8, steps=6, rows=(0, 8)))
    resumed.set_state(state)  # another row split (device count) picks up at the same step
    for s in range(3, 6):
        np.testing.assert_array_equal(next(resumed), whole[s])
    evals = data_lib.eval_batches(tokens, cfg, global_batch=8, num_batches=2, rows=(0, 8))
    assert {int(r[0]) // 10000 for b in evals for r in b} == {0, 1}
