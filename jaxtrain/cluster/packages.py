"""The packages jaxtrain needs at run time, checked before a command imports any of them or starts JAX.

An environment that lacks some of them (NVIDIA's JAX images have no grain, tensorboardX or prometheus-client) would
otherwise pass the health check and die with an ImportError in ``train``, after the allocation was paid for; here
every missing package is named at once, in one line, before anything runs (exit status 2).

The list is jaxtrain's own requirements, never a second hand-written copy: the ``[project] dependencies`` of the
checkout's ``pyproject.toml`` when jaxtrain runs from a checkout (an editable install's metadata goes stale when the
file changes and nobody reinstalls), else the installed distribution's metadata (``importlib.metadata.requires``);
requirements of extras and those whose environment marker does not hold are left out. A requirement counts as
present when its module can be found (``importlib.util.find_spec``, which imports none of it): the module names come
from the distribution's own ``top_level.txt`` or file list when it is installed. Versions are not checked at start
(pip's business, and each one costs a metadata read); ``python -m jaxtrain env`` and this module's command name the
installed distributions outside the required versions, without refusing them: images ship development builds
(``0.11.0.dev2026...``) that may well work.

``python -m jaxtrain.cluster.packages`` reports (exit 2 when something is missing; with ``--strict`` also when a
version is outside the requirements); ``--missing`` prints the missing requirements, one per line;
``--install`` installs them with pip, constrained to the versions of everything already installed, so that an image's
own jax, CUDA plugin and numpy are never replaced (pip stops instead, naming the conflict). ``launch/slurm.sbatch``
runs it in the container for the no-build path (``JAXTRAIN_CONTAINER_INSTALL=1``, docs/gpu.md).

The policy for an image's versions (docs/gpu.md#containers): a requirement installed *within* jaxtrain's range is
kept, whatever the image's build (a development build of Flax included); one installed *outside* it, older or newer,
is replaced by ``--install`` with a version inside it, unless it belongs to the image's compiled stack
(:func:`protected`: jax, jaxlib, the CUDA plugins, NVIDIA's wheels, Transformer Engine, numpy), which is never
touched. The range is what jaxtrain is tested with; a pure-Python library such as Flax, Orbax or optax is cheap to
swap, a JAX built against the image's CUDA is not. So after ``--install`` only a protected package can still be
outside the range, and ``--strict`` refuses exactly that image (its JAX is not one jaxtrain runs on).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import os
import re
import sys
from dataclasses import dataclass

from jaxtrain.errors import ConfigError

# Module names of jaxtrain's requirements whose distribution name says otherwise, for when the distribution is not
# installed (then there is no metadata to read them from) but its modules may still be importable from a path.
IMPORT_NAMES = {"pyyaml": "yaml", "orbax-checkpoint": "orbax.checkpoint", "prometheus-client": "prometheus_client",
                "tensorboardx": "tensorboardX"}

# The image's compiled stack (by normalised distribution name): JAX and its plugins, NVIDIA's CUDA, cuDNN and NCCL
# wheels, Transformer Engine, and numpy, whose ABI the compiled packages were built against. --install never replaces
# them, whatever their version (:func:`install`).
PROTECTED = frozenset({"jax", "jaxlib", "numpy"})
PROTECTED_PREFIXES = ("jax-cuda", "jax-rocm", "nvidia-", "transformer-engine")

# The Triton-language kernels' packages (model.attention=triton, model.moe.gemm=triton), from the `gpu` extra.
KERNEL_PACKAGES = ("jax-triton", "triton")

# Commands that start no JAX and import none of the requirements: `env` is what one runs on a bare node to see
# what is wrong with it, so it reports missing packages instead of refusing to run.
COMMANDS_WITHOUT_CHECK = frozenset({"env"})


class MissingPackagesError(ConfigError):
    """Packages jaxtrain needs are not installed: exit status 2, one line naming every one of them."""


@dataclass(frozen=True)
class Requirement:
    """One requirement: ``name`` as written (``prometheus-client``), ``specifier`` (``<1,>=0.26``, may be empty) and
    ``text``, the form pip takes (``prometheus-client<1,>=0.26``)."""

    name: str
    specifier: str
    text: str


@dataclass(frozen=True)
class Report:
    """``missing``: requirements whose modules cannot be found; ``other_versions``: (requirement, installed version)
    for present distributions outside the required versions."""

    missing: tuple[Requirement, ...]
    other_versions: tuple[tuple[Requirement, str], ...]


def _normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def parse(text: str) -> Requirement | None:
    """A requirement string (PEP 508) -> Requirement, or None when its marker does not hold here (an extra's
    requirement, or one for another platform or Python). Read without importing ``packaging`` (25 ms) unless there
    is a marker to evaluate."""
    head, _, marker = text.partition(";")
    match = re.fullmatch(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(\[[^\]]*\])?\s*\(?([^()@]*)\)?\s*", head)
    if match is None:
        raise ConfigError(f"jaxtrain's requirement {text!r} cannot be read (PEP 508: name[extras] specifiers; marker)")
    name, extras, spec = match.group(1), "".join((match.group(2) or "").split()), "".join(match.group(3).split())
    if marker.strip() and not _marker_holds(marker.strip()):
        return None
    return Requirement(name, spec, name + extras + spec)


def _marker_holds(marker: str) -> bool:
    """An environment marker, evaluated with no extra selected (an extra's requirements never apply)."""
    try:
        from packaging.markers import Marker
    except ImportError:  # no packaging: the one marker jaxtrain's own requirements use is the extras'
        return "extra" not in marker
    return Marker(marker).evaluate({"extra": ""})


def _checkout_pyproject() -> str | None:
    """The pyproject.toml of the checkout this jaxtrain was imported from, if it is one."""
    import jaxtrain

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(jaxtrain.__file__))), "pyproject.toml")
    return path if os.path.isfile(path) else None


