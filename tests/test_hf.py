"""Hugging Face import and export against ``transformers`` itself (CPU torch; small random Llama models built and
saved locally with save_pretrained, nothing downloaded)."""

import json
import os

os.environ["HF_HUB_OFFLINE"] = "1"  # never reach a hub, whatever the machine's settings

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from jaxtrain.checkpoint import format as ckpt  # noqa: E402
from jaxtrain.config import ConfigError  # noqa: E402
from jaxtrain.hf import convert  # noqa: E402
from jaxtrain_testing import HF_BASE, config_variant, hf_logits, import_dir, jax_logits, make_hf_model, run_cli  # noqa: E402

torch.set_num_threads(1)

CASES = {
    "gqa_untied": {},
    "mha_tied": dict(num_key_value_heads=4, tie_word_embeddings=True),
    "llama3_rope_scaling": dict(head_dim=16, rope_parameters=dict(
        rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=16)),
    "head_dim_not_d_over_heads": dict(head_dim=16, num_attention_heads=4, num_key_value_heads=1),
}




def tokens(vocab, shape=(2, 24), seed=1):
    return np.random.default_rng(seed).integers(0, vocab, size=shape)


@pytest.mark.parametrize("case", list(CASES))
def test_import_logits_match_transformers_and_round_trip(tmp_path, case):
    """Import -> logits equal transformers' (1e-4); export -> transformers loads it cleanly -> logits equal (1e-5)."""
    hf_model = make_hf_model(tmp_path / "hf", **CASES[case])
    cfg = import_dir(tmp_path / "hf", tmp_path / "jt")  # default mesh: fsdp over all 8 test devices
    if case == "llama3_rope_scaling":
        assert cfg.model.rope_scaling.type == "llama3" and cfg.model.rope_scaling.original_max_len == 16
    toks = tokens(HF_BASE["vocab_size"], (2, 40))  # 40 > original_max_position_embeddings: scaling matters
    want = hf_logits(hf_model, toks)
    got = jax_logits(cfg, tmp_path / "jt", toks)
    assert want.std() > 0.1  # logits that vary, so that the comparison can fail
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)

    directory, step = ckpt.resolve(str(tmp_path / "jt"))
    meta = ckpt.read_meta(directory, step)
    convert.export_hf(cfg, directory, step, meta, str(tmp_path / "out"))
    back, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", output_loading_info=True,
                                                                   dtype=torch.float32)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    np.testing.assert_allclose(hf_logits(back.eval(), toks), want, atol=1e-5, rtol=0)
    saved = json.load(open(tmp_path / "out" / "config.json"))
    assert saved["eos_token_id"] == 2 and saved["bos_token_id"] == 1


def test_an_import_is_written_like_trains_checkpoints_and_damage_to_it_is_caught(tmp_path):
    """convert from-hf writes through training's writer: the same meta (plus "hf"), with a fingerprint that is the
    wrapping uint32 sum of each stored parameter's bits (numpy, over the arrays read back); a parameter whose values
    differ from its recorded sum makes checkpoint.init_from of the import a one-line ConfigError."""
    from jaxtrain.parallel.layout import Layout

    make_hf_model(tmp_path / "hf")
    cfg = import_dir(tmp_path / "hf", tmp_path / "jt")
    directory, step = ckpt.resolve(str(tmp_path / "jt"))
    meta = ckpt.read_meta(directory, step)
    assert set(meta) == {"config", "mesh", "processes", "devices", "jaxtrain_version", "jax_version", "step",
                         "data_iterator", "time", "fingerprint", "hf"}
    assert meta["step"] == 0 and meta["data_iterator"] is None and meta["devices"] == 8
    layout = Layout.build(cfg)
    params = ckpt.restore_params(directory, step, layout.abstract_params)
    leaves = jax.tree_util.tree_flatten_with_path({"model": params})[0]
    sums = {ckpt.leaf_name(path): int(np.asarray(x).view(np.uint32).sum(dtype=np.uint32)) for path, x in leaves}
    assert len(sums) > 5 and meta["fingerprint"] == sums

    path = os.path.join(directory, str(step), "meta", "metadata")
    name = sorted(sums)[0]
    meta["fingerprint"][name] = (sums[name] + 1) % 2**32
    json.dump(meta, open(path, "w"))
    source = ckpt.RestoreSource("params", directory, step)
    with pytest.raises(ConfigError, match=r"checkpoint.init_from .* is damaged: .*checksum mismatch"):
        ckpt.restore(source, layout.abstract_state, layout.init_state)


