"""What tests share: the repository root, the fast float32 overrides, running the real CLI and the local launcher in
subprocesses, the losses a run logged, the hand FLOP count, a model with random weights, and the small Hugging Face
models built with ``transformers``.

Tests import these from here (``from jaxtrain_testing import run_cli``), never from one another; conftest.py only
configures JAX and fixtures. jax, jaxtrain, torch and transformers are imported inside the helpers that need them, so
that importing this module initialises nothing and needs neither torch nor transformers (the ``hf-parity`` extra).
"""

import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Small and float32, so that sharded and unsharded runs can be compared to 1e-4.
FAST = ["model.dtype=float32", "model.param_dtype=float32", "train.eval_batches=1", "data.threads=0"]

# float32 with every step logged and no evaluation: the multi-process runs (launch_local) and their references.
F32 = ["model.dtype=float32", "model.param_dtype=float32", "train.eval_every=0", "train.eval_batches=1",
       "train.log_every=1"]

# The meshes that sharded training (and the data each process reads) is checked on, 8 devices each.
MESHES = {
    "data=8": ["mesh.ici.data=8", "mesh.ici.fsdp=1"],
    "fsdp=8": ["mesh.ici.fsdp=8"],
    "data=2,fsdp=2,tensor=2": ["mesh.ici.data=2", "mesh.ici.fsdp=2", "mesh.ici.tensor=2"],
    "fsdp=4,tensor=2": ["mesh.ici.fsdp=4", "mesh.ici.tensor=2"],
    "data=2,tensor=4": ["mesh.ici.data=2", "mesh.ici.fsdp=1", "mesh.ici.tensor=4"],
    "dcn data=2 x ici fsdp=4": ["mesh.dcn.data=2", "mesh.ici.fsdp=4"],
}


def load_tool(name):
    """The module of ``tools/NAME.py`` (tools/ is not a package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, os.path.join(REPO, "tools", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_cli(*args, cwd=None, timeout=300, env=None):
    """``python -m jaxtrain ARGS`` in a subprocess; returns CompletedProcess with text output."""
    env = dict(os.environ if env is None else env)
    env.pop("XLA_FLAGS", None)
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, "-m", "jaxtrain", *args], capture_output=True, text=True,
                          cwd=cwd or REPO, env=env, timeout=timeout)


def launcher_env():
    """The environment for launch/local.sh and the processes it starts: no XLA_FLAGS, this checkout first on the
    path, this interpreter as $PYTHON."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    env["PYTHON"] = sys.executable
    return env


def launch_local(n, *args, timeout=600):
    """``launch/local.sh N ARGS``: N processes of ``python -m jaxtrain ARGS`` on 127.0.0.1."""
    return subprocess.run([os.path.join(REPO, "launch/local.sh"), str(n), *args], capture_output=True, text=True,
                          cwd=REPO, env=launcher_env(), timeout=timeout)


def logged_losses(run_dir):
    """step -> loss from run_dir/metrics.jsonl (JSON floats round-trip exactly, so equality here is bit equality)."""
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return {r["step"]: r["loss"] for r in map(json.loads, f)}


def hand_forward_flops_per_token(m, seq):
    """(matmul FLOPs, causal attention FLOPs) of one token's forward pass of model config ``m``."""
    hd = m.resolved_head_dim
    per_layer = {
        "q": 2 * m.d_model * m.n_heads * hd,
        "k": 2 * m.d_model * m.n_kv_heads * hd,
        "v": 2 * m.d_model * m.n_kv_heads * hd,
        "o": 2 * m.n_heads * hd * m.d_model,
        "gate": 2 * m.d_model * m.d_ff,
        "up": 2 * m.d_model * m.d_ff,
        "down": 2 * m.d_ff * m.d_model,
    }
    output = 2 * m.d_model * m.vocab_size
    # Scores q.k and the weighted sum p.v, 2 * hd FLOPs each per (query, key) pair; a token sees (seq + 1) / 2 keys
    # on average under the causal mask, counted as seq / 2 (the convention of PaLM's and Megatron's MFU).
    attention = 2 * (2 * hd) * (seq / 2) * m.n_heads
    return m.n_layers * sum(per_layer.values()) + output, m.n_layers * attention


