"""What ``mesh.auto``'s search says: why its choice beat the runner-up (and faster layouts that do not fit), the
one-line error when nothing fits, the text table ``plan`` and ``train`` print, and the JSON of ``plan --json``.
"""

from __future__ import annotations

import numpy as np

from jaxtrain.config import Config
from jaxtrain.planner.auto.space import GUESS_OVER, MAX_COMPILES, AutoResult, Row


def gb(x: float) -> str:
    """Bytes as ``1.23 GB`` (MB below 0.1 GB, TB from 1000 GB)."""
    if x >= 1e12:
        return f"{x / 1e12:,.3g} TB" if x < 1e15 else f"{x / 1e12:,.0f} TB"
    return f"{x / 1e9:.3g} GB" if x >= 1e8 else f"{x / 1e6:.3g} MB"


def ms(x: float) -> str:
    """Seconds as ``12.3 ms`` (or s from 10 s)."""
    return f"{x * 1e3:.1f} ms" if x < 10 else f"{x:.1f} s"


def why(choice: Row, runner: Row | None, compiled: list[Row], budget: float) -> list[str]:
    """The choice against the runner-up (by measurement after a trial, else by the estimate's largest difference)
    and against the fastest compiled layout that is over the memory ``budget``."""
    lines = []
    if runner is not None and runner.measured_s is not None and choice.measured_s is not None:
        # After the trial the measurement decided: the estimate's breakdown would explain a gap it did not see.
        lines.append(f"runner-up {runner.cand.label}: {ms(runner.measured_s)} measured in the trial "
                     f"({(runner.measured_s / choice.measured_s - 1) * 100:+.1f}%), est. {ms(runner.est)}")
    elif runner is not None:
        a, b = choice.result["time"], runner.result["time"]  # type: ignore[index]
        parts = {"compute": "compute", "intra_node": "in-node communication",
                 "inter_node": "inter-node communication", "optimizer": "optimizer update"}
        worst = max(parts, key=lambda p: b[p] - a[p])
        lines.append(f"runner-up {runner.cand.label}: {ms(runner.est)} "
                     f"({(runner.est / choice.est - 1) * 100:+.1f}%), mostly {parts[worst]} "
                     f"({ms(b[worst])} against {ms(a[worst])})")
    faster = [r for r in compiled if not r.result["fits"] and r.est < choice.est]  # type: ignore[index]
    if faster:
        f = min(faster, key=lambda r: (r.est, r.cand.label))
        need = f.result["memory_bytes_per_device"]  # type: ignore[index]
        lines.append(f"faster but over the memory budget: {f.cand.label}: {ms(f.est)}, needs "
                     f"{gb(need)} > {gb(budget)}")
    return lines


def nothing_fits(cfg: Config, rows: list[Row], compiled: list[Row], budget: float, n_devices: int,
                 usable: float) -> str:
    """The one-line error when no layout fits ``budget`` (``usable`` bytes a device less the margin): the smallest
    need found (compiled, else the closed form's state of ``rows``), and what would make room."""
    if compiled:
        best = min(compiled, key=lambda r: (r.result["memory_bytes_per_device"], r.cand.label))  # type: ignore
        need, what = best.result["memory_bytes_per_device"], best.cand.label  # type: ignore[index]
    else:
        best = min(rows, key=lambda r: (r.state_lower, r.cand.label))
        need, what = best.state_lower, f"{best.cand.label}, its parameters, optimizer state and layer inputs alone"
    more = int(np.ceil(n_devices * need / max(budget, 1.0)))
    return (f"mesh.auto: no layout fits {gb(budget)} per device ({gb(usable)} usable x (1 - "
            f"mesh.auto_memory_margin={cfg.mesh.auto_memory_margin:g})) on {n_devices} device(s), remat none to "
            f"full and microbatches 1 to {cfg.train.global_batch} searched; the smallest needs {gb(need)} "
            f"({what}): use about {more:,} or more devices, a smaller model, train.global_batch or data.seq_len, or a "
            "lower mesh.auto_memory_margin")


def format_result(res: AutoResult, top: int = 8) -> str:
    """The choice, the runner-up and why, the compiled candidates, and the search's cost."""
    c = res.choice
    memory = c.result["memory_bytes_per_device"]  # type: ignore[index]
    lines = [f"auto layout: {c.cand.label}: est. step {ms(c.est)}"
             + (f", measured {ms(c.measured_s)} in the trial" if c.measured_s is not None else "")
             + f", {gb(memory)} per device of {gb(res.budget)} allowed",
             *(f"  {w}" for w in res.why)]
    if res.trial:
        est = res.estimated
        measured = "; ".join(f"{r.cand.label}: {ms(r.measured_s)} measured, est. {ms(r.est)}"  # type: ignore
                             for r in res.trial)
        alone = "" if est is None or est.cand == c.cand else f"; the estimate alone picked {est.cand.label}"
        lines.append("  trial (fastest step, after a warm-up): " + measured + alone)
    capped = f", {res.capped} not compiled (stopped at {MAX_COMPILES} compiled or cached)" if res.capped else ""
    lines += [f"  searched {len(res.rows)} candidates in {res.seconds:.1f} s: {res.pruned} pruned (state alone "
              f"over the budget), {res.compiles} compiled, {res.cache_hits} from the cache, {res.bounded} not "
              f"compiled (a lighter remat of the layout fits, no faster than the runner-up without any "
              f"communication, or its closed-form memory over {GUESS_OVER:g}x the budget)" + capped,
              "  compiled (fits first, then by estimated step):"]
    for i, r in enumerate(res.compiled[:top], 1):
        assert r.result is not None  # compiled
        over = "" if r.result["fits"] else " (over budget)"
        lines.append(f"  {i:2d}. {r.cand.label}: {ms(r.est)}, {gb(r.result['memory_bytes_per_device'])}{over}")
    return "\n".join(lines)


def to_json(res: AutoResult) -> dict:
    """``plan --json``'s view of a search: every compiled row with its overrides, and the search's counts."""

    def row(r: Row) -> dict:
        assert r.result is not None  # compiled
        return {"label": r.cand.label, "overrides": r.cand.overrides(), "est_step_seconds": r.est,
                "measured_step_seconds": r.measured_s,
                "memory_bytes_per_device": r.result["memory_bytes_per_device"], "fits": r.result["fits"],
                "cached": r.cached,
                # the step's parts, and the bytes per device and step by collective kind and link class
                **{k: r.result[k] for k in ("est_step_seconds_overlap", "time", "collective_bytes",
                                            "intra_node_bytes_per_device", "inter_node_bytes_per_device")
                   if k in r.result},
                # what the search knew before compiling: the closed forms' memory and step (memory.memory_estimate)
                "closed_form": {"memory_bytes_per_device": r.memory_guess, "step_seconds": r.guess_s},
                # With --hardware and a GPU compiler: which compiler's figures, the CPU-derived ones, the checks.
                **{k: r.result[k] for k in ("figures", "cpu_derived", "xla_gpu", "xla_gpu_error") if k in r.result}}

    return {"choice": row(res.choice), "runner_up": row(res.runner_up) if res.runner_up else None, "why": res.why,
            "compiled": [row(r) for r in res.compiled], "budget_bytes": res.budget, "seconds": res.seconds,
            "candidates": len(res.rows), "compiles": res.compiles, "cache_hits": res.cache_hits,
            "pruned": res.pruned, "bounded": res.bounded, "capped": res.capped,
            "estimated_choice": row(res.estimated) if res.estimated else None, "trial": [row(r) for r in res.trial]}
