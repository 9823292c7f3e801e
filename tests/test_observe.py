"""Watching a job: the Prometheus endpoint scraped during real CPU runs, goodput across a SIGKILL and resume, profile
windows read back by XProf's own loader, the collective probe's warning, and the
monitoring files (every dashboard query names a metric a real run exports; scrape targets match the launchers)."""

import gzip
import importlib
import importlib.util
import json
import os
import re
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import types
import urllib.request

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from jaxtrain_testing import FAST, REPO

MONITORING = os.path.join(REPO, "launch", "monitoring")
SMALL = [*FAST, "data.seq_len=64", "train.global_batch=8", "train.warmup_steps=2", "train.decay_steps=400"]


class Job:
    """``python -m jaxtrain train ARGS`` in the background; its stderr collected line by line."""

    def __init__(self, *args, env=None):
        env = dict(os.environ if env is None else env)
        env.pop("XLA_FLAGS", None)
        env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
        self.proc = subprocess.Popen([sys.executable, "-m", "jaxtrain", "train", *args], stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, cwd=REPO, env=env)
        self.err: list[str] = []
        self.out: list[str] = []
        self._threads = [threading.Thread(target=self._pump, args=(s, d), daemon=True)
                         for s, d in ((self.proc.stderr, self.err), (self.proc.stdout, self.out))]
        for t in self._threads:
            t.start()

    @staticmethod
    def _pump(stream, lines):
        for line in stream:
            lines.append(line)

    def wait_for(self, pattern: str, timeout: float = 300) -> re.Match:
        deadline = time.time() + timeout
        while time.time() < deadline:
            for line in list(self.err) + list(self.out):
                m = re.search(pattern, line)
                if m:
                    return m
            if self.proc.poll() is not None and not any(t.is_alive() for t in self._threads):
                break
            time.sleep(0.1)
        raise AssertionError(f"{pattern!r} never appeared:\n{self.text()[-3000:]}")

    def finish(self, timeout: float = 300) -> int:
        rc = self.proc.wait(timeout=timeout)
        for t in self._threads:
            t.join(5)
        return rc

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
        self.finish()

    def text(self) -> str:
        return "".join(self.err) + "".join(self.out)


def scrape(url: str) -> dict:
    """{family name: family} from one scrape."""
    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    return {f.name: f for f in text_string_to_metric_families(text)}


def value(families: dict, name: str, **labels) -> float | None:
    """The sample ``name`` (family name or sample name) matching ``labels``, or None."""
    for fam in families.values():
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    return None


def last_step(run_dir) -> int:
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        return 0
    steps = [json.loads(line)["step"] for line in open(path) if line.strip().endswith("}")]
    return max(steps, default=0)


@pytest.fixture(scope="module")
def scraped_run(tmp_path_factory):
    """A real run on 2 CPU devices with the endpoint, evaluation, checkpoints and the collective probe (its
    hardware file claims an impossible link rate), scraped while it trains."""
    tmp = tmp_path_factory.mktemp("scraped")
    hw = tmp / "fast-cpu.yaml"
    hw.write_text(yaml.safe_dump({
        "name": "impossible-cpu", "device_kind": "cpu", "peak_flops": 1e12, "hbm_bytes": 1e10, "hbm_bandwidth": 1e11,
        "devices_per_node": 2, "intra_node_bandwidth": 1e15, "inter_node_bandwidth": 1e15, "compute_efficiency": 0.5}))
    run_dir = tmp / "run"
    job = Job(f"run.dir={run_dir}", *SMALL, "runtime.cpu_devices=2", "train.steps=60", "train.log_every=5",
              "train.eval_every=20", "checkpoint.every=20", "observe.prometheus_port=0",
              "observe.collective_probe_every=10", f"observe.hardware={hw}", "observe.prometheus_linger_s=5")
    try:
        url = job.wait_for(r"metrics: (http://127\.0\.0\.1:\d+/metrics)").group(1)
        scrapes = []
        deadline = time.time() + 400
        while time.time() < deadline and job.proc.poll() is None:
            try:
                scrapes.append(scrape(url))
            except OSError:
                break  # the run ended between the check and the scrape
            step = value(scrapes[-1], "jaxtrain_step")
            if step is not None and step >= 45 and value(scrapes[-1], "jaxtrain_eval_loss") is not None \
                    and value(scrapes[-1], "jaxtrain_checkpoint_save_seconds_count"):
                break
            time.sleep(0.5)
        job.wait_for(r"metrics: serving the last values 5 s more")
        final = scrape(url)  # during the linger: the end-of-run values
        rc = job.finish()
    finally:
        job.kill()
    assert rc == 0, job.text()[-3000:]
    return {"scrapes": scrapes, "text": job.text(), "run_dir": run_dir, "url": url, "final": final}


