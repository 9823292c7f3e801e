"""Tile and launch parameters shared by the Pallas and Triton kernels, and the document-mask tile ranges."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

MIN_BLOCK = 16  # smallest tile the GPU matrix units (tl.dot) accept
KINDS = ("fwd", "dq", "dkdv")
SUPPORTED_HEAD_DIMS = (32, 64, 128, 256)  # a tile's head-dim extent must be a power of two (tl.arange, Triton)


@dataclasses.dataclass(frozen=True)
class Launch:
    """One kernel's launch: ``block_q`` rows of queries by ``block_k`` keys per step, warps and pipeline stages.

    For ``fwd`` and ``dq`` a program owns a query tile (block_q) and loops over key tiles (block_k); for ``dkdv`` a
    program owns a key tile (block_k) and loops over query tiles (block_q).
    """

    block_q: int
    block_k: int
    num_warps: int
    num_stages: int


# Defaults for an H100/H200 (sm_90a), per kernel, dtype width and head dim. Chosen with `python
# tools/compile_check.py`: the largest tiles and most stages that fit Hopper's 227 KiB of shared memory and compile
# without register spills (no GPU timing yet; see docs/kernels.md). 16-bit kernels run on wgmma;
# float32 ones are exact float32 FMA loops (no tensor cores), so they get small tiles: they are for checking, not
# for speed.
_DEFAULTS = {
    # (kind, 16-bit?, head_dim): (block_q, block_k, num_warps, num_stages)
    ("fwd", True, 32): (128, 64, 4, 3), ("fwd", True, 64): (128, 64, 4, 3),
    ("fwd", True, 128): (128, 64, 8, 3), ("fwd", True, 256): (64, 32, 8, 2),
    ("dq", True, 32): (128, 32, 4, 3), ("dq", True, 64): (128, 32, 4, 3),
    ("dq", True, 128): (128, 32, 8, 3), ("dq", True, 256): (64, 16, 8, 2),
    ("dkdv", True, 32): (32, 128, 8, 2), ("dkdv", True, 64): (32, 128, 8, 2),
    ("dkdv", True, 128): (16, 128, 8, 2), ("dkdv", True, 256): (16, 64, 8, 2),  # 256: dk and dv in two passes
    ("fwd", False, 32): (32, 32, 4, 2), ("fwd", False, 64): (32, 32, 4, 2),
    ("fwd", False, 128): (32, 32, 4, 2), ("fwd", False, 256): (16, 32, 4, 2),
    ("dq", False, 32): (32, 32, 4, 2), ("dq", False, 64): (32, 32, 4, 2),
    ("dq", False, 128): (32, 32, 4, 2), ("dq", False, 256): (16, 32, 4, 2),
    ("dkdv", False, 32): (32, 32, 4, 2), ("dkdv", False, 64): (32, 32, 4, 2),
    ("dkdv", False, 128): (16, 32, 4, 2), ("dkdv", False, 256): (16, 32, 4, 2),
}


def default_launch(kind: str, dtype, head_dim: int) -> Launch:
    """The default launch of kernel ``kind`` ("fwd", "dq", "dkdv") for q's dtype and head_dim."""
    sixteen_bit = np.dtype(dtype).itemsize == 2
    return Launch(*_DEFAULTS[(kind, sixteen_bit, head_dim)])


def clamp_tile(block: int, seq: int) -> int:
    """A tile no larger than the next power of two >= seq (a 40-token call needs no 128-row tile)."""
    return min(block, max(MIN_BLOCK, 1 << (max(seq, 1) - 1).bit_length()))


def dkdv_passes(head_dim: int) -> int:
    """2 at head_dim 256: dk and dv accumulators of a wgmma-sized kv tile ([64, 256] float32 each) do not fit the
    registers together (ptxas spills), so one kernel computes dv and a second dk, recomputing S and P."""
    return 2 if head_dim >= 256 else 1


