"""Tests run on 8 emulated CPU devices; each test picks the first N it needs. Shared helpers: jaxtrain_testing.py."""

import atexit
import os
import shutil
import tempfile

import jax

jax.config.update("jax_num_cpu_devices", 8)
# runtime.compile_cache=auto keeps compiled programs under $XDG_CACHE_HOME/jaxtrain: here a directory of this
# session, so the suite starts as cold as on a fresh machine every time (its timings are CI's) and leaves no cache.
os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="jaxtrain-tests-")
atexit.register(shutil.rmtree, os.environ["XDG_CACHE_HOME"], True)
# Triton (the sm_90 compiles of the kernels' tests) caches under $TRITON_HOME/.triton, by default ~/.triton: unless
# the caller chose a place (TRITON_HOME or TRITON_CACHE_DIR), the same session directory, so the suite writes nothing
# into the home directory. Triton reads it when it compiles; child processes (run_cli, the interpreter's) inherit it.
if "TRITON_HOME" not in os.environ and "TRITON_CACHE_DIR" not in os.environ:
    os.environ["TRITON_HOME"] = os.environ["XDG_CACHE_HOME"]

import pytest  # noqa: E402

from jaxtrain.config import load_config  # noqa: E402
from jaxtrain_testing import FAST  # noqa: E402

# Slow tests of these files start, kill, freeze or time several processes (heartbeat and collective timeouts,
# stall bounds, a Slurm cluster on fixed ports): marked `serial`, they run one at a time after the others, which
# .ci/run spreads over 2 workers (`-m "slow and not serial" -n 2`, then `-m "slow and serial"`).
SERIAL_MODULES = {"test_checkpoint", "test_cpu_collectives", "test_data_multiprocess", "test_faults", "test_health",
                  "test_launch_interrupt", "test_listening", "test_local_checkpoint", "test_mp_faults",
                  "test_multihost", "test_observe", "test_pipeline_checkpoint", "test_prometheus",
                  "test_object_store", "test_slurm_two_nodes"}


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.get_closest_marker("slow") and item.module.__name__.rsplit(".", 1)[-1] in SERIAL_MODULES:
            item.add_marker(pytest.mark.serial)


@pytest.fixture
def make_config(tmp_path):
    def make(*overrides):
        return load_config(None, [f"run.dir={tmp_path / 'run'}", *FAST, *overrides])

    return make
