"""Attention laid out on the mesh: the parallel side of the model's attention (the model calls it, never the mesh).

At trace time :class:`MeshAttention` reads the abstract mesh and the logical rules in force and picks:

- **ring attention** where the sequence is split over the context axis (``jaxtrain.parallel.context``: K/V passed
  round the ring, or all-gathered for a ring of 2), on the XLA reference's blocks or the flash kernels';
- the **flash kernels and cuDNN per device** under ``shard_map`` over every mesh axis (the flash kernels are custom
  calls XLA cannot partition; see :class:`MeshAttention` for cuDNN): batch and heads split over the mesh axes their
  logical names map to (the config refuses a sharded sequence for them);
- otherwise the model's own attention (:class:`jaxtrain.models.attention.Local`) on the global arrays, which XLA
  partitions like any other op (the XLA reference).
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
from flax.linen import partitioning as nn_partitioning

from jaxtrain.models.attention import Local
from jaxtrain.parallel import context
from jaxtrain.parallel.dims import Axis

# Logical axes of q, k/v and the segment ids [batch, seq, heads, head_dim] / [batch, seq] inside attention.
Q_AXES = ("batch", "act_seq", "act_heads", None)
KV_AXES = ("batch", "act_seq", "act_kv_heads", None)
SEGMENT_AXES = ("batch", "act_seq")


@dataclass(frozen=True)
class MeshAttention:
    """Causal self-attention of q [batch, seq, heads, head_dim], k and v [batch, seq, kv_heads, head_dim] on the
    mesh in scope (``jax.set_mesh``) under the logical rules in scope: a drop-in for the model's ``attention``.

    ``impl`` is the resolved ``model.attention``; ``interpret`` runs the flash kernels in Pallas' interpreter (CPU).

    cuDNN runs per device too, though jax gives it a custom partitioner: that partitioner runs only where some mesh
    axis is still automatic, and inside the pipelines' ``shard_map`` (manual over stage and the batch axes) it fails
    on the manual operands (jax 0.11: an AssertionError, or ``'GSPMDSharding' object has no attribute 'spec'``).
    With every axis manual, jax lowers the cuDNN call as it is, on each device's shards.
    """

    impl: str
    interpret: bool = False
    window: int | None = None  # model.sliding_window (xla, cudnn, pallas; ring attention with xla or pallas)

    def __call__(self, q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array | None) -> jax.Array:
        mesh = jax.sharding.get_abstract_mesh()
        ring = 1 if mesh.empty else dict(mesh.shape).get(Axis.CONTEXT, 1)
        if ring > 1:  # the sequence is split over the context axis, in the zigzag order (parallel/context.py)
            return self._ring(q, k, v, segment_ids, mesh, ring)
        local = Local(self.impl, self.interpret, self.window)
        if self.impl not in ("pallas", "triton", "cudnn") or mesh.empty:
            return local(q, k, v, segment_ids)
        q_spec, kv_spec, seg_spec = (nn_partitioning.logical_to_mesh_axes(a) for a in (Q_AXES, KV_AXES, SEGMENT_AXES))
        if segment_ids is None:
            return jax.shard_map(lambda q, k, v: local(q, k, v, None), mesh=mesh, in_specs=(q_spec, kv_spec, kv_spec),
                                 out_specs=q_spec, check_vma=False)(q, k, v)
        return jax.shard_map(local, mesh=mesh, in_specs=(q_spec, kv_spec, kv_spec, seg_spec), out_specs=q_spec,
                             check_vma=False)(q, k, v, segment_ids)

    def _ring(self, q, k, v, segment_ids, mesh, ring: int) -> jax.Array:
        if self.impl not in ("xla", "pallas", "triton"):
            raise ValueError(f"attention impl {self.impl!r} cannot run over a context axis; use xla, pallas or triton")
        blocks = context.XLA_BLOCKS if self.impl == "xla" else context.kernel_blocks(self.impl, self.interpret)
        specs = tuple(nn_partitioning.logical_to_mesh_axes(a) for a in (Q_AXES, KV_AXES, SEGMENT_AXES))
        return context.context_attention(q, k, v, segment_ids, mesh=mesh, specs=specs, n=ring, blocks=blocks,
                                         window=self.window)
