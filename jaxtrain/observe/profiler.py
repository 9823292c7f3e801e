"""Profiler windows: ``jax.profiler`` traces of configured steps (``observe.profile_steps``) and of the steps after a
SIGUSR1, into ``run.dir/profile/process_<i>``. Driven by :class:`jaxtrain.observe.observer.Observer`."""

from __future__ import annotations

import math
import os
import signal
import threading
import time

import jax

from jaxtrain import log, rundir


class Profiler:
    """``jax.profiler`` traces of step windows into ``run.dir/profile/process_<i>`` (TensorBoard's profile plugin,
    XProf, and Perfetto through the ``perfetto_trace.json.gz`` written beside the XSpace)."""

    def __init__(self, run_dir: str, o):
        self.dir = rundir.profile_dir(run_dir, jax.process_index())
        mine = o.profile_processes is None or jax.process_index() in o.profile_processes
        self.configured = tuple(o.profile_steps) if o.profile_steps and mine else None
        self.window = self.configured
        self.signal_steps, self._signalled, self.active, self._old = o.signal_profile_steps, False, False, None
        self.written: list[str] = []
        self._last_written = 0.0  # time.time() when the last trace was written
        if threading.current_thread() is threading.main_thread():  # signal handlers live in the main thread
            self._old = signal.signal(signal.SIGUSR1, self._on_signal)

    def _on_signal(self, *_):
        self._signalled = True  # acted on at the next step: nothing else is safe inside a handler

    def begin(self, step: int) -> None:
        if self.active:
            return
        if self._signalled:
            self._signalled, self.window = False, (step, step + self.signal_steps - 1)
            log.info(f"SIGUSR1: tracing steps {self.window[0]}-{self.window[1]}")
        if self.window and step == self.window[0]:
            os.makedirs(self.dir, exist_ok=True)
            # jax.profiler names a trace's directory after the second it is written in: a second trace written
            # within the same second would overwrite the first (a SIGUSR1 window right after a configured one).
            wait = math.floor(self._last_written) + 1 - time.time()
            if wait > 0:
                time.sleep(wait)
            jax.profiler.start_trace(self.dir, create_perfetto_trace=True)
            self.active = True

    def end(self, step: int, in_flight) -> None:
        if self.active and self.window is not None and step >= self.window[1]:
            jax.block_until_ready(in_flight)  # the window's last step belongs in the trace
            self._stop(f"steps {self.window[0]}-{step}")

    def _stop(self, what: str) -> None:
        jax.profiler.stop_trace()
        self._last_written = time.time()
        self.active = False
        done = self.window[1] if self.window is not None else 0
        self.window = self.configured if self.configured and self.configured[0] > done else None
        self.written.append(self.dir)
        log.info(f"profile of {what} written to {self.dir}; view: tensorboard --logdir {os.path.dirname(self.dir)}"
                 f" (profile tab), xprof --logdir {os.path.dirname(self.dir)}, or perfetto_trace.json.gz in "
                 "https://ui.perfetto.dev")

    def close(self, last_step: int) -> None:
        if self.active:
            first = self.window[0] if self.window is not None else last_step
            self._stop(f"steps {first}-{last_step} (the run ended inside the window)")
        if self._old is not None:
            signal.signal(signal.SIGUSR1, self._old)