# ---------------------------------------------------------------------------------------------------------------
# A model with random weights, for the float64 NumPy references (test_reference_model, test_reference_optim)

# d_model 48 with 4 heads of 16 would make head_dim = d_model / heads; 24 breaks that coincidence on purpose.
REFERENCE_SMALL = ["model.d_model=48", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2",
                   "model.head_dim=24", "model.d_ff=80", "model.vocab_size=61", "model.rope_theta=300",
                   "model.norm_eps=0.05", "model.dtype=float32", "model.param_dtype=float32", "model.attention=xla",
                   "mesh.ici.fsdp=1", "data.seq_len=12", "train.global_batch=3", "data.threads=0"]


def random_model(tmp_path, *overrides, seed=0, devices=1):
    """(Step, state with random weights, the weights as a float64 nested dict), for REFERENCE_SMALL."""
    import jax
    import numpy as np
    from flax import nnx

    from jaxtrain.config import load_config
    from jaxtrain.train import step as step_lib

    cfg = load_config(None, [f"run.dir={tmp_path}", *REFERENCE_SMALL, *overrides])
    ts = step_lib.setup(cfg, jax.devices()[:devices])
    rng = np.random.default_rng(seed)

    def draw(path, leaf):
        name = jax.tree_util.keystr(path)
        if "scale" in name:  # norm scales far from 1: a dropped or misapplied scale shows
            value = rng.uniform(0.3, 2.0, leaf.shape)
        else:
            fan_in = leaf.shape[-3] * leaf.shape[-2] if "['o']" in name else leaf.shape[-2]
            value = rng.normal(0, 1.0 if "embedding" in name else fan_in ** -0.5, leaf.shape)
        return jax.device_put(value.astype(leaf.dtype), leaf.sharding)

    # Built from the abstract state (shapes and shardings), not init_state: no initialiser to compile. The
    # optimizer's part is zeros; only eval_step reads this state, and it reads the parameters alone.
    state = jax.tree.map(lambda a: jax.device_put(np.zeros(a.shape, a.dtype), a.sharding), ts.layout.abstract_state)
    state["model"] = jax.tree_util.tree_map_with_path(draw, ts.layout.abstract_state["model"])
    weights = jax.tree.map(lambda a: np.asarray(a, np.float64), nnx.to_pure_dict(state["model"]))
    return ts, state, weights


# ---------------------------------------------------------------------------------------------------------------
# Small random Llama models from transformers (test_hf, test_generate: the hf-parity extra)

HF_BASE = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5, tie_word_embeddings=False,
               initializer_range=0.1, bos_token_id=1, eos_token_id=2)


def make_hf_model(path, seed=0, **overrides):
    """A random float32 LlamaForCausalLM saved at ``path``; norm scales randomised too so that each one matters."""
    import torch
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(**{**HF_BASE, **overrides})
    model = transformers.LlamaForCausalLM(cfg).eval()
    randomize_norms(model)
    model.save_pretrained(path)
    return model


def make_family_model(path, family, base=None, seed=0, moe=False, **overrides):
    """A random float32 ``<family>ForCausalLM`` (transformers' class name prefix: Llama, Qwen2, Qwen3, Mistral,
    Qwen3Moe, ...) of config ``base`` (default :data:`HF_BASE`) updated by ``overrides``, saved at ``path``: norm
    scales and biases randomised (the initialisation zeroes biases) so that each one shows in the logits; ``moe``:
    eager experts, and router weights spread so that the choice of experts matters."""
    import torch
    import transformers

    torch.manual_seed(seed)
    config = getattr(transformers, f"{family}Config")(**{**(HF_BASE if base is None else base), **overrides})
    model = getattr(transformers, f"{family}ForCausalLM")(config).eval()
    if moe:
        model.set_experts_implementation("eager")
    randomize_norms(model)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias") or (moe and name.endswith("mlp.gate.weight")):
                p.normal_(0, 0.5)
    model.save_pretrained(path)
    return model


