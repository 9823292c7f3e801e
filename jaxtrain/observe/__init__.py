"""Watching a run from inside and outside: the progress line, ``metrics.jsonl`` and TensorBoard (:mod:`.metrics`),
goodput accounting (:mod:`.goodput`), profiler windows (:mod:`.profiler`) and the run-time observer (Prometheus
endpoint, straggler detection, the collective-bandwidth probe, out-of-memory reports). Nothing here waits for the
devices in the step loop unless a probe or a profile was asked for.

May import: errors, log, config, rundir, cluster and parallel (the layout's compiled memory); never the loop.
"""
