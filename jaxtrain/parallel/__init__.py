"""Parallelism: everything about splitting the work over devices, and the one place that knows the mesh.

- :mod:`.dims`: the device-free leaf: the :class:`~.dims.Axis` enum (the only definition of the mesh axes), mesh
  shapes (ici and dcn sizes, nodes) and every parallel fact derived from a config (batch axes, data-parallel size,
  stages, context, rows per microbatch and group) with the checks that shapes split evenly. No JAX.
- :mod:`.mesh`: the device mesh; :mod:`.layout`: a config on devices (rules, abstract sharded state, memory need).
- Parallelism applied to the model: :mod:`.attention` (ring, per-device kernels or XLA's partitioning),
  :mod:`.context` (ring attention over the context axis), :mod:`.expert` (an MoE model's experts over the expert
  axis), :mod:`.pipeline` and :mod:`.pipeline_1f1b` (the stage axis).

May import: errors, kernels, config, models and optim (``dims`` imports only errors).
"""
