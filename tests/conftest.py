"""Tests run on 8 emulated CPU devices; each test picks the first N it needs. Shared helpers live in helpers.py."""

import jax

jax.config.update("jax_num_cpu_devices", 8)

import pytest  # noqa: E402

from helpers import FAST  # noqa: E402
from jaxtrain.config import load_config  # noqa: E402


@pytest.fixture
def make_config(tmp_path):
    def make(*overrides):
        return load_config(None, [f"run.dir={tmp_path / 'run'}", *FAST, *overrides])

    return make
