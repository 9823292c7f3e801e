"""The cost model: bytes each device sends per link class, and the time of each part of a step.

A collective's replica groups are logical device ids; :meth:`MeshShape.coordinates` says which node each sits on
(the layout ``build_mesh`` gives the devices), hence which bytes stay within a node (NVLink) and which cross the
network. The step time is model FLOPs over (peak x efficiency), each link class's bytes over its rate, and the
memory-bound optimizer update.

With pipeline stages (mesh axis ``stage`` > 1) the step runs ``M * V + S - 1`` iterations (M microbatches, V virtual
stages, S stages) of which each stage works in ``M * V``: the compute time is divided by (1 - bubble fraction), bubble
``(S - 1) / (M * V + S - 1)`` (``jaxtrain.parallel.pipeline``). The 1F1B schedule (``train.pipeline_schedule=1f1b``) has
the same bubble (its stages skip the half of an iteration they have no work for) and recomputes each pass's forward in
its backward: one more forward, a third of the model FLOPs (:func:`pipeline_recompute`). The pipeline's own traffic (the
ring's collective permutes, once per iteration in the forward and the backward loop, the weight exchange of
interleaving, the all-to-all that hands out the outputs) is read from the HLO like every other collective.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from jaxtrain.config import Config
from jaxtrain.config.hardware import Hardware
from jaxtrain.models.flops import attention_flops_per_token, count_params, fp8_flops_per_token, train_flops_per_token
from jaxtrain.parallel.dims import MESH_AXES, Axis, MeshShape
from jaxtrain.parallel.pipeline import bubble_fraction
from jaxtrain.planner.cost.collectives import Collective
from jaxtrain.planner.cost.memory import (
    activation_bytes,
    dtype_bytes,
    moe_dispatch,
    params_per_shard,
    rows_and_seq,
    state_bytes_lower,
)


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
    return 1 / 3 if shape.axis_sizes[Axis.STAGE] > 1 and cfg.train.pipeline_schedule == "1f1b" else 0.0


def hbm_bandwidth(hw: Hardware) -> float:
    """The memory bandwidth the optimizer's update runs at: measured where ``hw`` has it, else the hardware file's."""
    from jaxtrain.planner.cost.measured import for_hardware

    measured = for_hardware(hw)
    return measured.hbm_bandwidth if measured and measured.hbm_bandwidth else hw.hbm_bandwidth


def optimizer_bytes_moved(params_bytes: float, opt_bytes: float) -> float:
    """Bytes the AdamW update reads and writes per device: gradients, parameters and moments in, the three out."""
    return 2 * (params_bytes + opt_bytes) + params_bytes


def pipeline_schedule(cfg: Config, shape: MeshShape) -> tuple[int, int, int, float]:
    """(stages, microbatches, virtual stages, bubble fraction) of the step on ``shape``; without a pipeline
    (stage axis 1): (1, microbatches, 1, 0.0), virtual stages doing nothing there."""
    stages, micro = shape.axis_sizes[Axis.STAGE], cfg.train.microbatches
    if stages == 1:
        return 1, micro, 1, 0.0
    virtual = cfg.train.virtual_stages
    return stages, micro, virtual, bubble_fraction(stages, micro, virtual)


def matmul_factor(hw: Hardware, rows: float) -> float:
    """The matmul rate at ``rows`` rows per device over the rate at the reference rows (those of ``peak_flops``'
    matmul): the hardware's ``matmul_rows`` (measured: ``measure.measure_sized``) interpolated in log-log, clamped
    at its ends; 1 without them."""
    table = hw.matmul_rows
    if not table:
        return 1.0
    xs, ys = np.log([r for r, _ in table]), np.log([f for _, f in table])
    return float(np.exp(np.interp(np.log(max(rows, 1e-9)), xs, ys)))


def overhead_seconds(cfg: Config, shape: MeshShape, hw: Hardware) -> float:
    """Fixed cost of a step's iterations, whatever their FLOPs: the hardware's ``layer_overhead_s`` (a layer's
    forward + backward iteration, measured) x (layers per stage + 1, for the embedding, head and loss) x the
    microbatches (each runs every layer again) x virtual stages, over (1 - bubble) like the compute. 0 without it."""
    per = hw.layer_overhead_s
    if not per:
        return 0.0
    stages, micro, virtual, bubble = pipeline_schedule(cfg, shape)
    return per * (cfg.model.n_layers / stages + 1) * micro * virtual / (1 - bubble)


def efficiency(cfg: Config, shape: MeshShape, hw: Hardware) -> float:
    """The compute efficiency of ``cfg``'s step on ``shape``: the one measured for its remat policy and tensor size
    (``hw.model_efficiency``); for a tensor size measured with another policy only, the policy's own (tensor 1)
    times that tensor size's ratio to tensor 1; without any for the policy, the hardware's ``compute_efficiency``."""
    table = {(r, t): e for r, t, e in hw.model_efficiency}
    remat, t = cfg.model.remat, shape.axis_sizes[Axis.TENSOR]
    if (remat, t) in table or (remat, 1) not in table:
        return table.get((remat, t), hw.compute_efficiency)
    other = next((r for r, u in table if u == t and (r, 1) in table), None)
    return table[remat, 1] * (table[other, t] / table[other, 1] if other else 1.0)


def _flops_and_rate(cfg: Config, shape: MeshShape, hw: Hardware, eff: float) -> tuple[float, float]:
    """(hardware FLOPs per device of a step, FLOP/s per device at efficiency ``eff``)."""
    tokens = cfg.train.global_batch * cfg.data.seq_len
    recompute = remat_factor(cfg) + pipeline_recompute(cfg, shape)
    flops = train_flops_per_token(cfg.model, cfg.data.seq_len) * tokens / shape.num_devices * recompute
    rows, seq = rows_and_seq(cfg, shape)
    # A tensor-parallel device multiplies its rows by a tensor-th of the weight: the table (measured with the whole
    # weight) is read at the rows that do the same work, rows / tensor.
    return flops, peak_rate(cfg, hw) * eff * matmul_factor(hw, rows * seq / shape.axis_sizes[Axis.TENSOR])


def fp8_share(cfg: Config) -> float:
    """The share of the model FLOPs that model.fp8 multiplies in float8 (the attention and MLP projections, and the
    routed experts with model.moe.gemm=xla)."""
    return fp8_flops_per_token(cfg.model, cfg.data.seq_len) / train_flops_per_token(cfg.model, cfg.data.seq_len)


def peak_rate(cfg: Config, hw: Hardware) -> float:
    """The peak FLOP/s of ``cfg``'s matmul mix on ``hw``: the bf16 peak, or with model.fp8 the FP8 peak for the
    projections' share of the FLOPs (:func:`fp8_share`) and the bf16 one for the rest (the time adds up, so the
    rates combine harmonically). Without an FP8 rate (CPUs, which emulate float8) the bf16 peak alone."""
    share = fp8_share(cfg)
    if not share or hw.fp8_peak_flops <= 0:
        return hw.peak_flops
    return 1 / (share / hw.fp8_peak_flops + (1 - share) / hw.peak_flops)


def compute_seconds(cfg: Config, shape: MeshShape, hw: Hardware, attention: str | None = None) -> float:
    """Model FLOPs per device x (remat factor + the schedule's recompute) / (peak x efficiency x the matmul rate's
    factor at a microbatch's rows per device over tensor) / (1 - bubble), plus the iterations' fixed cost
    (:func:`overhead_seconds`): the compute part of every estimate, known before compiling (the auto search's lower
    bound on a step). Where ``hw`` has measured rates (``measured.for_hardware``), each kind of work at its own:
    :func:`measured_compute`. ``attention``: the kernel the run uses (default the config's; a plan compiled with a
    stand-in for cuDNN passes cuDNN)."""
    parts = measured_compute(cfg, shape, hw, attention or cfg.model.attention)
    if parts is not None:
        return sum(parts.seconds.values()) / (1 - pipeline_schedule(cfg, shape)[3]) + overhead_seconds(cfg, shape, hw)
    flops, rate = _flops_and_rate(cfg, shape, hw, efficiency(cfg, shape, hw))
    return flops / rate / (1 - pipeline_schedule(cfg, shape)[3]) + overhead_seconds(cfg, shape, hw)


FWD_BWD_ATTENTION = 3.5  # forward + backward FLOPs of attention over the forward's, as the kernel benchmark counts


@dataclass
class ComputeParts:
    """A step's compute per device, by kind of work, priced at measured rates (no pipeline bubble)."""

    seconds: dict[str, float]  # "matmul" (16-bit), "matmul_fp8", "attention": seconds of each
    flops: dict[str, float]  # the FLOPs each part does (hardware FLOPs: recomputation included)
    rates: dict[str, float]  # the FLOP/s each part is priced at
    sources: dict[str, str]  # where each rate comes from: "measured" or "datasheet x efficiency E"


def _recomputed_forwards(cfg: Config, shape: MeshShape, attention: str) -> tuple[float, int]:
    """(weight-matmul FLOPs recomputed over model FLOPs, attention forwards run again): remat full recomputes the
    forward's weight matmuls (1/3 more matmul work); neither policy reruns a kernel's attention forward (both save
    its named output and log-sum-exp: ``models.attention.REMAT_POLICIES``), but the XLA reference's attention, which
    has no such names, is recomputed under either; 1F1B's backward recomputes each pass's whole forward (one more
    of each)."""
    extra = 1 / 3 if cfg.model.remat == "full" else 0.0
    attn = int(cfg.model.remat in ("full", "save_matmuls") and attention == "xla")
    if pipeline_recompute(cfg, shape):
        extra, attn = extra + 1 / 3, attn + 1
    return extra, attn


def measured_compute(cfg: Config, shape: MeshShape, hw: Hardware, attention: str) -> ComputeParts | None:
    """The step's compute per device with each kind of work at its own rate (``measured.measured_rates``), where ``hw``
    has measured rates: the weight matmuls at the matmul rate of the compute dtype (model.fp8's share,
    :func:`fp8_share`, at the float8 one), attention's forward + backward and the forwards remat recomputes at the
    rates of the kernel the run uses. Not charged: elementwise work (norms, rotary, SwiGLU, the loss), assumed fused
    into the GEMMs and attention or hidden behind them (docs/planning.md). None without measured rates."""
    from jaxtrain.planner.cost.measured import measured_rates

    rates = measured_rates(cfg, hw, attention)
    if rates is None:
        return None
    m, seq = cfg.model, cfg.data.seq_len
    tokens = cfg.train.global_batch * seq / shape.num_devices
    attn_fwd = attention_flops_per_token(m, seq) * tokens
    fp8 = fp8_flops_per_token(m, seq) * tokens if "matmul_fp8" in rates else 0.0
    extra, again = _recomputed_forwards(cfg, shape, attention)
    flops = {"matmul": (train_flops_per_token(m, seq) * tokens - 3 * attn_fwd - fp8) * (1 + extra),
             "matmul_fp8": fp8 * (1 + extra), "attention": (3 + again) * attn_fwd}
    seconds = {"matmul": flops["matmul"] / rates["matmul"][0],
               "matmul_fp8": flops["matmul_fp8"] / rates["matmul_fp8"][0] if fp8 else 0.0,
               "attention": attn_fwd * (FWD_BWD_ATTENTION / rates["attention_fwd_bwd"][0]
                                        + again / rates["attention_fwd"][0])}
    keep = [k for k in seconds if flops[k]]
    return ComputeParts({k: seconds[k] for k in keep}, {k: flops[k] for k in keep},
                        {k: flops[k] / seconds[k] for k in keep},
                        {k: rates["attention_fwd_bwd" if k == "attention" else k][1] for k in keep})


def measured_efficiency(cfg: Config, shape: MeshShape, hw: Hardware, seconds: float) -> float:
    """The efficiency at which :func:`compute_seconds` gives ``seconds`` for ``cfg`` on ``shape`` (no pipeline): how
    ``measure.measure_model``'s timing of the model's own forward + backward becomes ``Hardware.model_efficiency``.
    The iterations' fixed cost is taken out first (it is charged apart); at least 1% of ``seconds`` stays."""
    flops, rate = _flops_and_rate(cfg, shape, hw, 1.0)
    return flops / rate / max(seconds - overhead_seconds(cfg, shape, hw), 0.01 * seconds)


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
             opt_bytes: float, attention: str | None = None) -> tuple[Estimate, list[dict]]:
    """Step-time estimate of one mesh, and its collectives summarised by (kind, axes), most bytes first.

    compute = model FLOPs per device x (remat factor + the schedule's recompute) / (peak x efficiency) / (1 -
    pipeline bubble), or each kind of work at its measured rate (:func:`compute_seconds`; ``attention``: the kernel
    the run uses)."""
    compute_s, bubble = compute_seconds(cfg, shape, hw, attention), pipeline_schedule(cfg, shape)[3]
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
                   optimizer_s=optimizer_bytes_moved(params_bytes, opt_bytes) / hbm_bandwidth(hw),
                   ici_s=ici_bytes / hw.intra_node_bandwidth + ici_latency,
                   dcn_s=dcn_bytes / hw.inter_node_bandwidth + dcn_latency,
                   ici_bytes=ici_bytes, dcn_bytes=dcn_bytes, bubble=bubble, permute_ici_bytes=permute_ici,
                   permute_dcn_bytes=permute_dcn)
    return est, sorted(summary.values(), key=lambda r: -r["bytes"])


