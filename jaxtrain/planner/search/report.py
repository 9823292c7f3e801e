"""The plan as a text table (readable in 120 columns; ``wide`` adds the memory and per-kind collective columns)
and as JSON."""

from __future__ import annotations

import dataclasses
import math
import re
import textwrap
from collections.abc import Sequence

from jaxtrain.config import Config
from jaxtrain.config.hardware import Hardware
from jaxtrain.models.flops import count_params
from jaxtrain.planner.cost.measured import for_hardware
from jaxtrain.planner.cost.model import remat_factor

WIDTH = 120
_COLLECTIVE_COLUMNS = ("all-reduce", "all-gather", "reduce-scatter", "a2a+permute")


def decimal_bytes(x: float) -> str:
    """``x`` bytes in decimal units (kB, MB, GB, TB: as datasheets and link rates use them), 3 digits."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.3g} {unit}"
    return f"{x:.0f} B"


def _rate(x: float, unit: str) -> str:
    for prefix, scale in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6)):
        if x >= scale:
            return f"{x / scale:.3g} {prefix}{unit}"
    return f"{x:.3g} {unit}"


def _sec(x: float) -> str:
    return f"{x * 1e3:.1f} ms" if x < 1 else f"{x:.2f} s"


def _percent(x: float) -> str:
    return f"{x * 100:.1f}%" if x else "-"


def _header(wide: bool) -> list[str]:
    memory = ["params", "optimizer", "temp", "memory"] if wide else ["memory"]
    kinds = list(_COLLECTIVE_COLUMNS) if wide else []
    return ["#", "mesh (ici | dcn)", *memory, CPU_DERIVED, "fits", *kinds, "in-node", "x-node", "bubble", "compute",
            "comm", "step", "overlapped", *CHECKPOINT_COLUMNS]


# The checkpoint's bytes from the busiest host and their save time (planner/storage.py; hidden where absent).
CHECKPOINT_COLUMNS = ("ckpt/host", "save")


# The CPU-derived memory beside XLA:GPU's (planner/xla_gpu/deviceless.py); "" (column hidden) where the plan has
# only one.
CPU_DERIVED = "cpu-derived"


def _row(rank: int, r: dict, wide: bool) -> list[str]:
    cb, mem, t = r["collective_bytes"], r["memory"], r["time"]
    memory = [decimal_bytes(mem["params"]), decimal_bytes(mem["optimizer"]), decimal_bytes(mem["temp"])] if wide else []
    kinds = [decimal_bytes(cb["all-reduce"]), decimal_bytes(cb["all-gather"]), decimal_bytes(cb["reduce-scatter"]),
             decimal_bytes(cb["all-to-all"] + cb["collective-permute"])] if wide else []
    cpu = r.get("cpu_derived")
    cpu_memory = decimal_bytes(cpu["memory_bytes_per_device"]) if cpu else ("(cpu)" if r.get("xla_gpu_error") else "")
    return [str(rank), r["label"], *memory, decimal_bytes(r["memory_bytes_per_device"]), cpu_memory,
            "yes" if r["fits"] else "NO", *kinds, decimal_bytes(r["intra_node_bytes_per_device"]),
            decimal_bytes(r["inter_node_bytes_per_device"]),
            _percent(r["bubble_fraction"]), _sec(t["compute"]), _sec(t["intra_node"] + t["inter_node"]),
            _sec(r["est_step_seconds"]), _sec(r["est_step_seconds_overlap"]), *_checkpoint_cells(r.get("checkpoint"))]


def _checkpoint_cells(ck: dict | None) -> list[str]:
    """The :data:`CHECKPOINT_COLUMNS` of a row: bytes from the busiest host, its save time ("!" past the share of
    the interval that the plan warns at)."""
    if ck is None:
        return ["", ""]
    save = "" if ck["save_seconds"] is None else _sec(ck["save_seconds"]) + (" !" if ck["too_slow"] else "")
    return [decimal_bytes(ck["max_bytes_per_host"]), save]


def _pruned_row(p: dict, wide: bool) -> list[str]:
    n = len(_header(wide))
    row = ["-", p["label"]] + [""] * (n - 2)
    memory_col = 5 if wide else 2
    step_col = -2 - len(CHECKPOINT_COLUMNS)
    row[memory_col] = f"> {decimal_bytes(p['state_bytes_per_device'])}"
    row[memory_col + 2], row[step_col] = "NO", "pruned"
    return row


def _hidden(h: str, column: list[str]) -> bool:
    """Collective columns zero in every row, the bubble column where no mesh is a pipeline, the CPU-derived
    column where no figure came from XLA:GPU and the checkpoint columns without figures, are left out."""
    return (h in _COLLECTIVE_COLUMNS and all(c in ("0 B", "") for c in column)) or \
        (h == "bubble" and all(c in ("-", "") for c in column)) or \
        (h in (CPU_DERIVED, *CHECKPOINT_COLUMNS) and not any(column))


_AXIS_INITIAL = re.compile(r"\b(data|stage|fsdp|context|tensor)(?=\d)")
SHORT_LABELS = "mesh: d data, s stage, f fsdp, c context, t tensor"


def _table(header: list[str], rows: list[list[str]], width: int | None = None) -> tuple[list[str], bool, bool]:
    """Aligned text table without the :func:`_hidden` columns, whether the mesh labels were shortened (wider than
    ``width``, they name the axes by their initials: ``d2 s2 f2 | dcn s4``; :data:`SHORT_LABELS`) and whether the
    checkpoint columns were left out (still wider)."""
    keep = [i for i, h in enumerate(header) if not _hidden(h, [r[i] for r in rows])]
    lines, short = _table_kept(header, rows, keep, width)
    if width is None or max(map(len, lines)) <= width or not any(header[i] in CHECKPOINT_COLUMNS for i in keep):
        return lines, short, False
    keep = [i for i in keep if header[i] not in CHECKPOINT_COLUMNS]
    return (*_table_kept(header, rows, keep, width), True)


def _table_kept(header: list[str], rows: list[list[str]], keep: list[int], width: int | None) -> tuple[list[str], bool]:
    header, rows = [header[i] for i in keep], [[r[i] for i in keep] for r in rows]

    def render(rows: list[list[str]]) -> list[str]:
        widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(header)]

        def fmt(cells: list[str]) -> str:
            return "  ".join(c.ljust(w) if i == 1 else c.rjust(w)
                             for i, (c, w) in enumerate(zip(cells, widths))).rstrip()

        return [fmt(header), fmt(["-" * w for w in widths]), *map(fmt, rows)]

    lines = render(rows)
    if width is None or max(map(len, lines)) <= width:
        return lines, False
    return render([[r[0], _AXIS_INITIAL.sub(lambda m: m.group(1)[0], r[1]), *r[2:]] for r in rows]), True


def _wrap(text: str) -> list[str]:
    return textwrap.wrap(text, WIDTH, subsequent_indent="  ")


def _efficiency(hw: Hardware) -> str:
    if not hw.model_efficiency:
        return f"{hw.compute_efficiency:g}"
    return "measured on the model's own step (remat, tensor: " + ", ".join(
        f"{r} {t}: {e:.3g}" for r, t, e in hw.model_efficiency) + ")"


def format_report(cfg: Config, hw: Hardware, n_devices: int, nodes: int, result: dict, wide: bool = False,
                  notes: Sequence[str] = ()) -> str:
    """The ranked table printed by ``jaxtrain plan``: meshes that fit first, then by estimated step time.
    ``notes``: where the plan differs from the run it plans (``target.Target.notes``)."""
    m = cfg.model
    tokens = cfg.train.global_batch * cfg.data.seq_len
    lines = _wrap(
        f"model: {count_params(m)['total'] / 1e6:,.1f}M parameters ({m.param_dtype}), compute {m.dtype}, attention "
        f"{m.attention}, remat {m.remat}; {tokens:,} tokens/step (global_batch {cfg.train.global_batch} x seq_len "
        f"{cfg.data.seq_len}, {cfg.train.microbatches} microbatch(es)"
        + (f", {cfg.train.virtual_stages} virtual stages per pipeline stage" if cfg.train.virtual_stages > 1 else "")
        + ")")
    lines += _wrap(
        f"hardware: {hw.name}: {n_devices} devices ({hw.device}) on {nodes} node(s); peak "
        f"{_rate(hw.peak_flops, 'FLOP/s')} x efficiency {_efficiency(hw)}"
        + (" where no rate was measured" if for_hardware(hw) else "") + f"; memory {decimal_bytes(hw.hbm_bytes)} x "
        f"{hw.mem_fraction:g} usable at {_rate(hw.hbm_bandwidth, 'B/s')}; links "
        f"{_rate(hw.intra_node_bandwidth, 'B/s')} in a node, {_rate(hw.inter_node_bandwidth, 'B/s')} between nodes "
        "(per device, each way)"
        + (f"; {hw.collective_latency * 1e6:.0f} us per collective" if hw.collective_latency else ""))
    lines += _wrap(_checkpoint_line(cfg, result["candidates"]))
    for note in notes:
        lines += _wrap(f"note: {note}")
    lines.append("")
    rows = [_row(i, r, wide) for i, r in enumerate(result["candidates"], 1)]
    table, short, no_checkpoint = _table(_header(wide), rows + [_pruned_row(p, wide) for p in result["pruned"]],
                                         None if wide else WIDTH)
    lines += table
    lines.append("")
    notes = [
        "Per device and step. memory: parameter and optimizer shards (exact) + the compiler's temporaries + "
        f"non-donated outputs; fits: memory <= {hw.mem_fraction:g} x {decimal_bytes(hw.hbm_bytes)}.",
        "in-node / x-node: collective bytes each device sends within its node / to other nodes (hierarchical "
        "rings), loop trip counts included.",
        "step = compute + comm + optimizer update (no overlap); overlapped = max(compute, in-node, x-node) + update. "
        + (f"compute = model FLOPs x remat {remat_factor(cfg):.3g} / (peak x efficiency)." if for_hardware(hw) is None
         else "compute = the weight matmuls and attention (forward + backward, and what remat recomputes), each at its "
              f"rate (measured, else peak x efficiency: the note on {hw.name}'s measured rates)."),
        "Meshes that fit are listed first, then by step. --wide: memory and bytes per collective kind; --json: "
        "everything, per collective.",
    ]
    if any(r["bubble_fraction"] for r in result["candidates"]):
        notes.append(f"bubble: share of a pipeline stage's iterations spent idle, (S-1)/(M V + S-1) for S stages, "
                     f"M = {cfg.train.microbatches} microbatches, V = {cfg.train.virtual_stages} virtual stages; "
                     "compute is divided by 1 - bubble. The pipeline's permutes are in the in-node / x-node bytes.")
    if any(r.get("schedule") == "1f1b" for r in result["candidates"]):
        notes.append("1f1b: the 1F1B schedule (train.pipeline_schedule=1f1b, planned too where GPipe does not fit): "
                     "stage inputs bounded by the stages, the same bubble, compute x (remat + 1/3) for the forward "
                     "each backward recomputes.")
    if short:
        notes.append(f"{SHORT_LABELS} (the full names do not fit in {WIDTH} columns; --json has them).")
    if no_checkpoint:
        notes.append(f"The checkpoint columns ({', '.join(CHECKPOINT_COLUMNS)}) do not fit in {WIDTH} columns: "
                     "--wide or --json has them.")
    if result["pruned"]:
        notes.append("pruned: parameters + optimizer state alone exceed the usable memory, so not compiled.")
    if any(r.get("cpu_derived") for r in result["candidates"]):
        notes.append(f"memory, fits, bytes and times from XLA:GPU's compile; {CPU_DERIVED}: the memory XLA:CPU's "
                     "compile gives (--json: cpu_derived, with its collective bytes); (cpu): XLA:GPU failed, the "
                     "row's figures are CPU-derived.")
    notes += gpu_warnings(result["candidates"]) + checkpoint_warnings(result["candidates"])
    if any(u["holds_collectives"] for r in result["candidates"] for u in r["unknown_trip_count_loops"]):
        notes.append("note: some collectives run inside a loop whose number of iterations the compiler does not "
                     "state; they are counted as running once per step, so the collective bytes and comm times "
                     "above may be too low (--json lists the loops).")
    for note in notes:
        lines += _wrap(note)
    return "\n".join(lines)


def _checkpoint_line(cfg: Config, candidates: list[dict]) -> str:
    """The header line on the candidates' ``checkpoint`` entries (planner/storage.py); "" where they have none."""
    figs = [r["checkpoint"] for r in candidates if r.get("checkpoint")]
    if not figs:
        return ""
    ck, every = figs[0], cfg.checkpoint.every
    line = (f"checkpoint: {decimal_bytes(ck['bytes'])} a save (the train state in its dtypes); ckpt/host: the bytes "
            "the busiest host writes, each distinct shard once, "
            + ("replicated shards split among their copies (Orbax's replica-parallel writing)" if
               ck["replica_parallel"] else "replicated shards by the hosts of their first copy (Orbax with "
                                               "JAX_PLATFORMS=cuda, as jaxtrain's launchers set it)"))
    if ck["write_bandwidth"] is None:
        return line + "; --write-bandwidth adds the save time"
    return line + (f"; save: at {ck['write_bandwidth'] / 1e9:g} GB/s per host, '!' where longer than "
                   f"{ck['save_share']:g} x the interval between saves "
                   + (f"(checkpoint.every {every} x step)" if every else "(none: checkpoint.every=0)"))


