"""The straggler alarm names the slow process and never the ones waiting for it: the verdict on figures that
reproduce the old mistake (blaming the wall time before the dispatch returned) and the stall clock's arithmetic.
The 2-process job through launch/local.sh whose process 1 is slowed from outside (SIGSTOP/SIGCONT bursts to its
pid) shares its run with the real-Prometheus check: tests/test_prometheus.py."""


import pytest


def post(own, wait, data=0.0):
    """One process's window means (seconds per step); the cycle is own + wait, as the observer measures it."""
    return {"own": own, "wait": wait, "data": data, "cycle": own + wait, "first": 1, "last": 10}


def test_verdict_names_the_slow_process_not_the_one_waiting_for_it():
    """Figures as the old rule saw them: process 1 was stopped for 60 ms per step in its own work; process 0 spent
    those 60 ms blocked in its dispatch (the collective waits for process 1), which the old rule counted as host
    work. By own time (dispatch blocking is a wait) only process 1 is named, with one or several per host."""
    from jaxtrain.observe.stragglers import StragglerWatch, stragglers

    # Old figures: host = wall time until the dispatch returned. Process 0: 2 ms own + 60 ms blocked dispatch.
    old_host = {0: 0.062, 1: 0.063}
    assert old_host[0] / min(old_host.values()) < 1.5  # the old rule saw two equal processes (or named 0)
    posts = {0: post(own=0.002, wait=0.070), 1: post(own=0.062, wait=0.010)}
    assert stragglers(posts, 1.5)[0] == [1]
    for hosts in (["a", "b"], ["a", "a"]):  # one process per host, and both on one host
        watch = StragglerWatch(10, 1.5, hosts, None)
        assert watch.judge(posts) == [1]
        assert watch.warnings[0].startswith(f"straggler: process 1 (host {hosts[1]}) spends 62.0 ms of its own "
                                            "host work per step, 31.0x the median 2.0 ms")
    # The waiting process never: even with more own time than the median, it waits more than the others.
    posts = {0: post(0.010, 0.090), 1: post(0.004, 0.020), 2: post(0.004, 0.020), 3: post(0.090, 0.005)}
    assert stragglers(posts, 1.5)[0] == [3]
    posts = {0: post(0.020, 0.090), 1: post(0.004, 0.020), 2: post(0.004, 0.020), 3: post(0.004, 0.020)}
    assert stragglers(posts, 1.5)[0] == []  # above the ratio, but the one waiting most: not the job's pace
    # 3x the median but 2 ms of a 100 ms step: hidden behind the devices, not worth a warning; 1.4x: under the ratio.
    assert stragglers({0: post(0.001, 0.1), 1: post(0.003, 0.098), 2: post(0.001, 0.1)}, 1.5)[0] == []
    assert stragglers({0: post(0.010, 0.1), 1: post(0.014, 0.096)}, 1.5)[0] == []


def test_stall_clock_counts_stalls_only_inside_the_waits():
    """A stall overlapping a wait counts for its overlap only (one in the process's own work is own time already);
    stalls that ended before the cycle are forgotten."""
    from jaxtrain.observe.stragglers import StallClock

    clock = StallClock()
    clock.close()
    clock.gaps.extend([(1.0, 1.2), (2.0, 2.5), (3.0, 3.1)])
    assert clock.stalled_in([(0.9, 1.1), (2.2, 3.05)], since=0.5) == pytest.approx(0.1 + 0.3 + 0.05)
    assert clock.stalled_in([(2.0, 2.5)], since=2.6) == 0.0
    assert list(clock.gaps) == [(3.0, 3.1)]
