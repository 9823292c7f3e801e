"""Watching a job: the Prometheus endpoint scraped during real CPU runs, goodput across a SIGKILL and resume, profile
windows read back by XProf's own loader, the collective probe's warning, stragglers among 2 processes, and the
monitoring files (every dashboard query names a metric a real run exports; scrape targets match the launchers)."""

import gzip
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from helpers import FAST, REPO

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
    job = Job(f"run.dir={run_dir}", *SMALL, "runtime.cpu_devices=2", "train.steps=400", "train.log_every=5",
              "train.eval_every=20", "checkpoint.every=20", "observe.prometheus_port=0",
              "observe.collective_probe_every=10", f"observe.hardware={hw}")
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
        job.proc.send_signal(signal.SIGTERM)  # stops at the next step after saving it
        rc = job.finish()
    finally:
        job.kill()
    assert rc in (0, 75), job.text()[-3000:]  # 75: SIGTERM stopped it before train.steps (0: it had finished)
    return {"scrapes": scrapes, "text": job.text(), "run_dir": run_dir, "url": url}


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
    # Each logged step's split on this process: data wait within host work, then the device share.
    for r in list(records.values())[:-1]:
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
    prom = yaml.safe_load(open(os.path.join(MONITORING, "prometheus.yml")))
    jobs = {j["job_name"]: j for j in prom["scrape_configs"]}
    # Kubernetes: Prometheus keeps the pods' container port named "metrics"; the JobSet's container declares it,
    # and its command serves on that port on all interfaces.
    keep = [r for r in jobs["jaxtrain-k8s"]["relabel_configs"]
            if r.get("action") == "keep" and "__meta_kubernetes_pod_container_port_name" in r["source_labels"]]
    assert keep and keep[0]["regex"] == "metrics"
    pod = yaml.safe_load(open(os.path.join(REPO, "launch", "k8s", "jaxtrain.yaml")))
    container = pod["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["containers"][0]
    port = next(p["containerPort"] for p in container["ports"] if p.get("name") == "metrics")
    args = dict(a.split("=", 1) for a in container["command"] if a.startswith("observe."))
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


SLOW_DATA = """
import os
import time

delay = float(os.environ["SLOW_DATA_SECONDS"])
from jaxtrain import data  # noqa: E402

real = data.train_batches


class Slow:
    \"\"\"The real batch iterator, each batch {delay} s late: a data source that cannot keep up.\"\"\"

    def __init__(self, it):
        self.it = iter(it)

    def __iter__(self):
        return self

    def __next__(self):
        time.sleep(delay)
        return next(self.it)

    def __getattr__(self, name):
        return getattr(self.it, name)


data.train_batches = lambda *a, **k: Slow(real(*a, **k))
"""


@pytest.mark.slow
def test_two_processes_straggler_warning_names_the_slowed_process(tmp_path):
    """Process 1 reads its batches from a slow source (its real iterator, 80 ms late per batch, injected through a
    sitecustomize module); process 0's warning names process 1 and nobody else."""
    hook = tmp_path / "slow_hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(SLOW_DATA)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    run_dir = tmp_path / "run"
    common = [f"run.dir={run_dir}", *SMALL, "runtime.cpu_devices=1", "mesh.dcn.data=2", "mesh.ici.fsdp=1",
              "train.steps=60", "train.log_every=5", "train.eval_every=0", "checkpoint.every=0",
              "observe.straggler_every=5", f"dist.coordinator=127.0.0.1:{port}", "dist.num_processes=2"]
    env = dict(os.environ, JAX_COORDINATOR_BIND_ADDRESS=f"127.0.0.1:{port}")
    slow_env = dict(env, SLOW_DATA_SECONDS="0.08", PYTHONPATH=f"{hook}{os.pathsep}{env.get('PYTHONPATH', '')}")
    jobs = [Job(*common, "dist.process_id=0", env=env), Job(*common, "dist.process_id=1", env=slow_env)]
    try:
        assert [j.finish(timeout=600) for j in jobs] == [0, 0], jobs[0].text()[-2000:] + jobs[1].text()[-2000:]
    finally:
        for job in jobs:
            job.kill()
    warnings = re.findall(r"straggler: process (\d+) \(host [^)]+\) spends ([\d.]+) ms of host work per step, "
                          r"([\d.]+)x the median ([\d.]+) ms.*data wait ([\d.]+) ms", jobs[0].text())
    assert warnings, jobs[0].text()[-3000:]
    assert {w[0] for w in warnings} == {"1"}
    for _, host, ratio, median, data_wait in warnings:
        assert float(data_wait) >= 80 and float(host) >= 80  # the delay, seen as data wait
        assert float(ratio) > 1.5 and float(median) * float(ratio) == pytest.approx(float(host), rel=0.2)
    assert "straggler:" not in jobs[1].text()  # process 0 judges


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


def test_straggler_rule_names_only_a_process_that_costs_the_job(capsys):
    """Above ratio x the (lower) median AND by more than 5% of the median step; with two processes the lower median
    is the faster one, so the slow one of a pair can be named."""
    from jaxtrain.observe import StragglerWatch

    watch = StragglerWatch(10, 1.5, ["a", "b", "c", "d"], None)
    post = lambda host, device=0.1: {"host": host, "data": host / 2, "device": device, "first": 1, "last": 10}  # noqa
    assert watch.judge({0: post(0.010), 1: post(0.040), 2: post(0.011), 3: post(0.009)}) == [1]
    assert "straggler: process 1 (host b) spends 40.0 ms of host work per step, 4.0x the median 10.0 ms" in \
        capsys.readouterr().err
    assert watch.judge({0: post(0.010), 1: post(0.035)}) == [1]  # a pair: compared with the faster one
    # 3x the median but 2 ms of a 100 ms step: hidden behind the devices, not worth a warning.
    assert watch.judge({0: post(0.001), 1: post(0.003), 2: post(0.001)}) == []
    assert watch.judge({0: post(0.010), 1: post(0.014)}) == []  # 1.4x: under the ratio


def test_out_of_memory_writes_the_device_memory_profile_and_the_split(make_config, tmp_path, capsys):
    """A real RESOURCE_EXHAUSTED from XLA (a 128 TiB allocation): the profile lands next to the process log, as
    pprof, and the line gives the per-device parameter and optimizer bytes of the fsdp=2 layout."""
    import jax
    import jax.numpy as jnp

    from jaxtrain import observe
    from jaxtrain import step as step_lib
    from jaxtrain.metrics import Throughput
    from jaxtrain.model import count_params

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
