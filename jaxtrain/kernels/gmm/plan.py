"""Launch planning of the grouped matmul kernels (``jaxtrain.kernels.gmm.api``): per-kernel tiles, warps,
stages and tile order, the geometry each kernel sees, and the group tables XLA computes for them. No kernel code.

Three kernels per differentiable call, named after the forward's dimensions (lhs [m, k], rhs [groups, k, n]):

  * ``fwd``:  out [m, n] = lhs [m, k] @ rhs[g(row)] [k, n]; output tile block_m x block_n, contraction block_k.
  * ``dlhs``: d_lhs [m, k] = d_out [m, n] @ rhs[g(row)]^T; output tile block_m x block_k, contraction block_n.
  * ``drhs``: d_rhs[g] [k, n] = lhs[rows of g]^T @ d_out[rows of g]; output tile block_k x block_n, contraction
    over the group's rows in chunks of block_m.

``fwd`` and ``dlhs`` are one kernel (``GmmGeometry``: rows x cols output, a contraction, W_g possibly stored
transposed); ``drhs`` is the transposed grouped matmul (``TgmmGeometry``).
"""

from __future__ import annotations

import dataclasses

import numpy as np

KINDS = ("fwd", "dlhs", "drhs")
FIELDS = ("block_m", "block_n", "block_k", "num_warps", "num_stages", "band")
MIN_BLOCK = 16  # smallest tile the GPU matrix units (tl.dot) take


@dataclasses.dataclass(frozen=True)
class Tiles:
    """One kernel's launch: tiles over the forward's m, n and k, warps, pipeline stages, and ``band``: programs walk
    the output tiles in bands of ``band`` tile rows (all the band's tile columns, then the next band), so programs
    running together share operand tiles in L2."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    band: int


# Defaults for an H100/H200 (sm_90a) per kernel, dtype width and impl. Chosen with `python tools/compile_check.py`:
# the largest output tiles that fit Hopper's 227 KiB of shared memory and compile without register spills (no GPU
# timing yet; see docs/kernels.md). The Triton-language kernels take 128 x 256 output tiles (d_lhs with a 32-wide
# contraction step: with 64 its masked path, on no tile multiple, spilled 204 B); Pallas' lowering of the same loop
# needs more registers and spills at 128 x 256 (255 registers, 152-580 B), so the Pallas kernels take 128 x 128
# with one more pipeline stage. 16-bit kernels run on wgmma; float32 ones are exact float32 FMA loops (no tensor
# cores), for checking, not speed.
_SIXTEEN_BIT = {
    "triton": {"fwd": Tiles(128, 256, 64, 8, 3, 8), "dlhs": Tiles(128, 32, 256, 8, 4, 8),
               "drhs": Tiles(64, 256, 128, 8, 3, 8)},
    "pallas": {"fwd": Tiles(128, 128, 64, 8, 4, 8), "dlhs": Tiles(128, 64, 128, 8, 4, 8),
               "drhs": Tiles(64, 128, 128, 8, 4, 8)},
}
_FLOAT32 = Tiles(32, 32, 32, 4, 2, 8)


def default_tiles(kind: str, dtype, impl: str = "pallas") -> Tiles:
    """The default launch of kernel ``kind`` ("fwd", "dlhs", "drhs") for the inputs' dtype and the impl."""
    if np.dtype(dtype).itemsize == 2:
        return _SIXTEEN_BIT[impl][kind]
    return _FLOAT32


def clamp_tile(block: int, size: int) -> int:
    """A tile no larger than the next power of two >= size (a 40-row call needs no 128-row tile)."""
    return min(block, max(MIN_BLOCK, 1 << (max(size, 1) - 1).bit_length()))