def export_round_trip(cfg, tmp_path):
    """Export the import at ``tmp_path / "jt"`` to ``tmp_path / "out"`` and check it against the source at
    ``tmp_path / "hf"``: the same tensor names and bits, the same class and model_type. Returns (the source's
    config.json, the export's) for the caller's checks of the other keys."""
    import json

    import numpy as np
    from safetensors.numpy import load_file

    from jaxtrain.checkpoint import format as ckpt
    from jaxtrain.hf import convert

    directory, step = ckpt.resolve(str(tmp_path / "jt"))
    convert.export_hf(cfg, directory, step, ckpt.read_meta(directory, step), str(tmp_path / "out"))
    before, after = (load_file(str(tmp_path / d / "model.safetensors")) for d in ("hf", "out"))
    assert sorted(before) == sorted(after)
    for name in before:
        assert np.array_equal(after[name].view(np.uint32), before[name].view(np.uint32)), name
    src, out = (json.load(open(tmp_path / d / "config.json")) for d in ("hf", "out"))
    assert out["architectures"] == src["architectures"] and out["model_type"] == src["model_type"]
    return src, out


def load_export(path):
    """The export at ``path`` loaded by transformers in float32, checked to have no missing, unexpected or
    mismatched keys."""
    import torch
    import transformers

    back, info = transformers.AutoModelForCausalLM.from_pretrained(path, output_loading_info=True,
                                                                   dtype=torch.float32)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    return back.eval()


def randomize_norms(model) -> None:
    """Norm scales of a transformers model drawn from U(0.5, 1.5), so that a misplaced one changes the logits."""
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)


def hf_logits(model, tokens):
    """float32 logits (a NumPy array) of a transformers model on int ``tokens`` [batch, seq]."""
    import numpy as np
    import torch

    with torch.no_grad():
        return model(input_ids=torch.as_tensor(np.asarray(tokens), dtype=torch.long)).logits.float().numpy()


def jax_logits(cfg, directory, tokens):
    """Logits (a NumPy array) of the checkpoint in ``directory``, restored on ``cfg``'s mesh, on int ``tokens``
    [batch, seq]."""
    import jax
    import numpy as np
    from flax import nnx

    from jaxtrain.checkpoint import format as ckpt
    from jaxtrain.hf import convert

    model, layout = convert.load_model(cfg, *ckpt.resolve(str(directory)))
    with jax.set_mesh(layout.mesh), nnx.logical_axis_rules(layout.rules):
        return np.asarray(nnx.jit(lambda m, t: m(t))(model, np.asarray(tokens, np.int32)))


def config_variant(good, directory, edit):
    """A copy of the Hugging Face directory ``good`` at ``directory``: its safetensors hard-linked, its config.json
    changed by ``edit(dict)``; returns ``directory``."""
    os.makedirs(directory)
    os.link(os.path.join(good, "model.safetensors"), os.path.join(directory, "model.safetensors"))
    with open(os.path.join(good, "config.json")) as f:
        cfg = json.load(f)
    edit(cfg)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(cfg, f)
    return directory


def import_dir(src, out, *overrides):
    """``convert.import_hf`` of the Hugging Face directory ``src`` into ``out``; returns the imported config."""
    from jaxtrain.hf import convert

    cfg, hf_cfg, tensors = convert.hf_import_config(str(src), str(out), ["data.threads=0", *overrides])
    convert.import_hf(cfg, hf_cfg, tensors, str(src), str(out))
    return cfg