def checkpoint_warnings(candidates: list[dict]) -> list[str]:
    """The ``warning:`` line of each candidate whose checkpoint save takes too long (planner/storage.py)."""
    return [r["checkpoint"]["warning"] for r in candidates if (r.get("checkpoint") or {}).get("warning")]


def gpu_warnings(candidates: list[dict]) -> list[str]:
    """A ``warning:`` line per XLA:GPU compile that failed and per way a GPU program is not what was configured
    (``planner/xla_gpu/program.py``)."""
    lines = []
    for r in candidates:
        if r.get("xla_gpu_error"):
            lines.append(f"warning: {r['label']}: {r['xla_gpu_error']} (its figures are CPU-derived)")
        gpu = r.get("xla_gpu") or {}
        if gpu.get("stand_in"):
            lines.append(f"note: {r['label']}: {gpu['stand_in']}")
        lines += [f"warning: {r['label']}: XLA:GPU program: {v}" for v in gpu.get("violations", [])]
    return lines


def to_json(hw: Hardware, n_devices: int, nodes: int, result: dict, notes: Sequence[str] = ()) -> dict:
    """The JSON the ``--json`` flag prints."""
    return {"hardware": dataclasses.asdict(hw), "devices": n_devices, "nodes": nodes, "notes": list(notes), **result}


