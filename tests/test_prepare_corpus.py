"""``prepare`` at corpus scale (jaxtrain/data/prepare.py): .txt/.jsonl/.parquet inputs, directories and globs,
streamed in blocks over worker processes with the same output for any worker count, documents separated by eos,
shards of bounded size with an index, and an interrupted run that leaves nothing looking complete."""

import json
import os

import numpy as np
import pytest

from jaxtrain import data as data_lib
from jaxtrain.config import load_config
from jaxtrain.data import corpus as prepare_lib
from jaxtrain.errors import ConfigError
from jaxtrain_testing import run_cli


def _docs(n, seed=0):
    rng = np.random.default_rng(seed)
    words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "theta", "ünïcode", "naïve", "日本"]
    return [" ".join(rng.choice(words, size=rng.integers(5, 400))) + "\n" for _ in range(n)]


def _corpus(tmp_path, n=300, repeat=3000):
    """A directory with a .txt, a .jsonl and a .parquet file; returns (directory, documents in input order)."""
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    d = tmp_path / "corpus"
    d.mkdir()
    docs = _docs(n)
    (d / "a.jsonl").write_text("".join(json.dumps({"id": i, "text": t}) + "\n" for i, t in enumerate(docs[:n // 2])))
    pq.write_table(pa.table({"text": docs[n // 2: n - 1], "n": list(range(n // 2, n - 1))}), d / "b.parquet",
                   row_group_size=37)
    (d / "c.txt").write_text(docs[n - 1] * repeat)  # one document (large: read in several blocks)
    return d, docs[: n - 1] + [docs[n - 1] * repeat]


def _read(out):
    index = json.loads((out / "index.json").read_text())
    return np.concatenate([np.fromfile(out / s["file"], dtype=index["dtype"]) for s in index["shards"]]), index


def test_byte_level_output_is_the_documents_joined_by_nul_in_input_order(tmp_path, monkeypatch):
    monkeypatch.setattr(prepare_lib, "BLOCK_BYTES", 4096)  # many blocks, parquet batches and text pieces
    d, docs = _corpus(tmp_path)
    out = tmp_path / "bytes"
    meta = data_lib.prepare([str(d)], str(out), shard_tokens=50_000, workers=1)
    ids, index = _read(out)
    expected = np.frombuffer(b"\0".join(t.encode("utf-8") for t in docs), np.uint8)
    np.testing.assert_array_equal(ids, expected)
    assert index["documents"] == len(docs) == meta["documents"] and index["tokens"] == len(expected)
    sizes = [s["tokens"] for s in index["shards"]]
    assert all(n == 50_000 for n in sizes[:-1]) and 0 < sizes[-1] <= 50_000 and len(sizes) > 3
    assert not os.path.exists(str(out) + ".partial") and index["vocab_size"] == 256 and index["dtype"] == "uint16"
    # A glob of the same files in the same order gives the same tokens.
    glob_out = tmp_path / "glob"
    data_lib.prepare([str(d / "*.jsonl"), str(d / "b.parquet"), str(d / "c.*")], str(glob_out), workers=1)
    np.testing.assert_array_equal(_read(glob_out)[0], expected)


def test_tokenizer_output_is_identical_for_1_and_3_workers_and_matches_encode(tmp_path, monkeypatch):
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, pre_tokenizers, trainers

    monkeypatch.setattr(prepare_lib, "BLOCK_BYTES", 8192)
    d, docs = _corpus(tmp_path, n=80, repeat=2)
    tok = tokenizers.Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel()
    tok.train_from_iterator(docs[:50], trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "</s>"]))
    tok.save(str(tmp_path / "tokenizer.json"))
    outs = {}
    for workers in (1, 3):
        outs[workers] = tmp_path / f"w{workers}"
        data_lib.prepare([str(d)], str(outs[workers]), str(tmp_path / "tokenizer.json"), workers=workers,
                         shard_tokens=5_000)
    files = sorted(os.listdir(outs[1]))
    assert files == sorted(os.listdir(outs[3])) and len(files) > 2
    for f in files:
        if f != "index.json":
            assert (outs[1] / f).read_bytes() == (outs[3] / f).read_bytes(), f
    ids, index = _read(outs[1])
    eos = tok.token_to_id("</s>")
    assert index["eos_id"] == eos
    assert index["tokenizer_sha256"] == data_lib.file_sha256(str(tmp_path / "tokenizer.json"))
    # Each document encoded whole (a .txt larger than a block would be encoded in pieces of whole lines).
    expected = []
    for i, t in enumerate(docs):
        expected += ([eos] if i else []) + tok.encode(t, add_special_tokens=False).ids
    np.testing.assert_array_equal(ids, expected)
    assert index["documents"] == len(docs)


@pytest.mark.parametrize("workers", [1, 2])
@pytest.mark.parametrize("out_name", ["out", "out.bin", "out.npy"])
def test_a_malformed_line_leaves_nothing_behind(tmp_path, workers, out_name):
    """The bad line is found after shards were written (a small --shard-tokens, a good file first): the error names
    it, and neither the output, its .partial directory nor a raw or .tmp file is left; what was there stays."""
    good = tmp_path / "a.jsonl"
    good.write_text("".join(json.dumps({"text": t}) + "\n" for t in _docs(200)))
    bad = tmp_path / "b.jsonl"
    bad.write_text(json.dumps({"text": "fine"}) + "\n" + json.dumps({"body": "no text"}) + "\n")
    (tmp_path / "out.raw").write_text("someone else's file\n")  # beside the output: not prepare's to remove
    before = sorted(os.listdir(tmp_path))
    with pytest.raises(ConfigError, match="b.jsonl:2 has no string field 'text' \\(--text-field\\)"):
        data_lib.prepare([str(good), str(bad)], str(tmp_path / out_name), shard_tokens=5000, workers=workers)
    assert sorted(os.listdir(tmp_path)) == before
    assert (tmp_path / "out.raw").read_text() == "someone else's file\n"


def test_a_killed_prepare_leaves_nothing_that_looks_complete(tmp_path):
    """What a killed prepare leaves (shards written, the last one still .tmp, no index: made here by the writer
    itself, stopped before it finishes) is refused by training and replaced by a rerun."""
    good = tmp_path / "a.jsonl"
    good.write_text("".join(json.dumps({"text": t}) + "\n" for t in _docs(200)))
    out = tmp_path / "out"
    partial = tmp_path / "out.partial"
    partial.mkdir()
    shards = prepare_lib._Shards(str(partial), "uint16", 5000)
    shards.write(np.arange(12000, dtype=np.uint32) % 256)  # two full shards and a third still open
    assert sorted(os.listdir(partial)) == ["shard-00000.bin", "shard-00001.bin", "shard-00002.bin.tmp"]
    with pytest.raises(ConfigError):  # no index and an unfinished .tmp shard: refused
        data_lib.load_tokens(load_config(None, [f"data.source={partial}", "data.seq_len=16"]).data, 256)
    meta = data_lib.prepare([str(good)], str(out), shard_tokens=5000, workers=2)  # a rerun replaces the partial
    assert (out / "index.json").exists() and not partial.exists() and meta["documents"] == 200


def test_bad_inputs_exit_with_one_line(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"content": ["a", "b"]}), tmp_path / "x.parquet")
    with pytest.raises(ConfigError, match="parquet file .*x.parquet' has no column 'text' \\(--text-field\\); its "
                                          "columns: content"):
        data_lib.prepare([str(tmp_path / "x.parquet")], str(tmp_path / "o"))
    assert data_lib.prepare([str(tmp_path / "x.parquet")], str(tmp_path / "o2"), text_field="content")["tokens"] == 3
    with pytest.raises(ConfigError, match="matches no files"):
        data_lib.prepare([str(tmp_path / "nothing*.jsonl")], str(tmp_path / "o3"))
    (tmp_path / "j.jsonl").write_text('{"text": "ok"}\n[1, 2\n')
    with pytest.raises(ConfigError, match="j.jsonl:2 is not JSON"):
        data_lib.prepare([str(tmp_path / "j.jsonl")], str(tmp_path / "o4"))


def test_cli_prepares_shards_with_progress_and_training_reads_them(tmp_path):
    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"body": t}) + "\n" for t in _docs(400)))
    r = run_cli("prepare", str(tmp_path / "a.jsonl"), "--out", str(tmp_path / "out"), "--text-field", "body",
                "--workers", "2", "--shard-tokens", "30000")
    assert r.returncode == 0, r.stderr
    assert "MB/s" in r.stderr and "ETA" in r.stderr and "400 documents" in r.stdout and "shard(s)" in r.stdout
    tokens = data_lib.load_tokens(load_config(None, [f"data.source={tmp_path / 'out'}", "data.seq_len=64"]).data, 256)
    assert len(tokens.train) > 30000
