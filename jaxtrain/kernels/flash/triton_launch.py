"""Launch planning of the Triton-language flash kernels (``jaxtrain.kernels.flash.triton``): per-kernel tiles, warps and
stages, constexprs, grids, the GQA split of dk/dv and the dk/dv passes. Pure Python: no Triton needed."""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxtrain.kernels.flash.common import LOG2E
from jaxtrain.kernels.flash.tiling import BlockSizes, Launch, choose_splits, dkdv_passes, segment_tile_ranges


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
    seq_k: int | None = None  # key length (None: seq, self-attention)
    # q_offset - kv_offset (causal mask: query position + shift >= key position) when static; None: traced, read by
    # the kernels from the int32 [1] operand OFFS.
    shift: int | None = 0
    empty_rows: bool = False  # a query row may see no key: out 0, lse -inf (see jaxtrain.kernels.flash.common)
    out_dtype: str | None = None  # forward output (None: q's dtype)
    grad_dtype: str | None = None  # dq, dk, dv (None: the inputs' dtype)

    @property
    def kv_seq(self) -> int:
        return self.seq if self.seq_k is None else self.seq_k

    def _common(self, launch: Launch) -> dict:
        bq, bk = launch.block_q, launch.block_k
        return dict(
            SEQ=self.seq, SEQ_K=self.kv_seq, SHIFT=self.shift or 0, DYN_SHIFT=self.shift is None,
            EMPTY_ROWS=self.empty_rows, H=self.heads, KVH=self.kv_heads, HEAD_DIM=self.head_dim, BLOCK_Q=bq, BLOCK_K=bk,
            CAUSAL=self.causal, HAS_SEG=self.has_segments, EVEN=(self.seq % bq == 0 and self.kv_seq % bk == 0),
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
        grid = (_cdiv(self.kv_seq, launch.block_k), self.batch * self.kv_heads * self.splits)
        meta = dict(self._common(launch), SPLITS=self.splits)
        if dkdv_passes(self.head_dim) == 1:
            return [(grid, dict(meta, WANT_DK=True, WANT_DV=True), launch)]
        return [(grid, dict(meta, WANT_DK=False, WANT_DV=True), launch),
                (grid, dict(meta, WANT_DK=True, WANT_DV=False), launch)]

    def tile_ranges(self, seg, kind: str, seg_k=None):
        """Document-mask tile ranges for kernel ``kind`` (int32 [B, tiles, 2]), numpy or jax like ``seg``; seg [B, S]
        the queries' ids, seg_k [B, Sk] the keys' (None: seg)."""
        launch = getattr(self, f"{kind}_launch")
        xp = np if isinstance(seg, np.ndarray) else None
        seg_k = seg if seg_k is None else seg_k
        if kind == "dkdv":
            return segment_tile_ranges(seg_k, launch.block_k, launch.block_q, xp=xp, col_ids=seg)
        return segment_tile_ranges(seg, launch.block_q, launch.block_k, xp=xp, col_ids=seg_k)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def call_config(q_shape, kv_heads: int, dtype, *, causal: bool, sm_scale: float | None, has_segments: bool,
                block_sizes: dict, seq_k: int | None = None, shift: int | None = 0, empty_rows: bool = False,
                out_dtype=None, grad_dtype=None) -> CallConfig:
    """The static configuration of a call; raises ValueError on bad block sizes (names, values, dkdv_splits).
    q_shape [batch, seq, heads, head_dim]; seq_k: the key length (None: seq)."""
    b, s, h, d = q_shape
    sk = s if seq_k is None else seq_k
    sizes = BlockSizes.from_kwargs(block_sizes, "triton")
    launches = sizes.launches(dtype, d, s, sk)
    group = h // kv_heads
    splits = sizes.splits(group, lambda: choose_splits(b, sk, kv_heads, group, launches["dkdv"].block_k))
    name = (lambda t: None if t is None else np.dtype(t).name)  # noqa: E731
    scale = d**-0.5 if sm_scale is None else float(sm_scale)
    return CallConfig(batch=b, seq=s, heads=h, kv_heads=kv_heads, head_dim=d, causal=causal, sm_scale=scale,
                has_segments=has_segments, dtype=np.dtype(dtype).name, fwd_launch=launches["fwd"],
                dq_launch=launches["dq"], dkdv_launch=launches["dkdv"], splits=splits,
                seq_k=None if sk == s else sk, shift=shift if causal else 0, empty_rows=empty_rows,
                out_dtype=name(out_dtype), grad_dtype=name(grad_dtype))
