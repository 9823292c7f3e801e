"""Supervised fine-tuning data and loss (jaxtrain/data/chat.py, step.py's masked loss): the chat template renders
as transformers' apply_chat_template does, only assistant tokens are trained, examples are packed whole with
document starts (or padded one per row), bad examples are counted and skipped, and the loss is the sum of trained
token losses over the step's trained-token count whatever the microbatching, checked against NumPy."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxtrain import data as data_lib
from jaxtrain.config import load_config
from jaxtrain.data.tokens import DOC_START, NO_LOSS, TOKEN_BITS
from jaxtrain.errors import ConfigError
from jaxtrain_testing import make_chat_tokenizer, random_model, run_cli

pytest.importorskip("tokenizers")

CONVO = [{"role": "system", "content": "you are helpful"},
         {"role": "user", "content": "what is the colour of the sky ?"},
         {"role": "assistant", "content": "blue ."},
         {"role": "user", "content": "why ?"},
         {"role": "assistant", "content": "maybe the sun"}]


@pytest.fixture
def tok_dir(tmp_path):
    return make_chat_tokenizer(tmp_path / "tok")


def _write(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def _chat_cfg(tmp_path, tok_dir, source, *overrides):
    return load_config(None, ["data.format=chat", f"data.tokenizer={tok_dir}", f"data.source={source}",
                              "data.seq_len=39", "data.eval_fraction=0.2", *overrides]).data


def test_rendering_and_tokens_match_transformers_apply_chat_template(tok_dir):
    transformers = pytest.importorskip("transformers")
    ours = data_lib.ChatTokenizer(tok_dir)
    theirs = transformers.AutoTokenizer.from_pretrained(tok_dir)
    assert ours.render(CONVO) == theirs.apply_chat_template(CONVO, tokenize=False)
    assert ours.render(CONVO[:3], add_generation_prompt=True) == theirs.apply_chat_template(
        CONVO[:3], tokenize=False, add_generation_prompt=True)
    ids, _ = ours.encode(CONVO)
    expected = theirs.apply_chat_template(CONVO, tokenize=True)
    expected = expected["input_ids"] if isinstance(expected, dict) or hasattr(expected, "keys") else expected
    assert list(ids) == list(expected)


def test_only_assistant_turns_and_their_end_markers_are_trained(tok_dir):
    chat = data_lib.ChatTokenizer(tok_dir)
    ids, trained = chat.encode(CONVO)
    words = chat.tokenizer.decode([int(i) for i in ids[trained]], skip_special_tokens=False).split()
    assert words == ["blue", ".", "<|im_end|>", "maybe", "the", "sun", "<|im_end|>"]
    untrained = chat.tokenizer.decode([int(i) for i in ids[~trained]], skip_special_tokens=False)
    assert "assistant" in untrained and "sky" in untrained and "blue" not in untrained
    assert ids[0] == 1  # the template's bos, not one added by the tokenizer (add_special_tokens=False)


def test_packing_keeps_examples_whole_with_document_starts_and_padding(tmp_path, tok_dir):
    short = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    src = _write(tmp_path / "c.jsonl", [{"messages": CONVO}] + [{"messages": short}] * 9)
    chat = data_lib.ChatTokenizer(tok_dir)
    examples = [chat.encode(CONVO)] + [chat.encode(short)] * 9
    for packed in (True, False):
        tokens = data_lib.load_tokens(_chat_cfg(tmp_path, tok_dir, src, f"data.pack={packed}"), 96)
        rows = np.concatenate([tokens.train, tokens.eval])
        assert rows.shape[1] == 40 and rows.dtype == np.int32
        # Each row: whole examples in order, then padding (token 0, untrained, a document of its own).
        got, per_row = [], []
        for row in rows:
            starts = list(np.flatnonzero(row & DOC_START)) + [len(row)]
            per_row.append(0)
            for a, b in zip(starts, starts[1:]):
                piece = row[a:b]
                if (piece & TOKEN_BITS == 0).all():
                    assert (piece & NO_LOSS).all() and b == len(row)  # padding: untrained, at the end
                    continue
                got.append(piece)
                per_row[-1] += 1
        assert len(got) == 10
        for piece, (ids, trained) in zip(got, examples):
            np.testing.assert_array_equal(piece & TOKEN_BITS, ids)
            np.testing.assert_array_equal((piece & NO_LOSS) == 0, trained)
        assert max(per_row) > 1 if packed else per_row == [1] * 10
        assert len(tokens.eval) >= 1


def test_bad_examples_are_counted_and_skipped_and_none_left_exits(tmp_path, tok_dir, capsys):
    good = {"messages": CONVO}
    src = _write(tmp_path / "c.jsonl", [good, {"messages": [{"role": "wizard", "content": "hi"}]},
                                        {"messages": [{"role": "user", "content": "hi"}]}, good, good, good, good])
    tokens = data_lib.load_tokens(_chat_cfg(tmp_path, tok_dir, src), 96)
    err = capsys.readouterr().err
    assert "skipped 1 chat example(s) with unknown role 'wizard' (first: c.jsonl:2)" in err
    assert "skipped 1 chat example(s) with no assistant turn (first: c.jsonl:3)" in err
    assert len(tokens.train) + len(tokens.eval) >= 2
    bad = _write(tmp_path / "bad.jsonl", [{"messages": [{"role": "user", "content": "hi"}]}])
    with pytest.raises(ConfigError, match="has no usable chat example"):
        data_lib.load_tokens(_chat_cfg(tmp_path, tok_dir, bad), 96)
    broken = tmp_path / "broken.jsonl"
    broken.write_text(json.dumps(good) + "\n{not json\n")
    with pytest.raises(ConfigError, match="broken.jsonl:2 is not JSON"):
        data_lib.load_tokens(_chat_cfg(tmp_path, tok_dir, str(broken)), 96)
    with pytest.raises(ConfigError, match="needs data.tokenizer"):
        load_config(None, ["data.format=chat", f"data.source={src}"])


# -- the loss ------------------------------------------------------------------------------------------------------

SEQ = 12


def _example(rng, prompt, answer):
    """Flagged words of one example: ``prompt`` untrained tokens (the first a document start), ``answer`` trained."""
    ids = rng.integers(5, 61, size=prompt + answer)
    words = ids | np.where(np.arange(prompt + answer) < prompt, NO_LOSS, 0)
    words[0] |= DOC_START
    return words


def _batch(rng, rows_spec):
    rows = []
    for spec in rows_spec:
        row = np.concatenate([_example(rng, p, a) for p, a in spec])
        pad = np.full(SEQ + 1 - len(row), NO_LOSS)
        if len(pad):
            pad[0] |= DOC_START
        rows.append(np.concatenate([row, pad]))
    return np.stack(rows).astype(np.int32)


def _numpy_loss(ts, state, batch):
    """Sum over trained targets of -log softmax / their count, from the model's logits with the document segments
    (NumPy arithmetic; the model itself is what it is)."""
    model = nnx.merge(ts.layout.graphdef, state).model
    tokens = batch & TOKEN_BITS
    segments = np.cumsum((batch[:, :-1] & DOC_START) > 0, axis=1).astype(np.int32)
    with ts.layout.scope():
        logits = np.asarray(model(jnp.asarray(tokens[:, :-1]), jnp.asarray(segments)), np.float64)
    logp = logits - logits.max(-1, keepdims=True)
    logp = logp - np.log(np.exp(logp).sum(-1, keepdims=True))
    nll = -np.take_along_axis(logp, tokens[:, 1:, None], -1)[..., 0]
    trained = (batch[:, 1:] & (NO_LOSS | DOC_START)) == 0
    return float((nll * trained).sum() / trained.sum()), trained


def _loss_and_grads_fn(ts, state):
    """batch -> (loss, gradients) of the step's own masked loss, compiled once."""
    model_def, params = nnx.split(nnx.merge(ts.layout.graphdef, state).model, nnx.Param)
    with ts.layout.scope():
        fn = jax.jit(jax.value_and_grad(lambda p, b: ts._loss(p, model_def, b, ts._trained_tokens(b))))

    def run(batch):
        with ts.layout.scope():
            return fn(params, jnp.asarray(batch))
    return run


