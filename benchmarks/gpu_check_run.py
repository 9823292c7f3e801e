"""The mechanics of ``benchmarks/gpu_check.py`` (whose module holds the table of sections): the plan, each section run
under its cap, the figures read from what it wrote, the reports, the command line. Standard library only."""

from __future__ import annotations

import csv
import dataclasses
import datetime
import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import xml.etree.ElementTree as ET
from types import ModuleType
from typing import Any

SCHEMA = "jaxtrain.gpu_check/1"
GRACE_S = 5  # a section past its cap gets SIGTERM this long before it, SIGKILL at it
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# What the GPU image (Python 3.12, jax 0.11.2 + CUDA 13 plugin, flax, optax, orbax, triton 3.6, numpy, pyyaml, ...)
# lacks: grain and the two of its requirements the image does not have, jax-triton (0.3.1: the last that takes triton
# 3.6), tensorboardX.
GPU_WHEELS = ("grain==0.2.18", "array-record==0.8.6", "portpicker==1.6.0", "jax-triton==0.3.1", "tensorboardX==2.6.5")
MANYLINUX = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux1_x86_64")


# ---- rows: the figures of a section ---------------------------------------------------------------------------------

def json_rows(ctx, name: str, lines: list[str]) -> list[dict]:
    """The JSON objects among the lines a section printed."""
    rows = []
    for line in lines:
        if line.startswith("{"):
            try:
                value = json.loads(line)
            except ValueError:
                continue
            if isinstance(value, dict):
                rows.append(value)
    return rows


def junit_rows(ctx, name: str, lines: list[str]) -> list[dict]:
    """One row per test from pytest's JUnit XML (``ctx.work/NAME.xml``): outcome, seconds, the failure's first line."""
    path = ctx.path(name + ".xml")
    if not os.path.isfile(path):
        return []
    rows = []
    for case in ET.parse(path).getroot().iter("testcase"):
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            found = case.find(tag)
            if found is not None:
                outcome = {"failure": "failed"}.get(tag, tag)
                message = (found.get("message") or "").splitlines()[0][:300] if found.get("message") else ""
                break
        rows.append(dict(kind="test", test=case.get("name"), outcome=outcome,
                         seconds=round(float(case.get("time") or 0), 2), message=message))
    return rows


def _number(text: str) -> Any:
    if text in ("True", "False"):
        return text == "True"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return None if text == "" else text


def bench_rows(ctx, name: str, lines: list[str]) -> list[dict]:
    """The attention benchmark's rows (``kind: attention``) from the CSV files it rewrites after every row (so a
    sweep cut by the cap still gives the rows it finished), in ``ctx.work/NAME`` and its numbered subdirectories."""
    rows = []
    for path in sorted(glob.glob(ctx.path(name, "flash_attention_bench.csv"))
                       + glob.glob(ctx.path(name, "*", "flash_attention_bench.csv"))):
        with open(path, newline="") as f:
            rows += [dict(kind="attention", **{k: _number(v) for k, v in r.items()}) for r in csv.DictReader(f)]
    return rows


def train_rows(ctx, name: str, lines: list[str]) -> list[dict]:
    """``jaxtrain train``'s ``summary.json`` (in ``ctx.work/NAME``) as one row (``kind: train``)."""
    path = ctx.path(name, "summary.json")
    if not os.path.isfile(path):
        return []
    with open(path) as f:
        summary = json.load(f)
    keep = ("devices", "steps_timed", "compile_seconds", "step_seconds", "tokens_per_second", "mfu", "final_loss",
            "device_peak_bytes")
    return [dict(kind="train", attention=name.removeprefix("train-"), **{k: summary.get(k) for k in keep})]


def wheel_files(directory: str) -> list[str]:
    return sorted(glob.glob(os.path.join(directory, "*.whl")))


