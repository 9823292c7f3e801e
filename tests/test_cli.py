"""The command line as a user meets it: bad input exits 2 with one line and leaves run.dir alone."""

import json
import os

import numpy as np
import pytest

from jaxtrain_testing import run_cli

BAD = {
    "unknown key": (["train.stpes=3"], "did you mean 'train.steps'"),
    "wrong type": (["train.global_batch=many"], "train.global_batch='many' must be an integer"),
    "out of range": (["train.lr=-0.1"], "train.lr=-0.1 must be > 0"),
    "bad choice": (["model.attention=magic"], "model.attention='magic' is not valid"),
    "heads vs tensor": (["runtime.cpu_devices=6", "mesh.ici.tensor=3"], "not divisible by the tensor axis size 3"),
    "mesh vs devices": (["runtime.cpu_devices=4", "mesh.ici.fsdp=8"], "has 8 devices but 4 are available"),
    "mesh vs devices, before the batch": (["runtime.cpu_devices=8", "mesh.ici.fsdp=3"],
                                          "the mesh (ici.fsdp=3) has 3 devices but 8 are available"),
    "-1 cannot fill": (["runtime.cpu_devices=6", "mesh.ici.data=4"], "cannot fill 6 devices"),
    "batch vs data parallel": (["mesh.ici.data=3", "train.global_batch=16"],
                               "not divisible by the data-parallel size 3"),
    "missing data file": (["data.source=missing.bin"], "data.source file 'missing.bin' does not exist"),
    "not key=value": (["train.steps"], "is not of the form key=value"),
    "vocab too small for data": (["model.vocab_size=128"],
                                 "model.vocab_size=128 is smaller than the data's vocabulary"),
    "two fill axes": (["mesh.ici.data=-1"], "only one mesh axis may be -1"),
    "layers vs stages x virtual": (["runtime.cpu_devices=8", "mesh.ici.stage=2", "model.n_layers=6",
                                    "train.virtual_stages=2"],
                                   "model.n_layers=6 does not split into 2 stages x train.virtual_stages=2"),
    "fewer microbatches than stages": (["runtime.cpu_devices=8", "mesh.ici.stage=4", "train.microbatches=2"],
                                       "train.microbatches=2 must be a multiple of the 4 pipeline stages"),
    "tensor across nodes": (["runtime.cpu_devices=8", "mesh.dcn.tensor=2"], "mesh.dcn.tensor=2 would split tensor"),
}


@pytest.mark.parametrize("name", list(BAD))
def test_bad_input_exits_2_with_one_line(tmp_path, name):
    overrides, expected = BAD[name]
    run_dir = tmp_path / "existing"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text("precious: true\n")
    (run_dir / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0}\n')
    before = {p: p.read_text() for p in run_dir.iterdir()}

    proc = run_cli("train", f"run.dir={run_dir}", *overrides, env={**os.environ, "JAX_PLATFORMS": "cpu"})

    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    assert expected in lines[0]
    assert "Traceback" not in proc.stderr
    assert {p: p.read_text() for p in run_dir.iterdir()} == before


def test_bad_config_file_and_subcommand():
    proc = run_cli("train", "--config", "configs/nope.yaml")
    assert proc.returncode == 2 and "config file 'configs/nope.yaml' does not exist" in proc.stderr
    proc = run_cli("fly")
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1


def test_help_lists_subcommands():
    proc = run_cli("--help")
    assert proc.returncode == 0
    assert "train" in proc.stdout and "prepare" in proc.stdout


@pytest.mark.slow
def test_prepare_then_train_on_the_token_file(tmp_path):
    text = tmp_path / "doc.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 400)
    out = tmp_path / "tokens.bin"
    proc = run_cli("prepare", str(text), "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    meta = json.loads((tmp_path / "tokens.bin.json").read_text())
    assert meta == {**meta, "vocab_size": 256, "dtype": "uint16", "tokens": os.path.getsize(text)}
    # refuses to overwrite
    again = run_cli("prepare", str(text), "--out", str(out))
    assert again.returncode == 2 and "already exists" in again.stderr

    run_dir = tmp_path / "run"
    proc = run_cli("train", f"run.dir={run_dir}", f"data.source={out}", "train.steps=3", "data.seq_len=32",
                   "train.eval_every=0", "train.log_every=1")
    assert proc.returncode == 0, proc.stderr
    assert len((run_dir / "metrics.jsonl").read_text().splitlines()) == 3


def _llama_dir(path):
    """A Hugging Face Llama directory as far as `convert from-hf` reads it before the config is checked: config.json
    and a safetensors file (no torch needed)."""
    from safetensors.numpy import save_file

    path.mkdir()
    (path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 96, "hidden_size": 32,
        "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 64, "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "eos_token_id": 2}))
    save_file({"model.embed_tokens.weight": np.zeros((96, 32), np.float32)}, str(path / "model.safetensors"))
    return path


