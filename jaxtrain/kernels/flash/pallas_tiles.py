"""What every Pallas flash kernel does per tile (``jaxtrain.kernels.flash.pallas_forward`` and ``pallas_backward``):
which tiles its loops visit (causal bounds, unmasked tiles first, intersected with the document-mask tile ranges),
the mask inside a tile, the float32 dots, the launch order of the tiles, and the order of the optional leading
operands (traced shift, tile ranges, segment ids) as the kernels unpack them and the launches pass them."""

from __future__ import annotations

from collections.abc import Callable

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jaxtrain.kernels.flash.pallas_launch import CallConfig
from jaxtrain.kernels.flash.tiling import Launch, segment_tile_ranges


# precision=HIGHEST: float32 operands give an exact float32 dot (IEEE) in the Triton lowering instead of TF32;
# 16-bit operands are unaffected.
def dot_nt(a, b):
    """a [m, d] @ b[n, d]^T -> [m, n] in float32."""
    return lax.dot_general(a, b, (((1,), (1,)), ((), ())), precision=lax.Precision.HIGHEST,
                           preferred_element_type=jnp.float32)


def dot_nn(a, b):
    """a [m, n] @ b[n, d] -> [m, d] in float32."""
    return lax.dot_general(a, b, (((1,), (0,)), ((), ())), precision=lax.Precision.HIGHEST,
                           preferred_element_type=jnp.float32)


def is_zero(shift) -> bool:
    return isinstance(shift, int) and shift == 0


def plus(x, shift):
    """x + shift, adding nothing for a static zero shift (the no-offset call compiles as before offsets existed)."""
    return x if is_zero(shift) else x + shift


def tile_mask(q_pos, k_pos, q_seg, k_seg, *, causal: bool, seq_len: int | None, kv_major: bool = False,
              window: int | None = None):
    """Boolean mask of visible (query, key) pairs, [bq, bk] (or [bk, bq] with ``kv_major``); None when all visible.

    q_pos [bq] (shifted into key positions), k_pos [bk]: absolute positions; q_seg [bq] / k_seg [bk]: segment ids
    or None; seq_len: mask keys at or past it (sequence padding), or None when there is no padding; window: with
    ``causal``, also mask keys ``window`` or more positions before the query (q - window < k <= q).
    """
    if kv_major:  # rows are keys
        q_, k_ = (lambda x: x[None, :]), (lambda x: x[:, None])  # noqa: E731
    else:
        q_, k_ = (lambda x: x[:, None]), (lambda x: x[None, :])  # noqa: E731
    mask = None

    def _and(m, new):
        return new if m is None else jnp.logical_and(m, new)

    if causal:
        mask = _and(mask, q_(q_pos) >= k_(k_pos))
    if causal and window is not None:
        mask = _and(mask, q_(q_pos) - k_(k_pos) < window)
    if seq_len is not None:
        mask = _and(mask, k_(k_pos) < seq_len)
    if q_seg is not None:
        mask = _and(mask, q_(q_seg) == k_(k_seg))
    return mask


def clamp_ranges(ranges, bounds):
    """Intersect each (lo, hi, on_diagonal) with the document-mask tile range ``bounds`` (lo, hi) or None."""
    if bounds is None:
        return ranges
    lo, hi = bounds
    return [(jnp.maximum(a, lo), jnp.minimum(b, hi), diag) for a, b, diag in ranges]


def kv_ranges(q_block, block_q, block_k, num_k_blocks, causal, shift=0, more_queries=False, window=None):
    """[(lo, hi, on_diagonal)] kv-tile ranges a query tile must visit, unmasked first; tiles the causal mask hides
    wholly (past the tile's last query + shift) are not listed, so never loaded or computed. ``more_queries``: the
    padded queries outnumber the padded keys (the diagonal can pass the last key tile). ``window``: tiles wholly
    before the sliding window of the tile's first query are not listed either; those its lower edge crosses are
    masked ("on_diagonal")."""
    if not causal:
        return [(0, num_k_blocks, False)]
    first = plus(q_block * block_q, shift)  # the tile's first query, in key positions
    # Tile j is wholly visible when its last key <= first: (j+1)*bk - 1 <= first; visited while j*bk <= last query.
    if is_zero(shift):
        end = lax.div(first + block_q + block_k - 1, block_k)
        end = jnp.minimum(end, num_k_blocks) if more_queries else end
        full = jnp.minimum(lax.div(first + 1, block_k), end)
    else:  # lax.div truncates toward zero: clamp negative numerators (a tile before every key visits none)
        end = jnp.minimum(lax.div(jnp.maximum(first + block_q - 1, -1) + block_k, block_k), num_k_blocks)
        full = jnp.minimum(lax.div(jnp.maximum(first + 1, 0), block_k), end)
    if window is None:
        return [(0, full, False), (full, end, True)]
    # Query q sees keys from q - window + 1: the tile's first query from first - window + 1 (tiles wholly below are
    # skipped), its last from first + block_q - window (tiles from there up are in every row's window).
    lo = lax.div(jnp.maximum(first - window + 1, 0), block_k)
    edge = jnp.clip(lax.div(jnp.maximum(first + block_q - window, 0) + block_k - 1, block_k), lo, full)
    return [(edge, full, False), (lo, edge, True), (full, end, True)]


