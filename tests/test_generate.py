"""Greedy KV-cached generation against transformers' generate(do_sample=False), and the generate command."""

import json
import os

os.environ["HF_HUB_OFFLINE"] = "1"

import numpy as np  # noqa: E402
import pytest  # noqa: E402

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


from jaxtrain.checkpoint import format as ckpt  # noqa: E402
from jaxtrain.hf import convert, generate  # noqa: E402
from jaxtrain_testing import HF_BASE, import_dir, make_hf_model, run_cli  # noqa: E402

torch.set_num_threads(1)

PROMPTS = [[5, 17, 3, 44, 9, 71, 30, 12, 8, 61, 22], [40, 6], [9, 9, 81, 13, 50, 2 + 1]]


def hf_greedy(model, prompt, n, use_cache=True):
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, use_cache=use_cache,
                             pad_token_id=HF_BASE["eos_token_id"], eos_token_id=HF_BASE["eos_token_id"])
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("mesh", [
    [], ["runtime.cpu_devices=8", "mesh.ici.data=2", "mesh.ici.fsdp=2", "mesh.ici.tensor=2"],
    pytest.param(["runtime.cpu_devices=8", "mesh.ici.fsdp=1", "mesh.ici.context=4", "mesh.ici.tensor=2"],
                 marks=pytest.mark.slow)], ids=["one_device", "data2_fsdp2_tensor2", "context4_tensor2"])
def test_greedy_matches_transformers_batched_prompts_of_different_lengths(tmp_path, mesh):
    """32 new tokens per prompt, three prompts of different lengths decoded as one batch sharing a KV cache, equal
    transformers' greedy generate on each prompt alone, with its KV cache and without."""
    hf_model = make_hf_model(tmp_path / "hf", seed=3, num_hidden_layers=3, head_dim=16,
                             rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, factor=8.0,
                                                  low_freq_factor=1.0, high_freq_factor=4.0,
                                                  original_max_position_embeddings=16))
    cfg = import_dir(tmp_path / "hf", tmp_path / "jt", *mesh)
    model, layout = convert.load_model(cfg, *ckpt.resolve(str(tmp_path / "jt")))
    res = generate.generate(model, layout, PROMPTS, max_new_tokens=32, eos_ids=(HF_BASE["eos_token_id"],))
    for prompt, got in zip(PROMPTS, res.new_ids):
        want = hf_greedy(hf_model, prompt, 32)
        assert got == want, (prompt, got, want)
    assert hf_greedy(hf_model, PROMPTS[0], 32, use_cache=False) == res.new_ids[0]
    assert any(len(ids) == 32 for ids in res.new_ids)  # some row ran the full length


def test_eos_stops_a_row(tmp_path):
    """A row stops at its eos id (kept as its last id) while the others go on."""
    hf_model = make_hf_model(tmp_path / "hf", seed=4)
    cfg = import_dir(tmp_path / "hf", tmp_path / "jt")
    model, layout = convert.load_model(cfg, *ckpt.resolve(str(tmp_path / "jt")))
    free = generate.generate(model, layout, PROMPTS, max_new_tokens=12)
    stop = free.new_ids[1][4]  # make the 5th token of the second row an eos id
    res = generate.generate(model, layout, PROMPTS, max_new_tokens=12, eos_ids=(stop,))
    assert res.new_ids[1] == free.new_ids[1][:free.new_ids[1].index(stop) + 1]
    for got, full in zip(res.new_ids, free.new_ids):
        cut = full.index(stop) + 1 if stop in full else len(full)
        assert got == full[:cut]
    assert hf_greedy(hf_model, PROMPTS[0], 12) == free.new_ids[0] or HF_BASE["eos_token_id"] in free.new_ids[0]


@pytest.mark.slow
def test_sampling_is_seeded_and_top_p_small_is_greedy(tmp_path):
    make_hf_model(tmp_path / "hf", seed=5)
    cfg = import_dir(tmp_path / "hf", tmp_path / "jt")
    model, layout = convert.load_model(cfg, *ckpt.resolve(str(tmp_path / "jt")))
    kw = dict(max_new_tokens=16)
    a = generate.generate(model, layout, PROMPTS, temperature=1.0, seed=1, **kw).new_ids
    b = generate.generate(model, layout, PROMPTS, temperature=1.0, seed=1, **kw).new_ids
    c = generate.generate(model, layout, PROMPTS, temperature=1.0, seed=2, **kw).new_ids
    greedy = generate.generate(model, layout, PROMPTS, **kw).new_ids
    assert a == b and a != c and a != greedy
    # top_p this small keeps only the most likely token: sampling becomes greedy.
    assert generate.generate(model, layout, PROMPTS, temperature=1.0, top_p=1e-6, seed=1, **kw).new_ids == greedy