# ---- the plan -------------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Entry:
    section: Any  # gpu_check.Section
    cap: int  # seconds it may take (0 when skipped)
    skip: str = ""  # why it does not run, or ""


@dataclasses.dataclass(frozen=True)
class Plan:
    mode: str
    smoke: bool
    budget: int
    overhead: int
    entries: list[Entry]  # in order: the sections that run, and those skipped for a reason of their own
    left_out: list[Entry]  # over the budget

    @property
    def total(self) -> int:
        return self.overhead + sum(e.cap for e in self.entries)

    def as_json(self) -> dict:
        def one(e: Entry) -> dict:
            return dict(section=e.section.name, group=e.section.group, cap_s=e.cap, title=e.section.title,
                        skip=e.skip)
        return dict(mode=self.mode, smoke=self.smoke, budget_s=self.budget, overhead_s=self.overhead,
                    total_s=self.total, sections=[one(e) for e in self.entries],
                    left_out=[one(e) for e in self.left_out])


def make_plan(table: ModuleType, ctx, mode: str, budget: int, only: list[str]) -> Plan:
    """The sections of ``mode`` (or just ``only``, with the set-up), in the table's order, each kept if its cap fits
    what the budget leaves after the ones kept before it (a section skipped for a reason of its own takes 0 s)."""
    entries, left_out, total = [], [], table.OVERHEAD_S
    for s in table.SECTIONS:
        if s.group not in table.MODES[mode] or (only and s.group != "setup" and s.name not in only):
            continue
        got = s.commands(ctx, s.name)
        if isinstance(got, str):
            entries.append(Entry(s, 0, got))
        elif total + s.cap(ctx.smoke) <= budget:
            entries.append(Entry(s, s.cap(ctx.smoke)))
            total += s.cap(ctx.smoke)
        else:
            left_out.append(Entry(s, s.cap(ctx.smoke), f"left out of the plan: its {s.cap(ctx.smoke)} s cap does not "
                                                       f"fit the {budget} s budget"))
    return Plan(mode, ctx.smoke, budget, table.OVERHEAD_S, entries, left_out)


def plan_lines(plan: Plan) -> list[str]:
    where = "--smoke on a CPU (toy sizes)" if plan.smoke else "on a GPU"
    lines = [f"plan: {plan.mode} mode, {where}, budget {plan.budget} s",
             f"  {'#':>2}  {'section':<18} {'cap s':>5}  {'until s':>7}  what"]
    until = 0
    for i, e in enumerate(plan.entries, 1):
        until += e.cap
        lines.append(f"  {i:>2}  {e.section.name:<18} {e.cap:>5}  {until:>7}  "
                     + (f"(skipped: {e.skip})" if e.skip else e.section.title))
    lines.append(f"  {'':>2}  {'(this script)':<18} {plan.overhead:>5}  {until + plan.overhead:>7}  reports between "
                 "sections")
    lines.append(f"total {plan.total} s of the {plan.budget} s budget")
    if plan.left_out:
        lines.append("left out (over the budget): " + ", ".join(f"{e.section.name} ({e.cap} s)" for e in plan.left_out))
        flag = "" if plan.mode == "full" else f"--{plan.mode} "
        lines.append(f"a second call runs them: benchmarks/gpu_check.sh {flag}--sections "
                     + ",".join(e.section.name for e in plan.left_out))
    return lines


# ---- running a section ----------------------------------------------------------------------------------------------

class Console:
    """What is printed, also appended to ``path``."""

    def __init__(self, path: str):
        self._log = open(path, "a", buffering=1)
        self._lock = threading.Lock()

    def say(self, text: str = "") -> None:
        self.raw(text + "\n")

    def raw(self, text: str) -> None:
        with self._lock:
            sys.stdout.write(text)
            sys.stdout.flush()
            self._log.write(text)

    def close(self) -> None:
        self._log.close()


