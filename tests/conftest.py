"""Tests run on 8 emulated CPU devices; each test picks the first N it needs. Shared helpers live in helpers.py."""

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

import pytest  # noqa: E402

from helpers import FAST  # noqa: E402
from jaxtrain.config import load_config  # noqa: E402


@pytest.fixture
def make_config(tmp_path):
    def make(*overrides):
        return load_config(None, [f"run.dir={tmp_path / 'run'}", *FAST, *overrides])

    return make
