"""Expert parallelism: the MoE layers' experts laid out on the mesh (the parallel side of the model's experts).

:class:`MeshExperts` is the ``experts`` callable the layout builds the MoE model with
(:data:`jaxtrain.models.experts.ExpertsFn`). At trace time it reads the abstract mesh and the logical rules in force:
tokens split over the mesh axes of ``batch`` and ``act_seq``, experts over the axis of ``experts`` (the ``expert``
axis), each expert's hidden width over that of ``expert_mlp`` (``tensor``). Inside ``jax.shard_map`` over those axes
each device routes its own tokens (already routed by the model; the routing arrives with them) and then:

- expert axis 1: runs every expert on its own tokens (the weights' fsdp shards gathered by the partitioner);
- expert axis P > 1, ``all_to_all``: sorts its assignments by destination device and sends each device a chunk of
  ``C`` rows with one all-to-all, C the worst case (all its tokens chose that device's experts: T x min(k, E / P)
  rows, or fewer under a capacity), so nothing is ever dropped for lack of room; the receiving device groups the
  rows by its local experts, runs them, and a second all-to-all sends the results back. XLA:CPU cannot run
  ``ragged_all_to_all`` (docs/moe.md), so the exchange is padded on every platform;
- ``all_gather``: all-gathers the axis's tokens and routing (T x P rows), runs its local experts on the
  assignments that chose them, and reduce-scatters the weighted results back (float32). It sends fewer bytes when
  a token can choose several experts of one device (:func:`dispatch_bytes`);
- tensor > 1: every tensor rank holds the same tokens and a slice of each expert's hidden width; their partial
  outputs are summed over ``tensor`` once, after the combine.

The grouped matmuls run as ``model.moe.gemm`` says (:class:`jaxtrain.models.experts.GroupedMatmul`). The kernels
(pallas, triton) are custom calls GSPMD cannot partition, so with them the ``shard_map`` is over every mesh axis
(the axes that split neither tokens nor experts replicate; the weights' fsdp shards are gathered on entry), even
where nothing is split, as :class:`jaxtrain.parallel.attention.MeshAttention` does for the flash kernels.

The weights' gradients come from ``shard_map``'s transpose (summed over the token axes they are replicated on).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
from dataclasses import dataclass
from functools import partial
from typing import Literal

import jax
import jax.numpy as jnp
from flax.linen import partitioning as nn_partitioning
from jax.sharding import PartitionSpec

from jaxtrain.errors import ConfigError
from jaxtrain.models.experts import (
    XLA_GEMM,
    GroupedMatmul,
    combine,
    experts_on_tokens,
    grouped_swiglu,
    local_experts,
    sort_by_expert,
)
from jaxtrain.parallel.mesh import without_axes

Gemm = Literal["auto", "xla", "pallas", "triton"]  # config.tree.MoEConfig.gemm


def resolve_gemm(gemm: Gemm, platform: str) -> Gemm:
    """``model.moe.gemm`` for devices of ``platform`` (cpu, gpu, tpu): ``auto`` is pallas on GPUs, xla elsewhere;
    an explicit pallas runs interpreted on CPUs (slowly: for checking, as ``model.attention=pallas`` does). Raises
    ConfigError where the kernel cannot run: triton off a GPU or without jax-triton, a kernel on TPUs."""
    if gemm == "auto":
        return "pallas" if platform == "gpu" else "xla"
    if gemm == "triton" and platform == "gpu" and importlib.util.find_spec("jax_triton") is None:
        raise ConfigError("model.moe.gemm=triton needs the jax-triton package, which is not installed (pip install "
                          "jax-triton); or set model.moe.gemm=pallas or xla")
    if gemm == "triton" and platform != "gpu" or gemm == "pallas" and platform not in ("gpu", "cpu"):
        raise ConfigError(f"model.moe.gemm={gemm} does not run on {platform} devices: the triton kernel needs a CUDA "
                          "GPU, pallas a GPU (or a CPU, interpreted); set model.moe.gemm=xla or auto")
    return gemm


def chunk_rows(tokens: int, top_k: int, experts: int, ep: int, per_expert: int) -> int:
    """Rows one device sends another in the all-to-all: its assignments to that device's E / ep experts in the worst
    case, T x min(top_k, E / ep), and at most E / ep x ``per_expert`` (the most one expert takes of its tokens)."""
    local = experts // ep
    return min(tokens * min(top_k, local), local * per_expert)


def dispatch_bytes(kind: str, tokens: int, top_k: int, experts: int, ep: int, d_model: int, itemsize: int,
                   per_expert: int | None = None) -> float:
    """Bytes one device sends in one MoE layer's forward (the backward sends as many again): ``all_to_all``, the
    padded chunks out and the results back, 2 (ep - 1) C d_model; ``all_gather``, its tokens to the ep - 1 others and
    the float32 results' reduce-scatter, (ep - 1) T d_model (itemsize + 4). T: the device's tokens."""
    if ep == 1:
        return 0.0
    if kind == "all_to_all":
        c = chunk_rows(tokens, top_k, experts, ep, tokens if per_expert is None else per_expert)
        return 2.0 * (ep - 1) * c * d_model * itemsize
    return (ep - 1) * tokens * d_model * (itemsize + 4.0)


def choose_dispatch(kind: str, tokens: int, top_k: int, experts: int, ep: int, d_model: int, itemsize: int,
                    per_expert: int | None = None) -> str:
    """``model.moe.dispatch`` resolved: ``auto`` is the kind that sends fewer bytes (all_to_all on a tie)."""
    if kind != "auto":
        return kind
    sizes = {k: dispatch_bytes(k, tokens, top_k, experts, ep, d_model, itemsize, per_expert)
             for k in ("all_to_all", "all_gather")}
    return "all_to_all" if sizes["all_to_all"] <= sizes["all_gather"] else "all_gather"


def _a2a(x: jax.Array, axis: str) -> jax.Array:
    """[P, ...]: chunk p goes to device p; returns [P, ...] with chunk s from device s."""
    return jax.lax.all_to_all(x, axis, 0, 0, tiled=False)


def dispatch_all_to_all(x, experts, weights, w_gate, w_up, w_down, *, axis: str, num_experts: int, chunk: int,
                        gmm: GroupedMatmul = XLA_GEMM):
    """Padded all-to-all dispatch and combine on one device of the expert ``axis``: x [T, embed], experts int32 [T, K]
    (num_experts: dropped), weights float32 [T, K], this device's experts' weights [E / P, ...] -> [T, embed]."""
    t, k = experts.shape
    p = jax.lax.axis_size(axis)
    el = num_experts // p
    order, group_sizes = sort_by_expert(experts.reshape(-1), num_experts)
    dev_counts = group_sizes.reshape(p, el)  # [destination, its local expert]
    per_dev = dev_counts.sum(1)
    dev_start = jnp.cumsum(per_dev) - per_dev
    # Slot j of destination d's chunk holds sorted assignment dev_start[d] + j, if there is one.
    j = jnp.arange(chunk)
    src = jnp.clip(dev_start[:, None] + j[None, :], 0, t * k - 1)
    valid = j[None, :] < per_dev[:, None]
    send = jnp.where(valid[..., None], jnp.take(x, order[src] // k, axis=0), 0)
    recv = _a2a(send, axis)  # [P (source), chunk, embed]
    ys = _run_local(recv.reshape(p * chunk, -1), _a2a(dev_counts, axis), chunk, w_gate, w_up, w_down, gmm)
    back = _a2a(ys.reshape(p, chunk, -1), axis).reshape(p * chunk, -1)
    # The assignment at sorted place i went to slot dest * chunk + i - dev_start[dest]; dropped ones point nowhere.
    n = t * k
    dest = jnp.repeat(jnp.arange(p), per_dev, total_repeat_length=n)
    slot_sorted = jnp.where(jnp.arange(n) < per_dev.sum(), dest * chunk + jnp.arange(n) - dev_start[dest], 0)
    slot = jnp.take(slot_sorted, jnp.argsort(order), axis=0).reshape(t, k)
    ys = jnp.where((experts < num_experts)[..., None], jnp.take(back, slot, axis=0), 0)
    return combine(ys, weights)


def _run_local(rows, counts, chunk: int, w_gate, w_up, w_down, gmm: GroupedMatmul):
    """rows [P * chunk, embed]: P chunks, chunk s sorted by local expert with counts[s] [El] rows, padding after ->
    each row's expert output, in the rows' places (padding: 0)."""
    ends = jnp.cumsum(counts, axis=1)
    # The local expert of each row (El: padding): how many of its chunk's group ends lie at or before it.
    ids = jnp.sum(jnp.arange(chunk)[None, :, None] >= ends[:, None, :], axis=-1).reshape(-1)
    perm = jnp.argsort(ids, stable=True)
    ys = grouped_swiglu(jnp.take(rows, perm, axis=0), w_gate, w_up, w_down, counts.sum(0).astype(jnp.int32), gmm)
    return jnp.take(ys, jnp.argsort(perm), axis=0)


def dispatch_all_gather(x, experts, weights, w_gate, w_up, w_down, *, axis: str, num_experts: int, rows: int,
                        gmm: GroupedMatmul = XLA_GEMM):
    """All-gather dispatch, reduce-scatter combine on one device of the expert ``axis`` (arguments as
    :func:`dispatch_all_to_all`); ``rows``: the expert buffer, the most assignments this device's experts can get
    from the axis's P x T tokens."""
    t, k = experts.shape
    el = num_experts // jax.lax.axis_size(axis)
    me = jax.lax.axis_index(axis)
    xg = jax.lax.all_gather(x, axis, tiled=True)  # [P * T, embed]
    eg = jax.lax.all_gather(experts, axis, tiled=True).reshape(-1)
    wg = jax.lax.all_gather(weights, axis, tiled=True).reshape(-1)
    key = jnp.where(eg // el == me, eg % el, el)  # other devices' (and dropped) assignments sort last
    order = jnp.argsort(key, stable=True)[:rows]
    group_sizes = jnp.bincount(key, length=el + 1)[:el].astype(jnp.int32)
    ys = grouped_swiglu(jnp.take(xg, order // k, axis=0), w_gate, w_up, w_down, group_sizes, gmm)
    w = jnp.where(jnp.arange(rows) < group_sizes.sum(), jnp.take(wg, order), 0.0)
    out = jnp.zeros((xg.shape[0], x.shape[-1]), w.dtype).at[order // k].add(ys.astype(w.dtype) * w[:, None])
    return jax.lax.psum_scatter(out, axis, scatter_dimension=0, tiled=True).astype(x.dtype)


def _per_device(x, experts, weights, w_gate, w_up, w_down, history=None, *, ep_axis, sum_axes, slots, kind, gmm):
    """One device's share (inside shard_map): x [b, s, embed] its tokens -> [b, s, embed]; ``history``: the FP8
    histories [3, 3, H] of ``gmm``'s delayed recipe."""
    if gmm.fp8 != "none":
        gmm = dataclasses.replace(gmm, history=history)
    b, s, d = x.shape
    k = experts.shape[-1]
    xt, ids, w = x.reshape(b * s, d), experts.reshape(b * s, k), weights.reshape(b * s, k)
    ep = jax.lax.axis_size(ep_axis) if ep_axis else 1
    if ep == 1:
        y = experts_on_tokens(xt, ids, w, w_gate, w_up, w_down, gmm)
    else:
        num_experts = w_gate.shape[0] * ep
        per_expert = b * s if slots is None else min(b * s, b * slots)
        kind = choose_dispatch(kind, b * s, k, num_experts, ep, d, x.dtype.itemsize, per_expert)
        if kind == "all_to_all":
            chunk = chunk_rows(b * s, k, num_experts, ep, per_expert)
            y = dispatch_all_to_all(xt, ids, w, w_gate, w_up, w_down, axis=ep_axis, num_experts=num_experts,
                                    chunk=chunk, gmm=gmm)
        else:
            rows = chunk_rows(b * s * ep, k, num_experts, ep, per_expert * ep)
            y = dispatch_all_gather(xt, ids, w, w_gate, w_up, w_down, axis=ep_axis, num_experts=num_experts,
                                    rows=rows, gmm=gmm)
    for axis in sum_axes:  # partial sums of each expert's down projection over its hidden width's slices
        y = jax.lax.psum(y, axis)
    return y.reshape(b, s, d)


def _spec(logical: tuple[str | None, ...]) -> PartitionSpec:
    """The mesh axes of logical axes under the rules in scope."""
    spec = nn_partitioning.logical_to_mesh_axes(logical)
    assert spec is not None  # a tuple of logical names always maps to a spec
    return spec


def _names(spec: PartitionSpec) -> list[str]:
    return [a for entry in spec for a in (entry if isinstance(entry, tuple) else (entry,)) if a is not None]


@dataclass(frozen=True)
class MeshExperts:
    """The MoE layers' experts on the mesh in scope (``jax.set_mesh``) under the logical rules in scope: a drop-in
    for :func:`jaxtrain.models.experts.local_experts`. ``dispatch``: the resolved or ``auto``
    ``model.moe.dispatch``; ``gemm``: the resolved ``model.moe.gemm``; ``interpret``: the Pallas kernels in Pallas'
    interpreter (CPU)."""

    dispatch: str = "auto"
    gemm: str = "xla"
    interpret: bool = False

    def __call__(self, x, experts, weights, w_gate, w_up, w_down, slots: int | None = None, fp8: str = "none",
                 fp8_history: jax.Array | None = None) -> jax.Array:
        """:data:`jaxtrain.models.experts.ExpertsFn`; ``fp8``, ``fp8_history``: the experts' FP8 recipe and its
        histories [3, 3, H] (delayed), amaxes reduced over the mesh axes of the per-device region."""
        gmm = GroupedMatmul(self.gemm, self.interpret)
        local = partial(local_experts, x, experts, weights, w_gate, w_up, w_down, gmm=gmm, fp8=fp8,
                        fp8_history=fp8_history)
        mesh = jax.sharding.get_abstract_mesh()
        if mesh.empty:  # no mesh: the arrays are one device's
            return local()
        # Axes already manual (an enclosing shard_map: the pipeline's loop over stage and the batch axes) are this
        # device's already: the specs name only the others. The expert axis may be one of them: the pipeline keeps
        # the experts split over it (parallel/pipeline.py), so the arrays here are this device's experts and its
        # tokens, and the dispatch's collectives run over the enclosing shard_map's axis.
        outer_ep = [a for a in _names(PartitionSpec(_spec(("experts",))[0]))
                    if a in mesh.manual_axes and mesh.shape[a] > 1]
        tokens, w_in, w_out = (without_axes(_spec(axes), mesh.manual_axes)
                               for axes in (("batch", "act_seq"), ("experts", None, "expert_mlp"),
                                            ("experts", "expert_mlp", None)))
        sizes = dict(mesh.shape)
        split = {a for spec in (tokens, w_in) for a in _names(spec)} - set(mesh.manual_axes)
        # A kernel runs per device: every axis manual, as for the flash kernels (parallel/attention.py).
        manual = set(mesh.axis_names) - set(mesh.manual_axes) if gmm.kernel else split
        unsplit = not manual or math.prod(sizes[a] for a in split) == 1 and not gmm.kernel
        if unsplit and not outer_ep:
            return local()
        ep_axes, hidden_axes = outer_ep or _names(PartitionSpec(w_in[0])), _names(PartitionSpec(w_in[2]))
        if fp8 != "none":
            gmm = gmm.with_fp8(fp8, None, tuple(a for a in mesh.axis_names if a in manual), tuple(hidden_axes),
                               tuple(ep_axes))
        if len(ep_axes) > 1 or (ep_axes and not outer_ep and ep_axes[0] not in _names(tokens)):
            raise ValueError(f"the experts' rule names {ep_axes}: one mesh axis the tokens are also split over")
        x_spec = PartitionSpec(*tokens, None)
        body = partial(_per_device, ep_axis=ep_axes[0] if ep_axes else None, slots=slots, kind=self.dispatch,
                       sum_axes=tuple(hidden_axes), gmm=gmm)
        if unsplit:  # the expert axis manual already and nothing else split: this device's share, as it is
            return partial(body, sum_axes=())(x, experts, weights, w_gate, w_up, w_down, fp8_history)
        # pallas_call gives its outputs no varying-axes type, so the kernels' body cannot be type-checked (as with
        # the flash kernels'); the replicated weights' gradients are still summed over the token axes.
        args, specs = [x, experts, weights, w_gate, w_up, w_down], [x_spec, x_spec, x_spec, w_in, w_in, w_out]
        if fp8_history is not None:
            args.append(fp8_history)
            specs.append(PartitionSpec())
        # Inside the pipeline's loop (the expert axis manual there, without type checks) the arrays carry no
        # varying-axes types either, so this region is not checked (its transpose still sums over tensor).
        return jax.shard_map(body, mesh=mesh, in_specs=tuple(specs), out_specs=x_spec, axis_names=frozenset(manual),
                             check_vma=not gmm.kernel and not outer_ep)(*args)