@pytest.fixture
def chat(tmp_path, tok_dir):
    """Config overrides of chat data with a real tokenizer and source (the loss tests feed batches by hand)."""
    src = _write(tmp_path / "c.jsonl", [{"messages": CONVO}] * 4)
    return ["data.format=chat", f"data.tokenizer={tok_dir}", f"data.source={src}", f"data.seq_len={SEQ}"]


@pytest.mark.parametrize("pack", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_masked_tokens_no_trained_token_sees_change_nothing(tmp_path, chat, pack):
    """Packed: a prompt-only document after example A (as a cut example leaves) is changed entirely; padded: the
    padding after A. Neither is trained nor visible to A's trained tokens (a prompt token A's answer attends to
    necessarily changes its loss in a causal model), so loss and gradient are identical; changing one of A's answer
    tokens changes them (the test can fail). The loss equals the NumPy reference."""
    ts, state, _ = random_model(tmp_path, *chat, f"data.pack={pack}", "train.global_batch=2", seed=3)
    rng = np.random.default_rng(0)
    spec = [[(3, 4), (6, 0)], [(2, 5), (3, 3)]] if pack else [[(3, 4)], [(2, 5)]]
    batch = _batch(rng, spec)
    loss_and_grads = _loss_and_grads_fn(ts, state)
    loss, grads = loss_and_grads(batch)
    ref, trained = _numpy_loss(ts, state, batch)
    assert float(loss) == pytest.approx(ref, rel=1e-5)
    assert trained.sum() == sum(a for row in spec for _, a in row)  # every answer token, nothing else
    changed = batch.copy()
    tail = 7  # row 0: example A is columns 0-6; then the second example (packed) or the padding (padded)
    changed[0, tail:] = (changed[0, tail:] & ~TOKEN_BITS) | rng.integers(5, 61, size=SEQ + 1 - tail)
    assert not np.array_equal(changed, batch)
    loss2, grads2 = loss_and_grads(changed)
    assert float(loss2) == pytest.approx(float(loss), rel=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7),
                 grads, grads2)
    answer = batch.copy()
    answer[0, 5] = (answer[0, 5] & ~TOKEN_BITS) | ((answer[0, 5] & TOKEN_BITS) % 50 + 6)
    loss3, _ = loss_and_grads(answer)
    assert abs(float(loss3) - float(loss)) > 1e-4


