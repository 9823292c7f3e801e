"""Where does mesh.auto's pick land among the layouts a user could choose by hand? Measured on 8 emulated CPU devices.

For the tiny config and a ~18M-parameter config: hand choices (canonical meshes x remat none/full x microbatches
1/2, as many as --budget-s allows per config, in a fixed order) are compiled and run for --steps steps each in this
process (random tokens, zero-initialised state: the step's work does not depend on the values; the fastest step
counts, as in the trial); each compile's reading also fills the planner's cache, so the auto search that follows
recompiles only what was not measured. Then, at two memory budgets (ample, and the largest compiled memory of the
measured layouts below the ample pick's, so that the pick no longer fits and another does), the auto search runs
with its trial (``mesh.auto_trial_steps`` steps of each finalist, as ``train`` does), and its pick, and the
estimate's own pick before the trial, are measured too (if they were not). Before ranking, the referee
measures every one of them again the way the trial does (``trial.measure``: --referee-passes passes back and forth
over all of them, 2 x --steps steps each), so that the whole ranking shares the machine's drift; each pick is then
ranked by measured tokens/s among the hand choices that fit its budget. Last, the pick is measured against each of
the --duels fastest other layouts of the referee, one pair at a time, in --duel-rounds rounds back and forth
(``duel``: the median of the pick's step over the other's, each ratio from two measurements seconds apart, where
the referee compares layouts measured minutes apart). The CPU figures are those ``mesh.auto`` takes
(``auto.hardware_for``: the measured matmul, copy and all-reduce rates, the matmul rate by rows, the per-layer fixed
cost and the model's own efficiency by remat policy and tensor size).

    python benchmarks/auto_layout.py [--configs tiny,18m] [--steps 5] [--budget-s 150] [--referee-passes 4]
                                     [--duels 2] [--duel-rounds 10] [--json FILE]

Prints one markdown table per config and budget, and the auto pick's predicted vs measured step time.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import numpy as np  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

from jaxtrain.config import load_config  # noqa: E402
from jaxtrain.planner.auto import choose as auto  # noqa: E402
from jaxtrain.planner.auto import compile_cache, space, trial  # noqa: E402
from jaxtrain.planner.auto import report as auto_report  # noqa: E402
from jaxtrain.planner.cost.measure import back_and_forth  # noqa: E402
from jaxtrain.planner.search import meshes as search  # noqa: E402

CONFIGS = {
    "tiny": [],  # the built-in tiny config: 0.8M parameters, 16 x 128 tokens a step
    "18m": ["model.d_model=384", "model.n_layers=8", "model.n_heads=8", "model.n_kv_heads=4", "model.d_ff=1536",
            "train.global_batch=8", "data.seq_len=64"],
}
MESHES = ["fsdp8", "data8", "data2 fsdp4", "fsdp4 tensor2", "data4 fsdp2", "data2 fsdp2 tensor2", "fsdp2 tensor4"]
ORDER = [("none", 1), ("full", 1), ("none", 2), ("full", 2)]  # every mesh at one setting before the next


def hand_choices(cfg, devices) -> list[space.Candidate]:
    cands = {(c.shape.label, c.remat, c.microbatches): c
             for c in space.candidates(cfg, len(devices), 1, remats=("none", "full"), microbatches=[1, 2])}
    return [cands[m, r, k] for r, k in ORDER for m in MESHES if (m, r, k) in cands]


@dataclasses.dataclass
class Measured:
    cand: space.Candidate
    step_s: float
    memory: int
    est_s: float

    def tokens_per_s(self, cfg) -> float:
        return cfg.train.global_batch * cfg.data.seq_len / self.step_s


def measure(cfg, cand: space.Candidate, devices, hw, cache_dir: str, steps: int, exes: dict) -> Measured:
    """Compile ``cand``'s train step once: the planner's reading (cached for the search), the executable (kept in
    ``exes`` for the trial, as the search keeps its own) and the measured steps."""
    c = cand.apply(cfg)
    if cand in exes:
        step, train = exes[cand]
        comp = search.reading(step, train, 0.0)
    else:
        step = search._step(c, cand.shape, devices)
        train, seconds = search.compile_train_step(step)
        comp = search.reading(step, train, seconds)
        exes[cand] = (step, train)
    compile_cache.store(compile_cache.cache_path(cache_dir, c, cand.shape, devices), comp)
    times = trial.step_times(cfg, cand, devices, steps, exes[cand])
    est = search.candidate_result(c, cand.shape, hw, comp)["est_step_seconds"]
    return Measured(cand, min(times), comp.memory_bytes, est)


def duel(cfg, a: space.Candidate, b: space.Candidate, devices, rounds: int, exes: dict) -> list[float]:
    """``a``'s step over ``b``'s, one ratio a round: each runs a warm-up and 2 steps (fastest kept), in the order
    a, b then b, a: the two steps of a ratio are seconds apart, so the machine's slower minutes cancel out of it
    (the referee's ranking compares layouts measured minutes apart)."""
    t = {(r, c): min(trial.step_times(cfg, c, devices, 2, exes[c])) for r, c in back_and_forth((a, b), rounds)}
    return [t[r, a] / t[r, b] for r in range(rounds)]


def standing(fits: list[Measured], pick: Measured) -> tuple[int, float, float]:
    """(rank among ``fits`` by measured step, fraction slower than the best, measured / predicted - 1)."""
    rank = 1 + sum(m.step_s < pick.step_s for m in fits if m.cand != pick.cand)
    return rank, pick.step_s / fits[0].step_s - 1, pick.step_s / pick.est_s - 1


def table(cfg, name: str, measured: list[Measured], pick: Measured, budget: float, label: str,
          res: space.AutoResult, estimated: Measured) -> tuple[str, dict]:
    fits = sorted((m for m in measured if m.memory <= budget), key=lambda m: m.step_s)
    rank, gap, err = standing(fits, pick)
    best = fits[0]
    lines = [f"\n### {name}, {label} budget ({budget / 1e6:.1f} MB per device): {len(fits)} hand choices fit",
             "", "| rank | layout | measured step | tokens/s | predicted step | memory | auto |",
             "| ---: | --- | ---: | ---: | ---: | ---: | --- |"]
    for i, m in enumerate(fits, 1):
        lines.append(f"| {i} | {m.cand.label} | {m.step_s * 1e3:.1f} ms | {m.tokens_per_s(cfg):,.0f} | "
                     f"{m.est_s * 1e3:.1f} ms | {m.memory / 1e6:.1f} MB | "
                     f"{'**pick**' if m.cand == pick.cand else ''} |")
    over = [m for m in measured if m.memory > budget]
    if over:
        lines.append(f"\nover the budget: {', '.join(f'{m.cand.label} ({m.memory / 1e6:.1f} MB)' for m in over)}")
    trial = {r.cand: r.measured_s for r in res.trial}
    lines.append(f"\nauto pick {pick.cand.label}: rank {rank} of {len(fits)}, {gap * 100:+.1f}% from the best measured "
                 f"({best.cand.label}); predicted (cost model) {pick.est_s * 1e3:.1f} ms, measured "
                 f"{pick.step_s * 1e3:.1f} ms (measured {err * 100:+.1f}% against predicted)")
    lines.append("trial (the search's own measurement, fastest of mesh.auto_trial_steps): " + (
        "; ".join(f"{r.cand.label}: {r.measured_s * 1e3:.1f} ms, est. {r.est * 1e3:.1f} ms" for r in res.trial)
        if res.trial else "none (one finalist, or mesh.auto_trial_steps=0)"))
    e_rank, e_gap, e_err = standing(fits, estimated)
    lines.append(f"the estimate alone picked {estimated.cand.label}: rank {e_rank} of {len(fits)}, {e_gap * 100:+.1f}% "
                 f"from the best; predicted {estimated.est_s * 1e3:.1f} ms, measured {estimated.step_s * 1e3:.1f} ms "
                 f"({e_err * 100:+.1f}%)")
    return "\n".join(lines), {"config": name, "budget": label, "budget_bytes": budget, "pick": pick.cand.label,
                              "rank": rank, "of": len(fits), "gap_to_best": gap, "predicted_s": pick.est_s,
                              "measured_s": pick.step_s, "trial_s": trial.get(pick.cand), "best": best.cand.label,
                              "estimated_pick": estimated.cand.label, "estimated_rank": e_rank,
                              "estimated_gap": e_gap, "estimated_predicted_s": estimated.est_s,
                              "estimated_measured_s": estimated.step_s,
                              "hand": [{"label": m.cand.label, "measured_s": m.step_s, "predicted_s": m.est_s,
                                        "memory": m.memory} for m in fits]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--configs", default="tiny,18m")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--budget-s", type=float, default=150.0, help="seconds of hand choices per config")
    p.add_argument("--referee-passes", type=int, default=4,
                   help="passes over every layout when re-measuring them for the ranking (2 x --steps steps each)")
    p.add_argument("--duels", type=int, default=2,
                   help="the pick is measured against this many of the referee's fastest others, one pair at a time")
    p.add_argument("--duel-rounds", type=int, default=10, help="rounds of each duel")
    p.add_argument("--json", help="write the summary rows here")
    args = p.parse_args()
    devices = jax.devices()[:8]
    print(f"load average at start: {os.getloadavg()[0]:.1f} (2 cores shared)", flush=True)
    rows, t_start = [], time.perf_counter()
    for name in args.configs.split(","):
        with tempfile.TemporaryDirectory() as tmp:
            cfg = load_config(None, [f"run.dir={tmp}/run", "runtime.cpu_devices=8", "mesh.auto=true", *CONFIGS[name]])
            hw = auto.hardware_for(cfg, devices).hw
            print(f"{name}: CPU figures: {hw.peak_flops / 1e9:.1f} GFLOP/s a device x {hw.compute_efficiency}, "
                  f"matmul rate by rows {[(int(r), round(f, 2)) for r, f in hw.matmul_rows]}, "
                  f"{hw.layer_overhead_s * 1e3:.2f} ms a layer iteration, model efficiency by remat and tensor "
                  f"{[(r, t, round(e, 3)) for r, t, e in hw.model_efficiency]}, "
                  f"collective {hw.collective_latency * 1e3:.2f} ms", flush=True)
            cache = os.path.join(tmp, "cache")
            exes: dict = {}
            measured: dict[space.Candidate, Measured] = {}
            t0 = time.perf_counter()
            for cand in hand_choices(cfg, devices):
                if time.perf_counter() - t0 > args.budget_s and len(measured) >= 2:
                    break
                measured[cand] = m = measure(cfg, cand, devices, hw, cache, args.steps, exes)
                print(f"{name}: {cand.label}: {m.step_s * 1e3:.1f} ms measured, {m.est_s * 1e3:.1f} ms predicted, "
                      f"{m.memory / 1e6:.1f} MB", flush=True)
            budget, searches = None, []
            for label in ("ample", "tight"):
                big = hw if budget is None else dataclasses.replace(hw, hbm_bytes=budget / (
                    1 - cfg.mesh.auto_memory_margin), mem_fraction=1.0)
                res = auto.search_layout(cfg, devices, big, cache_dir=cache, keep=exes)
                t0 = time.perf_counter()
                auto.apply_trial(res, trial.measure(cfg, [r.cand for r in auto.finalists(res)], devices,
                                                    cfg.mesh.auto_trial_steps, exes))
                trial_s = time.perf_counter() - t0
                print(auto_report.format_result(res, top=3), flush=True)
                pick, estimated = res.choice.cand, (res.estimated or res.choice).cand
                for cand in dict.fromkeys([pick, estimated]):
                    if cand not in measured:
                        measured[cand] = measure(cfg, cand, devices, hw, cache, args.steps, exes)
                searches.append((label, res, trial_s))
                if label == "tight":
                    break
                # The next budget: the ample pick no longer fits, the largest measured layout below it does. Where
                # the pick already needs the least memory of all (remat full can), there is no tight case to test.
                smaller = [m.memory for m in measured.values() if m.memory < measured[pick].memory]
                if not smaller:
                    print(f"{name}: the ample pick needs the least memory of the layouts measured: no tight budget",
                          flush=True)
                    break
                budget = max(smaller)
            # The referee: every layout measured (the hand choices and the picks) measured again the way the trial
            # measures, in --referee-passes passes back and forth over all of them, so that every layout gets its
            # share of the machine's fast and slow minutes (this machine's own speed moves: the fastest of five
            # 1024^2 matmuls ranged over 41-74 ms within one idle minute).
            contenders = list(measured)
            again = trial.measure(cfg, contenders, devices, 2 * args.steps, exes, passes=args.referee_passes)
            for cand, t in again.items():
                print(f"{name}: referee: {cand.label}: {t * 1e3:.1f} ms (first measured "
                      f"{measured[cand].step_s * 1e3:.1f} ms)", flush=True)
                measured[cand] = dataclasses.replace(measured[cand], step_s=t)
            for label, res, trial_s in searches:
                pick, estimated = res.choice.cand, (res.estimated or res.choice).cand
                text, row = table(cfg, name, list(measured.values()), measured[pick], res.budget, label, res,
                                  measured[estimated])
                row.update(trial_seconds_total=trial_s, search_s=res.seconds, compiles=res.compiles,
                           cache_hits=res.cache_hits, referee=[c.label for c in contenders])
                # Duels: the pick against each of the referee's DUELS fastest (other than itself) that fit.
                fits = sorted((m for m in measured.values() if m.memory <= res.budget), key=lambda m: m.step_s)
                row["duels"] = []
                for other in [m.cand for m in fits if m.cand != pick][:args.duels]:
                    ratios = duel(cfg, pick, other, devices, args.duel_rounds, exes)
                    q = np.percentile(ratios, [0, 25, 50, 75, 100]) * 100 - 100
                    text += (f"\nduel against {other.label} (referee rank {[m.cand for m in fits].index(other) + 1}), "
                             f"{len(ratios)} rounds back and forth, the pick's step / the other's, adjacent in time: "
                             f"median {q[2]:+.1f}% (quartiles {q[1]:+.1f}% / {q[3]:+.1f}%, range {q[0]:+.1f}% to "
                             f"{q[4]:+.1f}%)")
                    row["duels"].append({"against": other.label, "median": float(np.median(ratios)) - 1,
                                         "ratios": ratios})
                print(text, flush=True)
                rows.append(row)
    print(f"\ntotal {time.perf_counter() - t_start:.0f} s; load average at the end: {os.getloadavg()[0]:.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
