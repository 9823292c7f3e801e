"""The data contract against hand computations: windows, their stride, batches, evaluation batches, segments.

Contract (jaxtrain/data.py's docstring, docs/training.md): training examples are windows of seq_len + 1 tokens taken
every seq_len tokens (consecutive windows share exactly the one token that is the last target of one and the first
input of the next), shuffled by train.seed and repeated epoch after epoch; row r of step s is example
s * global_batch + r. Evaluation windows are the same cut of the held-out tail, in order, wrapping around.
The token stream here is 0, 1, 2, ... so that every window names its own start.
"""

import jax.numpy as jnp
import numpy as np
import pytest

from jaxtrain import data as data_lib
from jaxtrain.config import load_config
from jaxtrain.train.step import document_segments

SEQ = 8


def _cfg(*overrides):
    return load_config(None, [f"data.seq_len={SEQ}", "data.threads=0", *overrides]).data


def _tokens(n_train=12 * SEQ + 1, n_eval=5 * SEQ + 3):
    stream = np.arange(n_train + n_eval, dtype=np.int64)
    return data_lib.Tokens(train=stream[:n_train], eval=stream[n_train:], vocab_size=n_train + n_eval)


def test_windows_have_stride_seq_len_and_share_one_token():
    tokens = np.arange(100)
    w = data_lib.Windows(tokens, SEQ)
    assert len(w) == (100 - 1) // SEQ == 12
    for i in range(len(w)):
        np.testing.assert_array_equal(w[i], np.arange(i * SEQ, i * SEQ + SEQ + 1))
        assert w[i].dtype == np.int32
    for i in range(len(w) - 1):
        assert set(w[i]) & set(w[i + 1]) == {(i + 1) * SEQ}  # only the shifted target token is shared
    # The last window still has its full seq_len + 1 tokens: no short window at the end, also when the stream is a
    # whole number of windows' strides long (96 tokens = 12 strides hold only 11 windows of 9).
    assert len(w[len(w) - 1]) == SEQ + 1 and (len(w)) * SEQ + 1 <= 100
    assert len(data_lib.Windows(np.arange(96), SEQ)) == 11 and len(data_lib.Windows(np.arange(97), SEQ)) == 12


@pytest.mark.parametrize("seed", [0, 3])
def test_each_epoch_visits_every_window_once_in_a_seeded_order(seed):
    tokens = _tokens()  # 12 windows; 4 rows a step: an epoch is 3 steps
    batches = list(data_lib.train_batches(tokens, _cfg(), seed=seed, global_batch=4, steps=6, rows=(0, 4)))
    assert len(batches) == 6 and all(b.shape == (4, SEQ + 1) and b.dtype == np.int32 for b in batches)
    rows = np.concatenate(batches)
    starts = rows[:, 0]
    np.testing.assert_array_equal(rows, starts[:, None] + np.arange(SEQ + 1))  # whole, contiguous windows
    assert (starts % SEQ == 0).all()
    windows = np.arange(12) * SEQ
    for epoch in (starts[:12], starts[12:]):
        np.testing.assert_array_equal(np.sort(epoch), windows)  # every window exactly once per epoch
    assert not np.array_equal(starts[:12], windows)  # shuffled
    other = np.concatenate(list(data_lib.train_batches(tokens, _cfg(), seed=seed + 1, global_batch=4, steps=3,
                                                       rows=(0, 4))))
    assert not np.array_equal(other[:, 0], starts[:12])  # by the seed


def test_a_process_reads_exactly_its_rows_of_each_global_batch():
    tokens = _tokens()
    whole = list(data_lib.train_batches(tokens, _cfg(), seed=0, global_batch=4, steps=5, rows=(0, 4)))
    part = list(data_lib.train_batches(tokens, _cfg(), seed=0, global_batch=4, steps=5, rows=(1, 3)))
    for w, p in zip(whole, part, strict=True):
        np.testing.assert_array_equal(p, w[1:3])


def test_resuming_the_iterator_continues_with_the_next_global_batch():
    tokens = _tokens()
    whole = list(data_lib.train_batches(tokens, _cfg(), seed=0, global_batch=4, steps=5, rows=(0, 4)))
    it = iter(data_lib.train_batches(tokens, _cfg(), seed=0, global_batch=4, steps=5, rows=(0, 4)))
    next(it), next(it)
    state = it.get_state()
    fresh = iter(data_lib.train_batches(tokens, _cfg(), seed=0, global_batch=4, steps=5, rows=(0, 4)))
    fresh.set_state(state)
    for step in (2, 3, 4):
        np.testing.assert_array_equal(next(fresh), whole[step])


def test_eval_batches_are_the_held_out_windows_in_order_wrapping_around():
    tokens = _tokens()
    n_train = len(tokens.train)
    n_windows = (len(tokens.eval) - 1) // SEQ  # 5
    batches = data_lib.eval_batches(tokens, _cfg(), global_batch=4, num_batches=3, rows=(0, 4))
    assert len(batches) == 3
    for b, batch in enumerate(batches):
        for r in range(4):
            start = n_train + ((b * 4 + r) % n_windows) * SEQ
            np.testing.assert_array_equal(batch[r], np.arange(start, start + SEQ + 1))


def test_the_held_out_tail_is_eval_fraction_of_the_stream(tmp_path):
    path = tmp_path / "t.npy"
    np.save(path, np.arange(10_000, dtype=np.uint32) % 1000)
    cfg = load_config(None, [f"data.source={path}", "model.vocab_size=1000", "data.eval_fraction=0.1",
                             "data.seq_len=16"])
    tokens = data_lib.load_tokens(cfg.data, cfg.model.vocab_size)
    assert len(tokens.eval) == 1000 and len(tokens.train) == 9000
    np.testing.assert_array_equal(tokens.train[:5], [0, 1, 2, 3, 4])
    assert tokens.eval[0] == 9000 % 1000 and tokens.train[-1] == 8999 % 1000


# ---------------------------------------------------------------------------------------------------------------
# Document segments (data.document_mask): written out by hand


@pytest.mark.parametrize("row, expected", [
    ([5, 0, 7, 8, 0, 0, 3], [0, 0, 1, 1, 1, 2, 3]),  # eos stays in its document; an empty document between eos
    ([0, 4, 4], [0, 1, 1]),  # a row that starts with the end of the previous document
    ([1, 2, 3, 4], [0, 0, 0, 0]),  # no eos: one document
    ([0, 0, 0], [0, 1, 2]),
    ([9, 9, 0], [0, 0, 0]),  # eos last: it still belongs to the document it ends
])
def test_document_segments_by_hand(row, expected):
    got = document_segments(jnp.asarray([row, row[::-1]]), eos_id=0)
    np.testing.assert_array_equal(np.asarray(got)[0], expected)
    assert got.dtype == jnp.int32


def test_document_segments_use_the_configured_eos_id():
    got = document_segments(jnp.asarray([[0, 7, 0, 7, 1]]), eos_id=7)
    np.testing.assert_array_equal(np.asarray(got), [[0, 0, 1, 1, 2]])