def _kill_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def run_one(argv: list[str], seconds: float, env: dict, log, console: Console, lines: list[str]) -> int | None:
    """Run ``argv`` (from the repository root, in its own process group) for at most ``seconds``: its output goes to
    ``log``, the console and ``lines``. Its exit status, or None when it was stopped at the limit. Whatever it
    started is killed when it ends."""
    proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            errors="replace", bufsize=1, start_new_session=True)

    def pump():
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line.rstrip("\n"))
            log.write(line)
            console.raw(line)

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    stopped = False
    try:
        proc.wait(timeout=max(0.0, seconds - GRACE_S))
    except subprocess.TimeoutExpired:
        stopped = True
        _kill_group(proc, signal.SIGTERM)
        try:
            proc.wait(timeout=max(0.1, min(GRACE_S, seconds) - 0.5))
        except subprocess.TimeoutExpired:
            pass
    finally:
        _kill_group(proc, signal.SIGKILL)  # also what it left behind (a background writer, a compiler)
        proc.wait()
        reader.join(timeout=2)
    return None if stopped else proc.returncode


def run_commands(argvs: list[list[str]], limit: int, env: dict, log_path: str, console: Console):
    """(status, output lines) of ``argvs`` run in turn within ``limit`` seconds; the first failure ends them."""
    deadline, lines = time.monotonic() + limit, list[str]()
    with open(log_path, "a") as log:
        log.write(f"---- {datetime.datetime.now().isoformat(timespec='seconds')}\n")
        for argv in argvs:
            log.write("$ " + " ".join(argv) + "\n")
            rc = run_one(argv, deadline - time.monotonic(), env, log, console, lines)
            if rc is None:
                return f"failed: stopped at its {limit} s cap", lines
            if rc != 0:
                return f"failed: exit status {rc} ({os.path.basename(argv[1]) if len(argv) > 1 else argv[0]})", lines
    return "ok", lines


# ---- the reports ----------------------------------------------------------------------------------------------------

class Reports:
    """OUT/results.jsonl (a line per section as it ends), OUT/results.json and OUT/results.md (the headline as a
    markdown table), both rewritten after each section."""

    def __init__(self, out: str, plan: Plan, meta: dict):
        self.json_path, self.jsonl_path = os.path.join(out, "results.json"), os.path.join(out, "results.jsonl")
        self.md_path = os.path.join(out, "results.md")
        self.doc: dict[str, Any] = dict(schema=SCHEMA, **meta, started=_now(), finished=None, elapsed_s=0.0,
                                        plan=plan.as_json(), failed=0, sections=[], headline=[])
        self._write()

    def add(self, record: dict, headline: list[dict]) -> None:
        with open(self.jsonl_path, "a") as f:
            f.write(json.dumps(record, default=str) + "\n")
        self.doc["sections"].append(record)
        self.doc["headline"] += headline
        self.doc["failed"] += record["status"].startswith("failed")
        self.doc["elapsed_s"] = record["elapsed_s"]
        self._write()

    def finish(self, elapsed: float) -> None:
        self.doc.update(finished=_now(), elapsed_s=round(elapsed, 1))
        self._write()

    def _write(self) -> None:
        tmp = self.json_path + ".partial"
        with open(tmp, "w") as f:
            json.dump(self.doc, f, indent=1, default=str)
        os.replace(tmp, self.json_path)
        with open(tmp, "w") as f:
            f.write(markdown(self.doc))
        os.replace(tmp, self.md_path)


