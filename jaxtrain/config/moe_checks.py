"""Checks of the ``model.moe`` section (mixture of experts, docs/moe.md) that need no mesh; the mesh's share (the
expert axis against the experts, pipelines, accumulation) is :meth:`jaxtrain.parallel.dims.ParallelDims.check`'s."""

from __future__ import annotations

from jaxtrain.config.ops import not_negative, positive, require
from jaxtrain.config.tree import Config


def check_moe_config(cfg: Config) -> None:
    """Raise ConfigError naming the first bad ``model.moe`` value; nothing to check for a dense model."""
    m, moe = cfg.model, cfg.model.moe
    not_negative("model.moe.experts", moe.experts, " (0: a dense model)")
    if not moe.experts:
        return
    require(1 <= moe.top_k <= moe.experts,
            f"model.moe.top_k={moe.top_k} must be between 1 and model.moe.experts={moe.experts}")
    not_negative("model.moe.d_ff", moe.d_ff, " (0: model.d_ff)")
    not_negative("model.moe.shared_experts", moe.shared_experts)
    require(not moe.shared_gate or moe.shared_experts > 0,
            "model.moe.shared_gate=true needs model.moe.shared_experts > 0 (it gates the shared experts' output)")
    positive("model.moe.every", moe.every)
    require(0 <= moe.first_dense < m.n_layers, f"model.moe.first_dense={moe.first_dense} must be between 0 and "
            f"model.n_layers - 1 = {m.n_layers - 1} (at least one layer after the dense ones)")
    grouped = m.n_layers - moe.first_dense
    require(grouped % moe.every == 0, f"model.n_layers - model.moe.first_dense = {grouped} is not a multiple of "
            f"model.moe.every={moe.every} (each group of `every` layers ends in one MoE layer)")
    not_negative("model.moe.capacity_factor", moe.capacity_factor, " (0: dropless)")
    # ceil() would still give every expert one slot, so a factor this small would silently mean "one slot".
    require(not 0 < moe.capacity_factor * moe.top_k < 1, f"model.moe.capacity_factor={moe.capacity_factor} gives an "
            f"expert less than one token's share of slots; use 0 (dropless) or >= {1 / moe.top_k:g}")
    not_negative("model.moe.aux_loss", moe.aux_loss)
    not_negative("model.moe.z_loss", moe.z_loss)
    not_negative("model.moe.seq_aux_loss", moe.seq_aux_loss)
    not_negative("model.moe.bias_update_rate", moe.bias_update_rate, " (0: the expert bias stays as loaded)")
    positive("model.moe.routed_scaling_factor", moe.routed_scaling_factor)
    _check_groups(moe)
    o = cfg.observe
    uniform = moe.top_k / moe.experts
    share = o.moe_collapse_share
    require(not o.moe_collapse_steps or share is None or share > uniform, f"observe.moe_collapse_share="
            f"{o.moe_collapse_share} must be above the share of tokens an expert gets when routing is uniform "
            f"(top_k / experts = {uniform:g}); raise it or set observe.moe_collapse_steps=0")


def _check_groups(moe) -> None:
    """Group-limited routing: groups of at least two experts (a group's score is the sum of its best two), kept
    groups holding at least top_k experts."""
    positive("model.moe.n_group", moe.n_group)
    require(moe.experts % moe.n_group == 0, f"model.moe.n_group={moe.n_group} does not divide model.moe.experts="
            f"{moe.experts}; use a divisor of {moe.experts}")
    size = moe.experts // moe.n_group
    require(moe.n_group == 1 or size >= 2, f"model.moe.n_group={moe.n_group} leaves {size} expert per group; a "
            f"group's score is the sum of its best two, so use at most {moe.experts // 2} groups")
    require(1 <= moe.topk_group <= moe.n_group, f"model.moe.topk_group={moe.topk_group} must be between 1 and "
            f"model.moe.n_group={moe.n_group}")
    require(moe.top_k <= moe.topk_group * size, f"model.moe.top_k={moe.top_k} is more than the "
            f"{moe.topk_group * size} experts in the model.moe.topk_group={moe.topk_group} kept groups of {size}; "
            f"raise topk_group to at least {-(-moe.top_k // size)} or lower top_k")


def moe_warnings(cfg: Config) -> list[str]:
    """Lines to say at start-up about ``model.moe`` values that are valid but probably not meant; [] for none."""
    moe = cfg.model.moe
    if moe.experts and moe.top_k == 1 and moe.normalize:
        # route(): the one weight w is renormalised to w / w = 1, whose gradient is 0.
        return ["model.moe.top_k=1 with model.moe.normalize=true: each token's one routing weight is renormalised "
                "to 1, so the router gets no gradient from the language loss (only from model.moe.aux_loss and "
                "z_loss); set model.moe.normalize=false (the weight is then the router's own score, as in Switch "
                "Transformer) or model.moe.top_k >= 2"]
    return []