def requirement_texts() -> tuple[list[str], str]:
    """jaxtrain's requirement strings and where they came from (a pyproject.toml path, or ``installed metadata``).
    Empty when neither exists (a copy of the package without metadata): then nothing can be checked."""
    path = _checkout_pyproject()
    if path is not None:
        import tomllib

        with open(path, "rb") as f:
            project = tomllib.load(f).get("project", {})
        if project.get("name") == "jaxtrain":
            return list(project.get("dependencies", [])), path
    try:
        return list(importlib.metadata.requires("jaxtrain") or []), "installed metadata of jaxtrain"
    except importlib.metadata.PackageNotFoundError:
        return [], "nowhere (no pyproject.toml beside the package, no installed metadata)"


def requirements() -> list[Requirement]:
    """jaxtrain's run-time requirements that apply here (extras' requirements left out)."""
    texts, _ = requirement_texts()
    return [req for req in map(parse, texts) if req is not None]


def _findable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package that fails to import, or a module set to None
        return False


def _distribution_modules(dist: importlib.metadata.Distribution) -> list[str]:
    """The top-level modules a distribution installs: its ``top_level.txt``, else the first part of the paths in
    its file list (RECORD)."""
    listed = (dist.read_text("top_level.txt") or "").split()
    if listed:
        return listed
    names = set()
    for file in dist.files or []:
        top = file.parts[0]
        if len(file.parts) > 1 and not top.endswith((".dist-info", ".data", ".egg-info")) and top != "..":
            names.add(top)
        elif len(file.parts) == 1 and top.endswith(".py"):
            names.add(top[:-3])
    return sorted(names)


def _present(req: Requirement) -> bool:
    """Whether ``req``'s modules can be found: the usual module name first (no metadata read: 1 ms for all of
    jaxtrain's requirements), then the modules its installed distribution lists."""
    guess = IMPORT_NAMES.get(_normalise(req.name), _normalise(req.name).replace("-", "_"))
    if _findable(guess):
        return True
    try:
        dist = importlib.metadata.distribution(req.name)
    except importlib.metadata.PackageNotFoundError:
        return False
    return any(_findable(m) for m in _distribution_modules(dist) if m != guess)


def _version(req: Requirement) -> str | None:
    try:
        return importlib.metadata.version(req.name)
    except importlib.metadata.PackageNotFoundError:
        return None  # importable without metadata (a source tree on the path): version unknown