def markdown(doc: dict) -> str:
    """results.md: the run (mode, budget, start, elapsed), the headline as a table, each section's status."""
    plan = doc["plan"]
    cell = lambda text: str(text).replace("|", "\\|").replace("\n", " ")  # noqa: E731 - one markdown cell
    lines = [f"# gpu_check: {plan['mode']} mode{' (--smoke: numbers mean nothing)' if plan['smoke'] else ''}", "",
             f"started {doc['started']}, finished {doc['finished'] or '-'}, {doc['elapsed_s']:.0f} s of the "
             f"{plan['budget_s']} s budget; command: `benchmarks/gpu_check.sh {' '.join(doc.get('argv', []))}`", "",
             "| what | result |", "| --- | --- |"]
    lines += [f"| {cell(h['what'])} | {cell(h['result'])} |" for h in doc["headline"]]
    lines += ["", "| section | status | seconds | cap s |", "| --- | --- | ---: | ---: |"]
    lines += [f"| {r['section']} | {cell(r['status'])} | {r['seconds']:.0f} | {r['cap_s']} |" for r in doc["sections"]]
    lines += [f"| {e['section']} | not run: {cell(e['skip'])} | 0 | {e['cap_s']} |" for e in plan["left_out"]
              if e["section"] not in {r["section"] for r in doc["sections"]}]
    return "\n".join(lines) + "\n"


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")


# ---- a run ----------------------------------------------------------------------------------------------------------

def section_env(ctx) -> dict:
    """The sections' environment: the carried wheels' site and this checkout first on PYTHONPATH, unbuffered output,
    JAX's compile cache in the work directory (a second try recompiles less) unless one is set."""
    env = dict(os.environ)
    paths = ([ctx.path("site")] if ctx.wheels else []) + [REPO] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
    env.update(PYTHONPATH=os.pathsep.join(paths), PYTHONUNBUFFERED="1")
    env.setdefault("JAX_COMPILATION_CACHE_DIR", ctx.path("jax-cache"))
    if getattr(ctx, "contained", False):  # --issue41: nothing written outside --out (the work directory is in it)
        for var, sub in (("TMPDIR", "tmp"), ("TRITON_CACHE_DIR", "triton-cache"), ("TRITON_HOME", "triton"),
                         ("CUDA_CACHE_PATH", "cuda-cache"), ("XDG_CACHE_HOME", "cache"),
                         ("XDG_CONFIG_HOME", "config"), ("MPLCONFIGDIR", "config/matplotlib")):
            env[var] = ctx.path(sub)
            os.makedirs(env[var], exist_ok=True)
        env.update(JAX_COMPILATION_CACHE_DIR=ctx.path("jax-cache"), PYTHONDONTWRITEBYTECODE="1")
    return env


def run_plan(plan: Plan, ctx, out: str, console: Console, argv: list[str]) -> int:
    """Run the plan's sections in turn; 0 when none failed, 1 when one did, 3 when the set-up did."""
    env, t0 = section_env(ctx), time.monotonic()
    reports = Reports(out, plan, dict(argv=argv, repo=REPO, work=ctx.work, environment={
        k: env[k] for k in ("PYTHONPATH", "JAX_COMPILATION_CACHE_DIR")}))
    console.say("\n".join(plan_lines(plan)))
    console.say(f"reports: {out} (results.json, results.md, results.jsonl, gpu_check.log); work: {ctx.work}")
    setup_failed = False
    for entry in plan.entries:
        if setup_failed:
            _record(reports, entry, "skipped: the set-up failed", t0)
            continue
        status = run_section(entry, ctx, env, console, reports, t0, plan.budget)
        setup_failed = entry.section.group == "setup" and status != "ok"
    for entry in plan.left_out:
        _record(reports, entry, f"skipped: {entry.skip}", t0)
    reports.finish(time.monotonic() - t0)
    print_summary(reports.doc, console, out)
    return 3 if setup_failed else 1 if reports.doc["failed"] else 0


def _record(reports: Reports, entry: Entry, status: str, t0: float, **more) -> dict:
    record = dict(section=entry.section.name, group=entry.section.group, title=entry.section.title, status=status,
                  seconds=0.0, cap_s=entry.cap, limit_s=0, elapsed_s=round(time.monotonic() - t0, 1), commands=[],
                  rows=[])
    record.update(more)
    headline = []
    if record["rows"] and entry.section.headline:
        try:
            headline = entry.section.headline(entry.section, record["rows"])
        except Exception as e:  # noqa: BLE001 - a figure the table did not expect must not lose the others
            headline = [dict(what=entry.section.name, result=f"no headline: {type(e).__name__}: {e}", figures={})]
    reports.add(record, headline)
    return record


