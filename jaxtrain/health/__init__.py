"""The pre-flight health check (``python -m jaxtrain check``): matmuls on every device and collectives over every
mesh axis, timed and checked for values, against the hardware file of the exact GPU kind (:mod:`.check`); the
verdict over nodes, which hosts to exclude and why, as pure functions of the measurements (:mod:`.verdict`). What it
measured becomes the planner's calibration. Which network NCCL uses on each node (IB, EFA, sockets), read from
NCCL's INIT/NET debug lines, and why an InfiniBand or EFA node fell back to sockets (:mod:`.fabric`).

May import: errors, config, cluster, parallel (the mesh) and the planner's calibration format.
"""