# ---------------------------------------------------------------------------------------------------------------
# Chat data (test_sft*): a small word-level tokenizer with a ChatML template, as a Hugging Face tokenizer directory

CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                 "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CHAT_WORDS = ("system user assistant tool hello hi what is the answer to a question sky blue red green one two "
              "three four five yes no maybe you are helpful bot please say colour of grass sun moon night day "
              "good bad why how when where who").split()


def make_chat_tokenizer(path, vocab_size=96):
    """A word-level tokenizer.json (ids: [UNK] 0, <s> 1, </s> 2, <|im_start|> 3, <|im_end|> 4, then CHAT_WORDS and
    punctuation) and a tokenizer_config.json with a ChatML chat_template, in the directory ``path``; returns it."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    specials = ["[UNK]", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
    vocab = {w: i for i, w in enumerate([*specials, *CHAT_WORDS, ".", ",", "?", "!"])}
    assert len(vocab) <= vocab_size
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    os.makedirs(path, exist_ok=True)
    tok.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": "<s>", "eos_token": "<|im_end|>", "unk_token": "[UNK]", "pad_token": "</s>",
                   "chat_template": CHAT_TEMPLATE, "tokenizer_class": "PreTrainedTokenizerFast",
                   "model_max_length": 64}, f)
    return str(path)


def triton_interpreter_results(test_file, function):
    """The JSON-able results of ``function()`` defined in ``test_file``, run in a subprocess with TRITON_INTERPRET=1
    (Triton reads it once, at import, so the test process itself cannot switch to the interpreter)."""
    code = (f"import json, runpy, sys; ns = runpy.run_path(sys.argv[1]); "
            f"print('RESULTS ' + json.dumps(ns[{function!r}]()))")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", code, test_file], env=env, cwd=REPO, capture_output=True, text=True,
                          timeout=600)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULTS ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(lines[-1][len("RESULTS "):])


def triton_interpreter_launch():
    """A ``launch(kernel, inputs, out_shapes, grid, constexprs, num_warps, num_stages) -> outputs`` for Triton's CPU
    interpreter on numpy arrays, as the kernels' launch sequences take it (``flash_triton.run_forward``,
    ``gmm_triton.run_gmm``). Child-process side: TRITON_INTERPRET=1 must be set before triton is imported, since
    Triton's own library functions are wrapped at import. Outputs start as NaN, so an unwritten element fails a test.

    Patches two interpreter internals that assume torch tensors (host copies; numpy memory is already host memory)
    and one numpy >= 2.4 incompatibility (int() of a one-element array as a loop bound).
    """
    import ml_dtypes
    import numpy as np
    from triton.runtime import interpreter

    assert os.environ.get("TRITON_INTERPRET") == "1"
    to_triton = {np.dtype(np.float32): "fp32", np.dtype(np.float16): "fp16", np.dtype(np.int32): "i32",
                 np.dtype(ml_dtypes.bfloat16): "bf16"}
    interpreter.GridExecutor._init_args_hst = lambda self, args, kwargs: (args, kwargs)
    interpreter.GridExecutor._restore_args_dev = lambda self, *a: None
    patch_tensor = interpreter._patch_lang_tensor

    def patched(tensor, scope):
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(np.asarray(self.handle.data).reshape(-1)[0]))

    interpreter._patch_lang_tensor = patched

    class Ptr:
        def __init__(self, array):
            self.array, self.dtype = array, to_triton[array.dtype]

        def data_ptr(self):
            return self.array.ctypes.data

    def launch(kernel, inputs, out_shapes, grid, meta, num_warps, num_stages):
        inputs = [np.ascontiguousarray(x) for x in inputs]
        outs = [np.full(shape, np.nan, dtype) for shape, dtype in out_shapes]  # unwritten -> NaN -> test fails
        kernel[grid](*map(Ptr, inputs), *map(Ptr, outs), **meta)
        return outs

    return launch
