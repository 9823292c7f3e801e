"""tools/collective_dtypes.py on the hand-written XLA:GPU module of tests/golden (async collectives, a loop of known
trip count, a tuple all-reduce, an async-wrapped reduce-scatter): bytes per kind and dtype worked out by hand."""

import os

from jaxtrain_testing import REPO, load_tool


def _tool():
    return load_tool("collective_dtypes")


def test_bytes_by_dtype_of_the_handwritten_module():
    with open(os.path.join(REPO, "tests/golden/async-gpu.handwritten.hlo.txt")) as f:
        found = _tool().bytes_by_dtype(f.read(), 8)
    assert found == {
        ("all-gather", "f32"): 4 * 16 * 8 * 4,  # in the 4-trip loop: a 16-float shard gathered from 8 devices
        ("all-reduce", "f32"): 128 * 4 + (128 + 32) * 4,  # f32[128], then the tuple (f32[128], f32[32])
        ("reduce-scatter", "f32"): 2 * 256 * 4,  # the sugared start and the async-wrapped one, inputs f32[256]
        ("collective-permute", "f32"): 64 * 4,
    }