def test_no_rotary_permutation_needed(tmp_path):
    """The q/k layout question decided by transformers, not assumed: applying the Meta -> HF permutation (or its
    inverse) to q/k breaks the logits, so the mapping without permutation is the one that matches."""
    from safetensors.numpy import load_file, save_file

    hf_model = make_hf_model(tmp_path / "hf")
    w = load_file(str(tmp_path / "hf" / "model.safetensors"))
    hd = HF_BASE["hidden_size"] // HF_BASE["num_attention_heads"]
    for name in list(w):
        if name.endswith(("q_proj.weight", "k_proj.weight")):
            x = w[name]
            heads = x.shape[0] // hd
            # transformers' convert_llama_weights_to_hf permute(): interleaved pairs -> half-split halves.
            w[name] = x.reshape(heads, hd // 2, 2, -1).transpose(0, 2, 1, 3).reshape(x.shape)
    os.makedirs(tmp_path / "perm")
    save_file(w, str(tmp_path / "perm" / "model.safetensors"), metadata={"format": "pt"})
    os.link(tmp_path / "hf" / "config.json", tmp_path / "perm" / "config.json")
    cfg = import_dir(tmp_path / "perm", tmp_path / "jt")
    toks = tokens(HF_BASE["vocab_size"])
    assert np.abs(jax_logits(cfg, tmp_path / "jt", toks) - hf_logits(hf_model, toks)).max() > 1e-2


def test_bfloat16_weights_round_trip_bit_exact(tmp_path):
    """bfloat16 weights (as Llama releases ship) stay bfloat16 parameters and come back bit for bit."""
    import ml_dtypes  # noqa: F401  (numpy's bfloat16 for safetensors' numpy API)
    from safetensors.numpy import load_file

    make_hf_model(tmp_path / "f32").to(torch.bfloat16).save_pretrained(tmp_path / "hf")
    cfg = import_dir(tmp_path / "hf", tmp_path / "jt")
    assert cfg.model.param_dtype == "bfloat16"
    directory, step = ckpt.resolve(str(tmp_path / "jt"))
    convert.export_hf(cfg, directory, step, ckpt.read_meta(directory, step), str(tmp_path / "out"))
    before = load_file(str(tmp_path / "hf" / "model.safetensors"))
    after = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert sorted(before) == sorted(after)
    for name in before:
        assert after[name].dtype == before[name].dtype and after[name].shape == before[name].shape, name
        assert np.array_equal(after[name].view(np.uint16), before[name].view(np.uint16)), name
    assert json.load(open(tmp_path / "out" / "config.json"))["dtype"] == "bfloat16"


def test_sharded_input_and_output_with_index(tmp_path):
    """Sharded safetensors in (index + several files, as save_pretrained writes them) and out (max shard size)."""
    hf_model = make_hf_model(tmp_path / "hf")
    hf_model.save_pretrained(tmp_path / "hf_sharded", max_shard_size="20KB")
    assert os.path.isfile(tmp_path / "hf_sharded" / "model.safetensors.index.json")
    cfg = import_dir(tmp_path / "hf_sharded", tmp_path / "jt", "runtime.cpu_devices=8", "mesh.ici.fsdp=4",
                     "mesh.ici.tensor=2")
    toks = tokens(HF_BASE["vocab_size"])
    want = hf_logits(hf_model, toks)
    np.testing.assert_allclose(jax_logits(cfg, tmp_path / "jt", toks), want, atol=1e-4, rtol=0)
    directory, step = ckpt.resolve(str(tmp_path / "jt" / "checkpoints" / "0"))
    summary = convert.export_hf(cfg, directory, step, ckpt.read_meta(directory, step), str(tmp_path / "out"),
                                max_shard_bytes=30_000)
    assert len(summary["files"]) > 2
    index = json.load(open(tmp_path / "out" / "model.safetensors.index.json"))
    assert sorted(set(index["weight_map"].values())) == summary["files"]
    for f in summary["files"]:
        assert os.path.getsize(tmp_path / "out" / f) < 30_000 + 4096  # tensors + safetensors header
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
    np.testing.assert_allclose(hf_logits(back, toks), want, atol=1e-5, rtol=0)


def test_cli_round_trip_and_tokenizer_files(tmp_path):
    """The commands themselves: from-hf writes config.yaml + checkpoint + tokenizer files, to-hf copies them back."""
    make_hf_model(tmp_path / "hf")
    (tmp_path / "hf" / "tokenizer.json").write_text('{"version": "1.0"}')  # copied, not parsed
    # an override after --out, in the order docs/huggingface.md writes them
    r = run_cli("convert", "from-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "jt"), "data.seq_len=48")
    assert r.returncode == 0, r.stderr
    assert "imported" in r.stdout and "tokenizer.json" in r.stdout
    assert "\n  seq_len: 48\n" in (tmp_path / "jt" / "config.yaml").read_text()
    assert sorted(os.listdir(tmp_path / "jt")) == ["checkpoints", "config.yaml", "generation_config.json",
                                                   "tokenizer.json"]
    r = run_cli("convert", "to-hf", str(tmp_path / "jt"), "--out", str(tmp_path / "out"))
    assert r.returncode == 0, r.stderr
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(os.listdir(tmp_path / "out"))


def _bad_inputs(tmp):
    """(name, SRC directory, the phrase the one-line error must contain)."""
    make_hf_model(tmp / "good")
    cases = []
    os.makedirs(tmp / "no_config")
    cases.append(("no config.json", tmp / "no_config", "no config.json"))

    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**HF_BASE))
    model.save_pretrained(tmp / "missing_shard", max_shard_size="20KB")
    index = json.load(open(tmp / "missing_shard" / "model.safetensors.index.json"))
    gone = sorted(set(index["weight_map"].values()))[1]
    os.remove(tmp / "missing_shard" / gone)
    cases.append(("missing shard", tmp / "missing_shard", f"shard {gone!r}"))

    def variant(name, edit):
        return config_variant(tmp / "good", tmp / name, edit)

    cases.append(("shape disagrees", variant("shape", lambda c: c.update(intermediate_size=80)),
                  "model.layers.0.mlp.gate_proj.weight has shape [64, 32] but config.json implies [80, 32]"))
    cases.append(("architecture", variant("arch", lambda c: c.update(architectures=["Gemma2ForCausalLM"])),
                  "unsupported architecture Gemma2ForCausalLM"))
    cases.append(("biases", variant("bias", lambda c: c.update(attention_bias=True)), "attention biases"))
    cases.append(("sliding window on some layers", variant("window", lambda c: c.update(
        architectures=["Qwen2ForCausalLM"], use_sliding_window=True, sliding_window=8, max_window_layers=1)),
        "a sliding window on 1 of 2 layers"))
    cases.append(("rope type", variant("yarn", lambda c: c.update(rope_parameters={"rope_type": "yarn",
                                                                                   "rope_theta": 1e4, "factor": 4})),
                  "unsupported rope scaling 'yarn'"))
    return cases


