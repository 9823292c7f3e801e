"""The default job end to end, and what it leaves in run.dir."""

import json
import time

import jax
import jax.numpy as jnp
import pytest

from jaxtrain.config import load_config
from jaxtrain.train import loop
from jaxtrain_testing import hand_forward_flops_per_token


def test_default_config_learns_and_writes_its_outputs(tmp_path):
    run_dir = tmp_path / "run"
    cfg = load_config(None, [f"run.dir={run_dir}", "train.steps=40", "train.eval_every=20", "train.log_every=1"])
    result = loop.train(cfg, devices=jax.devices()[:1])
    assert result.losses[40] < 0.8 * result.losses[1]

    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 41))
    assert all(r["loss"] == result.losses[r["step"]] for r in records)
    assert {"grad_norm", "learning_rate", "step_seconds", "tokens_per_second", "tokens_per_second_per_device",
            "tflops_per_device", "mfu"} <= set(records[-1])
    assert records[-1]["mfu"] is None  # CPU: peak unknown
    # The throughput figures follow from the step time and a hand count of the model's FLOPs (tests/
    # test_reference_flops.py), not only present: tokens are global_batch x seq_len inputs per step.
    tokens = cfg.train.global_batch * cfg.data.seq_len
    matmuls, attention = hand_forward_flops_per_token(cfg.model, cfg.data.seq_len)
    for r in records:
        assert r["tokens_per_second"] == pytest.approx(tokens / r["step_seconds"], rel=1e-9)
        assert r["tokens_per_second_per_device"] == pytest.approx(r["tokens_per_second"], rel=1e-9)  # one device
        assert r["tflops_per_device"] == pytest.approx(3 * (matmuls + attention) * tokens / r["step_seconds"] / 1e12,
                                                       rel=1e-9)
    # Step s of the warmup runs at lr * s / warmup_steps: the first step already moves the parameters.
    w = cfg.train.warmup_steps
    assert [r["learning_rate"] for r in records[:w]] == pytest.approx([cfg.train.lr * s / w for s in range(1, w + 1)])
    assert max(r["learning_rate"] for r in records) == pytest.approx(cfg.train.lr)
    assert [r["step"] for r in records if "eval_loss" in r] == [20, 40]
    assert list((run_dir / "tb").glob("events.out.tfevents.*"))
    # the written config is the effective one and loads back
    written = load_config(str(run_dir / "config.yaml"))
    assert written.mesh.ici.fsdp == 1 and written.model.dtype == "float32" and written.train.steps == 40
    assert len(result.step_times) == 40 and all(t > 0 for t in result.step_times)  # step 1 is timed too
    assert result.compile_seconds > 0
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["last_step"] == 40 and summary["steps_timed"] == 40
    assert summary["final_loss"] == result.losses[40] and summary["final_eval_loss"] == result.eval_losses[40]
    assert summary["step_seconds"]["p10"] <= summary["step_seconds"]["median"] <= summary["step_seconds"]["p90"]
    assert summary["tokens_per_second"] == pytest.approx(tokens / summary["step_seconds"]["median"], rel=1e-9)


def test_default_logging_and_a_finished_run_left_untouched(tmp_path, capsys):
    """log_every=10 logs steps 1, 10, 20, ...; invoking a finished run again (even on another mesh) trains nothing
    and rewrites nothing: its config.yaml still describes the run that trained, and the run says that the new mesh
    was not trained and what to do. The run directory and what is being compiled are said before compiling."""
    run_dir = tmp_path / "run"
    base = [f"run.dir={run_dir}", "train.steps=12", "train.eval_every=0", "data.threads=0"]
    loop.train(load_config(None, base), devices=jax.devices()[:1])
    lines = capsys.readouterr().err.splitlines()
    order = [next(i for i, line in enumerate(lines) if text in line)
             for text in (f"run directory {run_dir}", "compiling the train step: mesh one-device",
                          "compiled in")]
    assert order == sorted(order)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 10, 12]
    before = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file() and "logs" not in p.parts}
    again = loop.train(load_config(None, [*base, "mesh.ici.fsdp=2"]), devices=jax.devices()[:2])
    assert again.losses == {} and again.start_step == 12
    said = capsys.readouterr().err
    assert "nothing to do" in said and "mesh.ici.fsdp=2 here, 1 there" in said and "use another run.dir" in said
    after = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file() and "logs" not in p.parts}
    assert after == before


def test_a_step_after_an_idle_device_is_timed_from_when_the_host_began_it():
    """On CPUs a step's dispatch can run the step itself (launch/local.sh's first progress line said 1,107,687 tok/s
    against ~2,000 after: the step was timed from when its dispatch had returned). A step the device was idle for
    (the first, the one after an evaluation) is timed from when the host began it."""
    reported = {}
    pending = loop.PendingMetrics(lambda step, values, seconds, _: reported.__setitem__(step, seconds),
                                  lambda start, end: None)
    began = time.perf_counter()
    time.sleep(0.2)  # the host's work on step 1: its batch, and a dispatch that ran the step
    pending.add(1, {"loss": jnp.float32(1.0)}, started=began)
    pending.drain()
    assert reported[1] >= 0.2


@pytest.mark.parametrize("overrides, formats", [
    ([], "compute float32, params float32"),
    (["model.fp8=tensorwise"], "compute float32, FP8 projections (tensorwise), params float32"),
    (["model.fp8=rowwise", "model.dtype=bfloat16"], "compute bfloat16, FP8 projections (rowwise), params float32"),
    (["model.fp8=delayed", "model.fp8_amax_history=16"],
     "compute float32, FP8 projections (delayed, amax history 16), params float32"),
])
def test_the_start_up_line_names_the_fp8_recipe(tmp_path, capsys, monkeypatch, overrides, formats):
    """The line said before the compile names the number formats: FP8, when on, with its recipe (a run with
    model.fp8 said only its dtypes before). Stopped at the compile: the line is all this test needs."""
    class Stop(Exception):
        pass

    def stop(self, with_eval):
        raise Stop

    monkeypatch.setattr(loop.Step, "compile", stop)
    cfg = load_config(None, [f"run.dir={tmp_path / 'run'}", "model.dtype=float32", "data.threads=0", *overrides])
    with pytest.raises(Stop):
        loop.train(cfg, devices=jax.devices()[:1])
    line = next(line for line in capsys.readouterr().err.splitlines() if "compiling the train step" in line)
    assert f"parameters, {formats}, attention xla; global batch 16 x 128 tokens ..." in line, line