def check(reqs: list[Requirement] | None = None, versions: bool = True) -> Report:
    """Which of ``reqs`` (default: jaxtrain's) are missing, and (``versions``) which are installed in other
    versions than required."""
    reqs = requirements() if reqs is None else reqs
    missing = tuple(req for req in reqs if not _present(req))
    other = []
    for req in reqs if versions else []:
        version = None if req in missing or not req.specifier else _version(req)
        if version is not None and not _satisfies(version, req.specifier):
            other.append((req, version))
    return Report(missing, tuple(other))


def _satisfies(version: str, specifier: str) -> bool:
    try:
        from packaging.specifiers import SpecifierSet
        from packaging.version import InvalidVersion
    except ImportError:
        return True  # cannot tell without packaging; say nothing rather than something wrong
    try:
        return SpecifierSet(specifier).contains(version, prereleases=True)
    except InvalidVersion:
        return True


def missing_message(report: Report) -> str:
    """One line naming every missing requirement and how to install them."""
    names = ", ".join(r.name for r in report.missing)
    pip = " ".join(f"'{r.text}'" for r in report.missing)
    return (f"jaxtrain needs packages this Python ({sys.executable}) does not have: {names}. Install them with "
            f"`python -m jaxtrain.cluster.packages --install` (pip, keeping every installed version) or pip install "
            f"{pip}; NVIDIA's JAX images lack some of them: docs/gpu.md#containers")


def versions_message(report: Report) -> str:
    """One line naming the installed distributions outside jaxtrain's required versions."""
    items = ", ".join(f"{r.name} {version} (jaxtrain is tested with {r.specifier})"
                      for r, version in report.other_versions)
    return f"jaxtrain: warning: installed versions outside jaxtrain's requirements: {items}"


def require_runtime() -> None:
    """Raise MissingPackagesError naming every missing requirement. Versions are pip's business and not read here
    (each costs a metadata parse at every start); ``python -m jaxtrain env`` and this module's command report them."""
    report = check(versions=False)
    if report.missing:
        raise MissingPackagesError(missing_message(report))


def protected(name: str) -> bool:
    """Whether distribution ``name`` belongs to an image's compiled stack, which :func:`install` never replaces."""
    norm = _normalise(name)
    return norm in PROTECTED or norm.startswith(PROTECTED_PREFIXES)


def constraints(free: frozenset[str] = frozenset()) -> list[str]:
    """``name==version`` for every installed distribution (the first on the path where one is installed twice) but
    those named in ``free`` (normalised names, the ones being replaced): the constraints under which installing can
    add packages but never change another one."""
    seen, out = set(free), []
    for dist in importlib.metadata.distributions():
        name = dist.metadata["Name"]
        if name and _normalise(name) not in seen:
            seen.add(_normalise(name))
            out.append(f"{name}=={dist.version}")
    return sorted(out, key=str.lower)


def install(dry_run: bool = False) -> int:
    """pip-install the missing requirements, and those installed outside jaxtrain's range that are not
    :func:`protected` (in a version inside it), under :func:`constraints` for everything else; 0 when there is
    nothing to do. A protected package outside the range is left as it is, and said."""
    report = check()
    replace = [(r, v) for r, v in report.other_versions if not protected(r.name)]
    for r, v in report.other_versions:
        if protected(r.name):
            print(f"jaxtrain: {r.name} {v} is outside jaxtrain's range ({r.specifier}) and part of the image's "
                  "compiled stack: left as it is (`--strict` refuses it)")
    todo = [*report.missing, *(r for r, _ in replace)]
    if not todo:
        print("jaxtrain: every runtime package is installed" + (" (outside its range: the line above)"
                                                                if report.other_versions else ""))
        return 0
    said = [r.name for r in report.missing] + [f"{r.name} (replacing {v}, outside {r.specifier})" for r, v in replace]
    return _pip_install(todo, frozenset(_normalise(r.name) for r, _ in replace), said, dry_run)