# Slow pass: 19 s of CLI starts; tests/test_bad_inputs.py covers the same one-line, exit-2, nothing-written rule by
# default for every other command.
@pytest.mark.slow
def test_bad_inputs_exit_2_with_one_line_and_write_nothing(tmp_path):
    for name, src, phrase in _bad_inputs(tmp_path):
        out = tmp_path / f"out_{name.replace(' ', '_')}"
        r = run_cli("convert", "from-hf", str(src), "--out", str(out), timeout=120)
        assert r.returncode == 2, (name, r.stdout, r.stderr)
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and phrase in lines[0], (name, r.stderr)
        assert not out.exists(), name
    # An existing, non-empty output directory is never written into.
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "keep.txt").write_text("mine")
    r = run_cli("convert", "from-hf", str(tmp_path / "good"), "--out", str(tmp_path / "taken"))
    assert r.returncode == 2 and "already exists" in r.stderr
    assert os.listdir(tmp_path / "taken") == ["keep.txt"]
    r = run_cli("convert", "to-hf", str(tmp_path / "nowhere"), "--out", str(tmp_path / "x"))
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "does not exist" in r.stderr


def test_unsupported_config_in_process():
    with pytest.raises(ConfigError, match="mixture of experts"):
        convert.hf.model_fields_from_hf({"architectures": ["LlamaForCausalLM"], "num_local_experts": 8})