def comm_seconds(cfg: Config, shape: MeshShape, hw: Hardware) -> float:
    """A closed-form guess of one step's collective time, for ordering candidates before compiling: FSDP's
    parameter gathers (forward, backward) and gradient reduce-scatter, data parallelism's gradient all-reduce,
    tensor parallelism's two activation all-reduces per layer and pass, context parallelism's K/V ring, each at the
    rate of the link its axis crosses, plus the fixed cost per collective."""
    m, s = cfg.model, shape.axis_sizes
    rate = {ax: hw.inter_node_bandwidth if shape.crosses_nodes(ax) else hw.intra_node_bandwidth for ax in s}
    pbytes = params_per_shard(cfg, shape) * dtype_bytes(m.param_dtype) / (s[Axis.TENSOR] * s[Axis.STAGE])
    rows, seq = rows_and_seq(cfg, shape)
    act = dtype_bytes(m.dtype)
    layers, micro = m.n_layers / s[Axis.STAGE], cfg.train.microbatches
    gathers = micro if cfg.train.accumulate == "sharded" else 1
    t, count = 0.0, 0.0
    if s[Axis.FSDP] > 1:
        f = s[Axis.FSDP]
        t += 3 * gathers * pbytes * (f - 1) / f / rate[Axis.FSDP]
        count += 3 * gathers * layers
    if s[Axis.DATA] > 1:
        d = s[Axis.DATA]
        t += 2 * pbytes / s[Axis.FSDP] * (d - 1) / d / rate[Axis.DATA]
        count += layers
    if s[Axis.EXPERT] > 1:  # the dense weights' gradients summed over expert too; the tokens' all-to-alls
        e, moe = s[Axis.EXPERT], moe_dispatch(cfg, shape)
        dense = (count_params(m)["total"] - count_params(m)["experts"]) * dtype_bytes(m.param_dtype)
        t += 2 * dense / (s[Axis.TENSOR] * s[Axis.STAGE] * s[Axis.FSDP]) * (e - 1) / e / rate[Axis.EXPERT]
        t += 2 * moe["layers"] / s[Axis.STAGE] * micro * moe["bytes_per_layer"] / rate[Axis.EXPERT]
        count += layers + 4 * moe["layers"] / s[Axis.STAGE] * micro
    if s[Axis.TENSOR] > 1:
        n = s[Axis.TENSOR]
        t += 4 * layers * micro * 2 * rows * seq * m.d_model * act * (n - 1) / n / rate[Axis.TENSOR]
        count += 4 * layers * micro
    if s[Axis.CONTEXT] > 1:
        c = s[Axis.CONTEXT]
        kv = 2 * rows * seq * m.n_kv_heads * m.resolved_head_dim * act / s[Axis.TENSOR]
        t += 3 * layers * micro * (c - 1) * kv / rate[Axis.CONTEXT]  # forward, backward's K/V and their gradients
        count += 3 * layers * micro * (c - 1)
    return t + count * hw.collective_latency


