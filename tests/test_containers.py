"""Running in the images people use: jaxtrain's runtime packages (jaxtrain.cluster.packages), the container recipe
(launch/container/Dockerfile) and the pyxis path of launch/slurm.sbatch.

No Docker, pyxis or enroot here. The missing-package check runs the real CLI in a Python whose site-packages lack
grain, tensorboardX and prometheus-client (as NVIDIA's JAX images do); the Dockerfile is read with dockerfile-parse;
the sbatch script runs under tests/slurm/pyxis_srun.sh, an `srun` stand-in that records every step's options and
applies pyxis' rule for the container's environment (the image's value wins unless named in --container-env).
"""

import hashlib
import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys
import tomllib

import pytest

from jaxtrain.cluster import packages
from jaxtrain_testing import REPO

LAUNCH = os.path.join(REPO, "launch")
DOCKERFILE = os.path.join(LAUNCH, "container", "Dockerfile")
PYXIS_SRUN = os.path.join(REPO, "tests", "slurm", "pyxis_srun.sh")
HIDDEN = {"grain": "grain", "tensorboardX": "tensorboardX", "prometheus-client": "prometheus_client"}


def _python_without(tmp_path, modules):
    """A site-packages of symbolic links to this Python's, less ``modules`` and their *.dist-info: run with
    ``python -S`` and it on PYTHONPATH, those packages are absent as from an image that never had them."""
    farm = tmp_path / "site-packages"
    farm.mkdir()
    hidden = {m.lower() for m in modules}
    for directory in [p for p in sys.path if os.path.basename(p.rstrip("/")) in ("site-packages", "dist-packages")]:
        for entry in sorted(os.listdir(directory)):
            top = entry.split("-")[0] if entry.endswith((".dist-info", ".egg-info")) else entry
            if top.lower() in hidden or entry.endswith(".pth") or entry.startswith("__") or (farm / entry).exists():
                continue
            (farm / entry).symlink_to(os.path.join(directory, entry))
    return {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "PYTHONPATH": f"{REPO}{os.pathsep}{farm}"}


def _declared(names):
    """pyproject.toml's requirement strings (spaces removed) of the distributions ``names``."""
    declared = tomllib.load(open(os.path.join(REPO, "pyproject.toml"), "rb"))["project"]["dependencies"]
    return ["".join(d.split()) for d in declared if re.match(r"[\w.-]+", d).group(0) in names]


