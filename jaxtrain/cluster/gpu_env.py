"""The node's NVIDIA driver and the installed JAX CUDA plugin, and whether they go together (``python -m jaxtrain
env``), found without starting JAX or needing a GPU to import.

The driver's CUDA version comes from ``libcuda.so.1``'s ``cuDriverGetVersion`` (callable before ``cuInit``, so it
works where no GPU is visible) or, failing that, from ``nvidia-smi``; the driver's release (e.g. 550.54.14) from
``nvidia-smi``. The plugin is the installed ``jax-cuda12-plugin`` / ``jax-cuda13-plugin`` distribution.

A driver runs programs built for its own CUDA major version and older ones, not newer ones: the CUDA 13 plugin
(``jax[cuda13]``, jaxtrain's ``.[gpu-cuda13]``) needs a CUDA 13 driver, release 580 or later; the CUDA 12 plugin
(``jax[cuda12]``, ``.[gpu]``) needs release 525 or later (NVIDIA's minimum drivers per CUDA major version: CUDA 12
525.60.13, CUDA 13 580.65; within a major version, minor version compatibility applies).
"""

from __future__ import annotations

import ctypes
import importlib.metadata
import shutil
import subprocess
from dataclasses import dataclass

# CUDA major version -> (the oldest driver release that runs it, the jaxtrain extra that installs its plugin).
PLUGINS = {12: (525, "gpu"), 13: (580, "gpu-cuda13")}


@dataclass(frozen=True)
class Driver:
    """What the node's NVIDIA driver reports; all None where there is no driver."""

    cuda: tuple[int, int] | None  # the newest CUDA version the driver runs, e.g. (12, 4)
    release: str | None  # e.g. "550.54.14"
    source: str  # where it was read: "libcuda", "nvidia-smi", "libcuda + nvidia-smi", or why nothing was found


def _libcuda_version() -> tuple[int, int] | None:
    try:
        lib = ctypes.CDLL("libcuda.so.1")
        version = ctypes.c_int(0)
        if lib.cuDriverGetVersion(ctypes.byref(version)) != 0 or version.value <= 0:
            return None
    except (OSError, AttributeError):
        return None
    return version.value // 1000, (version.value % 1000) // 10


def _nvidia_smi() -> tuple[str | None, tuple[int, int] | None]:
    """(driver release, CUDA version) from nvidia-smi's header; (None, None) without it."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None, None
    try:
        out = subprocess.run([exe], capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.SubprocessError):
        return None, None
    release = cuda = None
    words = out.replace("|", " ").split()
    for i, word in enumerate(words[:-1]):
        if word == "Version:" and words[i - 1] == "Driver":
            release = words[i + 1]
        if word == "Version:" and words[i - 1] == "CUDA":
            major, _, minor = words[i + 1].partition(".")
            if major.isdigit() and minor.isdigit():
                cuda = (int(major), int(minor))
    return release, cuda


def find_driver() -> Driver:
    """The node's driver, from libcuda and nvidia-smi (either may be missing, e.g. in a container without the
    driver's tools mounted)."""
    cuda = _libcuda_version()
    release, smi_cuda = _nvidia_smi()
    if cuda is None and smi_cuda is None and release is None:
        return Driver(None, None, "no libcuda.so.1 and no nvidia-smi")
    sources = [name for name, found in (("libcuda", cuda), ("nvidia-smi", release or smi_cuda)) if found]
    return Driver(cuda or smi_cuda, release, " + ".join(sources))


def installed_plugins() -> dict[int, str]:
    """{CUDA major version: version} of the installed ``jax-cudaNN-plugin`` distributions."""
    found = {}
    for major in PLUGINS:
        try:
            found[major] = importlib.metadata.version(f"jax-cuda{major}-plugin")
        except importlib.metadata.PackageNotFoundError:
            pass
    return found


def _release_major(release: str | None) -> int | None:
    head = (release or "").split(".")[0]
    return int(head) if head.isdigit() else None


def _install_for(driver: Driver) -> str:
    """The extra to install for this driver: the newest CUDA major version it runs."""
    runnable = [major for major in PLUGINS if driver.cuda and driver.cuda[0] >= major]
    return f".[{PLUGINS[max(runnable)][1]}]" if runnable else ""


def _has(driver: Driver) -> str:
    cuda = f"CUDA {driver.cuda[0]}.{driver.cuda[1]}" if driver.cuda else "CUDA version unknown"
    release = _release_major(driver.release)
    return f"{release} ({cuda})" if release is not None else cuda


def verdict(driver: Driver, plugins: dict[int, str], jax_version: str | None) -> tuple[bool, str]:
    """(fits, one line) for this driver and these installed plugins ({CUDA major: version}) under ``jax_version``.

    Fits when no plugin is installed and there is no driver (a CPU node), or when exactly one plugin of jax's
    version is installed and the driver runs its CUDA major version."""
    if len(plugins) > 1:
        names = " and ".join(f"jax-cuda{m}-plugin {v}" for m, v in sorted(plugins.items()))
        keep = _install_for(driver) or f".[{PLUGINS[max(plugins)][1]}]"
        return False, (f"{names} are both installed and claim the same 'cuda' platform: keep one (pip uninstall "
                       f"the other, then pip install -e '{keep}')")
    if driver.cuda is None:
        if plugins:
            (major, version), = plugins.items()
            return False, (f"no NVIDIA driver on this node ({driver.source}): jax-cuda{major}-plugin {version} is "
                           "installed but JAX will find no GPU here")
        return True, f"no NVIDIA driver on this node ({driver.source}): JAX runs on CPU"
    if not plugins:
        return False, (f"this node has an NVIDIA driver {_has(driver)} but no JAX CUDA plugin: JAX runs on CPU; "
                       f"install {_install_for(driver) or 'a newer driver (>= 525) and then .[gpu]'}")
    (major, version), = plugins.items()
    need = PLUGINS[major][0]
    if driver.cuda[0] < major:
        fix = f"install {_install_for(driver)}" if _install_for(driver) else f"upgrade the driver to >= {need}"
        return False, (f"jax-cuda{major}-plugin {version} needs driver >= {need} (CUDA {major}), this node has "
                       f"{_has(driver)}: {fix}")
    if jax_version is not None and version != jax_version:
        return False, (f"jax-cuda{major}-plugin {version} does not match jax {jax_version} (jax's extras pin them "
                       f"equal): pip install -e '.[{PLUGINS[major][1]}]' again")
    return True, f"jax-cuda{major}-plugin {version} runs on this node's driver {_has(driver)}"


def report() -> dict:
    """The driver, the plugins, jax's version and the verdict, for ``python -m jaxtrain env`` (JSON-ready)."""
    try:
        jax_version: str | None = importlib.metadata.version("jax")
    except importlib.metadata.PackageNotFoundError:
        jax_version = None
    driver, plugins = find_driver(), installed_plugins()
    fits, line = verdict(driver, plugins, jax_version)
    return {
        "driver_release": driver.release,
        "driver_cuda": f"{driver.cuda[0]}.{driver.cuda[1]}" if driver.cuda else None,
        "driver_source": driver.source,
        "jax": jax_version,
        "cuda_plugins": {f"jax-cuda{m}-plugin": v for m, v in sorted(plugins.items())},
        "gpu_fits": fits,
        "gpu_verdict": line,
    }