@pytest.mark.slow
def test_finetune_imported_checkpoint_on_8_devices_then_export(tmp_path):
    """Import, train 3 steps from it (checkpoint.init_from, via the config.yaml the import wrote) on a 4 x 2 mesh of
    8 devices, export the result: transformers' loss on the held-out batches equals jaxtrain's eval loss (1e-4)."""
    from jaxtrain import data as data_lib
    from jaxtrain.config import load_config
    from jaxtrain.train import loop

    original = make_hf_model(tmp_path / "hf")
    import_dir(tmp_path / "hf", tmp_path / "jt")  # sharded fsdp=8 at write time; restored onto fsdp=4 x tensor=2
    cfg = load_config(str(tmp_path / "jt" / "config.yaml"), [
        f"run.dir={tmp_path / 'run'}", "data.source=synthetic", "data.seq_len=32", "data.threads=0",
        "train.steps=3", "train.global_batch=8", "train.eval_batches=2", "train.warmup_steps=1", "train.lr=1e-2",
        "train.decay_steps=10", "runtime.cpu_devices=8", "mesh.ici.fsdp=4", "mesh.ici.tensor=2", "model.dtype=float32"])
    assert cfg.checkpoint.init_from == str(tmp_path / "jt" / "checkpoints")
    result = loop.train(cfg)
    assert result.start_step == 0 and 3 in result.eval_losses

    directory, step = ckpt.resolve(str(tmp_path / "run"))
    assert step == 3
    convert.export_hf(cfg, directory, step, ckpt.read_meta(directory, step), str(tmp_path / "out"))
    tuned = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
    tokens_ = data_lib.load_tokens(cfg.data, cfg.model.vocab_size)
    batches = data_lib.eval_batches(tokens_, cfg.data, global_batch=8, num_batches=2, rows=(0, 8))
    losses = []
    for b in batches:
        logits = torch.as_tensor(hf_logits(tuned, b[:, :-1]))
        losses.append(float(torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                              torch.as_tensor(b[:, 1:]).reshape(-1).long())))
    assert abs(np.mean(losses) - result.eval_losses[3]) < 1e-4, (np.mean(losses), result.eval_losses[3])
    # Training moved the weights: the exported model is not the imported one.
    assert np.abs(hf_logits(tuned, batches[0][:, :-1]) - hf_logits(original, batches[0][:, :-1])).max() > 1e-2


def test_import_config_names_its_own_run_dir(tmp_path, monkeypatch):
    """An import to imports/tiny must not name runs/tiny in its config.yaml: that is another job's run.dir (the
    default job's), which `train --config imports/tiny/config.yaml` would then resume. It names <out>/run, absolute,
    so two imports of the same name never share one either."""
    from jaxtrain.config import load_config

    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs" / "tiny" / "checkpoints").mkdir(parents=True)  # an existing run with the import's name
    (tmp_path / "runs" / "tiny" / "config.yaml").write_text("run:\n  dir: runs/tiny\n")
    make_hf_model(tmp_path / "hf")
    import_dir(tmp_path / "hf", "imports/tiny")
    out = tmp_path / "imports" / "tiny"
    run_dir = load_config(str(out / "config.yaml")).run.dir
    assert run_dir != os.path.join("runs", "tiny") and os.path.abspath(run_dir) != str(tmp_path / "runs" / "tiny")
    assert os.path.isabs(run_dir) and os.path.dirname(run_dir) == str(out) and not os.path.exists(run_dir)
    other, _, _ = convert.hf_import_config(str(tmp_path / "hf"), "elsewhere/tiny", [])
    assert other.run.dir == str(tmp_path / "elsewhere" / "tiny" / "run") != run_dir