def _pip_install(reqs: list[Requirement], free: frozenset[str], said: list[str], dry_run: bool) -> int:
    """pip-install ``reqs`` under :func:`constraints` for every installed distribution not in ``free``; pip's exit
    status. ``said``: what the log line calls them."""
    import subprocess
    import tempfile

    with tempfile.NamedTemporaryFile("w", suffix="-constraints.txt", delete=False) as f:
        f.write("\n".join(constraints(free)) + "\n")
    # The same interpreter as started: a Python run with -S (no site-packages processing) installs into its path.
    cmd = [sys.executable, *(["-S"] if sys.flags.no_site else []), "-m", "pip", "install", "--no-cache-dir",
           "--constraint", f.name, *(["--dry-run"] if dry_run else []), *(r.text for r in reqs)]
    print("jaxtrain: installing " + ", ".join(said) + " (other installed versions kept): " + " ".join(cmd),
          flush=True)
    try:
        return subprocess.call(cmd)
    finally:
        os.unlink(f.name)


def extra_texts(extra: str) -> list[str]:
    """The requirement strings of jaxtrain's optional ``extra`` (``gpu``), from the checkout's pyproject.toml, else
    the installed metadata (their ``extra == "..."`` marker removed)."""
    path = _checkout_pyproject()
    if path is not None:
        import tomllib

        with open(path, "rb") as f:
            project = tomllib.load(f).get("project", {})
        if project.get("name") == "jaxtrain":
            return list(project.get("optional-dependencies", {}).get(extra, []))
    try:
        texts = importlib.metadata.requires("jaxtrain") or []
    except importlib.metadata.PackageNotFoundError:
        return []
    marker = re.compile(rf"""extra\s*==\s*["']{re.escape(extra)}["']""")
    return [t.partition(";")[0].strip() for t in texts if marker.search(t.partition(";")[2])]


def kernel_requirements() -> list[Requirement]:
    """What ``model.attention=triton`` and ``model.moe.gemm=triton`` need beyond the runtime: the ``gpu`` extra's
    :data:`KERNEL_PACKAGES` with its versions (the extra's jax[cudaNN] is the image's business, never installed)."""
    reqs = [parse(t) for t in extra_texts("gpu")]
    return [r for r in reqs if r is not None and _normalise(r.name) in KERNEL_PACKAGES]


def install_kernels(dry_run: bool = False) -> int:
    """pip-install the missing :func:`kernel_requirements` with every installed version kept (the image's jax
    included); 0 when both are importable already. Where pip cannot (the image's triton outside the range, say),
    its exit status, and the run-time check says the kernels are missing."""
    todo = [r for r in kernel_requirements() if not _present(r)]
    if not todo:
        print("jaxtrain: " + " and ".join(KERNEL_PACKAGES) + " are installed")
        return 0
    return _pip_install(todo, frozenset(), [r.name for r in todo], dry_run)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m jaxtrain.cluster.packages", description=__doc__.split("\n\n")[0])
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--missing", action="store_true", help="print the missing requirements, one per line")
    mode.add_argument("--install", action="store_true", help="pip-install the missing ones, and replace those outside "
                                                               "jaxtrain's range but the image's compiled stack")
    mode.add_argument("--install-kernels", action="store_true",
                      help="pip-install jax-triton and triton (the gpu extra's versions) for the Triton-language "
                           "kernels, keeping every installed version")
    p.add_argument("--dry-run", action="store_true", help="with --install or --install-kernels: pip's --dry-run")
    p.add_argument("--strict", action="store_true", help="exit 2 on installed versions outside the requirements too")
    args = p.parse_args(argv)
    if args.install:
        return install(args.dry_run)
    if args.install_kernels:
        return install_kernels(args.dry_run)
    report = check()
    if args.missing:
        print("\n".join(r.text for r in report.missing))
        return 0
    _, source = requirement_texts()
    print(f"jaxtrain's requirements ({source}): {len(requirements())} apply here, {len(report.missing)} missing")
    if report.missing:
        print(missing_message(report))
    if report.other_versions:
        print(versions_message(report))
    return 2 if report.missing or (args.strict and report.other_versions) else 0


if __name__ == "__main__":
    raise SystemExit(main())