def test_metrics_endpoint_scraped_during_a_real_run(scraped_run):
    scrapes = [s for s in scraped_run["scrapes"] if value(s, "jaxtrain_step") is not None]
    assert len(scrapes) >= 3, scraped_run["text"][-2000:]
    first, last = scrapes[0], scrapes[-1]
    labels = {"run": "run", "process": "0", "host": socket.gethostname().split(".")[0]}
    for name in ("jaxtrain_up", "jaxtrain_start_time_seconds", "jaxtrain_step", "jaxtrain_loss", "jaxtrain_grad_norm",
                 "jaxtrain_learning_rate", "jaxtrain_tokens_per_second", "jaxtrain_step_host_seconds",
                 "jaxtrain_step_device_seconds", "jaxtrain_eval_loss", "jaxtrain_step_seconds_count",
                 "jaxtrain_data_wait_seconds_count", "jaxtrain_checkpoint_blocking_seconds_count",
                 "jaxtrain_checkpoint_save_seconds_count"):
        assert value(last, name, **labels) is not None, name
    assert value(last, "jaxtrain_up", **labels) == 1
    assert 0 < time.time() - value(last, "jaxtrain_start_time_seconds", **labels) < 3600
    # Values move while the run trains, and agree with what the run itself logs.
    assert value(last, "jaxtrain_step") > value(first, "jaxtrain_step") >= 1
    assert value(last, "jaxtrain_step_seconds_count") > value(first, "jaxtrain_step_seconds_count")
    assert value(last, "jaxtrain_step_seconds_count") >= value(last, "jaxtrain_step") - 1
    assert value(last, "jaxtrain_learning_rate") > 0 and 0 < value(last, "jaxtrain_loss") < 6
    records = {r["step"]: r for r in map(json.loads, open(scraped_run["run_dir"] / "metrics.jsonl"))}
    # Each logged step's split on this process: data wait within own work, then the waits (a step reported inside
    # its own cycle, an evaluated one or the last: its figures so far).
    for r in records.values():
        host, device = r["step_host_seconds"], r["step_device_seconds"]
        assert 0 <= r["data_wait_seconds"] <= host < host + device, r
    step = int(value(last, "jaxtrain_step"))
    if step in records:  # a logged step: the endpoint shows the same loss as metrics.jsonl
        assert value(last, "jaxtrain_loss") == pytest.approx(records[step]["loss"], rel=1e-6)
    # Collective probe on the fsdp axis (2 devices), judged against the impossible hardware file.
    bw = value(last, "jaxtrain_collective_bus_bandwidth_bytes_per_second", axis="fsdp")
    assert bw is not None and 0 < bw < 1e15 * 0.7
    assert value(last, "jaxtrain_collective_expected_bytes_per_second", axis="fsdp") == 1e15
    assert value(last, "jaxtrain_bandwidth_warnings_total", axis="fsdp") >= 1
    fractions = {s.labels["category"]: s.value for s in last["jaxtrain_goodput_ratio"].samples}
    assert set(fractions) >= {"startup", "compilation", "productive", "checkpoint", "evaluation"}
    assert sum(fractions.values()) == pytest.approx(1, abs=1e-6)
    assert "process_cpu_seconds" in last  # the process collector
    # Counters exist at 0 before their first increment (increase() then sees it); the exact recent quantiles lie
    # within the step times the run logged.
    assert value(first, "jaxtrain_straggler_warnings_total", peer="0") == 0
    assert value(first, "jaxtrain_nonfinite_steps_total") == 0
    times = [r["step_seconds"] for r in records.values()]
    assert min(times) <= value(last, "jaxtrain_recent_step_seconds", quantile="0.5") <= max(times)


def test_end_of_run_values_are_served_for_the_linger_with_up_0(scraped_run):
    """After the run: jaxtrain_up 0, the final goodput (it adds up to 1 and matches summary.json's) and the last
    step, served for observe.prometheus_linger_s."""
    final = scraped_run["final"]
    assert value(final, "jaxtrain_up") == 0
    summary = json.load(open(scraped_run["run_dir"] / "summary.json"))
    assert value(final, "jaxtrain_step") == summary["last_step"]
    for category, fraction in summary["goodput"].items():
        assert value(final, "jaxtrain_goodput_ratio", category=category) == pytest.approx(fraction, abs=0.01)