def parse_overrides(tiles: dict) -> dict[str, dict[str, int]]:
    """``**tiles`` of ``grouped_matmul`` -> {kind: {field: value}}. ``block_m=64`` sets every kernel's block_m,
    ``block_m_drhs=64`` one kernel's (the per-kernel name wins). ValueError on unknown names or bad values."""
    valid = set(FIELDS) | {f"{f}_{kind}" for f in FIELDS for kind in KINDS}
    unknown = sorted(set(tiles) - valid)
    if unknown:
        raise ValueError(f"unknown tile keyword(s) {unknown} for grouped_matmul; expected one of {list(FIELDS)}, "
                         f"optionally suffixed with _{'/_'.join(KINDS)}")
    for name, value in tiles.items():
        _check_value(name, next(f for f in FIELDS if name == f or name.startswith(f + "_")), value)
    generic = {name: int(value) for name, value in tiles.items() if name in FIELDS}
    out = {}
    for kind in KINDS:
        own = {name[: -len(kind) - 1]: int(value) for name, value in tiles.items() if name.endswith("_" + kind)}
        out[kind] = generic | own
    return out


def _check_value(name: str, field: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{name}={value!r} must be an int")
    if field.startswith("block_") and (value < MIN_BLOCK or value & (value - 1)):
        raise ValueError(f"{name}={value} must be a power of two >= {MIN_BLOCK}")
    if field == "num_warps" and value not in (1, 2, 4, 8, 16):
        raise ValueError(f"{name}={value} must be one of 1, 2, 4, 8, 16")
    if field in ("num_stages", "band") and value < 1:
        raise ValueError(f"{name}={value} must be >= 1")


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclasses.dataclass(frozen=True)
class GmmGeometry:
    """out [rows, cols] = a [rows, contract] @ W_g [contract, cols] for the row tiles' groups g; W is stored
    [groups, contract, cols], or [groups, cols, contract] with ``transpose_w``. Tiles: tm rows, tn cols, tc of the
    contraction."""

    rows: int
    cols: int
    contract: int
    groups: int
    tm: int
    tn: int
    tc: int
    band: int
    transpose_w: bool
    num_warps: int
    num_stages: int
    float32: bool  # exact float32 dots (no TF32)

    @property
    def tiles_m(self) -> int:
        return _cdiv(self.rows, self.tm)

    @property
    def tiles_n(self) -> int:
        return _cdiv(self.cols, self.tn)

    @property
    def even_c(self) -> bool:  # the contraction is a whole number of tiles: no mask along it
        return self.contract % self.tc == 0

    @property
    def even_n(self) -> bool:
        return self.cols % self.tn == 0

    @property
    def even_m(self) -> bool:
        return self.rows % self.tm == 0

    @property
    def programs(self) -> int:
        return self.tiles_m * self.tiles_n

    @property
    def even(self) -> bool:  # no load or store masked by the static shapes (rows still are, by group)
        return self.even_m and self.even_n and self.even_c

    @property
    def tiles(self) -> str:  # output rows x columns / contraction step
        return f"{self.tm}x{self.tn}/{self.tc}"


@dataclasses.dataclass(frozen=True)
class TgmmGeometry:
    """out [groups, p, q]: out[g] = a [rows of g, p]^T @ b [rows of g, q], the group's rows in chunks of tr; output
    tiles tp x tq. An empty group's block is zeros."""

    rows: int
    p: int
    q: int
    groups: int
    tr: int
    tp: int
    tq: int
    band: int
    num_warps: int
    num_stages: int
    float32: bool

    @property
    def tiles_p(self) -> int:
        return _cdiv(self.p, self.tp)

    @property
    def tiles_q(self) -> int:
        return _cdiv(self.q, self.tq)

    @property
    def even_p(self) -> bool:
        return self.p % self.tp == 0

    @property
    def even_q(self) -> bool:
        return self.q % self.tq == 0

    @property
    def programs(self) -> int:
        return self.groups * self.tiles_p * self.tiles_q

    @property
    def even(self) -> bool:
        return self.even_p and self.even_q

    @property
    def tiles(self) -> str:  # output rows x columns / contraction step (rows of the group)
        return f"{self.tp}x{self.tq}/{self.tr}"


@dataclasses.dataclass(frozen=True)
class Plan:
    """Everything static about one call; hashable (a jit static / custom_vjp nondiff argument)."""

    impl: str  # "pallas" or "triton"
    interpret: bool
    m: int
    k: int
    n: int
    groups: int
    dtype: str
    fwd: Tiles
    dlhs: Tiles
    drhs: Tiles

    @property
    def float32(self) -> bool:
        return self.dtype == "float32"

    def geometry(self, kind: str) -> GmmGeometry | TgmmGeometry:
        t = getattr(self, kind)
        common = dict(groups=self.groups, band=t.band, num_warps=t.num_warps, num_stages=t.num_stages,
                      float32=self.float32)
        if kind == "fwd":
            return GmmGeometry(rows=self.m, cols=self.n, contract=self.k, tm=clamp_tile(t.block_m, self.m),
                               tn=clamp_tile(t.block_n, self.n), tc=clamp_tile(t.block_k, self.k),
                               transpose_w=False, **common)
        if kind == "dlhs":
            return GmmGeometry(rows=self.m, cols=self.k, contract=self.n, tm=clamp_tile(t.block_m, self.m),
                               tn=clamp_tile(t.block_k, self.k), tc=clamp_tile(t.block_n, self.n),
                               transpose_w=True, **common)
        return TgmmGeometry(rows=self.m, p=self.k, q=self.n, tr=clamp_tile(t.block_m, self.m),
                            tp=clamp_tile(t.block_k, self.k), tq=clamp_tile(t.block_n, self.n), **common)


def make_plan(m: int, k: int, n: int, groups: int, dtype, *, impl: str, interpret: bool = False,
              tiles: dict | None = None) -> Plan:
    """The static plan of a call: default tiles per kernel and dtype width with the ``tiles`` overrides applied."""
    overrides = parse_overrides(tiles or {})
    launches = {kind: dataclasses.replace(default_tiles(kind, dtype, impl), **overrides[kind]) for kind in KINDS}
    return Plan(impl=impl, interpret=interpret, m=m, k=k, n=n, groups=groups, dtype=np.dtype(dtype).name,
                **launches)


# ----------------------------------------------------------------------------------------------------------------
# Group tables, computed by XLA (jax.numpy) or NumPy (``xp``) before the launches
# ----------------------------------------------------------------------------------------------------------------


def group_offsets(group_sizes, rows: int, xp=None):
    """int32 [groups + 1]: group g owns rows [offsets[g], offsets[g + 1]); clamped to ``rows`` (rows past the last
    offset belong to no group and give zeros). Negative sizes count as 0."""
    xp = xp or _jnp()
    ends = xp.minimum(xp.cumsum(xp.maximum(group_sizes.astype(xp.int32), 0)), rows).astype(xp.int32)
    return xp.concatenate([xp.zeros((1,), xp.int32), ends])


def row_tile_groups(offsets, rows: int, tm: int, xp=None):
    """int32 [row tiles, 2]: the groups [lo, hi) whose rows a row tile of ``tm`` rows may hold (a contiguous range:
    groups are sorted); empty groups inside the range are skipped by the kernels, a tile past every group's rows
    gets lo == hi."""
    xp = xp or _jnp()
    starts = xp.arange(0, rows, tm, dtype=xp.int32)[:, None]
    lo = xp.sum(offsets[None, 1:] <= starts, axis=1)  # groups that end at or before the tile's first row
    hi = xp.sum(offsets[None, :-1] < starts + tm, axis=1)  # groups that start before the tile's end
    return xp.stack([lo, hi], axis=1).astype(xp.int32)


def _jnp():
    import jax.numpy as jnp

    return jnp


def band_order(pid, tiles_m: int, tiles_n: int, band: int, minimum):
    """Program id -> (row tile, column tile), in bands of ``band`` row tiles: each band's tiles column by column.
    Written for traced integers; ``minimum`` is the framework's elementwise minimum."""
    per_band = band * tiles_n
    first = (pid // per_band) * band
    height = minimum(tiles_m - first, band)
    local = pid % per_band
    return first + local % height, local // height
