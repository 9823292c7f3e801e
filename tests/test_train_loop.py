"""The default job end to end, and what it leaves in run.dir."""

import json

import jax
import pytest

from jaxtrain import train as train_lib
from jaxtrain.config import load_config


def test_default_config_learns_and_writes_its_outputs(tmp_path):
    run_dir = tmp_path / "run"
    cfg = load_config(None, [f"run.dir={run_dir}", "train.steps=40", "train.eval_every=20"])
    result = train_lib.train(cfg, devices=jax.devices()[:1])
    assert result.losses[40] < 0.8 * result.losses[1]

    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 41))
    assert all(r["loss"] == result.losses[r["step"]] for r in records)
    assert {"grad_norm", "lr", "step_time", "tokens_per_sec", "tokens_per_sec_per_device", "tflops_per_device",
            "mfu"} <= set(records[-1])
    assert records[-1]["mfu"] is None  # CPU: peak unknown
    assert records[0]["lr"] == 0.0 and max(r["lr"] for r in records) == pytest.approx(cfg.train.lr)
    assert [r["step"] for r in records if "eval_loss" in r] == [20, 40]
    assert list((run_dir / "tb").glob("events.out.tfevents.*"))
    # the written config is the effective one and loads back
    written = load_config(str(run_dir / "config.yaml"))
    assert written.mesh.ici.fsdp == 1 and written.model.dtype == "float32" and written.train.steps == 40
    assert len(result.step_times) == 39 and result.compile_seconds > 0