def test_probe_below_the_expected_rate_warns_naming_the_axis(scraped_run):
    warnings = [line for line in scraped_run["text"].splitlines() if "collective bandwidth: axis fsdp" in line]
    assert warnings, scraped_run["text"][-2000:]
    assert "below observe.min_bandwidth_fraction=0.7 of the expected 1000000.0 GB/s" in warnings[0]
    assert f"inside host {socket.gethostname().split('.')[0]}" in warnings[0]


def test_every_dashboard_query_names_an_exported_metric(scraped_run):
    """Each PromQL expression in the Grafana dashboard names only metrics the scraped run exports (a family with
    its samples' suffixes: _bucket/_count/_sum of histograms, _total of counters)."""
    exported = set()
    for fam in scraped_run["scrapes"][-1].values():
        exported.add(fam.name)
        exported.update(s.name for s in fam.samples)
    dash = json.load(open(os.path.join(MONITORING, "grafana-dashboard.json")))
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    assert len(exprs) >= 10
    words = {w for e in exprs for w in re.findall(r"\b(?:jaxtrain|process)_[a-z_]+", e)}
    missing = sorted(w for w in words if w not in exported)
    assert not missing, missing
    # ... and the endpoint's main metrics each have a panel.
    for name in ("jaxtrain_loss", "jaxtrain_step_seconds_bucket", "jaxtrain_tokens_per_second",
                 "jaxtrain_collective_bus_bandwidth_bytes_per_second", "jaxtrain_goodput_ratio",
                 "jaxtrain_straggler_host_ratio", "jaxtrain_device_memory_in_use_bytes", "jaxtrain_up"):
        assert name in words, name


