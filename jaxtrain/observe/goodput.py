"""Goodput: where this invocation's wall time went, from the process's start to the end of the run.

Every moment belongs to exactly one category, so the fractions add up to 1:

- ``startup``: process start (from the OS's record of it), imports, JAX and the coordination service, data, restore;
- ``compilation``: compiling the train and eval steps;
- ``productive``: training steps that no earlier invocation of this run had already done;
- ``restarts``: the work lost to the fault that ended the previous invocation: steps recomputed after a resume,
  i.e. steps at or below the highest step the run's own history (``run.dir/metrics.jsonl``, written before the
  previous invocation died) already holds (``summary.json``'s ``lost_work`` has the step count and seconds);
- ``checkpoint``: the time saves held the loop, and the final wait for background saves;
- ``evaluation``: the eval loss computations;
- ``other``: everything else (writing the summary, closing files).

The clock is a running category plus ``charge(category, seconds)`` for intervals measured elsewhere (a save's
blocking time), which moves those seconds out of the running category: no interval is counted twice.
"""

from __future__ import annotations

import contextlib
import os
import time

CATEGORIES = ("startup", "compilation", "productive", "restarts", "checkpoint", "evaluation", "other")
_previous_end: float | None = None  # Unix time an earlier run in this process ended (library callers train twice)


def process_start_time() -> float:
    """This process's start as a Unix time: from /proc on Linux, else the time of the first call."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22, starttime, after the "(comm)" field
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return time.time() - uptime + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return time.time()


class Goodput:
    """Wall-time accounting for one invocation; see the module docstring for the categories."""

    def __init__(self, start_time: float | None = None, previous_last_step: int = 0):
        """``start_time``: Unix time the process started (default: from the OS). ``previous_last_step``: the
        highest step an earlier invocation of this run completed (``rundir.last_logged_step``, read before this
        invocation drops the records past its restored step; steps up to it count as ``restarts``). A killed
        process's steps after its last logged one are not in the file, so this undercounts by less than
        ``train.log_every``."""
        self.previous_last_step = previous_last_step
        self.seconds = dict.fromkeys(CATEGORIES, 0.0)
        start = start_time or max(process_start_time(), _previous_end or 0.0)
        self.seconds["startup"] = max(0.0, time.time() - start)
        self.recomputed_steps = 0
        self._current, self._since = "startup", time.perf_counter()

    def switch(self, category: str) -> str:
        """Charge the time since the last switch to the running category, make ``category`` the running one, and
        return the previous one."""
        now = time.perf_counter()
        self.seconds[self._current] += now - self._since
        previous, self._current, self._since = self._current, category, now
        return previous

    def step(self, step: int) -> None:
        """A training step begins: productive, or recomputed when an earlier invocation already did it."""
        recomputed = step <= self.previous_last_step
        self.recomputed_steps += recomputed
        category = "restarts" if recomputed else "productive"
        if category != self._current:
            self.switch(category)

    def charge(self, category: str, seconds: float) -> None:
        """``seconds`` measured elsewhere, inside the running category, belong to ``category`` instead."""
        self.switch(self._current)  # bring the running category up to date first
        moved = min(seconds, self.seconds[self._current])
        self.seconds[self._current] -= moved
        self.seconds[category] += moved

    @contextlib.contextmanager
    def phase(self, category: str):
        """Time inside the block belongs to ``category``; the running category resumes after it."""
        previous = self.switch(category)
        try:
            yield
        finally:
            self.switch(previous)

    def totals(self) -> dict[str, float]:
        """Seconds per category up to now (the running category included)."""
        self.switch(self._current)
        return dict(self.seconds)

    def fractions(self) -> dict[str, float]:
        """Each category's fraction of the wall time so far; they add up to 1."""
        totals = self.totals()
        wall = sum(totals.values())
        return {k: (v / wall if wall > 0 else 0.0) for k, v in totals.items()}

    def finish(self) -> None:
        """The loop is over: what follows (the summary) is ``other``, and a later run in this process (a library
        caller training twice) counts its start-up from here, not from the process's start."""
        global _previous_end
        self.switch("other")
        _previous_end = time.time()

    def lost_work(self) -> dict:
        """``summary.json``'s ``lost_work``: what the fault before this invocation cost in recomputation: ``steps``
        recomputed, their ``seconds`` (the ``restarts`` category), and ``fault_after_step``, the last step the
        earlier invocation logged (0: no earlier invocation). Start-up and compilation of the restart are in their
        own categories."""
        return {"steps": self.recomputed_steps, "seconds": self.totals()["restarts"],
                "fault_after_step": self.previous_last_step}

    def summary(self) -> dict:
        """``summary.json``'s ``goodput``: category -> fraction of wall time (``fractions``)."""
        return self.fractions()

    def line(self) -> str:
        """One line for the end of the run: the wall time and each non-zero category's share."""
        totals = self.totals()
        wall = sum(totals.values())
        parts = [f"{k} {100 * v / wall:.1f}%" for k, v in totals.items() if v > 0 and wall > 0]
        extra = f" ({self.recomputed_steps} steps recomputed after a restart)" if self.recomputed_steps else ""
        return f"goodput: wall {wall:.1f} s | " + " | ".join(parts) + extra