def test_sample_top_p_against_numpy():
    """The nucleus kept by sample() is the smallest set of most likely tokens reaching top_p."""
    import jax

    logits = np.log(np.array([[0.5, 0.3, 0.15, 0.05]], np.float32))
    draws = {int(generate.sample(logits, jax.random.key(s), 1.0, 0.7)[0]) for s in range(200)}
    assert draws == {0, 1}  # 0.5 < 0.7 <= 0.5 + 0.3
    draws = {int(generate.sample(logits, jax.random.key(s), 1.0, 0.9)[0]) for s in range(200)}
    assert draws == {0, 1, 2}


@pytest.mark.slow
def test_generate_command_from_train_run_and_import(tmp_path):
    """The command on a checkpoint `train` wrote (byte-level text, no --config) and on a convert from-hf output
    (--prompt-ids, --json); bad inputs exit 2 with one line."""
    run = tmp_path / "run"
    r = run_cli("train", f"run.dir={run}", "train.steps=3", "data.threads=0", "train.eval_batches=1")
    assert r.returncode == 0, r.stderr
    r = run_cli("generate", "--checkpoint", str(run), "--prompt", "def ", "--max-new-tokens", "8", "--json")
    assert r.returncode == 0, r.stderr
    line = json.loads(r.stdout.strip().splitlines()[-1])
    assert line["prompt_ids"] == list(b"def ") and 1 <= len(line["new_ids"]) <= 8
    assert "tokens/s" in r.stderr and "prefill" in r.stderr

    make_hf_model(tmp_path / "hf")
    assert run_cli("convert", "from-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "jt")).returncode == 0
    prompts = tmp_path / "prompts.txt"
    r = run_cli("generate", "--checkpoint", str(tmp_path / "jt" / "checkpoints" / "0"), "--prompt-ids", "5,6,7",
                "--max-new-tokens", "4", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout.strip())["prompt_ids"] == [5, 6, 7]
    prompts.write_text("one\ntwo\n")
    for args, phrase in [(["--prompt-ids", "1,x"], "comma-separated integers"),
                         (["--prompt-ids", "1,96"], "outside the model's vocabulary"),
                         (["--prompt", "hi"], "no known tokenizer"),
                         (["--prompts", str(tmp_path / "none.txt")], "does not exist"),
                         (["--prompt-ids", "1", "--top-p", "0"], "--top-p=0.0")]:
        r = run_cli("generate", "--checkpoint", str(tmp_path / "jt"), *args)
        assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and phrase in r.stderr, (args, r.stderr)
    r = run_cli("generate", "--checkpoint", str(tmp_path), "--prompt-ids", "1")
    assert r.returncode == 2 and "holds no complete checkpoint" in r.stderr


@pytest.mark.slow  # four CLI runs, two of them training (.ci/run runs the slow tests)
def test_tokenizer_json_run_generates_text_and_exports_its_tokenizer(tmp_path):
    """A run prepared with `prepare --tokenizer`: generate takes text through that tokenizer.json, a --prompts file
    decodes as one batch, and to-hf copies the tokenizer next to the weights."""
    from pydoc_data.topics import topics

    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    text = "\n".join(topics[k] for k in sorted(topics)[:40])
    (tmp_path / "corpus.txt").write_text(text)
    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel()
    tok.train([str(tmp_path / "corpus.txt")], trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>",
                                                                                                 "[UNK]"]))
    tok.save(str(tmp_path / "tokenizer.json"))
    r = run_cli("prepare", str(tmp_path / "corpus.txt"), "--tokenizer", str(tmp_path / "tokenizer.json"),
                "--out", str(tmp_path / "data.bin"))
    assert r.returncode == 0, r.stderr
    vocab = json.load(open(tmp_path / "data.bin.json"))["vocab_size"]
    r = run_cli("train", f"run.dir={tmp_path / 'run'}", f"data.source={tmp_path / 'data.bin'}",
                f"model.vocab_size={vocab}", "train.steps=2", "data.seq_len=32", "train.global_batch=4",
                "train.eval_batches=1", "data.threads=0")
    assert r.returncode == 0, r.stderr
    (tmp_path / "prompts.txt").write_text("The with statement\nA class\n")
    r = run_cli("generate", "--checkpoint", str(tmp_path / "run"), "--prompts", str(tmp_path / "prompts.txt"),
                "--max-new-tokens", "5", "--json")
    assert r.returncode == 0, r.stderr
    rows = [json.loads(line) for line in r.stdout.strip().splitlines()]
    assert [row["prompt_ids"] for row in rows] == [tok.encode("The with statement").ids, tok.encode("A class").ids]
    for row in rows:
        assert row["text"] == tok.decode(row["new_ids"], skip_special_tokens=True) and 1 <= len(row["new_ids"]) <= 5
    r = run_cli("convert", "to-hf", str(tmp_path / "run"), "--out", str(tmp_path / "out"))
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "out" / "tokenizer.json").read_text() == (tmp_path / "tokenizer.json").read_text()
    assert transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").config.vocab_size == vocab
