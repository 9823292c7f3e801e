"""Model families, written against logical axes only: the Llama-style decoder (:mod:`.llama`), attention as one
device computes it and what rematerialisation may save of it (:mod:`.attention`), the mixture-of-experts decoder
(:mod:`.moe`: layer groups; :mod:`.routing`: top-k routing and its losses; :mod:`.experts`: grouped-matmul experts),
and FLOPs and parameter counts from a model config (:mod:`.flops`). Parallelism is applied to these models from
outside (``jaxtrain.parallel`` passes the mesh-aware attention and experts in); no module here names a mesh axis.

May import: config and the kernels; nothing of parallel, optim, train or the planner.
"""
