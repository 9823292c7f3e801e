"""An MoE model's routing seen while it trains (docs/moe.md): its figures as Prometheus gauges, and the warning when
routing collapses (one expert of a layer taking most of the layer's tokens step after step).

The figures come with each step's metrics (``jaxtrain.models.moe.objective``: ``moe_balance_loss``, ``moe_z_loss``,
``moe_max_load``, ``moe_top_share``, ``moe_dropped``); metrics.jsonl and TensorBoard take them like every metric.
"""

from __future__ import annotations

from typing import Any

from jaxtrain import log

GAUGES = {
    "moe_balance_loss": "MoE load-balancing loss of the last step (unweighted; top_k when perfectly balanced)",
    "moe_z_loss": "MoE router z-loss of the last step (unweighted)",
    "moe_max_load": "Busiest expert's tokens over the mean per expert, worst MoE layer, last step (1: balanced)",
    "moe_top_share": "Share of a layer's tokens that chose its busiest expert, worst MoE layer, last step",
    "moe_dropped": "Share of the routing assignments the capacity dropped, last step (0: dropless)",
}


def collapse_share(cfg: Any) -> float:
    """The share of a layer's tokens at which one expert counts as taking most of them: ``observe.
    moe_collapse_share``, or halfway between the uniform share (top_k / experts) and 1."""
    moe, share = cfg.model.moe, cfg.observe.moe_collapse_share
    return share if share is not None else (moe.top_k / moe.experts + 1) / 2


class RoutingWatch:
    """Fed each step's metrics (plain numbers, :meth:`report`); sets the MoE gauges in the registry of ``metrics`` (a
    :class:`jaxtrain.observe.metrics.PrometheusMetrics`, or None: no endpoint) and warns once per collapse:
    ``moe_top_share`` at or above :func:`collapse_share` in ``observe.moe_collapse_steps`` steps in a row. Does
    nothing for a dense model."""

    def __init__(self, cfg: Any):
        self.cfg, self.active = cfg, cfg.model.moe.experts > 0
        self.share = collapse_share(cfg) if self.active else 1.0
        self.window: int = cfg.observe.moe_collapse_steps if self.active else 0
        self.run, self.warned, self.warnings = 0, False, 0
        self._gauges: dict[str, Any] = {}
        self._counter: Any = None
        self._registry: Any = None

    def _bind(self, metrics: Any) -> None:
        """The gauges and the warning counter, in ``metrics``'s registry (once)."""
        import prometheus_client as prom

        self._registry, names = metrics.registry, tuple(metrics.base)
        self._gauges = {key: prom.Gauge(f"jaxtrain_{key}", doc, names, registry=metrics.registry)
                        .labels(**metrics.base) for key, doc in GAUGES.items()}
        self._counter = prom.Counter("jaxtrain_moe_collapse_warnings", "Routing-collapse warnings (one expert taking "
                                     "most of a layer's tokens)", names, registry=metrics.registry
                                     ).labels(**metrics.base)

    def report(self, step: int, values: dict, metrics: Any = None) -> str | None:
        """A step's metrics; returns the warning logged at this step, if any."""
        if not self.active or "moe_top_share" not in values:
            return None
        if metrics is not None and metrics.registry is not self._registry:
            self._bind(metrics)
        for key, gauge in self._gauges.items():
            gauge.set(values[key])
        if not self.window:
            return None
        if values["moe_top_share"] < self.share:
            self.run, self.warned = 0, False
            return None
        self.run += 1
        if self.run < self.window or self.warned:
            return None
        self.warned, self.warnings = True, self.warnings + 1
        if self._counter is not None:
            self._counter.inc()
        moe = self.cfg.model.moe
        message = (f"warning: step {step}: routing collapse: for {self.run} steps one expert of an MoE layer took "
                   f">= {100 * self.share:.0f}% of its tokens (now {100 * values['moe_top_share']:.0f}%; uniform "
                   f"routing: {100 * moe.top_k / moe.experts:.0f}%); {self._remedy()} or lower train.lr (docs/moe.md)")
        log.info(message)
        return message

    def _remedy(self) -> str:
        """What balances this model's experts: the expert bias's update rate where it has one, else the loss."""
        moe = self.cfg.model.moe
        if moe.expert_bias:
            return f"raise model.moe.bias_update_rate (now {moe.bias_update_rate:g})"
        return f"raise model.moe.aux_loss (now {moe.aux_loss:g})"
