"""Model families, written against logical axes only: the Llama-style decoder (:mod:`.llama`), attention as one
device computes it and what rematerialisation may save of it (:mod:`.attention`), and FLOPs and parameter counts
from a model config (:mod:`.flops`). Parallelism is applied to these models from outside (``jaxtrain.parallel``
passes the mesh-aware attention in); no module here names a mesh axis.

May import: config and the kernels; nothing of parallel, optim, train or the planner.
"""
