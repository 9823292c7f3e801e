import numpy as np
import pytest

from jaxtrain import data as data_lib
from jaxtrain.config import ConfigError, load_config
from jaxtrain.parallel.dims import MeshShape, ParallelDims
from jaxtrain_testing import MESHES


def _tokens(cfg):
    return data_lib.load_tokens(cfg.data, cfg.model.vocab_size)


def _batches(cfg, tokens, rows, steps=3, seed=0):
    it = data_lib.train_batches(tokens, cfg.data, seed=seed, global_batch=cfg.train.global_batch, steps=steps,
                                rows=rows)
    return list(it)


@pytest.mark.parametrize("processes", [2, 4, 8])
def test_process_slices_are_disjoint_and_cover_the_global_batch(processes):
    cfg = load_config(None, ["data.threads=0"])
    tokens = _tokens(cfg)
    gb = cfg.train.global_batch
    whole = _batches(cfg, tokens, (0, gb))
    per = gb // processes
    parts = [_batches(cfg, tokens, (p * per, (p + 1) * per)) for p in range(processes)]
    for step in range(3):
        np.testing.assert_array_equal(np.concatenate([part[step] for part in parts]), whole[step])
        rows = {tuple(r) for part in parts for r in part[step]}
        assert len(rows) == gb  # no row read twice


def test_same_seed_same_batches_other_seed_other_batches():
    cfg = load_config(None, [])
    tokens = _tokens(cfg)
    a, b = _batches(cfg, tokens, (0, 16)), _batches(cfg, tokens, (0, 16))
    c = _batches(cfg, tokens, (0, 16), seed=1)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)
    assert not np.array_equal(a[0], c[0])
    assert a[0].shape == (16, cfg.data.seq_len + 1) and a[0].dtype == np.int32
    assert not np.array_equal(a[0], a[1])


def test_windows_are_next_token_aligned_text():
    cfg = load_config(None, [])
    tokens = _tokens(cfg)
    batch = _batches(cfg, tokens, (0, 16), steps=1)[0]
    text = bytes(batch.astype(np.uint8).ravel()).decode("utf-8", errors="replace")
    assert sum(ch.isalpha() for ch in text) > len(text) // 3  # real English documentation, not noise
    # What the name promises: each row is seq_len + 1 consecutive tokens of the stream, starting on a window
    # boundary (input i's target is token i + 1 of the text).
    corpus = tokens.train.tobytes()
    for row in batch:
        start = corpus.find(bytes(row.astype(np.uint8)))
        assert start >= 0 and start % cfg.data.seq_len == 0
    assert " the " in text
    assert len(tokens.train) > 400_000 and len(tokens.eval) > 20_000


def test_train_and_eval_splits_do_not_overlap():
    cfg = load_config(None, [])
    tokens = _tokens(cfg)
    full = np.frombuffer(data_lib.embedded_corpus(), dtype=np.uint8)
    np.testing.assert_array_equal(np.concatenate([tokens.train, tokens.eval]), full)
    evals = data_lib.eval_batches(tokens, cfg.data, global_batch=16, num_batches=2, rows=(0, 16))
    assert len(evals) == 2 and evals[0].shape == (16, cfg.data.seq_len + 1)


@pytest.mark.parametrize("name", list(MESHES))
def test_default_global_batch_divides_over_every_tested_mesh(name):
    overrides = MESHES[name]
    cfg = load_config(None, overrides)
    ParallelDims(cfg, MeshShape.resolve(cfg.mesh, 8)).check()  # raises if not


def test_npy_source_and_vocab_check(tmp_path):
    path = tmp_path / "t.npy"
    np.save(path, np.arange(20_000, dtype=np.uint32) % 1000)
    cfg = load_config(None, [f"data.source={path}", "model.vocab_size=1000"])
    tokens = _tokens(cfg)
    assert len(tokens.train) + len(tokens.eval) == 20_000
    (tmp_path / "t.npy.json").write_text('{"vocab_size": 5000}')
    with pytest.raises(ConfigError, match="model.vocab_size=1000 is smaller than the data's vocabulary"):
        _tokens(cfg)


def test_synthetic_source_is_deterministic():
    a = data_lib.synthetic_tokens(64, 1000)
    np.testing.assert_array_equal(a, data_lib.synthetic_tokens(64, 1000))
    assert a.max() < 64


def test_prepare_with_a_local_tokenizer_json(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, pre_tokenizers, trainers

    corpus = data_lib.embedded_corpus().decode("utf-8").split("\0")[:20]
    tok = tokenizers.Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel()
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=500, special_tokens=["<unk>", "<|endoftext|>"]))
    tok_path = tmp_path / "tokenizer.json"
    tok.save(str(tok_path))
    docs = []
    for i, text in enumerate(corpus[:3]):
        p = tmp_path / f"d{i}.txt"
        p.write_text(text)
        docs.append(str(p))
    meta = data_lib.prepare(docs, str(tmp_path / "out.bin"), str(tok_path))
    ids = np.memmap(tmp_path / "out.bin", dtype=meta["dtype"], mode="r")
    eot = tok.token_to_id("<|endoftext|>")
    assert meta["vocab_size"] == tok.get_vocab_size() and (ids == eot).sum() == 2
    assert list(ids[: 10]) == tok.encode(corpus[0]).ids[:10]


@pytest.mark.parametrize("dtype, where", [("uint16", 0), ("uint16", -1), ("uint32", 12345), ("int64", 777)])
def test_token_id_range_is_checked_over_the_whole_file(tmp_path, dtype, where):
    """An id past model.vocab_size anywhere (first, last, middle) is named, with or without a sidecar; the largest
    id is found as NumPy's max finds it."""
    ids = (np.arange(20000) % 250).astype(dtype)
    ids[where] = 40000
    path = tmp_path / ("t.npy" if dtype == "int64" else "t.bin")
    np.save(path, ids) if dtype == "int64" else ids.tofile(path)
    cfg = load_config(None, [f"data.source={path}", f"data.token_dtype={dtype if dtype != 'int64' else 'uint16'}",
                             "data.seq_len=16"])
    with pytest.raises(ConfigError, match=f"holds token id {int(ids.max())} \\(its largest\\), which "
                                          "model.vocab_size=256 cannot represent; set model.vocab_size=40001"):
        _tokens(cfg)
    ids[where] = 255  # all in range again: loads
    np.save(path, ids) if dtype == "int64" else ids.tofile(path)
    tokens = _tokens(cfg)
    assert max(tokens.train.max(), tokens.eval.max()) == 255