def test_every_missing_package_is_named_in_one_line_before_anything_runs(tmp_path):
    env = _python_without(tmp_path, HIDDEN.values())
    run_dir = tmp_path / "run"
    for command in ("train", "check"):
        proc = subprocess.run([sys.executable, "-S", "-m", "jaxtrain", command, f"run.dir={run_dir}"], env=env,
                              cwd=tmp_path, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
        (line,) = proc.stderr.strip().splitlines()
        named = re.search(r"does not have: ([^.]+)\.", line).group(1).split(", ")
        assert sorted(named) == sorted(HIDDEN), line  # all three, and nothing that is installed
        for text in _declared(HIDDEN):
            assert f"'{text}'" in line  # pip-ready, with pyproject's versions
        assert not run_dir.exists()  # refused before the run directory (or JAX, or a collective) was touched
    # `env` diagnoses the node instead of refusing: it starts, says the same, and exits 0.
    diag = subprocess.run([sys.executable, "-S", "-m", "jaxtrain", "env", "--json"], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert diag.returncode == 0, diag.stderr
    assert sorted(json.loads(diag.stdout)["missing_packages"]) == sorted(_declared(HIDDEN))
    # The module's own command lists exactly what the no-build path would install.
    listed = subprocess.run([sys.executable, "-S", "-m", "jaxtrain.cluster.packages", "--missing"], env=env,
                            cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert sorted(listed.stdout.split()) == sorted(json.loads(diag.stdout)["missing_packages"])


@pytest.mark.slow
def test_the_install_adds_what_is_missing_and_never_changes_an_installed_package(tmp_path):
    """`--install --dry-run` through pip and the package index (needs the registry, hence slow): with grain,
    tensorboardX and prometheus-client hidden, pip would install exactly those three; with the installed protobuf
    replaced by a 4.0.0 (grain needs >= 5.28.3), the constraints make pip stop instead of upgrading it."""
    (tmp_path / "a").mkdir()
    env = _python_without(tmp_path / "a", HIDDEN.values())
    proc = subprocess.run([sys.executable, "-S", "-m", "jaxtrain.cluster.packages", "--install", "--dry-run"],
                          env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    (would,) = [line for line in proc.stdout.splitlines() if line.startswith("Would install")]
    assert sorted(p.rsplit("-", 1)[0].lower() for p in would.split()[2:]) == sorted(
        packages._normalise(n).replace("-", "_") for n in HIDDEN), would
    (tmp_path / "b").mkdir()
    env = _python_without(tmp_path / "b", [*HIDDEN.values(), "protobuf"])
    old = tmp_path / "b" / "site-packages" / "protobuf-4.0.0.dist-info"
    old.mkdir()
    (old / "METADATA").write_text("Metadata-Version: 2.1\nName: protobuf\nVersion: 4.0.0\n")
    proc = subprocess.run([sys.executable, "-S", "-m", "jaxtrain.cluster.packages", "--install", "--dry-run"],
                          env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    said = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "ResolutionImpossible" in said and "Would install" not in said, said[-2000:]
    assert "protobuf==4.0.0" in said  # pip names the constraint that stopped it
    # Without the constraints the same pip would have replaced the installed protobuf.
    plain = subprocess.run([sys.executable, "-S", "-m", "pip", "install", "--no-cache-dir", "--dry-run",
                            *_declared(HIDDEN)], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert re.search(r"^Would install .*\bprotobuf-", plain.stdout, re.M), plain.stdout[-2000:]


# The Flax and Orbax of ghcr.io/nvidia/jax:jax-2026-06-27 (the Dockerfile's base), as far as JAX-Toolbox's recipe
# says (not read from the image: no registry but PyPI here): Flax is built from its main branch on the build day,
# whose flax/version.py said 0.12.8 from 2026-06-19; Orbax is what pip-compile resolved from PyPI for Flax's
# unpinned requirement that day: 0.12.1 (released 2026-06-24; 0.12.2 followed on 2026-08-03). docs/gpu.md.
IMAGE_VERSIONS = {"flax": "0.12.8", "orbax-checkpoint": "0.12.1"}


def test_the_image_stack_is_never_replaced_and_the_libraries_are():
    for name in ("jax", "jaxlib", "jax-cuda12-plugin", "jax_cuda13_pjrt", "nvidia-nccl-cu13", "nvidia-cudnn-cu12",
                 "transformer-engine", "transformer_engine_jax", "numpy", "NumPy"):
        assert packages.protected(name), name
    for name in ("flax", "orbax-checkpoint", "optax", "grain", "tensorboardX", "safetensors", "jax-triton",
                 "numpyro"):
        assert not packages.protected(name), name
    free = packages.constraints(frozenset({"pyyaml"}))
    assert not any(c.lower().startswith("pyyaml==") for c in free) and any(c.startswith("numpy==") for c in free)


@pytest.mark.slow
def test_the_images_flax_and_orbax_are_kept_in_range_and_replaced_outside(tmp_path):
    """A venv over this Python with the image's Flax and Orbax (IMAGE_VERSIONS) installed into it, from the package
    index (skipped where it is unreachable). Flax 0.12.8 is inside jaxtrain's range, Orbax 0.12.1 below it: `--strict`
    names Orbax alone; jaxtrain's checkpoint tests pass with them as they are; `--install` replaces Orbax with a
    version in the range and touches nothing else (Flax, jax, numpy as before); then `--strict` passes."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True, timeout=120)
    py = str(venv / "bin" / "python")
    got = subprocess.run([py, "-m", "pip", "install", "--no-deps", "--ignore-installed", "--no-cache-dir",
                          *(f"{n}=={v}" for n, v in IMAGE_VERSIONS.items())], capture_output=True, text=True,
                         timeout=600)
    if got.returncode != 0:
        pytest.skip(f"the package index is unreachable: {(got.stderr or got.stdout).strip().splitlines()[-1:]}")
    env = {**os.environ, "PYTHONPATH": REPO}
    env.pop("XLA_FLAGS", None)

    def run(*args, timeout=600):
        return subprocess.run([py, *args], env=env, cwd=REPO, capture_output=True, text=True, timeout=timeout)

    def versions():
        out = run("-c", "import importlib.metadata as m; print(*(m.version(n) for n in "
                        "('flax', 'orbax-checkpoint', 'jax', 'numpy')))").stdout.split()
        return dict(zip(("flax", "orbax-checkpoint", "jax", "numpy"), out))

    before = versions()
    assert (before["flax"], before["orbax-checkpoint"]) == ("0.12.8", "0.12.1")
    strict = run("-m", "jaxtrain.cluster.packages", "--strict")
    assert strict.returncode == 2, strict.stdout + strict.stderr
    (line,) = [x for x in strict.stdout.splitlines() if "outside jaxtrain's requirements" in x]
    assert line.endswith("orbax-checkpoint 0.12.1 (jaxtrain is tested with >=0.12.8,<0.14)"), line
    tests = run("-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_checkpoint.py", "-k",
                "save_schedule_and_retention or adamw_moments")
    assert tests.returncode == 0 and re.search(r"^3 passed", tests.stdout, re.M), tests.stdout[-2000:]
    install = run("-m", "jaxtrain.cluster.packages", "--install")
    assert install.returncode == 0, install.stdout[-2000:] + install.stderr[-2000:]
    assert "orbax-checkpoint (replacing 0.12.1, outside >=0.12.8,<0.14)" in install.stdout
    after = versions()
    assert after["flax"] == "0.12.8" and after["jax"] == before["jax"] and after["numpy"] == before["numpy"]
    assert packages._satisfies(after["orbax-checkpoint"], ">=0.12.8,<0.14"), after
    assert run("-m", "jaxtrain.cluster.packages", "--strict").returncode == 0


def test_kernel_packages_are_the_gpu_extras():
    extra = tomllib.load(open(os.path.join(REPO, "pyproject.toml"), "rb"))["project"]["optional-dependencies"]["gpu"]
    wanted = {packages._normalise(re.match(r"[\w.-]+", t).group(0)): "".join(t.split()) for t in extra
              if re.match(r"(jax-triton|triton)\b", t)}
    got = packages.kernel_requirements()
    assert {packages._normalise(r.name): r.text for r in got} == wanted and set(wanted) == {"jax-triton", "triton"}


def test_an_image_without_jax_triton_refuses_the_triton_grouped_matmul_in_one_line():
    """What model.moe.gemm=triton does on GPUs where --install-kernels could not add jax-triton: a ConfigError
    (exit status 2, one line) when the layout is resolved, before anything compiles."""
    if importlib.util.find_spec("jax_triton") is not None:
        pytest.skip("jax-triton is installed here")
    from jaxtrain.parallel.expert import resolve_gemm

    with pytest.raises(packages.ConfigError, match=r"^model\.moe\.gemm=triton needs the jax-triton package") as e:
        resolve_gemm("triton", "gpu")
    assert "\n" not in str(e.value)


def test_an_image_without_jax_triton_refuses_triton_attention_in_one_line():
    """model.attention=triton likewise: refused when the config is resolved for GPUs, not when the kernel is first
    traced."""
    if importlib.util.find_spec("jax_triton") is not None:
        pytest.skip("jax-triton is installed here")
    from jaxtrain.config import load_config
    from jaxtrain.parallel.layout import resolve_auto

    cfg = load_config(None, ["model.attention=triton", "model.dtype=bfloat16", "model.head_dim=32"])
    with pytest.raises(packages.ConfigError, match=r"^model\.attention=triton needs the jax-triton package") as e:
        resolve_auto(cfg, "gpu", 1)
    assert "\n" not in str(e.value)


@pytest.mark.slow
def test_install_kernels_adds_jax_triton_and_keeps_jax(tmp_path):
    """`--install-kernels --dry-run` against the package index (skipped where it is unreachable): with triton 3.6
    installed and no jax-triton, pip would install jax-triton alone, in the gpu extra's range (0.3.x: 0.4 needs
    jax >= 0.11, and the installed jax is pinned)."""
    if importlib.util.find_spec("jax_triton") is not None:
        pytest.skip("jax-triton is installed here: nothing to add")
    proc = subprocess.run([sys.executable, "-m", "jaxtrain.cluster.packages", "--install-kernels", "--dry-run"],
                          cwd=REPO, capture_output=True, text=True, timeout=600)
    said = proc.stdout + proc.stderr
    if proc.returncode != 0 and re.search(r"No matching distribution|Could not fetch|connection", said, re.I):
        pytest.skip(f"the package index is unreachable: {said.strip().splitlines()[-1:]}")
    assert proc.returncode == 0, said[-2000:]
    (would,) = [line for line in proc.stdout.splitlines() if line.startswith("Would install")]
    assert would.split()[2:] and all(p.startswith("jax-triton-0.3.") for p in would.split()[2:]), would


def test_a_hidden_install_counts_as_missing(tmp_path):
    """Metadata present but the module unimportable (a broken install, or one shadowed on the path): missing."""
    (tmp_path / "sitecustomize.py").write_text("import sys\nsys.modules['grain'] = None\n")
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{tmp_path}")
    proc = subprocess.run([sys.executable, "-m", "jaxtrain", "train"], env=env, cwd=tmp_path, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2 and "does not have: grain." in proc.stderr, proc.stderr


def test_other_versions_are_reported_and_refused_only_when_strict(tmp_path):
    """safetensors' metadata replaced by a 0.1.0 (pyproject: >=0.8,<0.9), its module left: present, other version."""
    import safetensors

    env = _python_without(tmp_path, ["safetensors"])
    site = tmp_path / "site-packages"
    (site / "safetensors").symlink_to(os.path.dirname(safetensors.__file__))
    old = site / "safetensors-0.1.0.dist-info"
    old.mkdir()
    (old / "METADATA").write_text("Metadata-Version: 2.1\nName: safetensors\nVersion: 0.1.0\n")

    def run(*args):
        return subprocess.run([sys.executable, "-S", "-m", *args], env=env, cwd=tmp_path, capture_output=True,
                              text=True, timeout=120)

    assert run("jaxtrain.cluster.packages").returncode == 0
    strict = run("jaxtrain.cluster.packages", "--strict")
    assert strict.returncode == 2 and "safetensors 0.1.0 (jaxtrain is tested with " in strict.stdout, strict.stdout
    diag = run("jaxtrain", "env", "--json")
    assert json.loads(diag.stdout)["other_versions"] == {"safetensors": "0.1.0 (needs " + _declared(
        ["safetensors"])[0][len("safetensors"):] + ")"}


def test_requirements_are_pyprojects_and_parse_as_packaging_does():
    from packaging.requirements import Requirement

    declared = tomllib.load(open(os.path.join(REPO, "pyproject.toml"), "rb"))["project"]["dependencies"]
    got = packages.requirements()
    assert [(r.name, set(r.specifier.split(","))) for r in got] == [
        (Requirement(d).name, set(str(Requirement(d).specifier).split(","))) for d in declared]
    # Metadata strings as importlib.metadata gives them: extras' requirements and markers that do not hold are
    # dropped exactly where packaging's own evaluation drops them.
    texts = ['jax<0.12,>=0.10.2', 'xprof<3,>=2.24; extra == "profile"', 'numpy>=2.1.0; python_version >= "3.99"',
             'array-record>=0.8.1; sys_platform != "win32"', 'safetensors[numpy] (>=0.8)', 'name_with.dots==1']
    for text in texts:
        req = Requirement(text)
        applies = req.marker is None or req.marker.evaluate({"extra": ""})
        mine = packages.parse(text)
        assert (mine is not None) == applies, text
        if mine is not None:
            assert (mine.name, Requirement(mine.text).specifier) == (req.name, req.specifier), text
    with pytest.raises(packages.ConfigError):
        packages.parse("<1.0")


def test_versions_and_module_names_come_from_the_installed_metadata():
    import numpy

    report = packages.check([packages.parse("numpy<1"), packages.parse("numpy>=1"),
                             packages.parse("no-such-distribution-anywhere>=1")])
    assert [r.name for r in report.missing] == ["no-such-distribution-anywhere"]
    assert [(r.specifier, v) for r, v in report.other_versions] == [("<1", numpy.__version__)]
    import importlib.metadata

    assert "yaml" in packages._distribution_modules(importlib.metadata.distribution("pyyaml"))
    constraints = packages.constraints()
    assert f"numpy=={numpy.__version__}" in constraints and len(constraints) == len(
        {c.split("==")[0].lower() for c in constraints})


# --- the container recipe -------------------------------------------------------------------------------------------

def _instructions():
    dockerfile_parse = pytest.importorskip("dockerfile_parse")
    parser = dockerfile_parse.DockerfileParser(path=DOCKERFILE)
    return parser, [(i["instruction"], i["value"]) for i in parser.structure if i["instruction"] != "COMMENT"]


def test_dockerfile_pins_the_base_by_digest_and_installs_the_project_itself():
    parser, steps = _instructions()
    known = {"ARG", "FROM", "COPY", "RUN", "WORKDIR", "ENV", "LABEL"}
    assert {kind for kind, _ in steps} <= known, steps
    # No ENTRYPOINT or CMD: the base image's entrypoint (NVIDIA's, which sets up CUDA forward compatibility and then
    # runs its arguments) stays, and launch/k8s/jaxtrain.yaml passes `args:` to it (tests/test_jobset.py).
    assert not {"ENTRYPOINT", "CMD"} & {kind for kind, _ in steps}
    (arg, base), (frm, image) = steps[:2]
    assert arg == "ARG" and frm == "FROM" and image == "${BASE}"
    default = base.partition("=")[2]
    assert re.fullmatch(r"ghcr\.io/nvidia/jax:jax-\d{4}-\d\d-\d\d@sha256:[0-9a-f]{64}", default), default
    assert parser.baseimage == default  # dockerfile-parse resolves the ARG the way docker does
    # The documented digest is the Dockerfile's (docs/gpu.md says where it comes from).
    assert default.split("@")[1] in open(os.path.join(REPO, "docs", "gpu.md")).read()
    (copy,) = [v for k, v in steps if k == "COPY"]
    source, target = copy.split()
    assert source == "."  # the repository root: pyproject.toml, from which pip reads the requirements
    run, kernels = [v for k, v in steps if k == "RUN"]
    commands = [shlex.split(c) for c in run.split("&&")]
    # The package list is pyproject.toml's, read by jaxtrain.cluster.packages in the copied checkout (the tests
    # above run the same command): no name of a requirement is listed by hand, so the image cannot drift from it.
    names = {packages._normalise(r.name) for r in packages.requirements()}
    assert not names & {packages._normalise(w) for c in commands for w in c}, run
    assert commands[0] == ["cd", target] and ["python", "-m", "jaxtrain.cluster.packages", "--install"] in commands
    install = commands.index(["python", "-m", "jaxtrain.cluster.packages", "--install"])
    (itself,) = [i for i, c in enumerate(commands) if c[:4] == ["python", "-m", "pip", "install"]]
    assert install < itself and "--no-deps" in commands[itself] and commands[itself][-1] == target
    # Then, from outside the checkout, the installed jaxtrain checks itself: missing packages or versions outside
    # pyproject's fail the build.
    assert commands[-2:] == [["cd", "/"], ["python", "-m", "jaxtrain.cluster.packages", "--strict"]]
    # Then the Triton-language kernels' packages, from the same checkout and by the same module (the gpu extra's
    # versions, none named here), the build going on with one line where pip cannot add them.
    steps = [" ".join(c.split()) for c in kernels.split("&&")]
    assert steps[0] == "cd /opt/jaxtrain" and "pip install" not in kernels
    assert re.fullmatch(r"\{ python -m jaxtrain\.cluster\.packages --install-kernels \|\| echo \"jaxtrain: jax-triton "
                        r"not added [^\"]*\"; \}", steps[-1]), steps[-1]
    ignore = open(DOCKERFILE + ".dockerignore").read().split()
    assert {".git", "runs", "gpu-wheels"} <= set(ignore) and "jaxtrain" not in ignore and "pyproject.toml" not in ignore


def test_the_efa_variant_extends_the_built_image_with_libfabric_and_the_nccl_plugin():
    """launch/container/Dockerfile.efa: on the jaxtrain image named at build time (no default), AWS's EFA installer
    in its NGC-container mode (installer 1.49.0 or later has it), a build that fails without an NCCL net plugin, and
    the libfabric variables the eks overlay sets, with the overlay's values."""
    import yaml

    dockerfile_parse = pytest.importorskip("dockerfile_parse")
    with open(DOCKERFILE + ".efa", "rb") as f:
        parser = dockerfile_parse.DockerfileParser(fileobj=f)
        steps = [(i["instruction"], i["value"]) for i in parser.structure if i["instruction"] != "COMMENT"]
    assert steps[:2] == [("ARG", "BASE"), ("FROM", "${BASE}")]
    (version,) = [v.partition("=")[2] for k, v in steps if k == "ARG" and v.startswith("EFA_INSTALLER_VERSION=")]
    assert tuple(map(int, version.split("."))) >= (1, 49, 0), version
    (run,) = [v for k, v in steps if k == "RUN"]
    commands = [" ".join(c.split()) for c in run.split("&&")]
    assert "./efa_installer.sh -y --enable-ngc" in commands[commands.index("cd aws-efa-installer") + 1:][:1]
    assert 'test -n "$plugin"' in commands and "/opt/amazon/efa/bin/fi_info --version" in commands
    (env,) = [v for k, v in steps if k == "ENV"]
    image_env = dict(item.split("=", 1) for item in env.split())
    overlay = yaml.safe_load(open(os.path.join(LAUNCH, "k8s", "overlays", "eks", "kustomization.yaml")))
    ops = yaml.safe_load(overlay["patches"][0]["patch"])
    pod_env = {op["value"]["name"]: op["value"]["value"] for op in ops if op["path"].endswith("/env/-")}
    assert set(image_env) == {"FI_PROVIDER", "FI_EFA_USE_DEVICE_RDMA"}
    assert image_env == {k: pod_env[k] for k in image_env}


# --- launch/slurm.sbatch under pyxis ---------------------------------------------------------------------------------

IMAGE = "registry.example.com#acme/jaxtrain@sha256:" + "0123456789abcdef" * 4
# What `ENV` may set in an image: NVIDIA's JAX images set XLA_FLAGS (until 2025 also CUDA_DEVICE_MAX_CONNECTIONS
# and NCCL_NVLS_ENABLE), other images may set NCCL_* variables; every kind is here, so each rule of the script is
# seen.
IMAGE_ENV = {"XLA_FLAGS": "--xla_gpu_enable_triton_gemm=false", "CUDA_DEVICE_MAX_CONNECTIONS": "16",
             "NCCL_DEBUG": "INFO", "NCCL_IB_HCA": "mlx5", "NCCL_HOME": "/usr/local/nccl",
             "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.75", "JAX_PLATFORMS": "cuda,cpu"}


def _env_file():
    out = {}
    for line in open(os.path.join(LAUNCH, "jaxtrain.env")):
        if re.match(r"[A-Za-z_][A-Za-z0-9_]*=", line):
            key, _, value = line.strip().partition("=")
            out[key] = value
    return out


def _sbatch_in_pyxis(tmp_path, extra_env, *args, python_rc=0):
    """launch/slurm.sbatch on this host with tests/slurm/pyxis_srun.sh as `srun` and stubs for scontrol, scancel
    and sbatch; $PYTHON is a stub that writes its environment to tmp_path/env-<step> and exits python_rc.
    Returns (process, srun argument lists, {step: environment inside the container})."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").symlink_to(PYXIS_SRUN)
    for name in ("scontrol", "scancel", "sbatch"):
        (bin_dir / name).write_text(f'#!/usr/bin/env bash\nprintf "{name} %s\\n" "$*" >> {tmp_path}/others\n')
        (bin_dir / name).chmod(0o755)
    python = tmp_path / "python"
    python.write_text('#!/usr/bin/env bash\nstep=$3; [ "$3" = jaxtrain ] && step=$4\n'
                      f'env -0 > {tmp_path}/env-$step\nexit {python_rc}\n')
    python.chmod(0o755)
    image_env = tmp_path / "image.env"
    image_env.write_text("".join(f"{k}={v}\n" for k, v in IMAGE_ENV.items()))
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "HOME": str(tmp_path), "SLURM_SUBMIT_DIR": REPO,
           "SLURM_JOB_ID": "7", "SLURM_JOB_NUM_NODES": "2", "JAXTRAIN_METRICS_PORT": "off", "PYTHON": str(python),
           "PYXIS_STUB_LOG": str(tmp_path / "srun-calls"), "PYXIS_STUB_IMAGE_ENV": str(image_env)} | extra_env
    proc = subprocess.run(["bash", os.path.join(LAUNCH, "slurm.sbatch"), *args], env=env, capture_output=True,
                          text=True, timeout=60, cwd=tmp_path)
    log = tmp_path / "srun-calls"
    calls = [shlex.split(line) for line in log.read_text().splitlines()] if log.exists() else []
    inside = {}
    for path in tmp_path.glob("env-*"):
        inside[path.name[4:]] = dict(item.split("=", 1) for item in path.read_text().split("\0") if "=" in item)
    return proc, calls, inside


def _options(call):
    return dict(a[2:].split("=", 1) if "=" in a else (a[2:], "") for a in call if a.startswith("--container"))


def test_every_step_gets_the_named_container_and_the_variables_jaxtrain_sets(tmp_path):
    user = {"XLA_FLAGS": "--xla_gpu_enable_command_buffer=", "NCCL_IB_HCA": "=mlx5_0,mlx5_1",
            "NCCL_HOME": "/host/modules/nccl", "JAXTRAIN_IMAGE": IMAGE}
    proc, calls, inside = _sbatch_in_pyxis(tmp_path, user, "train", "run.dir=/shared/r")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert len(calls) == 2 and set(inside) == {"check", "train"}, calls
    name = "jaxtrain-" + hashlib.sha256(IMAGE.encode()).hexdigest()[:16]
    for call in calls:
        opts = _options(call)
        assert opts["container-image"] == IMAGE and opts["container-name"] == name  # imported once per node
        assert opts["container-mounts"] == f"{REPO}:{REPO}" and opts["container-workdir"] == REPO
    file = _env_file()
    for step, env in inside.items():
        # The environment file's values, not the image's ones (which pyxis would otherwise keep).
        for key, value in file.items():
            if key != "XLA_FLAGS":
                assert env[key] == value, (step, key, env[key])
        # XLA flags layered: the image's, then the file's, then the user's (the last of repeated flags wins).
        assert env["XLA_FLAGS"] == f"{IMAGE_ENV['XLA_FLAGS']} {file['XLA_FLAGS']} {user['XLA_FLAGS']}", step
        assert env["NCCL_IB_HCA"] == user["NCCL_IB_HCA"]  # the user's own setting wins over the image's
        assert env["NCCL_HOME"] == IMAGE_ENV["NCCL_HOME"]  # a host module's install path is not the image's
        assert env["JAX_COMPILATION_CACHE_DIR"] == "/shared/r/jax-cache"
        assert "CUDA_VISIBLE_DEVICES" not in _options(calls[0])["container-env"].split(",")
    # The batch script itself never goes to sbatch with a container (it would then run in it, without srun).
    assert not (tmp_path / "others").exists()
    directives = [line for line in open(os.path.join(LAUNCH, "slurm.sbatch")) if line.startswith("#SBATCH")]
    assert directives and not any("container" in line for line in directives)


def test_the_no_build_path_installs_into_the_named_container_first(tmp_path):
    settings = {"JAXTRAIN_IMAGE": IMAGE, "JAXTRAIN_CONTAINER_INSTALL": "1"}
    (tmp_path / "ok").mkdir()
    proc, calls, inside = _sbatch_in_pyxis(tmp_path / "ok", settings, "train")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    install, kernels, check, train = calls
    for step, mode in ((install, "--install"), (kernels, "--install-kernels")):
        assert step[step.index(next(a for a in step if a.endswith("python"))):][1:] == \
            ["-u", "-m", "jaxtrain.cluster.packages", mode]
        assert "--ntasks-per-node=1" in step and "--ntasks=2" in step and "--container-writable" in step
    # the steps find what the installs added
    assert len({_options(c)["container-name"] for c in (install, kernels, check, train)}) == 1
    assert set(inside) == {"jaxtrain.cluster.packages", "check", "train"}
    # A failed install stops the job before any other step.
    (tmp_path / "fail").mkdir()
    proc, calls, _ = _sbatch_in_pyxis(tmp_path / "fail", settings, "train", python_rc=3)
    assert proc.returncode == 3 and len(calls) == 1 and "nothing else was run" in proc.stdout


@pytest.mark.parametrize("env, says", [
    ({"JAXTRAIN_IMAGE": IMAGE, "JAXTRAIN_CONTAINER_NAME": "a:exec"}, "JAXTRAIN_CONTAINER_NAME=a:exec must be"),
    ({"JAXTRAIN_IMAGE": IMAGE, "JAXTRAIN_CONTAINER_ENV": "WANDB_API_KEY,$(touch x)"}, "must be comma-separated"),
    ({"JAXTRAIN_IMAGE": IMAGE, "JAXTRAIN_CONTAINER_INSTALL": "yes"}, "JAXTRAIN_CONTAINER_INSTALL=yes must be 0 or 1"),
    ({"JAXTRAIN_CONTAINER_INSTALL": "1"}, "JAXTRAIN_CONTAINER_INSTALL=1 needs JAXTRAIN_IMAGE"),
])
def test_container_settings_are_checked_before_any_step(tmp_path, env, says):
    proc, calls, _ = _sbatch_in_pyxis(tmp_path, env, "train")
    assert proc.returncode == 2 and calls == [] and not (tmp_path / "x").exists(), proc.stderr
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()] and says in proc.stderr


def test_extra_names_reach_the_container_and_unset_ones_are_not_named(tmp_path):
    proc, calls, inside = _sbatch_in_pyxis(tmp_path, {"JAXTRAIN_IMAGE": IMAGE, "JAXTRAIN_CONTAINER_ENV":
                                                      "CUDA_MODULE_LOADING,NOT_SET_ANYWHERE",
                                                      "CUDA_MODULE_LOADING": "LAZY", "JAXTRAIN_CHECK": "0"}, "train")
    assert proc.returncode == 0, proc.stderr
    (call,) = calls
    names = _options(call)["container-env"].split(",")
    assert "CUDA_MODULE_LOADING" in names and "NOT_SET_ANYWHERE" not in names and names == sorted(set(names))
    assert inside["train"]["CUDA_MODULE_LOADING"] == "LAZY"
