"""Watching a run from inside and outside: the progress line, ``metrics.jsonl`` and TensorBoard (:mod:`.metrics`),
goodput accounting (:mod:`.goodput`), profiler windows (:mod:`.profiler`) and the run-time observer
(:mod:`.observer`, the train loop's hooks), composed of the Prometheus endpoint (:mod:`.prometheus`), straggler
detection (:mod:`.stragglers`, through the coordination service: :mod:`.hosts`), the collective-bandwidth probe
(:mod:`.probe`) and out-of-memory reports (:mod:`.oom`). Nothing here waits for the devices in the step loop unless
a probe or a profile was asked for.

May import: errors, log, config, rundir, cluster and parallel (the layout's compiled memory); never the loop.
"""
