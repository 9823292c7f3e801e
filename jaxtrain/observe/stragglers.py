"""Straggler detection: each step's time on this process split into its own work and its waits, and every
``observe.straggler_every`` steps an exchange of those figures between the processes, judged by process 0.

A step's cycle (from its start to the next step's) splits into *own* time, the host work this process does by
itself (reading and sending the batch, the loop's bookkeeping), and *wait*: the dispatch blocking, the wait for
results, saves and evaluation (the devices and the other processes' collectives). :class:`StepCycles` times the
cycles around the loop's own calls; :class:`StallClock` finds the moments the process was not running at all;
:class:`StragglerWatch` keeps the figures and exchanges them through JAX's coordination service (a key-value
store, not the devices); :func:`stragglers` is the verdict on one window.
"""

from __future__ import annotations

import json
import math
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable

import jax

from jaxtrain import log
from jaxtrain.observe.hosts import KV_PREFIX, kv_client
from jaxtrain.observe.metrics import PrometheusMetrics

# A straggler must also matter: its own time must exceed the median by this fraction of the median step time
# (below that, host work hides behind the devices' and costs the job nothing).
STRAGGLER_MIN_STEP_SHARE = 0.05


class StallClock:
    """A daemon thread that wakes every ``interval`` seconds and records each time it woke more than ``slack``
    late: the process was not running (stopped, CPU-throttled, its cores given to other work). It sleeps in
    ``time.sleep``, which releases the GIL, so a main thread blocked in JAX (GIL released) does not delay it.
    ``gaps``: (start, end) perf_counter times of the stalls, oldest first."""

    def __init__(self, interval: float = 0.01, slack: float = 0.015):
        self.interval = interval
        self.slack = slack
        self._stopped = False
        self.gaps: deque[tuple[float, float]] = deque()  # appended by the thread, read and trimmed by the loop
        self._thread = threading.Thread(target=self._run, name="jaxtrain-stall-clock", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        last = time.perf_counter()
        while not self._stopped:
            time.sleep(self.interval)  # cheaper per wake than Event.wait (no lock made per call)
            now = time.perf_counter()
            if now - last > self.interval + self.slack:
                self.gaps.append((last + self.interval, now))
            last = now

    def stalled_in(self, intervals: list[tuple[float, float]], since: float) -> float:
        """Seconds of stalls inside ``intervals`` (disjoint (start, end)); forgets those ended before ``since``."""
        while self.gaps and self.gaps[0][1] < since:
            self.gaps.popleft()
        return sum(max(0.0, min(e, g1) - max(s, g0)) for g0, g1 in list(self.gaps) for s, e in intervals)

    def close(self) -> None:
        self._stopped = True
        self._thread.join(1)  # it ends within one interval


class StragglerWatch:
    """Per-step split of this process's time, and every ``every`` steps an exchange of window means.

    A process slowed by its host shows it as own time, the others as wait: blaming by own time names the slow one,
    never the ones waiting for it (blaming the wall time until the dispatch returned named the waiting one, whose
    dispatch blocks in the collective). A stall of the process while it waits (:class:`StallClock`) delays its
    peers too: own time. Each process posts its window's means under ``KV_PREFIX/straggler/<step>/<process>``;
    process 0 reads the previous window's posts (one window late: it never waits for a process still finishing
    it) and judges them."""

    def __init__(self, every: int, ratio: float, hosts: list[str], metrics: PrometheusMetrics | None):
        self.every = every
        self.ratio = ratio
        self.hosts = hosts
        self.metrics = metrics
        self.own: dict[int, float] = {}  # step -> seconds
        self.data: dict[int, float] = {}
        self.wait: dict[int, float] = {}
        self.cycle: dict[int, float] = {}
        self.stalled: dict[int, float] = {}
        self._posted: int | None = None
        self.warnings: list[str] = []

    def finished(self, step: int, cycle_s: float, wait_s: float, data_s: float, stalled_s: float = 0.0) -> None:
        """``step``'s cycle took ``cycle_s``, ``wait_s`` of it waiting (stalls excluded), ``data_s`` of it for the
        batch, ``stalled_s`` of its waits stalled."""
        wait_s = min(max(0.0, wait_s), cycle_s)
        self.cycle[step] = cycle_s
        self.wait[step] = wait_s
        self.own[step] = cycle_s - wait_s
        self.data[step] = data_s
        self.stalled[step] = stalled_s

    def split(self, step: int) -> dict[str, float]:
        """This process's figures for a step, for metrics.jsonl: own host work, data wait, wait (when known)."""
        if step not in self.own:
            return {}
        return {"step_host_seconds": self.own[step], "data_wait_seconds": self.data[step],
                "step_device_seconds": self.wait[step]}

    def _forget(self, before: int) -> None:
        for d in (self.own, self.data, self.wait, self.cycle, self.stalled):
            for old in [k for k in d if k < before]:
                del d[old]

    def maybe_exchange(self, step: int) -> None:
        """After ``step``: post this window's means when one ends (every ``every`` steps), and on process 0 judge
        the previous window's posts."""
        if not (self.every and jax.process_count() > 1 and kv_client() is not None):
            if len(self.own) > 64:  # nothing to exchange: keep only what report() still needs
                self._forget(step - 1)
            return
        if step % self.every or not self.own:
            return
        window = sorted(self.own)
        figures = (("own", self.own), ("data", self.data), ("wait", self.wait), ("cycle", self.cycle),
                   ("stalled", self.stalled))
        mine = {k: statistics.fmean(d.values()) for k, d in figures}
        mine.update(first=window[0], last=window[-1])
        self._forget(step - 1)  # the last finished step stays until report() has used it
        client = kv_client()
        client.key_value_set(f"{KV_PREFIX}/straggler/{step}/{jax.process_index()}", json.dumps(mine))
        previous, self._posted = self._posted, step
        if jax.process_index() != 0 or previous is None:
            return
        posts = {int(k.rsplit("/", 1)[1]): json.loads(v)
                 for k, v in client.key_value_dir_get(f"{KV_PREFIX}/straggler/{previous}/")}
        client.key_value_delete(f"{KV_PREFIX}/straggler/{previous}")
        self.judge(posts)

    def judge(self, posts: dict[int, dict]) -> list[int]:
        """Warn about stragglers among ``posts`` (process -> window means); returns their indices."""
        slow, median, step_time = stragglers(posts, self.ratio)
        for proc, p in sorted(posts.items()):
            ratio = p["own"] / median if median > 0 else math.inf
            if self.metrics:
                gauge = self.metrics.host_ratio.labels(**self.metrics.base, peer=str(proc))
                gauge.set(ratio if math.isfinite(ratio) else 0.0)
            if proc not in slow:
                continue
            others = statistics.median(q["wait"] for k, q in posts.items() if k != proc)
            msg = self._warning(proc, p, ratio, median, others, step_time)
            self.warnings.append(msg)
            log.info(msg)
            if self.metrics:
                self.metrics.straggler_warnings.labels(**self.metrics.base, peer=str(proc)).inc()
        return slow

    def _warning(self, proc: int, p: dict, ratio: float, median: float, others: float, step_time: float) -> str:
        """The line naming straggler ``proc`` (its window means ``p``), against the median and the others' wait."""
        return (f"straggler: process {proc} (host {self.hosts[proc]}) spends {p['own'] * 1e3:.1f} ms of its own "
                f"host work per step, {ratio:.1f}x the median {median * 1e3:.1f} ms "
                f"(observe.straggler_ratio={self.ratio}), steps {p['first']}-{p['last']}: "
                f"data wait {p['data'] * 1e3:.1f} ms, stalled {p.get('stalled', 0.0) * 1e3:.1f} ms "
                f"(its CPU taken away while it waited); it waits {p['wait'] * 1e3:.1f} ms per step for devices "
                f"and peers, the others {others * 1e3:.1f} ms; the job runs at its pace "
                f"(mean step {step_time * 1e3:.1f} ms)")


def stragglers(posts: dict[int, dict], ratio: float) -> tuple[list[int], float, float]:
    """The verdict on one window: ``posts`` maps a process to its means per step of ``own`` (host work by itself),
    ``wait`` (for devices and peers) and ``cycle`` (the whole step), in seconds.

    A process is a straggler when its own time exceeds ``ratio`` x the median of all processes' (the lower
    median: with two processes, the faster one) by more than ``STRAGGLER_MIN_STEP_SHARE`` of the median step,
    and it waits less than the others do (the median of theirs): the one the others wait for. Returns
    (stragglers, the median own time, the median step time).
    """
    if len(posts) < 2:
        return [], 0.0, 0.0
    median = statistics.median_low(p["own"] for p in posts.values())
    step_time = statistics.median(p["cycle"] for p in posts.values())
    slow = [proc for proc, p in sorted(posts.items())
            if p["own"] > ratio * median and p["own"] - median > STRAGGLER_MIN_STEP_SHARE * step_time
            and p["wait"] < statistics.median(q["wait"] for k, q in posts.items() if k != proc)]
    return slow, median, step_time


class StepCycles:
    """Times each step's cycle around the loop's calls and hands it, split into own work and waits, to a
    :class:`StragglerWatch`.

    ``phases()`` gives the seconds so far in the loop's phases that are waits, not own work (checkpoint,
    evaluation, the eval step's compilation: goodput's clock); ``clock``, when given, finds the stalls inside the
    waits, which count as own time."""

    def __init__(self, watch: StragglerWatch, phases: Callable[[], float], clock: StallClock | None):
        self.watch = watch
        self.phases = phases
        self.clock = clock
        # The step whose cycle runs: (step, its start, its data wait); what it waited so far.
        self._cycle: tuple[int, float, float] | None = None
        self._waits: list[tuple[float, float]] = []
        self._phases_at_start = 0.0

    def _waited_so_far(self) -> float:
        return sum(e - s for s, e in self._waits) + self.phases() - self._phases_at_start

    def finish(self, now: float) -> None:
        """The running cycle (if any) ends at ``now``: its figures go to the watch."""
        if self._cycle is None:
            return
        step, start, data_s = self._cycle
        stalled = self.clock.stalled_in(self._waits, start) if self.clock else 0.0
        self.watch.finished(step, now - start, self._waited_so_far() - stalled, data_s, stalled)
        self._cycle = None

    def begin(self, step: int) -> float:
        """``step`` starts, and the previous step's cycle ends. Returns the start time (perf_counter)."""
        now = time.perf_counter()
        self.finish(now)
        self._waits = []
        self._phases_at_start = self.phases()
        self._cycle = (step, now, 0.0)
        return now

    def dispatched(self, step: int, t_begin: float, t_batch: float, t_sent: float) -> None:
        """The step was dispatched: its batch arrived at ``t_batch`` and was on the devices at ``t_sent``; from
        then until now the dispatch may have blocked on the devices and the other processes (a wait)."""
        self._waits.append((t_sent, time.perf_counter()))
        self._cycle = (step, t_begin, t_batch - t_begin)

    def waited(self, start: float, end: float) -> None:
        """The loop waited from ``start`` to ``end`` (perf_counter)."""
        self._waits.append((start, end))

    def split(self, step: int) -> dict[str, float]:
        """``step_host_seconds``, ``data_wait_seconds``, ``step_device_seconds`` of a reported step; for one
        reported inside its own cycle (an evaluated step, the last), its figures so far."""
        split = self.watch.split(step)
        if split or self._cycle is None or self._cycle[0] != step:
            return split
        _, start, data_s = self._cycle
        wait = self._waited_so_far()
        return {"step_host_seconds": time.perf_counter() - start - wait, "data_wait_seconds": data_s,
                "step_device_seconds": wait}

    def close(self) -> None:
        """End of the run: the last cycle ends now; the stall clock stops."""
        self.finish(time.perf_counter())
        if self.clock:
            self.clock.close()