BAD_MESH = ["runtime.cpu_devices=8", "mesh.ici.fsdp=3"]  # 3 devices of 8: the mesh is the mistake, not the batch
MESH_ERROR = ("error: the mesh (ici.fsdp=3) has 3 devices but 8 are available; make the mesh sizes multiply to 8 (or "
              "set one axis to -1), or set runtime.cpu_devices=3 on CPU\n")


def test_convert_takes_overrides_on_either_side_of_out_and_names_trains_first_error(tmp_path):
    """`convert from-hf SRC --out DIR key=value` (the documented order), the overrides before --out, or split
    around it: each applies every override, and a bad mesh is named by the same first error as `train` names it (the
    mesh against the 8 devices, not the batch of 16 over 3 that the mesh's axes alone would name first)."""
    src, out = _llama_dir(tmp_path / "hf"), tmp_path / "out"
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    train = run_cli("train", f"run.dir={tmp_path / 'run'}", *BAD_MESH, env=env)
    assert train.returncode == 2 and train.stderr == MESH_ERROR, train.stderr
    for args in ([str(src), "--out", str(out), *BAD_MESH], [str(src), *BAD_MESH, "--out", str(out)],
                 [str(src), BAD_MESH[0], "--out", str(out), BAD_MESH[1]]):
        proc = run_cli("convert", "from-hf", *args, env=env)
        assert (proc.returncode, proc.stderr) == (2, MESH_ERROR), (args, proc.stderr)
        assert not out.exists()
    # train too: an override after --config counts (8 devices comes after it)
    proc = run_cli("train", BAD_MESH[1], "--config", "tiny", f"run.dir={tmp_path / 'run'}", BAD_MESH[0], env=env)
    assert (proc.returncode, proc.stderr) == (2, MESH_ERROR), proc.stderr
    proc = run_cli("convert", "from-hf", str(src), "--out", str(out), "--bogus", *BAD_MESH, env=env)
    assert proc.returncode == 2 and proc.stderr.startswith("error: unrecognized arguments: --bogus"), proc.stderr


def test_doubtful_settings_are_said_at_start_up(tmp_path):
    """Valid settings that are probably not meant (tests/test_config.py holds the lines' whole text): one warning
    line each, first of all; here the run then stops at an empty data file, found after JAX started."""
    empty = tmp_path / "empty.bin"
    empty.write_bytes(b"")
    proc = run_cli("train", f"run.dir={tmp_path / 'run'}", "model.moe.experts=4", "model.moe.top_k=1",
                   "model.fp8=tensorwise", "model.dtype=float32", f"data.source={empty}",
                   env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert proc.returncode == 2, proc.stderr
    # jaxtrain's lines without their time stamps (JAX's C++ start-up may log its own lines too)
    lines = [line for line in (raw.split("] ", 1)[-1] for raw in proc.stderr.splitlines())
             if line.startswith(("warning: ", "error: "))]
    assert len(lines) == 3 and proc.stderr.splitlines()[-1] == lines[2], proc.stderr
    assert lines[0].startswith("warning: model.moe.top_k=1 with model.moe.normalize=true: each token's one routing "
                               "weight is renormalised to 1, so the router gets no gradient from the language loss")
    assert lines[1].startswith("warning: model.fp8=tensorwise with model.dtype=float32: the projections still "
                               "multiply in float8")
    assert lines[2] == f"error: data.source '{empty}' is empty: not a raw uint16 token file (data.token_dtype)"
    assert not (tmp_path / "run").exists()
