"""Attention kernels for jaxtrain: the XLA reference and the flash kernels (Pallas, Triton via jax-triton).

``flash_attention(q, k, v, *, causal=True, segment_ids=None, kv_segment_ids=None, q_offset=0, kv_offset=0,
sm_scale=None, impl="pallas", interpret=False, **block_sizes)`` is the public entry point (differentiable);
``flash_attention_fwd`` / ``flash_attention_bwd`` are its kernels for callers that merge key blocks (ring
attention); see ``jaxtrain.kernels.api``. ``python -m jaxtrain.kernels.bench`` times them against cuDNN and XLA.

May import: nothing of jaxtrain (a leaf that other projects could vendor), except the benchmark, which reads the
data package for real documents.
"""

from jaxtrain.kernels.api import flash_attention, flash_attention_bwd, flash_attention_fwd
from jaxtrain.kernels.reference import mha_reference

__all__ = ["flash_attention", "flash_attention_bwd", "flash_attention_fwd", "mha_reference"]
