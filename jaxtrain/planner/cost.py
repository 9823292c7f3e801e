"""The cost model: bytes each device sends per link class, and the time of each part of a step.

A collective's replica groups are logical device ids; :meth:`MeshShape.coordinates` says which node each sits on
(the layout ``build_mesh`` gives the devices), hence which bytes stay within a node (NVLink) and which cross the
network. The step time is model FLOPs over (peak x efficiency), each link class's bytes over its rate, and the
memory-bound optimizer update.

With pipeline stages (mesh axis ``stage`` > 1) the step runs ``M * V + S - 1`` iterations (M microbatches, V virtual
stages, S stages) of which each stage works in ``M * V``: the compute time is divided by (1 - bubble fraction),
bubble ``(S - 1) / (M * V + S - 1)`` (``jaxtrain.pipeline``). The 1F1B schedule (``train.pipeline_schedule=1f1b``)
has the same bubble (its stages skip the half of an iteration they have no work for) and recomputes each pass's
forward in its backward: one more forward, a third of the model FLOPs (:func:`pipeline_recompute`). The pipeline's
own traffic (the ring's collective permutes, once per iteration in the forward and the backward loop, the weight
exchange of interleaving, the all-to-all that hands out the outputs) is read from the HLO like every other
collective.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from jaxtrain.config import MESH_AXES, Config
from jaxtrain.hardware import Hardware
from jaxtrain.mesh import MeshShape
from jaxtrain.model import attention_flops_per_token, train_flops_per_token
from jaxtrain.pipeline import bubble_fraction
from jaxtrain.planner.collectives import Collective


def group_span(shape: MeshShape, groups: np.ndarray) -> tuple[int, int, list[str]]:
    """(a, b, axes): a group's devices per node (a) and nodes (b), and the mesh axes it runs over, e.g.
    ``["fsdp", "data(dcn)"]``. ``groups``: [groups, size] logical device ids."""
    if groups.size == 0:
        return 1, 1, []
    sub = shape.coordinates(groups)  # [groups, size, 2 * axes]: (dcn, ici) per axis
    varies = (sub != sub[:, :1]).any(axis=(0, 1))
    names = []
    for k, ax in enumerate(MESH_AXES):
        dcn, ici = varies[2 * k], varies[2 * k + 1]
        if ici and dcn:
            names.append(f"{ax}(ici+dcn)")
        elif dcn:
            names.append(f"{ax}(dcn)")
        elif ici:
            names.append(ax)
    nodes = shape.node_of(groups)  # [groups, size]
    b = max(len(set(row.tolist())) for row in nodes)
    return groups.shape[1] // b, b, names


def link_bytes(kind: str, size: float, a: int, b: int, crosses: bool) -> tuple[float, float]:
    """(intra-node, inter-node) bytes one device sends for one collective of ``size`` bytes over a group of ``a``
    devices per node x ``b`` nodes, done hierarchically as NCCL's rings do (within nodes first, then across):

    - all-gather / reduce-scatter: size (a-1)/a within, (size/a) (b-1)/b across;
    - all-reduce = reduce-scatter + all-gather: twice that;
    - all-to-all: each device sends size/n to each other device, (n-a) of them on other nodes;
    - collective-permute: the whole buffer, across nodes when the pair is split (``crosses``: some pair of the
      permute is, the busiest device's view: a ring paces at its slowest link).
    """
    n = a * b
    if kind in ("all-gather", "reduce-scatter"):
        return size * (a - 1) / a, size / a * (b - 1) / b
    if kind == "all-reduce":
        return 2 * size * (a - 1) / a, 2 * size / a * (b - 1) / b
    if kind == "all-to-all":
        return size * (a - 1) / n, size * (n - a) / n
    if kind == "collective-permute":
        return (0.0, size) if crosses else (size, 0.0)
    raise ValueError(kind)


def remat_factor(cfg: Config) -> float:
    """Hardware FLOPs / model FLOPs: rematerialisation recomputes (part of) the forward pass in the backward."""
    m, seq = cfg.model, cfg.data.seq_len
    if m.remat == "full":
        return 4 / 3  # forward + backward (2x forward) + the forward again
    if m.remat == "save_matmuls":  # weight matmuls saved; attention's S x S matmuls (batched dots) recomputed
        return 1 + attention_flops_per_token(m, seq) / train_flops_per_token(m, seq)
    return 1.0


def pipeline_recompute(cfg: Config, shape: MeshShape) -> float:
    """Hardware FLOPs the pipeline schedule adds, over model FLOPs: 1F1B's backward recomputes each pass from its
    saved stage input (one forward, 1/3 of forward + backward); 0 for GPipe and without a pipeline."""
    return 1 / 3 if shape.axis_sizes["stage"] > 1 and cfg.train.pipeline_schedule == "1f1b" else 0.0


def optimizer_bytes_moved(params_bytes: float, opt_bytes: float) -> float:
    """Bytes the AdamW update reads and writes per device: gradients, parameters and moments in, the three out."""
    return 2 * (params_bytes + opt_bytes) + params_bytes


def pipeline_schedule(cfg: Config, shape: MeshShape) -> tuple[int, int, int, float]:
    """(stages, microbatches, virtual stages, bubble fraction) of the step on ``shape``; without a pipeline
    (stage axis 1): (1, microbatches, 1, 0.0), virtual stages doing nothing there."""
    stages, micro = shape.axis_sizes["stage"], cfg.train.microbatches
    if stages == 1:
        return 1, micro, 1, 0.0
    virtual = cfg.train.virtual_stages
    return stages, micro, virtual, bubble_fraction(stages, micro, virtual)


@dataclass
class Estimate:
    compute_s: float  # bubble included: the idle iterations of a pipeline stage take time too
    optimizer_s: float
    ici_s: float
    dcn_s: float
    ici_bytes: float
    dcn_bytes: float
    bubble: float = 0.0  # share of a pipeline stage's iterations spent idle (0 without a pipeline)
    permute_ici_bytes: float = 0.0  # collective-permute bytes (the pipeline's ring and weight exchange), in ici_bytes
    permute_dcn_bytes: float = 0.0  # ... and in dcn_bytes

    @property
    def serial_s(self) -> float:
        """No overlap: compute, then every collective, then the update."""
        return self.compute_s + self.ici_s + self.dcn_s + self.optimizer_s

    @property
    def overlap_s(self) -> float:
        """Perfect overlap: the slowest of compute and each link class (NVLink and network are separate hardware)."""
        return max(self.compute_s, self.ici_s, self.dcn_s) + self.optimizer_s


def estimate(cfg: Config, shape: MeshShape, hw: Hardware, colls: list[Collective], params_bytes: float,
             opt_bytes: float) -> tuple[Estimate, list[dict]]:
    """Step-time estimate of one mesh, and its collectives summarised by (kind, axes), most bytes first.

    compute = model FLOPs per device x (remat factor + the schedule's recompute) / (peak x efficiency) / (1 -
    pipeline bubble)."""
    tokens = cfg.train.global_batch * cfg.data.seq_len
    recompute = remat_factor(cfg) + pipeline_recompute(cfg, shape)
    flops = train_flops_per_token(cfg.model, cfg.data.seq_len) * tokens / shape.num_devices * recompute
    bubble = pipeline_schedule(cfg, shape)[3]
    compute_s = flops / (hw.peak_flops * hw.compute_efficiency) / (1 - bubble)
    ici_bytes = dcn_bytes = ici_latency = dcn_latency = permute_ici = permute_dcn = 0.0
    summary: dict[tuple[str, str], dict] = {}
    for c in colls:
        a, b, axes = group_span(shape, c.groups)
        within, across = link_bytes(c.kind, c.total_bytes, a, b, crosses=b > 1)
        ici_bytes += within
        dcn_bytes += across
        if c.kind == "collective-permute":
            permute_ici += within
            permute_dcn += across
        if b > 1:
            dcn_latency += c.count * hw.collective_latency
        else:
            ici_latency += c.count * hw.collective_latency
        key = (c.kind, "+".join(axes) or "-")
        row = summary.setdefault(key, {"kind": c.kind, "axes": axes, "crosses_nodes": b > 1, "bytes": 0, "count": 0,
                                       "intra_node_bytes": 0.0, "inter_node_bytes": 0.0})
        row["bytes"] += c.total_bytes
        row["count"] += c.count
        row["intra_node_bytes"] += within
        row["inter_node_bytes"] += across
    est = Estimate(compute_s=compute_s,
                   optimizer_s=optimizer_bytes_moved(params_bytes, opt_bytes) / hw.hbm_bandwidth,
                   ici_s=ici_bytes / hw.intra_node_bandwidth + ici_latency,
                   dcn_s=dcn_bytes / hw.inter_node_bandwidth + dcn_latency,
                   ici_bytes=ici_bytes, dcn_bytes=dcn_bytes, bubble=bubble, permute_ici_bytes=permute_ici,
                   permute_dcn_bytes=permute_dcn)
    return est, sorted(summary.values(), key=lambda r: -r["bytes"])
