"""benchmarks/gpu_check.sh on CPU: its arguments, its plan (caps that fit the budget; quick mode within 5 minutes),
sections stopped at their caps, the reports (results.json, results.jsonl) and their schema; the slow pass runs the
sections that can run on a CPU (--smoke: toy sizes, interpret-mode kernels) and checks what they wrote."""

import contextlib
import dataclasses
import importlib.util
import io
import json
import os
import re
import subprocess
import sys
import time

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "benchmarks", "gpu_check.sh")


def _load():
    spec = importlib.util.spec_from_file_location("gpu_check", os.path.join(REPO, "benchmarks", "gpu_check.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


gc = _load()
run = gc.run


def _script(*args, timeout=60):
    return subprocess.run(["bash", SCRIPT, *args], cwd=REPO, capture_output=True, text=True, timeout=timeout)


def _main(*args):
    """gpu_check.py's main in this process (what the script runs, without the start-up of one): a CompletedProcess."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = gc.main(list(args))
        except SystemExit as e:
            rc = e.code
    return subprocess.CompletedProcess(args, rc, out.getvalue(), err.getvalue())


# ---- arguments ------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("args, message", [
    (["--budget", "ten"], "--budget 'ten' must be whole seconds"),
    (["--wheels", "/nonexistent/wheels"], "--wheels '/nonexistent/wheels' is not a directory"),
    (["--fast"], "unknown argument '--fast'; valid: "),
    (["--quick", "--budget", "400"], "--budget 400 is over quick mode's 300 s"),
    (["--budget", "20"], "--budget 20 is below the set-up's 30 s"),
    (["--quick", "--rest"], "not allowed with argument --quick"),
    (["--sections", "step-auto,nope"], "unknown section(s) nope; valid: setup, kernel-tests"),
    (["--quick", "--sections", "bench,step-xla"], "--sections: step-xla not in quick mode; leave out --quick"),
    (["--issue41", "--budget", "600"], "--budget 600 is over --issue41's 540 s"),
    (["--issue41", "--out", "/tmp/o41", "--work", "/tmp/w41"],
     "--work '/tmp/w41' is outside --out '/tmp/o41': --issue41 writes nothing outside --out"),
    (["--issue41", "--sections", "bench"], "--sections: bench not in issue41 mode; leave out --issue41"),
])
def test_bad_arguments_exit_2_with_one_line(args, message):
    proc = _main(*args)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and not proc.stdout


def test_the_shell_entry_point_runs_the_same_checks():
    proc = _script("--fast")
    assert proc.returncode == 2 and proc.stderr.startswith("gpu_check.sh: unknown argument '--fast'"), proc.stderr
    proc = _script("--plan", "--quick")
    assert proc.returncode == 0 and "total 300 s of the 300 s budget" in proc.stdout, proc.stdout + proc.stderr


def test_wheels_directory_without_wheels_and_an_earlier_out_are_refused(tmp_path):
    (tmp_path / "wheels").mkdir()
    proc = _main("--wheels", str(tmp_path / "wheels"))
    assert proc.returncode == 2 and "holds no .whl file" in proc.stderr, proc.stderr
    earlier = tmp_path / "out" / "results.json"
    earlier.parent.mkdir()
    earlier.write_text('{"earlier": true}')
    proc = _main("--smoke", "--out", str(earlier.parent))
    assert proc.returncode == 2 and "already holds an earlier run's results.json" in proc.stderr, proc.stderr
    assert earlier.read_text() == '{"earlier": true}' and os.listdir(earlier.parent) == ["results.json"]


# ---- the plan -------------------------------------------------------------------------------------------------------

PLAN_ROW = re.compile(r"^\s+(\d+)\s+(\S+)\s+(\d+)\s+(\d+)\s+(.*)$")


def _printed_plan(*args):
    """(rows (number, section, cap, until, what), total, budget, left-out names) as `--plan` prints them."""
    proc = _main("--plan", *args)
    assert proc.returncode == 0, proc.stderr
    rows = [m.groups() for m in map(PLAN_ROW.match, proc.stdout.splitlines()) if m]
    overhead = re.search(r"\(this script\)\s+(\d+)\s+(\d+)", proc.stdout)
    total, budget = map(int, re.search(r"^total (\d+) s of the (\d+) s budget$", proc.stdout, re.M).groups())
    left = re.search(r"^left out \(over the budget\): (.*)$", proc.stdout, re.M)
    left_out = re.findall(r"(\S+) \(\d+ s\)", left.group(1)) if left else []
    return rows, int(overhead.group(1)), total, budget, left_out


@pytest.mark.parametrize("args", [["--quick"], [], ["--rest"], ["--rest", "--budget", "300"], ["--budget", "200"],
                                  ["--budget", "900"], ["--smoke"], ["--smoke", "--budget", "1000"],
                                  ["--sections", "bench,step-xla", "--budget", "150"]])
def test_plan_prints_sections_caps_and_a_total_within_the_budget(args):
    rows, overhead, total, budget, left_out = _printed_plan(*args)
    caps = [int(cap) for _, _, cap, _, _ in rows]
    assert total == sum(caps) + overhead <= budget
    assert [int(until) for *_, until, _ in rows] == [sum(caps[:i + 1]) for i in range(len(caps))]
    assert rows[0][1] == "setup"
    mode = "quick" if "--quick" in args else "rest" if "--rest" in args else "full"
    only = args[args.index("--sections") + 1].split(",") if "--sections" in args else None
    expected = [s.name for s in gc.SECTIONS if s.group in gc.MODES[mode]
                and (only is None or s.group == "setup" or s.name in only)]
    planned = [name for _, name, *_ in rows]
    assert sorted(planned + left_out) == sorted(expected) and not set(planned) & set(left_out)
    assert [n for n in expected if n in planned] == planned  # the table's order: by value
    smoke = "--smoke" in args
    for name in left_out:  # each left out because it did not fit after the ones kept before it
        kept_before = sum(c for (_, n, *_), c in zip(rows, caps) if expected.index(n) < expected.index(name))
        assert kept_before + gc.SECTIONS_BY_NAME[name].cap(smoke) + overhead > budget, name


def test_quick_mode_fits_five_minutes_by_its_caps():
    quick = [s for s in gc.SECTIONS if s.group in ("setup", "quick")]
    assert sum(s.cap_s for s in quick) + gc.OVERHEAD_S <= 300
    assert {s.name for s in quick} >= {"setup", "kernel-tests", "bench", "step-auto"}  # the headline's sections
    rows, _, total, budget, left_out = _printed_plan("--quick")
    assert budget == 300 and total <= 300 and not left_out
    assert [name for _, name, *_ in rows] == [s.name for s in quick]


def test_every_budget_gives_a_plan_within_it():
    ctx = gc.Ctx(py=sys.executable, smoke=False, work="/nonexistent")
    for mode in ("quick", "rest", "full"):
        for budget in range(gc.SECTIONS[0].cap_s + gc.OVERHEAD_S, 1200, 7):
            plan = run.make_plan(gc, ctx, mode, budget, [])
            assert plan.total == gc.OVERHEAD_S + sum(e.cap for e in plan.entries) <= budget
            assert plan.entries[0].section.name == "setup"


def test_the_table_check_refuses_quick_caps_over_five_minutes_and_duplicate_names():
    gc.check_tables()
    heavy = gc.Section("fp8", "quick", 60, 60, "an FP8 check", lambda ctx, name: [])
    with pytest.raises(ValueError, match=r"quick mode's caps add up to 3\d\d s .* over its 300 s"):
        gc.check_tables(gc.SECTIONS + [heavy])
    gc.check_tables(gc.SECTIONS + [dataclasses.replace(heavy, group="rest")])  # the rest may grow
    with pytest.raises(ValueError, match="unique names"):
        gc.check_tables(gc.SECTIONS + [gc.SECTIONS[1]])
    with pytest.raises(ValueError, match="unknown section group"):
        gc.check_tables(gc.SECTIONS + [dataclasses.replace(heavy, group="later")])


# ---- --issue41: what issue 41 has not measured, in at most 9 minutes --------------------------------------------

ISSUE41 = {"i41-fp8", "i41-gmm", "i41-flash", "i41-kernel-tests", "i41-rates", "i41-8b", "i41-remat", "i41-moe"}


def test_issue41_plan_fits_nine_minutes_most_valuable_first_and_names_what_it_leaves_out():
    rows, overhead, total, budget, left_out = _printed_plan("--issue41")
    assert budget == 540 and total == overhead + sum(int(r[2]) for r in rows) <= 540
    table = [s for s in gc.SECTIONS if s.group == "issue41"]
    assert {s.name for s in table} == ISSUE41 and table[0].name == "i41-fp8"  # FP8 with its program first
    kept, used = ["setup"], gc.SECTIONS[0].cap_s + gc.OVERHEAD_S  # each kept if it fits after those before it
    for s in table:
        if used + s.cap_s <= 540:
            kept.append(s.name)
            used += s.cap_s
    assert [name for _, name, *_ in rows] == kept and total == used
    assert left_out == [s.name for s in table if s.name not in kept] and left_out
    printed = _main("--plan", "--issue41").stdout
    assert f"a second call runs them: benchmarks/gpu_check.sh --issue41 --sections {','.join(left_out)}" in printed
    rows, _, total, _, left = _printed_plan("--issue41", "--sections", ",".join(left_out))  # ... and fits in one
    assert [name for _, name, *_ in rows] == ["setup", *left_out] and not left and total <= 540


def test_issue41_sections_measure_what_the_issue_asks():
    ctx = gc.Ctx(py="python", smoke=False, work="/w")
    argv = {s.name: [" ".join(a) for a in s.commands(ctx, s.name)] for s in gc.SECTIONS if s.group == "issue41"}
    assert [("--program" in a, a.endswith(f"model.fp8={r}")) for a, r in zip(argv["i41-fp8"], ("none", "tensorwise"))
            ] == [(True, True)] * 2
    (gmm,) = argv["i41-gmm"]
    assert "--projections up,down" in gmm and "--routing balanced,skewed" in gmm and "--impls pallas,triton" in gmm
    assert [("--head-dims=64" in a, "--head-dims=128" in a) for a in argv["i41-flash"]] == [(True, False),
                                                                                           (False, True)]
    assert all("--impls cudnn,xla,triton,pallas" in a for a in argv["i41-flash"])
    assert dict(gc.SECTIONS_BY_NAME["i41-kernel-tests"].env) == {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    assert [a.rsplit(" ", 1)[1] for a in argv["i41-8b"]] == ["model.n_layers=8", "model.n_layers=16"]
    assert all("data.seq_len=8192" in a and "--rows-per-device 2" in a for a in argv["i41-8b"])
    assert [a.split("model.attention=auto ")[1] for a in argv["i41-remat"]] == [
        "model.remat=none", "model.remat=full",
        "model.remat=save_matmuls --xla-flags=--xla_gpu_enable_triton_gemm=false"]
    assert argv["i41-rates"] == ["python benchmarks/gpu_rates.py --iters 10"]


def test_issue41_children_write_caches_and_temporary_files_under_the_work_directory(tmp_path):
    env = run.section_env(gc.Ctx(py=sys.executable, smoke=True, work=str(tmp_path), contained=True))
    for var in ("TMPDIR", "TRITON_CACHE_DIR", "TRITON_HOME", "CUDA_CACHE_PATH", "XDG_CACHE_HOME", "XDG_CONFIG_HOME",
                "MPLCONFIGDIR", "JAX_COMPILATION_CACHE_DIR"):
        assert env[var].startswith(str(tmp_path) + os.sep), var
    assert env["PYTHONDONTWRITEBYTECODE"] == "1"
    plain = run.section_env(gc.Ctx(py=sys.executable, smoke=True, work=str(tmp_path)))
    assert plain.get("TMPDIR") == os.environ.get("TMPDIR")  # the other modes leave them alone


# ---- running sections and writing the reports ----------------------------------------------------------------------

def test_a_section_is_stopped_at_its_cap_with_whatever_it_started(tmp_path):
    """A child that ignores SIGTERM and leaves a grandchild behind: both are gone when the cap is reached, and the
    lines printed before are kept."""
    pid_file = tmp_path / "grandchild"
    child = ("import signal, subprocess, sys, time\n"
             "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
             f"p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
             f"open({str(pid_file)!r}, 'w').write(str(p.pid))\n"
             "print('{\"kind\": \"partial\", \"value\": 1}', flush=True)\n"
             "time.sleep(120)\n")
    console = run.Console(str(tmp_path / "log"))
    t0 = time.monotonic()
    status, lines = run.run_commands([[sys.executable, "-c", child]], 7, dict(os.environ), str(tmp_path / "s.log"),
                                     console)
    elapsed = time.monotonic() - t0
    console.close()
    assert status == "failed: stopped at its 7 s cap" and 6.5 <= elapsed <= 8.5, (status, elapsed)
    assert run.json_rows(None, "s", lines) == [{"kind": "partial", "value": 1}]
    pid = int(pid_file.read_text())
    for _ in range(50):  # SIGKILL is delivered asynchronously; a zombie awaiting its reaper is dead
        if not _running(pid):
            break
        time.sleep(0.1)
    assert not _running(pid), "the grandchild outlived the section"


def _running(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _check_results_schema(out, plan_names):
    """results.json and results.jsonl as documented; returns results.json."""
    doc = json.loads((out / "results.json").read_text())
    assert doc["schema"] == "jaxtrain.gpu_check/1" and doc["finished"] and doc["started"] <= doc["finished"]
    plan = doc["plan"]
    assert plan["total_s"] == plan["overhead_s"] + sum(s["cap_s"] for s in plan["sections"]) <= plan["budget_s"]
    lines = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert lines == doc["sections"]
    assert [r["section"] for r in lines] == plan_names
    for r in lines:
        assert set(r) >= {"section", "group", "title", "status", "seconds", "cap_s", "limit_s", "elapsed_s",
                          "commands", "rows"}, r
        assert r["status"] == "ok" or r["status"].startswith(("failed: ", "skipped: ")), r["status"]
        assert r["seconds"] <= r["limit_s"] + 1 and r["limit_s"] <= r["cap_s"], r
        assert all(isinstance(row, dict) for row in r["rows"])
    assert doc["failed"] == sum(r["status"].startswith("failed") for r in lines)
    for h in doc["headline"]:
        assert set(h) == {"what", "result", "figures"} and h["what"] and h["result"], h
    return doc


def test_reports_are_written_after_each_section_in_the_documented_schema(tmp_path):
    """Two sections of the real runner with real children: a row-printing one and a failing one; results.json
    after each, results.jsonl a line per section, a headline entry from the rows."""
    ok = gc.Section("rows", "rest", 30, 30, "prints rows", lambda ctx, name: [
        [sys.executable, "-c", "import json; print('noise'); print(json.dumps(dict(kind='step', config='c', "
         "attention='a', devices=1, device_kind='k', mfu=0.5, step_ms=10.0, tokens_per_s=100, compile_s=1.0)))"]],
        headline=gc._step_and_save)
    bad = gc.Section("fails", "rest", 30, 30, "exits 4", lambda ctx, name: [[sys.executable, "-c", "exit(4)"]])
    ctx = gc.Ctx(py=sys.executable, smoke=False, work=str(tmp_path))
    plan = run.Plan("rest", False, 100, gc.OVERHEAD_S, [run.Entry(ok, 30), run.Entry(bad, 30)], [])
    reports = run.Reports(str(tmp_path), plan, dict(argv=[]))
    console = run.Console(str(tmp_path / "gpu_check.log"))
    t0 = time.monotonic()
    assert run.run_section(plan.entries[0], ctx, {**os.environ}, console, reports, t0, 100) == "ok"
    first = json.loads((tmp_path / "results.json").read_text())
    assert [r["section"] for r in first["sections"]] == ["rows"] and first["finished"] is None
    assert run.run_section(plan.entries[1], ctx, {**os.environ}, console, reports, t0, 100).startswith(
        "failed: exit status 4")
    reports.finish(time.monotonic() - t0)
    console.close()
    doc = _check_results_schema(tmp_path, ["rows", "fails"])
    assert doc["sections"][0]["rows"] == [dict(kind="step", config="c", attention="a", devices=1, device_kind="k",
                                               mfu=0.5, step_ms=10.0, tokens_per_s=100, compile_s=1.0)]
    assert doc["headline"][0]["result"].startswith("MFU 50.0 %, 10 ms/step, 100 tokens/s") and doc["failed"] == 1
    assert "noise" in (tmp_path / "gpu_check.log").read_text() and "noise" in (tmp_path / "rows.log").read_text()


# ---- the sections that run on a CPU (slow) --------------------------------------------------------------------------

@pytest.mark.slow
def test_quick_smoke_run_on_cpu_writes_every_figure_as_json(tmp_path):
    """--smoke --quick on CPU with a separate work directory: the set-up, the kernel tests (GPU cases skipped), the
    attention benchmark (interpreted), the tiny model's step and two timed checkpoint saves; --out holds only the
    three reports, the work directory the rest, and the checkpoints are gone."""
    out, work = tmp_path / "out", tmp_path / "work"
    proc = _script("--smoke", "--quick", "--out", str(out), "--work", str(work), timeout=1800)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert sorted(os.listdir(out)) == ["gpu_check.log", "results.json", "results.jsonl", "results.md"]
    doc = _check_results_schema(out, ["setup", "kernel-tests", "bench", "step-auto"])
    by = {r["section"]: r for r in doc["sections"]}
    assert all(r["status"] == "ok" for r in doc["sections"])
    assert by["setup"]["rows"][0]["backend"] == "cpu" and by["setup"]["rows"][0]["devices"] >= 1
    tests = by["kernel-tests"]["rows"]
    assert tests and all(t["kind"] == "test" and t["outcome"] == "skipped" for t in tests)  # no GPU here
    bench = {r["impl"]: r for r in by["bench"]["rows"]}
    assert set(bench) == {"cudnn", "xla", "triton", "pallas"}
    assert bench["pallas"]["status"] == "ok" and bench["pallas"]["fwdbwd_tflops"] > 0
    assert bench["pallas"]["max_err_fwd"] < 0.05
    step, *saves = by["step-auto"]["rows"]
    assert step["kind"] == "step" and step["step_ms"] > 0
    assert [s["save"] for s in saves] == ["first", "later"]
    for s in saves:
        assert s["kind"] == "checkpoint" and s["status"] == "ok"
        assert 0.5 * s["state_bytes"] <= s["on_disk_gb"] * 1e9 <= 1.5 * s["state_bytes"] + 1e6, s
        assert 0 < s["blocked_s"] <= s["written_s"] and s["gb_per_s"] == pytest.approx(
            s["state_bytes"] / 1e9 / s["written_s"], rel=0.05, abs=1e-3)
    assert not os.listdir(work / "checkpoint") if (work / "checkpoint").exists() else True
    whats = [h["what"] for h in doc["headline"]]
    assert whats[0] == "machine" and any(w.startswith("kernels vs float64") for w in whats)
    assert any(w.startswith("attention d64") for w in whats) and any(w.startswith("checkpoint save") for w in whats)
    assert "== headline" in proc.stdout and "0 section(s) failed" in proc.stdout


@pytest.mark.slow
def test_a_budget_that_fits_only_the_set_up_records_the_rest_as_left_out(tmp_path):
    setup_cap = gc.SECTIONS[0].smoke_cap_s
    proc = _script("--smoke", "--quick", "--budget", str(setup_cap + gc.OVERHEAD_S), "--out", str(tmp_path),
                   timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = _check_results_schema(tmp_path, ["setup", "kernel-tests", "bench", "step-auto"])
    assert doc["sections"][0]["status"] == "ok"
    assert all(r["status"].startswith("skipped: left out of the plan") for r in doc["sections"][1:])


def test_fp8_headline_compares_with_the_bf16_step_and_states_both_peaks():
    """step-fp8's line: FP8's speed against the BF16 step of the same section, MFU over the BF16 and the FP8 peak."""
    common = dict(kind="step", config="1b", attention="cudnn", peak_tflops=989.4, fp8_peak_tflops=1978.9)
    rows = [dict(common, fp8="none", step_ms=200.0, mfu=0.40, mfu_fp8_peak=None),
            dict(common, fp8="tensorwise", step_ms=160.0, mfu=0.50, mfu_fp8_peak=0.25)]
    (line,) = gc._fp8(gc.SECTIONS_BY_NAME["step-fp8"], rows)
    assert line["what"] == "1b train step, model.fp8=tensorwise, attention cudnn"
    assert line["result"] == ("160 ms/step: 1.25x BF16's speed (200 ms, MFU 40.0 %); MFU 50.0 % of the BF16 peak "
                              "(989 TFLOP/s), 25.0 % of the FP8 peak (1979)")


@pytest.mark.slow
def test_issue41_smoke_run_on_cpu_writes_its_figures_and_nothing_outside_out(tmp_path):
    """--smoke --issue41 on CPU (toy sizes, interpreted kernels): every section runs, each gives the rows it
    measures, the reports (JSON and the markdown table) are in --out, and HOME and TMPDIR stay empty."""
    out, outside = tmp_path / "out", tmp_path / "outside"
    (outside / "home").mkdir(parents=True)
    (outside / "tmp").mkdir()
    env = {**os.environ, "HOME": str(outside / "home"), "TMPDIR": str(outside / "tmp")}
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    proc = subprocess.run(["bash", SCRIPT, "--smoke", "--issue41", "--out", str(out)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=3000)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert sorted(outside.rglob("*")) == [outside / "home", outside / "tmp"]  # both still empty
    assert {"gpu_check.log", "results.json", "results.jsonl", "results.md"} <= set(os.listdir(out))
    names = ["setup", *[s.name for s in gc.SECTIONS if s.group == "issue41"]]
    doc = _check_results_schema(out, names)
    by = {r["section"]: r for r in doc["sections"]}
    assert all(r["status"] == "ok" for r in doc["sections"]), [(r["section"], r["status"]) for r in doc["sections"]]
    steps = [r for r in by["i41-fp8"]["rows"] if r.get("kind") == "step"]
    assert [r["fp8"] for r in steps] == ["none", "tensorwise"]
    assert all(r["program"]["fusions"] > 0 and r["program"]["flops"] > 0 for r in steps)
    assert steps[1]["program"]["f8_converts"] > steps[0]["program"]["f8_converts"] == 0
    gmm = {(r["projection"], r["routing"]) for r in by["i41-gmm"]["rows"] if r.get("status") == "ok"}
    assert gmm == {("up", "balanced"), ("up", "skewed"), ("down", "balanced"), ("down", "skewed")}
    assert any(r["impl"] == "pallas" and r["status"] == "ok" for r in by["i41-flash"]["rows"])
    assert by["i41-kernel-tests"]["rows"] and all(r["kind"] == "test" for r in by["i41-kernel-tests"]["rows"])
    rates = by["i41-rates"]["rows"]
    assert {(r["what"], r.get("dtype")) for r in rates} >= {("gemm", "bfloat16"), ("gemm", "float8"), ("hbm", None)}
    assert [r["remat"] for r in by["i41-remat"]["rows"] if r.get("kind") == "step"] == ["none", "full",
                                                                                         "save_matmuls"]
    assert [r["remat"] for r in by["i41-8b"]["rows"] if r.get("kind") == "step"] == ["save_matmuls"]
    assert [r["kind"] for r in by["i41-moe"]["rows"]] == ["step"]
    md = (out / "results.md").read_text()
    assert "| what | result |" in md and "| i41-moe | ok |" in md
    assert all(f"| {h['what']} |" in md for h in doc["headline"])
