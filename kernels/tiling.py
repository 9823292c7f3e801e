"""Tile and launch parameters shared by the Pallas and Triton kernels."""

from __future__ import annotations

import dataclasses

MIN_BLOCK = 16  # smallest tile the GPU matrix units (tl.dot) accept


def checked_block_sizes(cls, kwargs: dict, tiles: tuple[str, ...], impl: str):
    """``cls(**kwargs)`` after checking names and values; ValueError naming the first bad one.

    ``cls`` is a dataclass of tile sizes (the names in ``tiles``: powers of two >= MIN_BLOCK), ``num_warps`` and
    ``num_stages``.
    """
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(kwargs) - names)
    if unknown:
        raise ValueError(f"unknown block-size keyword(s) {unknown} for impl={impl!r}; accepted: {sorted(names)}")
    sizes = cls(**kwargs)
    for name in tiles:
        b = getattr(sizes, name)
        if not isinstance(b, int) or b < MIN_BLOCK or b & (b - 1):
            raise ValueError(f"{name}={b!r} must be a power of two >= {MIN_BLOCK} (Triton tiles are 2^n)")
    if sizes.num_warps is not None and sizes.num_warps not in (1, 2, 4, 8, 16):
        raise ValueError(f"num_warps={sizes.num_warps!r} must be one of 1, 2, 4, 8, 16")
    if not isinstance(sizes.num_stages, int) or sizes.num_stages < 1:
        raise ValueError(f"num_stages={sizes.num_stages!r} must be a positive int")
    return sizes
