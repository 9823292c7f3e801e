"""XLA:GPU's own reading of the train step, for GPUs that are not here (a CUDA jax plugin, no GPU).

``deviceless`` (finds the plugin, compiles each layout for a GPU topology in a child process and reads the result;
other modules import it as ``xla_gpu``), ``child`` (that process: ``python -m jaxtrain.planner.xla_gpu.child
REQUEST.json``), ``program`` (what the GPU program must hold: the attention kernel, no S x S scores on a flash path,
no float32 GEMM in 16-bit runs, the collectives; imported as ``gpu_program``), ``fp8_gemms`` (which GEMMs of a
compiled program multiply in float8).

May import: errors, config, parallel, train (the step, in the child process), ``planner.cost`` and
``planner.search``; never ``planner.auto``.
"""