def test_scrape_config_targets_match_the_launchers_ports():
    jobs = {j["job_name"]: j for path in (os.path.join(MONITORING, "prometheus.yml"),
                                           os.path.join(REPO, "launch", "k8s", "prometheus-scrape.yml"))
            for j in yaml.safe_load(open(path))["scrape_configs"]}
    # Kubernetes: Prometheus keeps the pods' container port named "metrics"; the JobSet's container declares it,
    # and its args (the image keeps its entrypoint) serve on that port on all interfaces.
    keep = [r for r in jobs["jaxtrain-k8s"]["relabel_configs"]
            if r.get("action") == "keep" and "__meta_kubernetes_pod_container_port_name" in r["source_labels"]]
    assert keep and keep[0]["regex"] == "metrics"
    pod = yaml.safe_load(open(os.path.join(REPO, "launch", "k8s", "jaxtrain.yaml")))
    container = pod["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["containers"][0]
    port = next(p["containerPort"] for p in container["ports"] if p.get("name") == "metrics")
    args = dict(a.split("=", 1) for a in container["args"] if a.startswith("observe."))
    assert int(args["observe.prometheus_port"]) == port
    assert args["observe.prometheus_address"] == "0.0.0.0" and args["observe.prometheus_port_offset"] == "none"
    # Slurm: the job writes its targets for file_sd into the directory the scrape config reads, on the port the
    # sbatch script serves.
    sd = jobs["jaxtrain-slurm"]["file_sd_configs"][0]["files"][0]
    sbatch = open(os.path.join(REPO, "launch", "slurm.sbatch")).read()
    default_port = re.search(r"JAXTRAIN_METRICS_PORT:-(\d+)", sbatch).group(1)
    default_dir = re.search(r"JAXTRAIN_PROMETHEUS_SD_DIR:-([^}]+)}", sbatch).group(1)
    assert sd.startswith(default_dir.rstrip("/") + "/") and sd.endswith(".json")
    assert "observe.prometheus_port=$metrics_port" in sbatch and "observe.prometheus_port_offset=local" in sbatch
    assert default_port == "9478"


@pytest.mark.slow
def test_goodput_adds_up_and_counts_steps_recomputed_after_sigkill(tmp_path):
    run_dir = tmp_path / "run"
    args = [f"run.dir={run_dir}", *SMALL, "train.steps=40", "train.log_every=1", "train.eval_every=0",
            "checkpoint.every=5", "checkpoint.async_save=false"]
    first = Job(*args)
    try:
        deadline = time.time() + 300
        while time.time() < deadline and first.proc.poll() is None:
            s = last_step(run_dir)
            if s >= 7 and s % 5 in (2, 3):
                break
            time.sleep(0.05)
    finally:
        first.kill()  # SIGKILL: no chance to save or write a summary
    assert first.proc.returncode == -signal.SIGKILL, first.text()[-2000:]
    history = last_step(run_dir)
    saved = max(int(d) for d in os.listdir(run_dir / "checkpoints") if d.isdigit())
    assert saved < history < 40 and not (run_dir / "summary.json").exists()

    second = Job(*args)
    assert second.finish() == 0, second.text()[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["start_step"] == saved
    assert summary["recomputed_steps"] == history - saved  # steps saved+1 .. history ran twice
    goodput = summary["goodput"]
    assert set(goodput) == {"startup", "compilation", "productive", "restarts", "checkpoint", "evaluation", "other"}
    assert all(v >= 0 for v in goodput.values()) and sum(goodput.values()) == pytest.approx(1, abs=1e-9)
    assert goodput["restarts"] > 0 and goodput["productive"] > 0 and goodput["checkpoint"] > 0
    assert goodput["evaluation"] > 0  # the final evaluation
    # The compilation share is the compile time the run measured itself, over the wall time.
    wall = summary["goodput_wall_seconds"]
    assert goodput["compilation"] * wall == pytest.approx(summary["compile_seconds"], rel=0.05)
    assert re.search(r"goodput: wall [\d.]+ s \| .*restarts [\d.]+%.*\(\d+ steps recomputed", second.text())


def _xspace_events(profile_dir):
    """The trace events of a profile directory, through XProf's own converter (what its trace viewer loads)."""
    from xprof.convert import raw_to_tool_data

    paths = [os.path.join(d, f) for d, _, fs in os.walk(profile_dir) for f in fs if f.endswith(".xplane.pb")]
    assert len(paths) == 1, paths
    assert "trace_viewer@" in raw_to_tool_data.xspace_to_tool_names(paths)
    data, content_type = raw_to_tool_data.xspace_to_tool_data(paths, "trace_viewer", {})
    assert content_type == "application/json"
    return paths[0], json.loads(data)["traceEvents"]


@pytest.mark.slow
def test_profile_window_and_sigusr1_write_traces_xprof_reads(tmp_path):
    run_dir = tmp_path / "run"
    job = Job(f"run.dir={run_dir}", *SMALL, "train.steps=2000", "train.log_every=1", "train.eval_every=0",
              "checkpoint.every=0", "observe.profile_steps=[3,4]", "observe.signal_profile_steps=2")
    try:
        job.wait_for(r"profile of steps 3-4 written to")
        while last_step(run_dir) < 8:
            time.sleep(0.1)
        job.proc.send_signal(signal.SIGUSR1)
        start, end = map(int, job.wait_for(r"SIGUSR1: tracing steps (\d+)-(\d+)").groups())
        assert end == start + 1 and start > 8
        job.wait_for(rf"profile of steps {start}-{end} written to")
        job.proc.send_signal(signal.SIGTERM)
        assert job.finish() == 75, job.text()[-2000:]  # EXIT_PREEMPTED: stopped before train.steps
    finally:
        job.kill()
    runs = sorted((run_dir / "profile" / "process_0" / "plugins" / "profile").iterdir())
    assert len(runs) == 2  # the configured window, then the one SIGUSR1 asked for
    for run in runs:
        path, events = _xspace_events(run)
        names = {e.get("name", "") for e in events}
        assert any("train_step" in n for n in names), sorted(names)[:50]
        with gzip.open(run / "perfetto_trace.json.gz") as f:  # what ui.perfetto.dev opens
            assert json.load(f)["traceEvents"]


@pytest.mark.parametrize("override, message", [
    ("observe.prometheus_port=70000", "observe.prometheus_port=70000 must be a TCP port in [0, 65535]"),
    ("observe.straggler_ratio=1", "observe.straggler_ratio=1.0 must be > 1"),
    ("observe.profile_steps=[5,2]", "observe.profile_steps=[5, 2] must be [START, END] with 1 <= START <= END"),
    ("observe.min_bandwidth_fraction=2", "observe.min_bandwidth_fraction=2.0 must be in [0, 1]"),
    ("observe.prometheus_port_offset=host", "observe.prometheus_port_offset='host' is not valid"),
])
def test_bad_observe_settings_are_one_line_errors(make_config, override, message):
    from jaxtrain.config import ConfigError

    with pytest.raises(ConfigError, match=re.escape(message)):
        make_config(override)


def test_out_of_memory_writes_the_device_memory_profile_and_the_split(make_config, tmp_path, capsys):
    """A real RESOURCE_EXHAUSTED from XLA (a 128 TiB allocation): the profile lands next to the process log, as
    pprof, and the line gives the per-device parameter and optimizer bytes of the fsdp=2 layout."""
    import jax
    import jax.numpy as jnp

    from jaxtrain.models.flops import count_params
    from jaxtrain.observe import observer as observe
    from jaxtrain.observe.metrics import Throughput
    from jaxtrain.train import step as step_lib

    cfg = make_config("runtime.cpu_devices=2")
    ts = step_lib.setup(cfg, jax.devices()[:2])
    obs = observe.Observer(ts.layout, str(tmp_path / "run"), Throughput(1, 1.0, ts.layout.num_devices, None))
    try:
        with pytest.raises(Exception) as err:
            jnp.ones((2**45,), jnp.float32).block_until_ready()
        assert obs.out_of_memory(ValueError("shapes do not match")) is None  # not an OOM: nothing written
        compiled, _, _ = ts.compile(ts.layout.abstract_state)
        path = obs.out_of_memory(err.value, compiled)
    finally:
        obs.close()
    assert path == str(tmp_path / "run" / "logs" / "memory_process_0.prof")
    with gzip.open(path) as f:
        profile = f.read()
    assert b"space" in profile and b"bytes" in profile  # pprof's sample types
    line = capsys.readouterr().err
    params = re.search(r"parameters ([\d.]+) MiB, optimizer ([\d.]+) MiB, temporaries", line)
    assert params, line
    # float32 parameters, half of them per device (fsdp=2; the norm scales are replicated, a rounding error here);
    # AdamW's two moments of the same size.
    expected = count_params(cfg.model)["total"] * 4 / 2 / 2**20
    assert float(params.group(1)) == pytest.approx(expected, rel=0.02)
    assert float(params.group(2)) == pytest.approx(2 * expected, rel=0.02)


def _event_protos():
    """tensorboardX's generated Event proto, loaded without its package's __init__ (which imports torch)."""
    spec = importlib.util.find_spec("tensorboardX")
    if spec is None:
        pytest.skip("tensorboardX (its Event proto is the independent reader) is not installed")
    saved = sys.modules.get("tensorboardX")
    stub = types.ModuleType("tensorboardX")
    stub.__path__ = list(spec.submodule_search_locations)
    sys.modules["tensorboardX"] = stub
    try:
        return importlib.import_module("tensorboardX.proto.event_pb2")
    finally:
        if saved is None:
            del sys.modules["tensorboardX"]
        else:
            sys.modules["tensorboardX"] = saved


def test_tensorboard_events_read_back_by_the_protobuf_library(tmp_path):
    """The event file (tensorboardX, imported without torch): every record's framing checked with google-crc32c,
    every Event parsed by the protobuf library: the version header, a resumed run's purge marker (at its first
    step), then each logged record's finite numbers as scalars at their step."""
    crc32c = pytest.importorskip("google_crc32c")
    event_pb2 = _event_protos()
    from jaxtrain.observe.metrics import MetricsWriter

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    torch_before = "torch" in sys.modules
    writer = MetricsWriter(str(run_dir), enabled=True, total_steps=20, start_step=10)
    records = [{"step": 11, "loss": 3.25, "mfu": None}, {"step": 12, "loss": 3.0, "learning_rate": 1e-3}]
    for r in records:
        writer.write(r)
    writer.close()
    assert torch_before or "torch" not in sys.modules  # the writer's import left torch out
    (path,) = (run_dir / "tb").iterdir()
    assert path.name.startswith("events.out.tfevents.")
    data, events = path.read_bytes(), []

    def masked(b):
        c = int.from_bytes(crc32c.Checksum(b).digest(), "big")
        return (((c >> 15) | (c << 17)) + 0xA282EAD8) & 0xFFFFFFFF

    while data:
        (n,) = struct.unpack("<Q", data[:8])
        assert struct.unpack("<I", data[8:12])[0] == masked(data[:8])
        body = data[12:12 + n]
        assert struct.unpack("<I", data[12 + n:16 + n])[0] == masked(body)
        events.append(event_pb2.Event.FromString(body))
        data = data[16 + n:]
    assert events[0].file_version == "brain.Event:2" and events[0].wall_time > 0
    # tensorboardX's purge marker: a version event at the resumed run's first step (TensorBoard drops the earlier
    # files' events from that step on)
    assert events[1].step == 11 and events[1].file_version == "brain.Event:2"
    scalars = [(e.step, v.tag, v.simple_value) for e in events[2:] for v in e.summary.value]
    assert scalars == [(11, "loss", 3.25), (12, "loss", 3.0),
                       (12, "learning_rate", pytest.approx(1e-3, rel=1e-6))]
