"""Every kind of bad input through the real command line: exit 2, one line on stderr, no traceback, and nothing on
disk created or changed (checksums of the whole workspace, run directory included, before and after).

Cases in FAST fail before JAX starts (about half a second each); cases in AFTER_JAX are found once JAX and the mesh
exist (data files, checkpoints, memory), 2-8 s each on 2 shared cores, so most of them are marked slow.
"""

import hashlib
import json
import os

import numpy as np
import pytest

from jaxtrain_testing import run_cli

RUN = "run"  # the run directory inside the workspace: it already holds a previous run's files


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    ws = tmp_path_factory.mktemp("bad_inputs")
    run = ws / RUN
    run.mkdir()
    (run / "config.yaml").write_text("precious: true\n")
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0}\n')
    (ws / "a_file").write_text("not a directory\n")
    (ws / "dir.bin").mkdir()
    (ws / "dir.yaml").mkdir()
    (ws / "notes.txt").write_text("hello world\n")
    (ws / "latin1.yaml").write_bytes("train:\n  steps: 3 # caf\xe9\n".encode("latin-1"))
    (ws / "dup.yaml").write_text("train:\n  steps: 3\n  lr: 0.001\n  steps: 4\n")
    (ws / "list.yaml").write_text("- train\n- steps\n")
    (ws / "broken.yaml").write_text("train: [1, 2\n")
    (ws / "model_scalar.yaml").write_text("model: 5\n")
    (ws / "hw_partial.yaml").write_text("name: x\npeak_flops: 1.0e15\n")
    (ws / "exp_list.yaml").write_text("- mesh.ici.fsdp=2\n")
    (ws / "empty.bin").write_bytes(b"")
    (ws / "odd.bin").write_bytes(b"abc")
    (ws / "text.npy").write_text("hello\n")
    np.save(ws / "matrix.npy", np.ones((64, 64), np.int32))
    np.save(ws / "floats.npy", np.ones(4096, np.float32))
    negative = (np.arange(4096) % 200).astype(np.int32)
    negative[7] = -200
    np.save(ws / "negative.npy", negative)
    ids = (np.arange(8192) % 251).astype(np.uint16)
    ids[100] = 300  # one id beyond the default model.vocab_size=256, no sidecar (nanoGPT-style)
    ids.tofile(ws / "out_of_range.bin")
    good = (np.arange(8192) % 200).astype(np.uint16)
    for name, sidecar in {"bad_json": "{not json", "list_json": "[1, 2]", "str_vocab": '{"vocab_size": "many"}',
                          "latin1_json": b'{"tokenizer": "caf\xe9"}'}.items():
        good.tofile(ws / f"{name}.bin")
        path = ws / f"{name}.bin.json"
        path.write_bytes(sidecar) if isinstance(sidecar, bytes) else path.write_text(sidecar)
    (ws / "not_a_tokenizer.json").write_text('{"x": 1')
    (ws / "not_a_checkpoint" / "sub").mkdir(parents=True)
    (ws / "binary.txt").write_bytes(b"\xff\xfe\x00caf\xe9")
    (ws / "broken.jsonl").write_text('{"text": "fine"}\n{"text": "cut off\n')
    return ws


