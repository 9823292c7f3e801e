"""Launch planning of the Triton-language flash kernels (``kernels.flash_triton``): per-kernel tiles, warps and
stages, constexprs, grids, the GQA split of dk/dv and the dk/dv passes. Pure Python: no Triton needed."""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from kernels.tiling import BlockSizes, Launch, choose_splits, segment_tile_ranges

LOG2E = math.log2(math.e)
SUPPORTED_HEAD_DIMS = (32, 64, 128, 256)  # tl.arange needs powers of two

@dataclasses.dataclass(frozen=True)
class CallConfig:
    """Static description of one attention call: shapes, per-kernel launches and the constexprs of every kernel."""

    batch: int
    seq: int
    heads: int
    kv_heads: int
    head_dim: int
    causal: bool
    sm_scale: float
    has_segments: bool
    dtype: str  # numpy dtype name of q/k/v
    fwd_launch: Launch
    dq_launch: Launch
    dkdv_launch: Launch
    splits: int  # dk/dv programs per GQA group

    def _common(self, launch: Launch) -> dict:
        bq, bk = launch.block_q, launch.block_k
        return dict(
            SEQ=self.seq, H=self.heads, KVH=self.kv_heads, HEAD_DIM=self.head_dim, BLOCK_Q=bq, BLOCK_K=bk,
            CAUSAL=self.causal, HAS_SEG=self.has_segments, EVEN=(self.seq % bq == 0 and self.seq % bk == 0),
            QK_SCALE=self.sm_scale * LOG2E, SM_SCALE=self.sm_scale,
            # float32 users get float32 matmuls; Triton's default for fp32 dots would be TF32.
            INPUT_PRECISION="ieee" if self.dtype == "float32" else "tf32",
        )

    def forward(self):
        """-> (grid, constexprs, launch) for ``_fwd_kernel``."""
        launch = self.fwd_launch
        return (_cdiv(self.seq, launch.block_q), self.batch * self.heads), self._common(launch), launch

    def dq(self):
        launch = self.dq_launch
        return (_cdiv(self.seq, launch.block_q), self.batch * self.heads), self._common(launch), launch

    def dkdv(self):
        """-> [(grid, constexprs, launch)], one launch computing dk and dv, or one for each (see dkdv_passes)."""
        launch = self.dkdv_launch
        grid = (_cdiv(self.seq, launch.block_k), self.batch * self.kv_heads * self.splits)
        meta = dict(self._common(launch), SPLITS=self.splits)
        if dkdv_passes(self.head_dim) == 1:
            return [(grid, dict(meta, WANT_DK=True, WANT_DV=True), launch)]
        return [(grid, dict(meta, WANT_DK=False, WANT_DV=True), launch),
                (grid, dict(meta, WANT_DK=True, WANT_DV=False), launch)]

    def tile_ranges(self, seg, kind: str):
        """Document-mask tile ranges for kernel ``kind`` (int32 [B, tiles, 2]), numpy or jax like ``seg``."""
        launch = getattr(self, f"{kind}_launch")
        xp = np if isinstance(seg, np.ndarray) else None
        if kind == "dkdv":
            return segment_tile_ranges(seg, launch.block_k, launch.block_q, xp=xp)
        return segment_tile_ranges(seg, launch.block_q, launch.block_k, xp=xp)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def dkdv_passes(head_dim: int) -> int:
    """2 at head_dim 256: dk and dv accumulators of a wgmma-sized kv tile ([64, 256] float32 each) do not fit the
    registers together (ptxas spills), so one launch computes dv and a second dk, recomputing S and P."""
    return 2 if head_dim >= 256 else 1


def call_config(q_shape, kv_heads: int, dtype, *, causal: bool, sm_scale: float | None, has_segments: bool,
                block_sizes: dict) -> CallConfig:
    """The static configuration of a call; raises ValueError on bad block sizes (names, values, dkdv_splits)."""
    b, s, h, d = q_shape
    sizes = BlockSizes.from_kwargs(block_sizes, "triton")
    launches = sizes.launches(dtype, d, s)
    group = h // kv_heads
    splits = sizes.splits(group, lambda: choose_splits(b, s, kv_heads, group, launches["dkdv"].block_k))
    scale = d**-0.5 if sm_scale is None else float(sm_scale)
    return CallConfig(batch=b, seq=s, heads=h, kv_heads=kv_heads, head_dim=d, causal=causal, sm_scale=scale,
                has_segments=has_segments, dtype=np.dtype(dtype).name, fwd_launch=launches["fwd"],
                dq_launch=launches["dq"], dkdv_launch=launches["dkdv"], splits=splits)