# ---------------------------------------------------------------------------------------------------------------
# Time and money: a token budget over the plans for several node counts

SECONDS_PER_DAY = 86400.0


def training_budget(tokens: float, tokens_per_step: int, step_seconds: float, n_devices: int,
                    gpu_hour_cost: float | None = None) -> dict:
    """Days and cost of training ``tokens`` tokens at ``step_seconds`` a step of ``tokens_per_step`` tokens on
    ``n_devices`` devices (accelerator-hours x ``gpu_hour_cost``; None: no price given). The last step is whole:
    ceil(tokens / tokens_per_step) steps."""
    steps = math.ceil(tokens / tokens_per_step)
    seconds = steps * step_seconds
    gpu_hours = seconds / 3600 * n_devices
    return {"steps": steps, "days": seconds / SECONDS_PER_DAY, "gpu_hours": gpu_hours,
            "cost": None if gpu_hour_cost is None else gpu_hours * gpu_hour_cost}


def scaling_efficiency(step_a: float, devices_a: int, step_b: float, devices_b: int) -> float:
    """Throughput per device at ``devices_b`` relative to ``devices_a`` for the same global batch: 1.0 when
    ``devices_b / devices_a`` times the devices take ``devices_a / devices_b`` of the step time (linear scaling);
    equal to the ratio of accelerator-hours (hence of cost), a over b."""
    return (step_a * devices_a) / (step_b * devices_b)


