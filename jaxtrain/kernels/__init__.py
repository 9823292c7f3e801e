"""Kernels for jaxtrain: attention (the XLA reference and the flash kernels) and the grouped matmul of
mixture-of-experts layers, each in Pallas and in Triton (via jax-triton), one package per family: ``flash``
(attention), ``gmm`` (the grouped matmul), ``bench`` (their benchmarks).

``flash_attention(q, k, v, *, causal=True, segment_ids=None, kv_segment_ids=None, q_offset=0, kv_offset=0,
sm_scale=None, impl="pallas", interpret=False, **block_sizes)`` is the attention entry point (differentiable);
``flash_attention_fwd`` / ``flash_attention_bwd`` are its kernels for callers that merge key blocks (ring
attention); see ``jaxtrain.kernels.flash.api``. ``python -m jaxtrain.kernels.bench.flash`` times them against cuDNN
and XLA.

``grouped_matmul(lhs, rhs, group_sizes, *, impl="auto", interpret=False, **tiles)`` multiplies row blocks of lhs
(sorted by group) by their group's matrix, differentiably (``jax.lax.ragged_dot``'s contract); see
``jaxtrain.kernels.gmm.api``. ``python -m jaxtrain.kernels.bench.gmm`` times it against ragged_dot and a dense
one-hot einsum.

May import: nothing of jaxtrain outside ``jaxtrain.kernels`` (a leaf that other projects could vendor), benchmarks
included: the attention benchmark's document-mask report takes its segment ids from its caller
(``benchmarks/tile_skip.py`` reads the embedded corpus). Inside, ``flash`` imports no other family, ``gmm`` only
``flash``, and ``bench`` imports the kernels through this package.
"""

from jaxtrain.kernels.flash.api import flash_attention, flash_attention_bwd, flash_attention_fwd
from jaxtrain.kernels.flash.reference import mha_reference
from jaxtrain.kernels.gmm.api import grouped_matmul

__all__ = ["flash_attention", "flash_attention_bwd", "flash_attention_fwd", "grouped_matmul", "mha_reference"]