def _snapshot(root) -> dict:
    """Relative path -> sha256 of every file (and None for every directory) under ``root``."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for d in dirnames:
            out[os.path.relpath(os.path.join(dirpath, d), root)] = None
        for f in filenames:
            with open(os.path.join(dirpath, f), "rb") as fh:
                out[os.path.relpath(os.path.join(dirpath, f), root)] = hashlib.sha256(fh.read()).hexdigest()
    return out


T = ["train", f"run.dir={RUN}"]
DIST = ["dist.num_processes=1", "dist.process_id=0"]

# name -> (command line, text the one error line must contain)
FAST = {
    "unknown FP8 recipe": ([*T, "model.fp8=e4m3"], "model.fp8='e4m3' is not valid; choose one of none, tensorwise"),
    "empty FP8 history": ([*T, "model.fp8=delayed", "model.fp8_amax_history=0"],
                          "model.fp8_amax_history=0 must be > 0"),
    "infinite lr": ([*T, "train.lr=.inf"], "train.lr=inf must be a finite number"),
    "nan lr": ([*T, "train.lr=.nan"], "train.lr=nan must be a finite number"),
    "overflowing number": ([*T, "train.b1=1e999"], "train.b1='1e999' must be a finite number"),
    "negative infinite rope": ([*T, "model.rope_theta=-.inf"], "model.rope_theta=-inf must be a finite number"),
    "nested list rule": ([*T, "mesh.rules.batch=[[data]]"], "mesh.rules.batch=[['data']] names an unknown mesh axis"),
    "mapping rule": ([*T, "mesh.rules.batch={data: fsdp}"], "mesh.rules.batch={'data': 'fsdp'} names an unknown"),
    "rules not a mapping": ([*T, "mesh.rules=5"], "mesh.rules must be a mapping"),
    "unknown logical axis": ([*T, "mesh.rules.nope=data"], "unknown config key 'mesh.rules.nope'"),
    "sequence not split by the context axis": ([*T, "mesh.ici.context=4", "mesh.ici.fsdp=2", "data.seq_len=100"],
                                                "data.seq_len=100 is not divisible by 2 x the context axis size 4"),
    "too many cpu devices": ([*T, "runtime.cpu_devices=100000"], "runtime.cpu_devices=100000 is more emulated"),
    "moe top_k above experts": ([*T, "model.moe.experts=4", "model.moe.top_k=5"],
                                "model.moe.top_k=5 must be between 1 and model.moe.experts=4"),
    "moe experts not split by the expert axis": ([*T, "model.moe.experts=6", "mesh.ici.expert=4", "mesh.ici.fsdp=1"],
                                                 "model.moe.experts=6 is not divisible by the expert axis size 4: "
                                                 "make the expert axis (mesh.ici.expert x mesh.dcn.expert) one of 1, "
                                                 "2, 3, 6, or model.moe.experts a multiple of 4 (e.g. 8)"),
    "moe capacity below a token's share": ([*T, "model.moe.experts=8", "model.moe.capacity_factor=0.25"],
                                           "model.moe.capacity_factor=0.25 gives an expert less than one token's"),
    "moe every not dividing the layers": ([*T, "model.moe.experts=8", "model.moe.every=3"],
                                          "model.n_layers - model.moe.first_dense = 4 is not a multiple of "
                                          "model.moe.every=3"),
    "expert axis on a dense model": ([*T, "mesh.ici.expert=2", "mesh.ici.fsdp=1"],
                                     "the expert axis has size 2 but the model is dense"),
    "fp8 experts with stages": ([*T, "model.moe.experts=8", "mesh.ici.stage=2", "mesh.ici.fsdp=1",
                                 "mesh.ici.expert=2", "train.microbatches=2", "model.fp8=delayed"],
                                "model.fp8=delayed with the expert axis (size 2) and 2 pipeline stages is not "
                                "supported yet"),
    "moe groups not split by stages": ([*T, "model.moe.experts=8", "model.moe.every=4", "mesh.ici.stage=2",
                                        "mesh.ici.fsdp=1", "train.microbatches=2"],
                                       "model.n_layers / model.moe.every = 1 layer groups do not split into 2"),
    "zero cpu devices": ([*T, "runtime.cpu_devices=0"], "runtime.cpu_devices=0 must be > 0"),
    "coordinator without host": ([*T, "dist.coordinator=:1", *DIST], "dist.coordinator=':1' must be host:port"),
    "coordinator port 0": ([*T, "dist.coordinator=localhost:0", *DIST], "a port in 1..65535"),
    "coordinator port too big": ([*T, "dist.coordinator=localhost:70000", *DIST], "a port in 1..65535"),
    "coordinator without port": ([*T, "dist.coordinator=localhost", *DIST], "dist.coordinator='localhost' must be"),
    "bind address port not a number": ([*T, "dist.bind_address=10.0.0.1:http"], "dist.bind_address='10.0.0.1:http'"),
    "max_nonfinite_steps 0": ([*T, "train.max_nonfinite_steps=0"], "train.max_nonfinite_steps=0 must be > 0"),
    "fractional steps": ([*T, "train.steps=1.5"], "train.steps=1.5 must be an integer"),
    "bool not bool": ([*T, "runtime.ignore_memory_check=2"], "runtime.ignore_memory_check=2 must be true or false"),
    "eval fraction 1.5": ([*T, "data.eval_fraction=1.5"], "data.eval_fraction=1.5 must be in (0, 1)"),
    "empty key": ([*T, "=5"], "is not of the form key=value"),
    "resume path missing": ([*T, "checkpoint.resume=missing_dir"], "checkpoint.resume='missing_dir' does not exist"),
    "resume path a file": ([*T, "checkpoint.resume=a_file"], "checkpoint.resume='a_file' is a file"),
    "init_from a file": ([*T, "checkpoint.init_from=a_file"], "checkpoint.init_from='a_file' is a file"),
    "init_from missing": ([*T, "checkpoint.init_from=missing_dir"], "is a directory that does not exist"),
    "data source a directory": ([*T, "data.source=dir.bin"],
                                "data.source 'dir.bin' is a directory without an index.json"),
    "data source wrong suffix": ([*T, "data.source=notes.txt"], "data.source='notes.txt' must be 'embedded'"),
    "data source missing": ([*T, "data.source=no-such-tokens"], "data.source='no-such-tokens' does not exist"),
    "run.dir a file": (["train", "run.dir=a_file"], "run.dir='a_file' is a file, not a directory"),
    "run.dir under a file": (["train", "run.dir=a_file/run"], "run.dir='a_file/run' cannot be created"),
    "checkpoint.dir under a file": ([*T, "checkpoint.dir=a_file/ckpt"], "checkpoint.dir='a_file/ckpt' cannot be"),
    "config not UTF-8": ([*T[:1], "--config", "latin1.yaml", *T[1:]], "config file 'latin1.yaml' is not UTF-8"),
    "config duplicate key": ([*T[:1], "--config", "dup.yaml", *T[1:]], "duplicate key 'steps'"),
    "config a directory": ([*T[:1], "--config", "dir.yaml", *T[1:]], "config file 'dir.yaml' is a directory"),
    "config a list": ([*T[:1], "--config", "list.yaml", *T[1:]], "must hold a mapping at the top level, got a list"),
    "config broken YAML": ([*T[:1], "--config", "broken.yaml", *T[1:]], "config file 'broken.yaml' is not valid YAML"),
    "config section not a mapping": ([*T[:1], "--config", "model_scalar.yaml", *T[1:]], "model must be a mapping"),
    "prepare into a missing directory": (["prepare", "notes.txt", "--out", "missing_dir/tokens.bin"],
                                         "is not an existing directory"),
    "prepare from a directory": (["prepare", "dir.bin", "--out", "tokens.bin"], "input file 'dir.bin' is a directory"),
    "prepare with a broken tokenizer": (["prepare", "notes.txt", "--out", "tokens.bin", "--tokenizer",
                                         "not_a_tokenizer.json"], "is not a Hugging Face tokenizer.json"),
    "prepare a malformed .jsonl line into shards": (["prepare", "notes.txt", "broken.jsonl", "--out", "shards"],
                                                    "broken.jsonl:2 is not JSON"),
    "prepare a malformed .jsonl line into a file": (["prepare", "notes.txt", "broken.jsonl", "--out", "tokens.bin",
                                                     "--workers", "2"], "broken.jsonl:2 is not JSON"),
    "prepare over an existing file": (["prepare", "notes.txt", "--out", "odd.bin"], "already exists"),
    "hardware file of the wrong shape": (["plan", "--hardware", "list.yaml"], "hardware file 'list.yaml' must hold"),
    "hardware file missing fields": (["plan", "--hardware", "hw_partial.yaml"], "lacks: hbm_bytes"),
    "FP8 planned on A100": (["plan", "--config", "7b", "--hardware", "a100-8x", "mesh.ici.fsdp=8", "model.fp8=rowwise"],
                            "model.fp8=rowwise needs FP8 tensor cores, which a100-8x"),
    "experiment file of the wrong shape": (["sweep", "--config", "exp_list.yaml"],
                                           "experiment file 'exp_list.yaml' must hold a mapping"),
}

AFTER_JAX = {
    "triton attention off a GPU": ([*T, "model.attention=triton", "model.head_dim=32"],
                                   "model.attention=triton runs on a CUDA GPU, not on cpu devices"),
    "empty .bin": ([*T, "data.source=empty.bin"], "data.source 'empty.bin' is empty"),
    "odd-length .bin": ([*T, "data.source=odd.bin"], "has 3 bytes, not a multiple of 2"),
    ".npy that is not an array file": ([*T, "data.source=text.npy"], "is not a NumPy .npy array file"),
    "2-D .npy": ([*T, "data.source=matrix.npy"], "must hold a 1-D integer array, got int32 of shape (64, 64)"),
    "float .npy": ([*T, "data.source=floats.npy"], "must hold a 1-D integer array, got float32"),
    "negative token id": ([*T, "data.source=negative.npy"], "holds the negative token id -200"),
    "token id >= vocab_size, no sidecar": ([*T, "data.source=out_of_range.bin"],
                                           "holds token id 300 (its largest), which model.vocab_size=256 cannot"),
    "sidecar not JSON": ([*T, "data.source=bad_json.bin"], "the sidecar 'bad_json.bin.json' of data.source is not"),
    "sidecar not an object": ([*T, "data.source=list_json.bin"], "must hold a JSON object, got list"),
    "sidecar vocab_size a string": ([*T, "data.source=str_vocab.bin"], "has vocab_size='many'; expected a int"),
    "sidecar not UTF-8": ([*T, "data.source=latin1_json.bin"], "is not valid JSON"),
    "init_from not a checkpoint": ([*T, "checkpoint.init_from=not_a_checkpoint"], "holds no complete checkpoint"),
    "state larger than memory": ([*T, "model.d_model=65536", "model.n_heads=8", "model.n_kv_heads=8"],
                                 "the parameters and optimizer state alone need"),
}


def _check(workspace, args, expected):
    before = _snapshot(workspace)
    proc = run_cli(*args, cwd=workspace)
    lines = proc.stderr.strip().splitlines()
    errors = [line for line in lines if line.startswith("error: ")]
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    # JAX's C++ start-up may log its own lines before ours (absl); ours is one line and the last.
    assert len(errors) == 1 and lines[-1] == errors[0], proc.stderr[-3000:]
    assert expected in errors[0], errors[0]
    assert _snapshot(workspace) == before


@pytest.mark.parametrize("name", list(FAST))
def test_bad_input_before_jax_starts(workspace, name):
    _check(workspace, *FAST[name])


# JAX's start-up makes each of these cost 2-8 s on 2 cores: three stay in the default suite, all run under -m slow.
DEFAULT_AFTER_JAX = {"token id >= vocab_size, no sidecar", "sidecar not JSON", "state larger than memory"}


@pytest.mark.parametrize("name", [n if n in DEFAULT_AFTER_JAX else pytest.param(n, marks=pytest.mark.slow)
                                  for n in AFTER_JAX])
def test_bad_input_found_after_jax_starts(workspace, name):
    _check(workspace, *AFTER_JAX[name])


def test_the_table_is_large_and_distinct():
    cases = {**FAST, **AFTER_JAX}
    assert len(cases) >= 40
    assert len({tuple(args) for args, _ in cases.values()}) == len(cases)


def test_prepare_with_a_tokenizer_rejects_text_that_is_not_utf8(workspace, tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({"[UNK]": 0, "hello": 1}, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.save(str(workspace / "tokenizer.json"))
    _check(workspace, ["prepare", "binary.txt", "--out", "tokens.bin", "--tokenizer", "tokenizer.json"],
           "input file 'binary.txt' is not UTF-8 text")
    os.remove(workspace / "tokenizer.json")


def test_a_sidecar_written_by_prepare_is_read(workspace, tmp_path):
    """The sidecar checks above reject bad sidecars only: prepare's own output trains (see test_cli) and its sidecar
    is an object with an integer vocab_size."""
    out = tmp_path / "t.bin"
    proc = run_cli("prepare", str(workspace / "notes.txt"), "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    meta = json.loads((tmp_path / "t.bin.json").read_text())
    assert isinstance(meta["vocab_size"], int) and meta["dtype"] == "uint16"
