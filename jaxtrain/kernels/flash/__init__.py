"""Flash attention: the Pallas and Triton (jax-triton) kernels, their entry point, and attention in plain XLA ops.

``api`` (``flash_attention``, ``flash_attention_fwd`` / ``flash_attention_bwd``: validation and dispatch),
``reference`` (attention in XLA ops: the ``model.attention=xla`` path and the tests' oracle), ``tiling`` (tiles and
launch parameters of both implementations, the document-mask tile ranges), ``common`` (what both implementations
share on the JAX side). Pallas: ``pallas`` (forward, backward and ``jax.custom_vjp``), ``pallas_forward`` and
``pallas_backward`` (the kernels), ``pallas_tiles`` (what each kernel does per tile), ``pallas_launch`` (launch
planning). Triton: ``triton`` (the launch sequence tied to JAX), ``triton_kernels`` (the kernel bodies),
``triton_launch`` (launch planning, pure Python). Modules of other packages import ``pallas`` as ``flash_pallas``
and ``triton`` as ``flash_triton``.

May import: nothing of jaxtrain outside this package (the grouped matmul and the benchmarks import it, never the
other way round).
"""
