"""Benchmarks of the kernels, sized for one GPU call each (``--smoke`` runs their code paths on CPU, interpreted).

``flash`` (``python -m jaxtrain.kernels.bench.flash``: flash attention against cuDNN, XLA and JAX's own Pallas op;
and ``tile_skip_report``, the causal tiles document masking computes over segment ids its caller reads:
``benchmarks/tile_skip.py``), ``gmm`` (``python -m jaxtrain.kernels.bench.gmm``: the grouped matmul against
``ragged_dot`` and a dense one-hot einsum).

May import: the kernels (``jaxtrain.kernels`` and its packages), nothing else of jaxtrain: a benchmark that needs
documents takes them from its caller.
"""
