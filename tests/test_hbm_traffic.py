"""tools/hbm_traffic.py on a hand-written HLO module (tests/golden/hbm-traffic.handwritten.hlo.txt): a scanned loop
(trip count 4) whose body slices its input out of the stacked buffer, takes its amax, casts it to float8, multiplies
it by a float8 weight and writes the result into the stacked output; every kernel's class and bytes by hand."""

import os

from jaxtrain_testing import REPO, load_tool


def _tool():
    return load_tool("hbm_traffic")


def test_each_kernel_class_and_bytes_by_hand():
    with open(os.path.join(REPO, "tests/golden/hbm-traffic.handwritten.hlo.txt")) as f:
        got = _tool().traffic(f.read())
    # Per iteration, x 4: the slice reads its 1 x 8 x 16 bf16 slice (256 B, not the 1,024 B buffer) and the index
    # (4 B), writes 256 B; the update writes only its 8 x 32 bf16 (512 B), reading the update and the index (the
    # buffer it writes into is not read); the amax reads 256 B and writes a float32; the cast reads 256 + 4 B and
    # writes 8 x 16 float8 (128 B); the GEMM reads 128 B + the 16 x 32 float8 weight (512 B) and writes 512 B; the
    # induction variable's add reads 8 B and writes 4 B.
    want = {"slices": (8, 4 * (260 + 516), 4 * (256 + 512)), "amax": (4, 4 * 256, 4 * 4),
            "f8 cast": (4, 4 * 260, 4 * 128), "gemm f8": (4, 4 * 640, 4 * 512), "other": (4, 4 * 8, 4 * 4)}
    for cls, figures in got.items():
        kernels, read, written = want.get(cls, (0, 0, 0))
        found = (figures["kernels"], round(figures["read_gb"] * 1e9), round(figures["written_gb"] * 1e9))
        assert found == (kernels, read, written), cls