def run_section(entry: Entry, ctx, env: dict, console: Console, reports: Reports, t0: float, budget: int) -> str:
    """Run one section under min(its cap, what the budget leaves); record it with its rows and headline."""
    sec, started = entry.section, time.monotonic()
    console.say(f"\n== {sec.title} ({started - t0:.0f} s elapsed; cap {entry.cap} s)")
    got = entry.skip or sec.commands(ctx, sec.name)  # again: commands may depend on what the set-up learnt
    limit = min(entry.cap, int(budget - (started - t0)))
    lines: list[str] = []
    if isinstance(got, str):
        status, got = f"skipped: {got}", []
    elif limit < min(10, entry.cap):
        status = "skipped: the budget is spent"
    else:
        status, lines = run_commands(got, limit, {**env, **dict(sec.env)}, ctx.path(sec.name + ".log"), console)
    try:
        rows = sec.rows(ctx, sec.name, lines)
    except Exception as e:  # noqa: BLE001 - a damaged report file is a finding, not a crash of the run
        rows = [dict(kind="error", error=f"reading its figures: {type(e).__name__}: {e}")]
    for path in sec.cleanup(ctx, sec.name) if sec.cleanup else []:
        shutil.rmtree(path, ignore_errors=True)
    if sec.group == "setup":
        ctx.devices = next((r["devices"] for r in rows if r.get("kind") == "setup"), ctx.devices)
    if status != "ok":
        console.say(f"!! {sec.name}: {status}")
    tail = {} if status == "ok" or not lines else {"output_tail": [line[-500:] for line in lines[-20:]]}
    _record(reports, entry, status, t0, seconds=round(time.monotonic() - started, 1), limit_s=limit, commands=got,
            rows=rows, **tail)
    return status


def print_summary(doc: dict, console: Console, out: str) -> None:
    plan = doc["plan"]
    console.say(f"\n== headline ({plan['mode']} mode{', --smoke: numbers mean nothing' if plan['smoke'] else ''}: "
                f"{doc['elapsed_s']:.0f} s of the {plan['budget_s']} s budget)")
    width = min(70, max((len(h["what"]) for h in doc["headline"]), default=10))
    for h in doc["headline"]:
        console.say(f"{h['what']:<{width}}  {h['result']}")
    console.say("sections: " + "; ".join(f"{r['section']} {r['status']} ({r['seconds']:.0f} s)"
                                         for r in doc["sections"]))
    trains = [r for r in doc["sections"] if r["section"].startswith("train-") and not r["status"].startswith("skipped")]
    if trains:  # the end-to-end runs side by side
        console.say(f"\n{'attention':10} {'status':8} {'compile s':>9} {'step ms':>8} {'tokens/s':>10} {'MFU':>6}")
        for r in trains:
            row = next((x for x in r["rows"] if x.get("kind") == "train"), None)
            impl, status = r["section"].removeprefix("train-"), r["status"].split(":")[0]
            if row is None:
                console.say(f"{impl:10} {status:8}")
                continue
            mfu = f"{100 * row['mfu']:.1f}%" if row.get("mfu") is not None else "-"
            step_ms = 1e3 * row["step_seconds"]["median"]
            console.say(f"{impl:10} {status:8} {row['compile_seconds']:9.1f} {step_ms:8.1f} "
                        f"{row['tokens_per_second']:10.0f} {mfu:>6}")
    console.say(f"\n== done: {doc['failed']} section(s) failed in {doc['elapsed_s']:.0f} s; reports in {out} "
                "(results.json, results.md, results.jsonl, gpu_check.log)")
