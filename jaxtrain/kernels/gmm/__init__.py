"""The grouped matmul of mixture-of-experts layers (``jax.lax.ragged_dot``'s contract), in Pallas and in Triton.

``api`` (``grouped_matmul``: dispatch, the custom VJP, the ``ragged_dot`` reference; imported as ``gmm_api``),
``plan`` (per-kernel tiles, the geometry each kernel sees, the group tables: no kernel code), ``pallas`` (the
``gmm`` and ``tgmm`` kernels), ``triton`` (their launch in the Triton language), ``triton_kernels`` (the Triton
kernel bodies).

May import: ``jaxtrain.kernels.flash`` (the Triton availability check both kernels share), nothing else of
jaxtrain.
"""