def layout_family(r: dict) -> tuple[str, str]:
    """The layout a candidate keeps as nodes are added: (its per-node (ici) part with the pipeline schedule, the
    axes that span the nodes), e.g. ``("fsdp8", "data")``; one node has no such axes (``""``)."""
    ici = " ".join(f"{a}{s}" for a, s in r["mesh"]["ici"].items() if s > 1) or "one-device"
    dcn = " ".join(a for a, s in r["mesh"]["dcn"].items() if s > 1)
    return ici + (" 1f1b" if r.get("schedule") == "1f1b" else ""), dcn


def budget_rows(plans: Sequence[tuple[int, int, dict]], tokens: float, tokens_per_step: int,
                gpu_hour_cost: float | None) -> list[dict]:
    """One row per candidate and node count, from ``plans`` = [(nodes, devices, plan result)] in node order: the
    layout, its days and cost at the no-overlap step estimate (``est_step_seconds``; ``days_overlapped`` at the
    overlapped one), and ``scaling_efficiency`` against the same layout (:func:`layout_family`) at the latest
    smaller node count that has it, or else that has its per-node part on one node (None for neither)."""
    rows: list[dict] = []
    last: dict[tuple[str, str], tuple[float, int]] = {}  # family -> (step seconds, devices), latest node count
    for nodes, n_devices, result in plans:
        seen = dict(last)  # this node count's candidates compare with smaller node counts only
        for r in result["candidates"]:
            family, step_s = layout_family(r), r["est_step_seconds"]
            budget = training_budget(tokens, tokens_per_step, step_s, n_devices, gpu_hour_cost)
            before = seen.get(family) or seen.get((family[0], ""))
            rows.append({"nodes": nodes, "devices": n_devices, "mesh": r["label"],
                         "fits": r["fits"], "memory_bytes_per_device": r["memory_bytes_per_device"],
                         "est_step_seconds": step_s,
                         "days_overlapped": training_budget(tokens, tokens_per_step, r["est_step_seconds_overlap"],
                                                            n_devices)["days"],
                         **budget,
                         "scaling_efficiency": None if before is None else
                         scaling_efficiency(before[0], before[1], step_s, n_devices)})
            last[family] = (step_s, n_devices)
    return rows


