"""Checkpoints on an object store (``checkpoint.dir=s3://...``), against a real S3-compatible HTTP server started here
(moto's server, a separate process; no mock inside the tested process): an exact resume after a stop, and one-line
errors (exit status 2) for bad locations and missing credentials before any training."""

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from jaxtrain.errors import ConfigError
from jaxtrain_testing import REPO, launch_local, logged_losses, run_cli

pytest.importorskip("moto.server", reason="the test extra's moto[server] runs the local S3 server")
pytest.importorskip("s3fs", reason="s3:// directories go through etils.epath -> s3fs")
boto3 = pytest.importorskip("boto3")

SMALL = ["model.dtype=float32", "model.param_dtype=float32", "data.seq_len=64", "train.global_batch=8",
         "train.eval_every=0", "train.eval_batches=1", "train.warmup_steps=5", "train.decay_steps=60",
         "train.log_every=1"]
BUCKET = "jaxtrain-runs"
# Credentials and region that no real AWS account has: the server accepts any.
KEYS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_REGION": "us-east-1"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def s3_env():
    """A moto S3 server on 127.0.0.1 with bucket BUCKET; the environment that points the AWS SDKs at it."""
    port = _free_port()
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 30
        while True:
            try:
                urllib.request.urlopen(url, timeout=1)
                break
            except OSError:
                if time.time() > deadline or server.poll() is not None:
                    raise AssertionError("the moto S3 server did not start") from None
                time.sleep(0.2)
        env = {**{k: v for k, v in os.environ.items() if k != "XLA_FLAGS" and not k.startswith("AWS_")}, **KEYS,
               "AWS_ENDPOINT_URL_S3": url, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
        client = boto3.client("s3", endpoint_url=url, region_name="us-east-1", aws_access_key_id="testing",
                              aws_secret_access_key="testing")
        client.create_bucket(Bucket=BUCKET)
        yield env, client
    finally:
        server.terminate()
        server.wait(timeout=30)


def _keys(client, prefix):
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix)
    return [o["Key"] for page in pages for o in page.get("Contents", [])]


