"""Attention kernels for jaxtrain: the XLA reference and the flash kernels (Pallas, Triton via jax-triton).

``flash_attention(q, k, v, *, causal=True, segment_ids=None, sm_scale=None, impl="pallas", interpret=False,
**block_sizes)`` is the public entry point; see ``kernels.api``.
"""

from kernels.api import flash_attention
from kernels.reference import mha_reference

__all__ = ["flash_attention", "mha_reference"]