@pytest.mark.slow
def test_step_loss_is_per_trained_token_of_the_whole_step_across_microbatches(tmp_path, chat):
    """Rows with very different trained counts: the train step's loss with 2 microbatches over data=2
    (unreduced accumulation) and with 1 is the sum of trained-token losses over the step's trained tokens (NumPy),
    not the mean of per-microbatch means."""
    rng = np.random.default_rng(1)
    batch = _batch(rng, [[(2, 10)], [(10, 2)], [(3, 9)], [(9, 1)]])
    losses = {}
    for k, devices, mesh in ((1, 1, []), (2, 2, ["mesh.ici.data=2"])):
        ts, state, _ = random_model(tmp_path / str(k), *chat, "train.global_batch=4", f"train.microbatches={k}",
                                    *mesh, seed=5, devices=devices)
        ref, trained = _numpy_loss(ts, state, batch)
        with ts.layout.scope():
            train_step, _, _ = ts.compile(state)
        _, metrics = train_step(state, jax.device_put(jnp.asarray(batch), ts.layout.batch_sharding))
        losses[k] = float(metrics["loss"])
        assert losses[k] == pytest.approx(ref, rel=1e-5)
    # Microbatch i takes rows i, i+2: its own mean per trained token differs from the step's.
    micro_means = []
    for rows in ([0, 2], [1, 3]):
        sub = batch[rows]
        ts1, state1, _ = random_model(tmp_path / "m", *chat, "train.global_batch=2", seed=5)
        micro_means.append(_numpy_loss(ts1, state1, sub)[0])
    assert abs(np.mean(micro_means) - losses[2]) > 1e-3


def test_chat_with_pipeline_stages_or_cudnn_packing_exits_before_training(tmp_path, chat):
    """Chat data with stages is refused by config validation (ParallelDims.check, which plan and mesh.auto ask too):
    one line naming the value and what is valid, exit 2 through the command line, nothing written."""
    staged = [f"run.dir={tmp_path / 'run'}", *chat, "mesh.ici.stage=2", "mesh.ici.fsdp=1", "mesh.ici.data=4",
              "train.microbatches=2", "train.global_batch=8"]
    with pytest.raises(ConfigError, match=r"^data.format=chat .* not yet supported with pipeline stages \(mesh "
                       r"stage=2\); fine-tune with stage=1 .*data.format=tokens"):
        load_config(None, staged)
    proc = run_cli("train", *staged, "runtime.cpu_devices=8")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1].startswith("error: data.format=chat"), proc.stderr[-2000:]
    assert not (tmp_path / "run").exists()
    with pytest.raises(ConfigError, match="cudnn cannot keep packed chat examples apart"):
        load_config(None, [*chat, "model.attention=cudnn"])
