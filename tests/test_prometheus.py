"""One short 2-process run (launch/local.sh) watched from outside, for two checks (one run: the slow pass's budget):

- the straggler alarm: once the run trains, process 1 is stopped and continued in bursts from outside
  (SIGSTOP/SIGCONT to its pid, as a host taking its CPU away); every straggler warning names process 1;
- monitoring seen through a real Prometheus: Debian's ``prometheus`` (2.42; that test skips where it is not
  installed) scrapes the run through the shipped scrape config (launch/monitoring/prometheus.yml, its file_sd job
  pointed at the run's ports as launch/slurm.sbatch would), then every query of the shipped Grafana dashboard is
  evaluated over Prometheus' HTTP API: none may fail, none may come back empty for a series the run must produce,
  and the step-time quantiles, the loss, the final goodput and the straggler warnings' counts agree with the run's
  own summary.json and log.

Also (default suite) Debian's promtool accepts the shipped prometheus.yml."""

import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import threading
import time
import urllib.parse
import urllib.request

import pytest
import yaml

from jaxtrain_testing import FAST, REPO

PROMETHEUS = shutil.which("prometheus")
PROMTOOL = shutil.which("promtool")
MONITORING = os.path.join(REPO, "launch", "monitoring")
SMALL = [*FAST, "data.seq_len=64", "train.global_batch=8", "train.warmup_steps=2", "train.decay_steps=400"]
# Series a CPU run does not produce: MFU (no peak rate for CPUs), device memory (the CPU backend reports none),
# the probe's expected rate (no hardware file matches a CPU).
MAY_BE_EMPTY = ("jaxtrain_mfu_ratio", "jaxtrain_device_memory", "jaxtrain_collective_expected")
STEPS = 60  # under the 100 steps of the exact quantile gauges: they then cover the whole run


