"""What watching a job costs: the tiny config's step time with the observers off and on, side by side in one run.

    python benchmarks/observe_overhead.py [--steps 150] [--rounds 3] [--two-process]

One process, 2 emulated CPU devices (fsdp=2, so the collective probe has an axis to measure), the default tiny
model. Configurations run interleaved, round after round (off, endpoint, probe, all, off, ...), so that a change
in the machine's load hits them alike; each figure is the median over rounds of the MEAN step time (the mean, not
the median, so that the probe's once-every-N cost counts). "endpoint" serves /metrics and is scraped once a
second by a thread of this process (Prometheus' usual interval is 15 s). "probe" runs the all-reduce probe every
10 steps. The straggler exchange needs several processes: ``--two-process`` adds a pair of 2-process runs
(launch/local.sh; straggler_every=0 vs 10), and a micro-benchmark times one exchange through the coordination
service of a 1-process jax.distributed job.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

import jax

jax.config.update("jax_num_cpu_devices", 2)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from jaxtrain import log  # noqa: E402
from jaxtrain.config import load_config  # noqa: E402
from jaxtrain.train import loop  # noqa: E402

CONFIGS = {
    "off": [],
    "endpoint": ["observe.prometheus_port=0"],
    "probe (every 10 steps)": ["observe.collective_probe_every=10"],
    "all": ["observe.prometheus_port=0", "observe.collective_probe_every=10"],
}


def scraper(stop: threading.Event, log_path: str) -> None:
    """Scrape the endpoint the run logged, once a second."""
    url = None
    while not stop.is_set():
        if url is None and os.path.exists(log_path):
            for line in open(log_path):
                if "metrics: http" in line:
                    url = line.split("metrics: ", 1)[1].strip()
        if url:
            try:
                urllib.request.urlopen(url, timeout=5).read()
            except OSError:
                pass
        stop.wait(1.0)


def one_run(name: str, steps: int, tmp: str, i: int) -> float:
    run_dir = os.path.join(tmp, f"{i}-{name.split()[0]}")
    cfg = load_config(None, [f"run.dir={run_dir}", f"train.steps={steps}", "train.eval_every=0", "train.log_every=50",
                             "checkpoint.every=0", "observe.straggler_every=0", "observe.prometheus_linger_s=0",
                             *CONFIGS[name]])
    stop = threading.Event()
    t = threading.Thread(target=scraper, args=(stop, os.path.join(run_dir, "logs", "process_0.log")), daemon=True)
    t.start()
    try:
        result = loop.train(cfg, devices=jax.devices()[:2])
    finally:
        stop.set()
        t.join()
    return statistics.fmean(result.step_times[1:])  # step 1 waits for the first batch and warms caches


def hook_costs(tmp: str, n: int = 2000) -> dict[str, float]:
    """Seconds per call of the loop's observer hooks, timed directly (robust to a loaded machine, unlike step
    times): a step's hooks with the endpoint on (every 10th step logged), and one collective probe."""
    import jax.numpy as jnp

    from jaxtrain.observe import observer as observe
    from jaxtrain.observe.metrics import Throughput
    from jaxtrain.parallel.layout import Layout

    cfg = load_config(None, [f"run.dir={tmp}/hooks", "observe.prometheus_port=0", "observe.straggler_every=0",
                             "observe.collective_probe_every=1", "observe.prometheus_linger_s=0"])
    layout = Layout.build(cfg, jax.devices()[:2])
    obs = observe.Observer(layout, cfg.run.dir, Throughput(2048, 1e9, layout.num_devices, None))
    probe, obs.probe = obs.probe, None
    values = {"loss": 3.2, "grad_norm": 0.9, "learning_rate": 1e-3, "nonfinite_steps": 0.0}
    t0 = time.perf_counter()
    for step in range(1, n + 1):
        t_begin = obs.step_begin(step)
        obs.step_dispatched(step, t_begin, t_begin, time.perf_counter())
        t_wait = time.perf_counter()
        obs.waited(t_wait, time.perf_counter())
        obs.report(step, values, 0.03, logged=step % 10 == 0)
        obs.step_end(step, None)
    per_step = (time.perf_counter() - t0) / n
    x = jnp.ones(4)
    probe.maybe_run(1, x)  # first call: caches warm
    runs = []
    for _ in range(10):
        t0 = time.perf_counter()
        probe.maybe_run(1, x)
        runs.append(time.perf_counter() - t0)
    obs.close()
    return {"hooks per step (endpoint on)": per_step, "one probe (2 devices, 1 MiB)": statistics.median(runs),
            "stall clock, CPU share of one core": stall_clock_share()}


