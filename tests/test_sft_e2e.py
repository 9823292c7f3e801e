"""End to end (slow pass, hf-parity extra): a tiny Hugging Face Llama or Qwen3 (q/k norms, head_dim != d_model /
heads) made with transformers, with a chat tokenizer
-> ``convert from-hf`` -> supervised fine-tuning on chat .jsonl for a few steps from it (``checkpoint.init_from``) ->
``generate`` -> ``convert to-hf`` -> transformers loads the result, and its loss on the held-out chat rows, masked
to the assistant tokens, equals the run's own evaluation loss."""

import json

import numpy as np
import pytest

from jaxtrain_testing import make_chat_tokenizer, make_family_model, make_hf_model, run_cli

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

QUESTIONS = [("what is the colour of the sky ?", "blue ."), ("what is the colour of grass ?", "green ."),
             ("why ?", "maybe the sun"), ("hello", "hi ! you are good"), ("one two three ?", "four five")]


def _make_model(path, family):
    """A random float32 ``family`` model saved at ``path`` (its norm scales randomised); its class name."""
    if family == "llama":
        make_hf_model(path)
        return "LlamaForCausalLM"
    make_family_model(path, "Qwen3", head_dim=16)
    return "Qwen3ForCausalLM"


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_import_finetune_on_chat_generate_export(tmp_path, family):
    from jaxtrain import data as data_lib
    from jaxtrain.checkpoint import format as ckpt
    from jaxtrain.config import load_config
    from jaxtrain.data.tokens import NO_LOSS, TOKEN_BITS
    from jaxtrain.hf import convert
    from jaxtrain.train import loop

    arch = _make_model(tmp_path / "hf", family)
    make_chat_tokenizer(tmp_path / "hf")  # the model's tokenizer files sit next to its weights, as on the Hub
    r = run_cli("convert", "from-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "jt"))
    assert r.returncode == 0, r.stderr
    rng = np.random.default_rng(0)
    with open(tmp_path / "chat.jsonl", "w") as f:
        for i in range(60):
            q, a = QUESTIONS[rng.integers(len(QUESTIONS))]
            msgs = ([{"role": "system", "content": "you are helpful"}] if i % 2 else []) + [
                {"role": "user", "content": q}, {"role": "assistant", "content": a}]
            f.write(json.dumps({"messages": msgs}) + "\n")
    cfg = load_config(str(tmp_path / "jt" / "config.yaml"), [
        f"run.dir={tmp_path / 'run'}", "data.format=chat", f"data.source={tmp_path / 'chat.jsonl'}",
        f"data.tokenizer={tmp_path / 'jt'}", "data.seq_len=47", "data.eval_fraction=0.2", "data.threads=0",
        "train.steps=4", "train.global_batch=8", "train.microbatches=2", "train.eval_batches=1",
        "train.warmup_steps=1", "train.lr=3e-2", "train.decay_steps=10", "runtime.cpu_devices=8",
        "mesh.ici.data=2", "mesh.ici.fsdp=2", "mesh.ici.tensor=2", "model.dtype=float32"])
    result = loop.train(cfg)
    assert result.start_step == 0 and 4 in result.eval_losses
    assert result.losses[4] < result.losses[1]  # it learns the answers

    r = run_cli("generate", "--checkpoint", str(tmp_path / "run"), "--prompt", "<s><|im_start|>user\nwhy ?"
                "<|im_end|>\n<|im_start|>assistant\n", "--max-new-tokens", "4", "--json")
    assert r.returncode == 0, r.stderr
    assert 1 <= len(json.loads(r.stdout.strip().splitlines()[-1])["new_ids"]) <= 4

    directory, step = ckpt.resolve(str(tmp_path / "run"))
    convert.export_hf(cfg, directory, step, ckpt.read_meta(directory, step), str(tmp_path / "out"))
    tuned = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
    assert type(tuned).__name__ == arch  # exported as the class it was imported from
    hf_tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "out")  # the tokenizer came along
    assert hf_tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False).startswith("<s>")
    rows = data_lib.eval_batches(data_lib.load_tokens(cfg.data, cfg.model.vocab_size), cfg.data, global_batch=8,
                                 num_batches=1, rows=(0, 8))[0]
    tokens = torch.as_tensor(rows & TOKEN_BITS).long()
    trained = torch.as_tensor((rows[:, 1:] & NO_LOSS) == 0) & torch.as_tensor((rows[:, 1:] & (1 << 29)) == 0)
    # Packed rows: transformers cannot mask documents, so score each example on its own span.
    total, count = 0.0, 0
    for r_i, row in enumerate(rows):
        starts = list(np.flatnonzero(row & (1 << 29))) + [len(row)]
        for a, b in zip(starts, starts[1:]):
            with torch.no_grad():
                logits = tuned(tokens[r_i:r_i + 1, a:b]).logits[0, :-1]
            nll = torch.nn.functional.cross_entropy(logits, tokens[r_i, a + 1:b], reduction="none")
            mask = trained[r_i, a:b - 1]
            total, count = total + float(nll[mask].sum()), count + int(mask.sum())
    assert count > 0 and abs(total / count - result.eval_losses[4]) < 1e-4, (total / count, result.eval_losses[4])