def context_parallel(cfg: Config, shape: MeshShape, hw: Hardware) -> dict:
    """Closed-form figures of context parallelism (ring attention over the ``context`` axis) per device and step.

    - ring K/V bytes per layer per link: each device's K and V block (seq / C tokens, its kv heads, 16 or 32 bits)
      passes C - 1 hops in the forward; the backward passes K/V again and their gradients: 3 (C - 1) blocks;
    - compute: model FLOPs per device; causal attention with contiguous chunks gives chunk i (of C) i + 1/2 blocks
      of work, so the last device does (C - 1/2) / (C / 2) = 2 - 1/C times the average attention work; with load
      balancing (each device two chunks, i and 2C - 1 - i, the zigzag order) every device does the average;
    - memory: ``state_bytes_lower`` + ``activation_bytes`` (the estimate), on seq / C tokens a device.
    """
    m, s = cfg.model, shape.axis_sizes
    c = s[Axis.CONTEXT]
    rows, seq = rows_and_seq(cfg, shape)
    act = dtype_bytes(m.dtype)
    kv_block = 2 * rows * seq * m.n_kv_heads / s[Axis.TENSOR] * m.resolved_head_dim * act
    ring_per_layer = 3 * (c - 1) * kv_block
    link = hw.inter_node_bandwidth if shape.crosses_nodes(Axis.CONTEXT) else hw.intra_node_bandwidth
    tokens = cfg.train.global_batch * cfg.data.seq_len
    rate = peak_rate(cfg, hw) * efficiency(cfg, shape, hw)
    per_dev = train_flops_per_token(m, cfg.data.seq_len) * tokens / shape.num_devices * remat_factor(cfg)
    attn = attention_flops_per_token(m, cfg.data.seq_len) * tokens / shape.num_devices * remat_factor(cfg)
    layers = m.n_layers / s[Axis.STAGE]
    return {"context": c, "ring_bytes_per_layer": ring_per_layer, "ring_s_per_layer": ring_per_layer / link,
            "compute_s_per_layer": per_dev / rate / layers, "compute_s_balanced": per_dev / rate,
            "compute_s_unbalanced": (per_dev + attn * (1 - 1 / c)) / rate,
            "memory_bytes": state_bytes_lower(cfg, shape) + activation_bytes(cfg, shape)[1]}


def context_table(cfg: Config, shapes: list[MeshShape], hw: Hardware) -> str:
    """:func:`context_parallel` for each mesh, as a markdown table (docs/planning.md)."""
    lines = ["| mesh | ring K/V per layer per link | its time on the link | compute per layer | step compute, "
             "balanced | unbalanced (last device) | memory per device (estimate) |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for shape in shapes:
        f = context_parallel(cfg, shape, hw)
        label = shape.label.replace(" | ", " x ")  # a markdown cell
        lines.append(f"| {label} | {f['ring_bytes_per_layer'] / 1e9:.2f} GB | {f['ring_s_per_layer'] * 1e3:.1f} "
                     f"ms | {f['compute_s_per_layer'] * 1e3:.0f} ms | {f['compute_s_balanced']:.2f} s | "
                     f"{f['compute_s_unbalanced']:.2f} s | {f['memory_bytes'] / 1e9:.1f} GB |")
    return "\n".join(lines)