def stall_clock_share(seconds: float = 5.0) -> float:
    """CPU the straggler watch's StallClock thread (on with several processes; it wakes every 10 ms) takes, as a
    share of one core: this process's CPU time while the main thread sleeps and the clock runs (CPU time, not wall
    time: a loaded machine does not blur it)."""
    from jaxtrain.observe.stragglers import StallClock

    clock = StallClock()
    c0, t0 = time.process_time(), time.perf_counter()
    time.sleep(seconds)
    share = (time.process_time() - c0) / (time.perf_counter() - t0)
    clock.close()
    return share


EXCHANGE = """
import json, socket, sys, time
import jax
from jaxtrain.observe.hosts import KV_PREFIX, kv_client

with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=1, process_id=0,
                           coordinator_bind_address=f"127.0.0.1:{port}")
client = kv_client()
payload = json.dumps({"own": 0.0123, "data": 0.001, "wait": 0.02, "cycle": 0.0323, "stalled": 0.0, "first": 1,
                      "last": 100})
n = int(sys.argv[1])
t0 = time.perf_counter()
for step in range(n):
    client.key_value_set(f"{KV_PREFIX}/straggler/{step}/0", payload)
    client.key_value_dir_get(f"{KV_PREFIX}/straggler/{step}/")
    client.key_value_delete(f"{KV_PREFIX}/straggler/{step}")
print((time.perf_counter() - t0) / n)
"""


def exchange_cost(n: int = 200) -> float:
    """Seconds for one straggler exchange's coordination-service traffic (set, dir_get, delete) in a 1-process
    jax.distributed job (its own process: jax.distributed must start before any computation)."""
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-c", EXCHANGE, str(n)], capture_output=True, text=True, env=env,
                         check=True).stdout
    return float(out.strip().splitlines()[-1])


def two_process(steps: int, tmp: str, every: int) -> float:
    run_dir = os.path.join(tmp, f"two-{every}")
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    env["PYTHON"] = sys.executable
    proc = subprocess.run([os.path.join(REPO, "launch", "local.sh"), "2", "train", f"run.dir={run_dir}",
                           "runtime.cpu_devices=1", "mesh.dcn.data=2", "mesh.ici.fsdp=1", f"train.steps={steps}",
                           "train.eval_every=0", "train.log_every=50", "checkpoint.every=0",
                           f"observe.straggler_every={every}"], capture_output=True, text=True, env=env, cwd=REPO)
    if proc.returncode:
        raise SystemExit(proc.stderr[-2000:])
    with open(os.path.join(run_dir, "summary.json")) as f:
        return json.load(f)["step_seconds"]["median"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--two-process", action="store_true")
    p.add_argument("--hooks-only", action="store_true", help="only the direct timings of the hooks and the probe")
    a = p.parse_args()
    times: dict[str, list[float]] = {k: [] for k in CONFIGS}
    with tempfile.TemporaryDirectory() as tmp:
        for name, seconds in hook_costs(tmp).items():
            print(f"{name}: {seconds * 100:.2f}%" if "share" in name else f"{name}: {seconds * 1e6:.0f} us")
        for r in range(0 if a.hooks_only else a.rounds):
            for i, name in enumerate(CONFIGS):
                times[name].append(one_run(name, a.steps, tmp, r * len(CONFIGS) + i))
                log.info(f"round {r + 1}: {name}: mean step {times[name][-1] * 1e3:.2f} ms")
        if a.hooks_only:
            print(f"one straggler exchange (coordination service, 1 process): {exchange_cost() * 1e6:.0f} us")
            return
        base = statistics.median(times["off"])
        print(f"\ntiny config, 2 CPU devices (fsdp=2), {a.steps} steps x {a.rounds} rounds, "
              f"{os.cpu_count()} CPU cores; jax {jax.__version__}")
        print("| observers | mean step (median of rounds) | vs off | rounds |\n| --- | --- | --- | --- |")
        for name, ts in times.items():
            med = statistics.median(ts)
            print(f"| {name} | {med * 1e3:.2f} ms | {100 * (med / base - 1):+.1f}% | "
                  f"{', '.join(f'{t * 1e3:.1f}' for t in ts)} |")
        if a.two_process:
            pair = {every: two_process(a.steps, tmp, every) for every in (0, 10)}
            print(f"\n2 processes x 1 CPU device (dcn data=2), median step: straggler exchange off "
                  f"{pair[0] * 1e3:.2f} ms, every 10 steps {pair[10] * 1e3:.2f} ms "
                  f"({100 * (pair[10] / pair[0] - 1):+.1f}%)")
    cost = exchange_cost()
    print(f"one straggler exchange (coordination service set + dir_get + delete, 1 process): {cost * 1e6:.0f} us; "
          f"every 100 steps (the default) that is {cost / 100 * 1e6:.1f} us per step")


if __name__ == "__main__":
    main()