def free_ports(n: int) -> int:
    """A base port p with p .. p+n-1 free on loopback."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + n > 65535:
            continue
        try:
            socks = [socket.socket() for _ in range(n)]
            for i, s in enumerate(socks):
                s.bind(("127.0.0.1", base + i))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no free port range")


def _descendant_with(root: int, var: str) -> int | None:
    """The pid of a descendant of ``root`` whose environment holds ``var`` (e.g. JAX_PROCESS_ID=1)."""
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except OSError:
                continue
            children.setdefault(ppid, []).append(int(d))
    todo = list(children.get(root, []))
    while todo:
        pid = todo.pop()
        todo += children.get(pid, [])
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = f.read().split(b"\0")
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read()
        except OSError:
            continue
        if var.encode() in env and b"jaxtrain" in cmd:
            return pid
    return None


def api(port: int, path: str, **params) -> dict:
    url = f"http://127.0.0.1:{port}/api/v1/{path}?" + urllib.parse.urlencode(params)
    try:
        with urllib.request.urlopen(url, timeout=30) as r:
            body = json.load(r)
    except urllib.error.HTTPError as e:  # a bad query: Prometheus answers 400 with the error in the body
        body = json.load(e)
    return body


def dashboard_queries(run: str) -> list[tuple[str, str]]:
    """(panel title, PromQL) of every dashboard target, ``$run`` set to this run."""
    dash = json.load(open(os.path.join(MONITORING, "grafana-dashboard.json")))
    return [(p["title"], t["expr"].replace("$run", run)) for p in dash["panels"] for t in p.get("targets", [])]


@pytest.mark.skipif(PROMTOOL is None, reason="needs Debian's prometheus package (apt-get install prometheus)")
def test_promtool_accepts_the_shipped_scrape_config():
    """Debian's promtool (a build without Kubernetes discovery) checks the shipped prometheus.yml; the Kubernetes
    job, in its own file, is the only place that names kubernetes_sd_configs."""
    out = subprocess.run([PROMTOOL, "check", "config", os.path.join(MONITORING, "prometheus.yml")],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "kubernetes_sd_configs" not in open(os.path.join(MONITORING, "prometheus.yml")).read()
    k8s = yaml.safe_load(open(os.path.join(REPO, "launch", "k8s", "prometheus-scrape.yml")))
    assert [j["job_name"] for j in k8s["scrape_configs"]] == ["jaxtrain-k8s"]


@pytest.fixture(scope="module")
def slowed_run(tmp_path_factory):
    """The 2-process run, process 1 slowed by bursts (seeded, printed), Prometheus scraping it when installed.
    Yields what the tests read; Prometheus keeps serving its data until the module's tests are done."""
    tmp = tmp_path_factory.mktemp("slowed")
    metrics_port, prom_port = free_ports(2), free_ports(1)
    prom = None
    if PROMETHEUS:
        targets = tmp / "file_sd"
        targets.mkdir()
        (targets / "jaxtrain-test.json").write_text(json.dumps(
            [{"targets": [f"127.0.0.1:{metrics_port + i}" for i in range(2)], "labels": {"slurm_job_id": "test"}}]))
        config = yaml.safe_load(open(os.path.join(MONITORING, "prometheus.yml")))
        config["global"].update(scrape_interval="1s", scrape_timeout="1s")
        (job,) = [j for j in config["scrape_configs"] if j["job_name"] == "jaxtrain-slurm"]
        job["file_sd_configs"][0].update(files=[str(targets / "*.json")], refresh_interval="1s")
        (tmp / "prometheus.yml").write_text(yaml.safe_dump(config))
        prom = subprocess.Popen([PROMETHEUS, f"--config.file={tmp / 'prometheus.yml'}",
                                 f"--storage.tsdb.path={tmp / 'tsdb'}", f"--web.listen-address=127.0.0.1:{prom_port}",
                                 "--log.level=warn"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    seed = random.randrange(2**31)
    print(f"burst seed {seed}")
    rng = random.Random(seed)
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("XLA_FLAGS", None)
    run_dir = tmp / "run"
    start = time.time()
    launcher = subprocess.Popen(
        ["bash", os.path.join(REPO, "launch", "local.sh"), "2", "train", f"run.dir={run_dir}", *SMALL,
         "runtime.cpu_devices=1", "mesh.dcn.data=2", "mesh.ici.fsdp=1", f"train.steps={STEPS}", "train.log_every=5",
         "train.eval_every=20", "checkpoint.every=20", "observe.straggler_every=5",
         "observe.collective_probe_every=10", f"observe.prometheus_port={metrics_port}",
         "observe.prometheus_linger_s=3"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO, env=env, start_new_session=True)
    lines: list[str] = []
    training = threading.Event()

    def pump():
        for line in launcher.stdout:
            lines.append(line)
            if re.match(r"\[0\] step +\d+/", line):
                training.set()

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    bursts = 0
    try:
        assert training.wait(400), "".join(lines)[-3000:]
        pid = _descendant_with(launcher.pid, "JAX_PROCESS_ID=1")
        assert pid is not None
        try:  # bursts of 40-120 ms stopped, 150-300 ms running, until process 1 ends
            while launcher.poll() is None:
                os.kill(pid, signal.SIGSTOP)
                try:
                    time.sleep(rng.uniform(0.04, 0.12))
                finally:
                    os.kill(pid, signal.SIGCONT)
                bursts += 1
                time.sleep(rng.uniform(0.15, 0.3))
        except ProcessLookupError:  # process 1 ended between the poll and the signal
            pass
        rc = launcher.wait(120)
        reader.join(10)
        end = time.time() + 2  # the last scrape of the linger is in by then
        time.sleep(2)
        text = "".join(lines)
        assert rc == 0, text[-3000:]
        yield {"text": text, "bursts": bursts, "run_dir": run_dir, "prom": prom, "port": prom_port, "start": start,
               "end": end}
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
        if prom is not None:
            prom.terminate()
            prom.wait(30)


@pytest.mark.slow
def test_process_slowed_from_outside_is_named_by_every_warning(slowed_run):
    named = re.findall(r"straggler: process (\d+) \(host [^)]+\) spends ([\d.]+) ms of its own host work",
                       slowed_run["text"])
    print(f"{slowed_run['bursts']} bursts; warnings name {[n for n, _ in named]}")
    assert named, slowed_run["text"][-3000:]
    assert {n for n, _ in named} == {"1"}, slowed_run["text"][-3000:]


@pytest.mark.slow
@pytest.mark.skipif(PROMETHEUS is None, reason="needs Debian's prometheus package (apt-get install prometheus)")
def test_dashboard_queries_through_a_real_prometheus(slowed_run):
    prom, port = slowed_run["prom"], slowed_run["port"]
    assert prom.poll() is None, prom.stderr.read()
    summary = json.load(open(slowed_run["run_dir"] / "summary.json"))

    def query(expr: str) -> list[dict]:
        """The series ``expr`` has at any point of the run (a range query, 1 s steps); fails on an error."""
        r = api(port, "query_range", query=expr, start=slowed_run["start"], end=slowed_run["end"], step=1)
        assert r["status"] == "success", (expr, r)
        return r["data"]["result"]

    def last(expr: str) -> float:
        (series,) = query(expr)
        return float(series["values"][-1][1])

    empty = []
    queries = dashboard_queries("run")
    assert len(queries) >= 27
    for title, expr in queries:
        if not query(expr) and not any(name in expr for name in MAY_BE_EMPTY):
            empty.append(f"{title}: {expr}")
    assert not empty, empty
    # Both processes scraped, and the linger's last scrape saw each one end (jaxtrain_up 0).
    ups = query('jaxtrain_up{run="run"}')
    assert sorted(s["metric"]["process"] for s in ups) == ["0", "1"]
    assert all(float(s["values"][-1][1]) == 0 for s in ups), ups
    # Step-time quantiles against the run's own: the exact gauge (nearest rank over all STEPS steps, as
    # summary.json's p90) and the histogram within one bucket (10 per decade: a factor 10**0.1).
    p90 = last('jaxtrain_recent_step_seconds{run="run",process="0",quantile="0.9"}')
    assert p90 == pytest.approx(summary["step_seconds"]["p90"], rel=1e-9)
    p50 = last('histogram_quantile(0.5, sum by (le) (increase(jaxtrain_step_seconds_bucket{run="run",'
               'process="0"}[1h])))')
    median = summary["step_seconds"]["median"]
    print(f"step p50: histogram {p50 * 1e3:.1f} ms, summary.json {median * 1e3:.1f} ms")
    assert median / 10**0.1 <= p50 <= median * 10**0.1
    assert last('jaxtrain_loss{run="run",process="0"}') == pytest.approx(summary["final_loss"], rel=1e-6)
    assert last('jaxtrain_step{run="run",process="0"}') == STEPS
    # End-of-run values: the final goodput (set as the run ended, served only by the linger) and saves.
    for category, fraction in summary["goodput"].items():
        got = last(f'jaxtrain_goodput_ratio{{run="run",process="0",category="{category}"}}')
        assert got == pytest.approx(fraction, abs=0.01), category
    assert last('jaxtrain_checkpoint_save_seconds_count{run="run",process="0"}') == STEPS // 20
    # The warnings' counter per named process, from 0: as many for process 1 as the log has, none for process 0.
    warned = len(re.findall(r"straggler: process 1 ", slowed_run["text"]))
    assert last('jaxtrain_straggler_warnings_total{run="run",peer="1"}') == warned
    assert last('jaxtrain_straggler_warnings_total{run="run",peer="0"}') == 0