def _amount(x: float) -> str:
    """Device-hours and money: three significant digits, k / M / G for thousands, millions, billions."""
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if x >= scale:
            return f"{x / scale:.3g}{unit}"
    return f"{x:.3g}"


def _step(x: float) -> str:
    return f"{x:.3g} s" if x >= 1 else f"{x * 1e3:.3g} ms"


def _duration(days: float) -> str:
    if days >= 1:
        return f"{days:.3g} d"
    hours = days * 24
    return f"{hours:.3g} h" if hours >= 1 else f"{hours * 60:.3g} min"


def format_budget(cfg: Config, hw: Hardware, tokens: float, gpu_hour_cost: float | None, rows: list[dict]) -> str:
    """The table ``plan --tokens`` prints: per node count (in the order given) its candidates, fitting ones first."""
    tokens_per_step = cfg.train.global_batch * cfg.data.seq_len
    m = cfg.model
    lines = _wrap(f"model: {count_params(m)['total'] / 1e6:,.1f}M parameters, remat {m.remat}; {tokens:.4g} tokens = "
                  f"{rows[0]['steps']:,} steps of {tokens_per_step:,} tokens; hardware {hw.name} ({hw.device})"
                  + (f"; {gpu_hour_cost:g} per device-hour" if gpu_hour_cost is not None else ""))
    lines.append("")
    header = ["nodes", "devices", "mesh (ici | dcn)", "memory", "fits", "step", "time (overlapped)", "device-hours",
              *(["cost"] if gpu_hour_cost is not None else []), "scaling"]
    body = [[str(r["nodes"]), str(r["devices"]), r["mesh"], decimal_bytes(r["memory_bytes_per_device"]),
             "yes" if r["fits"] else "NO", _step(r["est_step_seconds"]),
             f"{_duration(r['days'])} ({_duration(r['days_overlapped'])})", _amount(r["gpu_hours"]),
             *([_amount(r["cost"])] if gpu_hour_cost is not None else []),
             "-" if r["scaling_efficiency"] is None else f"{r['scaling_efficiency'] * 100:.0f}%"] for r in rows]
    widths = [max(len(h), *(len(b[i]) for b in body)) for i, h in enumerate(header)]
    for cells in [header, ["-" * w for w in widths], *body]:
        lines.append("  ".join(c.ljust(w) if i == 2 else c.rjust(w)
                               for i, (c, w) in enumerate(zip(cells, widths))).rstrip())
    lines.append("")
    for note in (
            "time: to train the token budget at the estimated step (no overlap); in brackets at the overlapped "
            "estimate. device-hours = time x devices"
            + ("; cost = device-hours x the price." if gpu_hour_cost is not None else "."),
            "scaling: throughput per device against the same layout (per-node mesh, axes across nodes; on one node "
            "the same per-node mesh) at the previous node count, same global batch (100% = linear = the same cost).",
            "Estimates from the planner's cost model (peak x efficiency, link rates of the hardware file); "
            "memory: per device, fits as in plan's table."):
        lines += _wrap(note)
    return "\n".join(lines)