def _train_until_sigterm(args, env, step, timeout=180):
    """Start training, send SIGTERM once ``step`` is logged; (exit status, output)."""
    proc = subprocess.Popen([sys.executable, "-m", "jaxtrain", "train", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, cwd=REPO, env=env)
    lines, deadline = [], time.time() + timeout
    while time.time() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        if line.startswith("step ") and int(line.split()[1].split("/")[0]) >= step:
            proc.send_signal(signal.SIGTERM)
            break
    out, _ = proc.communicate(timeout=timeout)
    return proc.returncode, "".join(lines) + out


@pytest.mark.slow
def test_checkpoints_on_s3_resume_bit_exact(tmp_path, s3_env):
    env, client = s3_env
    common = [*SMALL, "train.steps=14", "checkpoint.every=5"]
    ref = run_cli("train", f"run.dir={tmp_path / 'ref'}", *common, env=env)
    assert ref.returncode == 0, ref.stderr

    run_dir, url = tmp_path / "s3run", f"s3://{BUCKET}/exact/checkpoints"
    args = [f"run.dir={run_dir}", f"checkpoint.dir={url}", *common]
    status, out = _train_until_sigterm(args, env, 7)
    assert status == 75, out  # stopped before train.steps, its step saved
    saved = int(out.split("saving step ")[1].split(",")[0])
    assert 7 <= saved < 14
    keys = _keys(client, "exact/checkpoints/")
    assert f"exact/checkpoints/{saved}/commit_success.txt" in keys  # the step is complete on the server
    assert any(k.startswith(f"exact/checkpoints/{saved}/state/") and "/d/" in k for k in keys)  # TensorStore's data
    assert not (run_dir / "checkpoints").exists()  # nothing went to the local run directory instead

    # A later step whose save never finished (its objects without Orbax's commit_success.txt markers) is not resumed.
    for k in keys:
        if k.startswith(f"exact/checkpoints/{saved}/") and "commit_success" not in k:
            client.copy_object(Bucket=BUCKET, Key=k.replace(f"/{saved}/", "/13/"), CopySource=f"{BUCKET}/{k}")
    resumed = run_cli("train", *args, env=env)
    assert resumed.returncode == 0, resumed.stderr
    assert f"resumed from {url}/{saved}" in resumed.stderr
    expected, got = logged_losses(tmp_path / "ref"), logged_losses(run_dir)
    assert sorted(got) == list(range(1, 15))
    assert got == expected  # every step, before and after the stop, bit-equal to the uninterrupted run


def test_unknown_bucket_is_one_line_exit_2_before_training(tmp_path, s3_env):
    env, _ = s3_env
    r = run_cli("train", f"run.dir={tmp_path}", "checkpoint.dir=s3://no-such-bucket-here/ckpt", *SMALL,
                "train.steps=2", env=env)
    assert r.returncode == 2, r.stderr
    line = [x for x in r.stderr.splitlines() if x.startswith("error:")]
    assert len(line) == 1 and "s3://no-such-bucket-here/ckpt" in line[0] and "does not exist" in line[0], r.stderr
    assert "Traceback" not in r.stderr and "step 1/" not in r.stdout


@pytest.mark.parametrize("setting, value, says", [
    ("run.dir", "s3://jaxtrain-runs/run", "must be a directory on a file system"),
    ("checkpoint.dir", "s3://Bad_Bucket/ckpt", "'Bad_Bucket' is not a valid bucket name"),
    ("checkpoint.dir", "s3://ab/ckpt", "'ab' is not a valid bucket name"),
    ("checkpoint.dir", "ftp://host/ckpt", "'ftp://' is not a supported location; use s3://bucket/path or gs://"),
    ("checkpoint.resume", "s3:///ckpt", "'' is not a valid bucket name"),
    ("checkpoint.init_from", "S3://bucket/ckpt", "'S3://' is not a supported location"),
    ("data.source", "gs://a/shards", "'a' is not a valid bucket name"),
])
def test_bad_object_store_locations_name_the_value(tmp_path, setting, value, says):
    from jaxtrain.config import load_config  # validates, paths last (config.locations.check_paths)

    overrides = [f"run.dir={tmp_path}", f"{setting}={value}"] if setting != "run.dir" else [f"run.dir={value}"]
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    assert value in str(e.value) and says in str(e.value) and "\n" not in str(e.value)


def test_missing_aws_credentials_exit_2_before_training(tmp_path, s3_env):
    env, _ = s3_env
    bare = {k: v for k, v in env.items() if not k.startswith("AWS_")}
    # No keys, no profile files, no instance metadata to ask: botocore finds nothing, as on a laptop without AWS.
    bare.update(HOME=str(tmp_path), AWS_CONFIG_FILE=str(tmp_path / "none"),
                AWS_SHARED_CREDENTIALS_FILE=str(tmp_path / "none"), AWS_EC2_METADATA_DISABLED="true")
    url = f"s3://{BUCKET}/ckpt"
    half = "AWS_ACCESS_KEY_ID is set but AWS_SECRET_ACCESS_KEY is not"
    for extra, says in (({}, "no AWS credentials found"), ({"AWS_ACCESS_KEY_ID": "testing"}, half)):
        r = run_cli("train", f"run.dir={tmp_path / 'run'}", f"checkpoint.dir={url}", *SMALL, "train.steps=2",
                    env={**bare, **extra})
        assert r.returncode == 2, r.stderr
        assert r.stderr.strip().splitlines()[-1].startswith("error: checkpoint.dir='s3://jaxtrain-runs/ckpt': " + says)
        assert "Traceback" not in r.stderr and not (tmp_path / "run").exists()


def _prepared_on_s3(tmp_path, client, prefix):
    """prepare's shards of a small corpus in tmp_path/shards, uploaded (by the test's own S3 client) under prefix."""
    import json

    from jaxtrain import data as data_lib

    text = tmp_path / "t.jsonl"
    text.write_text("".join(json.dumps({"text": f"document {i} " * 40}) + "\n" for i in range(300)))
    data_lib.prepare([str(text)], str(tmp_path / "shards"), shard_tokens=20000)
    for f in sorted((tmp_path / "shards").iterdir()):
        client.upload_file(str(f), BUCKET, f"{prefix}/{f.name}")
    return tmp_path / "shards", f"s3://{BUCKET}/{prefix}"


def test_token_shards_read_from_s3_equal_the_local_files(tmp_path, s3_env, monkeypatch):
    import numpy as np

    from jaxtrain import data as data_lib
    from jaxtrain.config import load_config

    env, client = s3_env
    for k, v in env.items():
        if k.startswith("AWS_"):
            monkeypatch.setenv(k, v)
    local, url = _prepared_on_s3(tmp_path, client, "shards-read")
    cfg = load_config(None, [f"run.dir={tmp_path / 'run'}", f"data.source={url}", "data.seq_len=64"])
    remote = data_lib.load_tokens(cfg.data, 256)
    index = data_lib.read_index(str(local))
    ids = np.concatenate([np.fromfile(local / s["file"], dtype=index["dtype"]) for s in index["shards"]])
    assert len(remote.train) + len(remote.eval) == len(ids)
    w = data_lib.Windows(remote.train, 64)
    bounds = np.cumsum([s["tokens"] for s in index["shards"]])
    for i in (0, int(bounds[0]) // 64, len(w) - 1):  # the second spans the first shard boundary
        np.testing.assert_array_equal(w[i], ids[i * 64: i * 64 + 65])  # windows of 65 tokens, 64 apart
    # A shard cut short on the server after the index was written: named, exit status 2 (ConfigError).
    first = index["shards"][0]["file"]
    client.put_object(Bucket=BUCKET, Key=f"shards-read/{first}", Body=(local / first).read_bytes()[:-2])
    with pytest.raises(ConfigError, match=f"shard '{url}/{first}' has .* bytes but"):
        data_lib.load_tokens(cfg.data, 256)


@pytest.mark.slow
def test_training_on_s3_shards_logs_the_losses_of_the_local_copy(tmp_path, s3_env):
    env, client = s3_env
    local, url = _prepared_on_s3(tmp_path, client, "shards-train")
    common = [*SMALL, "train.steps=6", "checkpoint.every=0"]
    for name, source in (("local", local), ("s3", url)):
        r = run_cli("train", f"run.dir={tmp_path / name}", f"data.source={source}", *common, env=env)
        assert r.returncode == 0, r.stderr
    assert logged_losses(tmp_path / "s3") == logged_losses(tmp_path / "local")


@pytest.mark.slow
def test_two_processes_save_to_s3_and_resume_exact(tmp_path, s3_env, monkeypatch):
    """Each process writes its own shards of a state sharded across both (mesh.dcn.fsdp=2) into one s3:// step; the
    restarted job resumes from it and logs the losses of the same job run without a stop, checkpoints on local disk."""
    env, client = s3_env
    for k, v in env.items():
        if k.startswith("AWS_"):
            monkeypatch.setenv(k, v)  # launch_local passes this process's environment on
    common = [*SMALL, "checkpoint.every=4"]
    ref = launch_local(2, "train", f"run.dir={tmp_path / 'ref'}", "mesh.dcn.fsdp=2", *common, "train.steps=12")
    assert ref.returncode == 0, ref.stdout + ref.stderr
    url, run_dir = f"s3://{BUCKET}/two/checkpoints", tmp_path / "two"
    args = ["train", f"run.dir={run_dir}", f"checkpoint.dir={url}", "mesh.dcn.fsdp=2", *common]
    first = launch_local(2, *args, "train.steps=8")
    assert first.returncode == 0, first.stdout + first.stderr
    keys = _keys(client, "two/checkpoints/8/state/")
    assert {p for p in ("ocdbt.process_0/", "ocdbt.process_1/") if any(p in k for k in keys)} == {
        "ocdbt.process_0/", "ocdbt.process_1/"}  # both processes wrote shards through TensorStore's s3 driver
    again = launch_local(2, *args, "train.steps=12")
    assert again.returncode == 0, again.stdout + again.stderr
    out = again.stdout + again.stderr
    assert f"[process 0/2] resumed from {url}/8" in out and f"[process 1/2] resumed from {url}/8" in out
    assert logged_losses(run_dir) == logged_losses(tmp_path / "ref")