TARGET_PROGRAMS = 2 * 132  # dk/dv programs wanted before splitting a GQA group: two waves of an H100/H200's SMs


def choose_splits(batch: int, seq: int, kv_heads: int, group: int, block_k: int) -> int:
    """Smallest divisor of ``group`` giving at least TARGET_PROGRAMS dk/dv programs (or ``group`` itself)."""
    programs = -(-seq // block_k) * batch * kv_heads
    for splits in range(1, group + 1):
        if group % splits == 0 and programs * splits >= TARGET_PROGRAMS:
            return splits
    return group


TILE_FIELDS = ("block_q", "block_k", "block_q_bwd", "block_k_bwd", "block_q_dq", "block_k_dq", "block_q_dkdv",
               "block_k_dkdv")
# Per kernel: the fields that set its (query tile, key tile), most specific first.
OVERRIDES = {
    "fwd": (("block_q",), ("block_k",)),
    "dq": (("block_q_dq", "block_q_bwd"), ("block_k_dq", "block_k_bwd")),
    "dkdv": (("block_q_dkdv", "block_q_bwd"), ("block_k_dkdv", "block_k_bwd")),
}


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Overrides of the per-kernel defaults, the same for both kernel families; None keeps the default. Tiles:
    powers of two >= MIN_BLOCK.

    block_q/block_k: forward (query x key tile); block_q_bwd/block_k_bwd: both backward kernels; block_*_dq and
    block_*_dkdv: one of them. num_warps / num_stages apply to all three kernels. dkdv_splits: programs per GQA
    group in dk/dv (None: as many as needed to fill the GPU; must divide heads // kv_heads).
    """

    block_q: int | None = None
    block_k: int | None = None
    block_q_bwd: int | None = None
    block_k_bwd: int | None = None
    block_q_dq: int | None = None
    block_k_dq: int | None = None
    block_q_dkdv: int | None = None
    block_k_dkdv: int | None = None
    num_warps: int | None = None
    num_stages: int | None = None
    dkdv_splits: int | None = None

    @classmethod
    def from_kwargs(cls, kwargs: dict, impl: str) -> BlockSizes:
        """``BlockSizes(**kwargs)`` after checking names and values; ValueError naming the first bad one."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise ValueError(f"unknown block-size keyword(s) {unknown} for impl={impl!r}; accepted: {sorted(names)}")
        sizes = cls(**kwargs)
        for name in TILE_FIELDS:
            b = getattr(sizes, name)
            if b is not None and (not isinstance(b, int) or b < MIN_BLOCK or b & (b - 1)):
                raise ValueError(f"{name}={b!r} must be a power of two >= {MIN_BLOCK} (Triton tiles are 2^n)")
        if sizes.num_warps is not None and sizes.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"num_warps={sizes.num_warps!r} must be one of 1, 2, 4, 8, 16")
        if sizes.num_stages is not None and (not isinstance(sizes.num_stages, int) or sizes.num_stages < 1):
            raise ValueError(f"num_stages={sizes.num_stages!r} must be a positive int")
        return sizes

    def launches(self, dtype, head_dim: int, seq: int, seq_k: int | None = None) -> dict:
        """{kind: Launch}: these overrides over the defaults, query tiles clamped to the query length ``seq`` and
        key tiles to the key length ``seq_k`` (None: ``seq``)."""
        seq_k = seq if seq_k is None else seq_k
        out = {}
        for kind in KINDS:
            base = default_launch(kind, dtype, head_dim)
            q_names, k_names = OVERRIDES[kind]
            bq = next((getattr(self, n) for n in q_names if getattr(self, n) is not None), base.block_q)
            bk = next((getattr(self, n) for n in k_names if getattr(self, n) is not None), base.block_k)
            out[kind] = Launch(clamp_tile(bq, seq), clamp_tile(bk, seq_k), self.num_warps or base.num_warps,
                               self.num_stages or base.num_stages)
        return out

    def splits(self, group: int, default: Callable[[], int]) -> int:
        """dk/dv programs per GQA group of ``group`` query heads: ``dkdv_splits``, else ``default()``."""
        if self.dkdv_splits is None:
            return default()
        if not isinstance(self.dkdv_splits, int) or self.dkdv_splits < 1 or group % self.dkdv_splits:
            raise ValueError(f"dkdv_splits={self.dkdv_splits!r} must be a positive divisor of heads // kv_heads = "
                             f"{group}")
        return self.dkdv_splits


# --------------------------------------------------------------------------------------------------------------
# Document masking: which tiles can hold a visible (query, key) pair
# --------------------------------------------------------------------------------------------------------------


def segment_tile_ranges(segment_ids, block_rows: int, block_cols: int, xp=None, col_ids=None):
    """For each row tile, the column tiles [lo, hi) that can share a segment id with it.

    segment_ids: int [batch, seq] of the rows; col_ids: int [batch, cols] of the columns (None: the same as the
    rows', self-attention; separate ones for a query block against another key block). Tile i covers positions
    [i*block_rows, (i+1)*block_rows); the last tile is completed with copies of the last id, which adds no id.
    Returns int32 [batch, row tiles, 2]: (lo, hi) in column-tile units. A column tile outside [lo, hi) has an id
    range [min, max] disjoint from the row tile's, so no pair in it has equal ids: skipping it is exact for any
    ids. Packed documents (ids non-decreasing along the sequence) make [lo, hi) exactly the overlapping tiles.
    ``xp``: jax.numpy (default) or numpy.
    """
    if xp is None:
        import jax.numpy as xp
    col_ids = segment_ids if col_ids is None else col_ids
    b, s = segment_ids.shape
    rows, cols = -(-s // block_rows), -(-col_ids.shape[1] // block_cols)

    def tile_min_max(ids, block, n):
        pad = n * block - ids.shape[1]
        seg = ids if pad == 0 else xp.pad(ids, ((0, 0), (0, pad)), mode="edge")
        seg = seg.reshape(b, n, block)
        return seg.min(-1), seg.max(-1)

    rmin, rmax = tile_min_max(segment_ids, block_rows, rows)
    cmin, cmax = tile_min_max(col_ids, block_cols, cols)
    overlap = (cmin[:, None, :] <= rmax[:, :, None]) & (cmax[:, None, :] >= rmin[:, :, None])  # [b, rows, cols]
    lo = xp.argmax(overlap, axis=-1)
    hi = cols - xp.argmax(overlap[..., ::-1], axis=-1)
    any_ = overlap.any(-1)  # false only with separate column ids: then [0, 0), no tile visited
    return xp.stack([xp.where(any_, lo, 0), xp.where(any_, hi, 0)], axis=-1).astype(xp.int32)


def tiles_computed(segment_ids, block_q: int, block_k: int, causal: bool) -> tuple[int, int, int]:
    """Forward-kernel tile counts for numpy segment ids [batch, seq]: (computed with document-mask skipping,
    computed without it, all tiles). Causal tiles wholly above the diagonal are never computed."""
    b, s = segment_ids.shape
    rows, cols = -(-s // block_q), -(-s // block_k)
    ranges = segment_tile_ranges(np.asarray(segment_ids), block_q, block_k, xp=np)
    i = np.arange(rows)[:, None]
    j = np.arange(cols)[None, :]
    visited = np.ones((rows, cols), bool)
    if causal:  # key tile j holds a key <= the tile's last query (i+1)*block_q - 1
        visited = j * block_k <= np.minimum((i + 1) * block_q, s) - 1
    with_skip = visited[None] & (j[None] >= ranges[..., :1]) & (j[None] < ranges[..., 1:])
    return int(with_skip.sum()), int(visited.sum()) * b, rows * cols * b