def q_ranges(k_block, block_q, block_k, num_q_blocks, causal, shift=0, window=None):
    """[(lo, hi, on_diagonal)] query-tile ranges that can see kv tile ``k_block``, unmasked first (the masked
    diagonal loop last: a loop of only-unmasked steps is what lets wgmma run without serialising); tiles wholly
    before it skipped, and with a sliding ``window`` those wholly past its upper edge too."""
    if not causal:
        return [(0, num_q_blocks, False)]
    # In query positions, the tile's keys span [first, last]. Query tile t sees some of them when its last row
    # (t+1)*bq - 1 >= first; all of them when its first row t*bq >= last.
    first = plus(k_block * block_k, 0 if is_zero(shift) else -shift)
    last = first + (block_k - 1)
    raw_first, raw_last = first, last
    if not is_zero(shift):  # lax.div truncates toward zero: negative numerators mean query tile 0
        first, last = jnp.maximum(first, 0), jnp.maximum(last, 0)
    start = lax.div(first, block_q)
    full = jnp.minimum(lax.div(last + block_q - 1, block_q), num_q_blocks)
    if window is None:
        return [(full, num_q_blocks, False), (start, full, True)]
    # Query q sees key k while q < k + window: every key of the tile up to raw_first + window - 1, some of them up
    # to raw_last + window - 1 (tile `stop` and later see none).
    reach = raw_last + window - 1
    stop = jnp.minimum(jnp.where(reach < 0, 0, lax.div(jnp.maximum(reach, 0), block_q) + 1), num_q_blocks)
    inside = jnp.clip(lax.div(jnp.maximum(raw_first + window, 0), block_q), full, stop)
    return [(full, inside, False), (start, jnp.minimum(full, stop), True), (inside, stop, True)]


def tile_index(cfg: CallConfig, i, num_tiles: int):
    """Grid index -> tile index: reversed under causal, so the tiles with the most work are launched first."""
    return num_tiles - 1 - i if cfg.causal else i


def ref_bounds(ref):
    return None if ref is None else (ref[0], ref[1])


def unpack_refs(refs, cfg: CallConfig):
    """Kernel refs -> (shift, bounds_ref, seg_q_ref, seg_k_ref, rest): the optional leading operands (the traced
    shift, then the document-mask tile ranges and the query / key segment ids) and the kernel's own."""
    refs = list(refs)
    shift = cfg.shift
    if shift is None:
        shift = refs.pop(0)[0]
    if cfg.has_segments:
        return (shift, *refs[:3], refs[3:])
    return shift, None, None, None, refs


def leading_operands(cfg: CallConfig, shift, seg_specs, seg_args: Callable[[], list]):
    """(in_specs, args) of the optional leading operands, in ``unpack_refs``'s order."""
    specs, args = [], []
    if cfg.shift is None:
        specs.append(pl.BlockSpec((1,), lambda *_: (0,)))
        args.append(shift)
    if cfg.has_segments:
        specs += seg_specs
        args += seg_args()  # a callable: the tile ranges are computed only for calls with segments
    return specs, args


def tile_ranges(seg_q, seg_k, launch: Launch, kv_major: bool):
    """Document-mask ranges for one kernel: [B, tiles, 2] in units of the tiles its loop walks."""
    if kv_major:
        return segment_tile_ranges(seg_k, launch.block_k, launch.block_q, col_ids=seg_q)
    return segment_tile_ranges(seg_q, launch.block_q, launch.block_k, col_ids=seg_k)
