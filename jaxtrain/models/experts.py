"""Routed SwiGLU experts as one device computes them: assignments sorted by expert, grouped matmuls, results
gathered back to their tokens and combined with the routing weights. No mesh is named here;
``jaxtrain.parallel.expert`` sends tokens to the experts of other devices and calls the same pieces.

Expert weights (logical axes in brackets): w_gate, w_up [E, embed, d_ff] (experts, embed, expert_mlp); w_down
[E, d_ff, embed] (experts, expert_mlp, embed); row e holds expert e (its ``x @ w`` form: Hugging Face's per-expert
w1, w3, w2 transposed).

:class:`GroupedMatmul` is the one place the grouped matmul happens (``model.moe.gemm``): ``jax.lax.ragged_dot``
(``xla``), or jaxtrain's grouped-matmul kernels (``pallas``, ``triton``: ``jaxtrain.kernels.gmm.api``). On XLA:CPU,
and in XLA:GPU as of jax 0.11.2, ragged_dot becomes a masked dense matmul over all groups (E times the FLOPs of the
real work; docs/moe.md); the kernels do each row's own group's work only. A kernel is a custom call GSPMD cannot
partition: the caller runs it on per-device arrays (``jaxtrain.parallel.expert`` puts the experts under
``shard_map`` over every mesh axis for them).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from jaxtrain.kernels.gmm import api as gmm_api
from jaxtrain.models import fp8, fp8_experts

GEMMS = ("xla", "pallas", "triton")  # model.moe.gemm, resolved ("auto": pallas on GPUs, xla elsewhere)

# (x, experts, weights, w_gate, w_up, w_down, slots) -> y: x [batch, seq, embed] in the compute dtype; experts int32
# [batch, seq, top_k] (E: dropped); weights float32 [batch, seq, top_k] (0: dropped); the expert weights as above in
# the compute dtype; slots: most assignments an expert takes from one sequence (None: dropless), which bounds the
# dispatch buffers; keywords fp8 (the experts' FP8 recipe) and fp8_history (its histories [3, 3, H], delayed). y [batch,
# seq, embed] like x: the weighted sum of each token's experts' outputs.
ExpertsFn = Callable[..., jax.Array]


@dataclass(frozen=True)
class GroupedMatmul:
    """How the routed experts' grouped matmuls run: ``impl`` a resolved ``model.moe.gemm`` (:data:`GEMMS`);
    ``interpret`` runs the Pallas kernels in Pallas' interpreter (CPU). The kernels need per-device operands.
    ``fp8``: the experts' FP8 recipe (``jaxtrain.models.fp8_experts``; xla only), ``history`` its delayed-scaling
    histories float32 [3 (gate, up, down), 3, H], ``reduce`` the mesh axes of the per-device region (per-tensor
    amaxes are reduced over them all), ``hidden`` those that split each expert's hidden width (``expert_mlp``) and
    ``expert_axes`` those that split the experts: rowwise amaxes are reduced over what splits their own slice only
    (:meth:`rowwise_axes`)."""

    impl: str = "xla"
    interpret: bool = False
    fp8: str = "none"
    history: jax.Array | None = None
    reduce: tuple[str, ...] = ()
    hidden: tuple[str, ...] = ()
    expert_axes: tuple[str, ...] = ()

    def __post_init__(self):
        if self.impl not in GEMMS:
            raise ValueError(f"unknown grouped-matmul impl {self.impl!r}; expected one of {GEMMS}")
        if self.fp8 != "none" and self.kernel:
            raise ValueError(f"the {self.impl} grouped-matmul kernel takes no float8 operands (fp8={self.fp8})")

    @property
    def kernel(self) -> bool:
        """A custom-call kernel (pallas, triton): per-device arrays only."""
        return self.impl != "xla"

    def with_fp8(self, recipe: str, history: jax.Array | None, reduce: tuple[str, ...] = (),
                 hidden: tuple[str, ...] = (), expert_axes: tuple[str, ...] = ()) -> GroupedMatmul:
        """This one multiplying through ``recipe`` (histories and axes as the class says); amaxes also reduced over
        the axes of an enclosing :func:`jaxtrain.models.fp8.amax_over` (batch axes: they split the tokens)."""
        outer = fp8._AMAX_AXES.get()
        return dataclasses.replace(self, fp8=recipe, history=history, reduce=(*outer, *reduce), hidden=hidden,
                                   expert_axes=expert_axes)

    def rowwise_axes(self, which: int) -> fp8_experts.RowwiseAxes:
        """The axes projection ``which``'s rowwise amaxes are reduced over: the hidden width is gate's and up's N
        (the input gradient's contraction) and down's K (the forward's); a group's rows are split over the region's
        axes but those of the experts and the hidden width (whose devices hold other experts, other columns)."""
        rows = tuple(a for a in self.reduce if a not in (*self.hidden, *self.expert_axes))
        k, n = (self.hidden, ()) if which == 2 else ((), self.hidden)
        return fp8_experts.RowwiseAxes(k, n, rows)

    def __call__(self, lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, which: int = 0) -> jax.Array:
        """Rows of lhs [M, K] in consecutive groups (group g: the next group_sizes[g] rows) times rhs[g] [K, N] ->
        float32 [M, N] (float64 for float64 inputs, xla only); rows past sum(group_sizes) give 0. group_sizes int32
        [G]. The kernels round their float32 accumulation to lhs's dtype (exact for float32 inputs). ``which``: the
        projection (0 gate, 1 up, 2 down), whose FP8 history is used."""
        if self.fp8 != "none":
            history = None if self.history is None else self.history[which]
            return fp8_experts.grouped_fp8(lhs, rhs, group_sizes, self.fp8, history, self.reduce,
                                           self.rowwise_axes(which))
        if self.impl == "xla":
            acc = jnp.promote_types(lhs.dtype, jnp.float32)
            return jax.lax.ragged_dot(lhs, rhs, group_sizes, preferred_element_type=acc)
        out = gmm_api.grouped_matmul(lhs, rhs, group_sizes, impl=self.impl, interpret=self.interpret)
        return out.astype(jnp.promote_types(lhs.dtype, jnp.float32))


XLA_GEMM = GroupedMatmul()  # the default: jax.lax.ragged_dot


def sort_by_expert(experts: jax.Array, num_experts: int) -> tuple[jax.Array, jax.Array]:
    """experts int [N] (``num_experts``: dropped) -> (order int32 [N]: the indices grouped by expert, stable, the
    dropped last; group_sizes int32 [num_experts]: rows of each group)."""
    order = jnp.argsort(experts, stable=True).astype(jnp.int32)
    return order, jnp.bincount(experts, length=num_experts).astype(jnp.int32)


def grouped_swiglu(xs: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array,
                   group_sizes: jax.Array, gmm: GroupedMatmul = XLA_GEMM) -> jax.Array:
    """SwiGLU of each row with its group's expert: xs [M, embed] sorted by expert, group_sizes int32 [E'] (rows past
    their sum give 0), weights [E', ...] in xs's dtype -> [M, embed] in xs's dtype (float32 accumulation), the three
    grouped matmuls through ``gmm``."""
    gate = gmm(xs, w_gate, group_sizes, 0)
    up = gmm(xs, w_up, group_sizes, 1)
    hidden = (jax.nn.silu(gate) * up).astype(xs.dtype)
    return gmm(hidden, w_down, group_sizes, 2).astype(xs.dtype)


def combine(ys: jax.Array, weights: jax.Array) -> jax.Array:
    """ys [T, K, embed] (each assignment's expert output, in token order), weights float32 [T, K] -> [T, embed]: the
    weighted sum in float32, cast to ys's dtype."""
    return jnp.einsum("tkd,tk->td", ys.astype(weights.dtype), weights).astype(ys.dtype)


def experts_on_tokens(x: jax.Array, experts: jax.Array, weights: jax.Array, w_gate: jax.Array, w_up: jax.Array,
                      w_down: jax.Array, gmm: GroupedMatmul = XLA_GEMM) -> jax.Array:
    """All experts on one device: x [T, embed], experts int32 [T, K] (E: dropped), weights float32 [T, K], expert
    weights [E, ...] -> [T, embed]. T x K rows are multiplied, grouped by expert (dropped ones past the groups)."""
    t, k = experts.shape
    e = w_gate.shape[0]
    order, group_sizes = sort_by_expert(experts.reshape(-1), e)
    ys = grouped_swiglu(jnp.take(x, order // k, axis=0), w_gate, w_up, w_down, group_sizes, gmm)
    # Back through the inverse permutation: the forward stays a gather, its transpose (backward) the scatter.
    ys = jnp.take(ys, jnp.argsort(order), axis=0).reshape(t, k, -1)
    return combine(jnp.where((experts < e)[..., None], ys, 0), weights)


def local_experts(x: jax.Array, experts: jax.Array, weights: jax.Array, w_gate: jax.Array, w_up: jax.Array,
                  w_down: jax.Array, slots: int | None = None, gmm: GroupedMatmul = XLA_GEMM, fp8: str = "none",
                  fp8_history: jax.Array | None = None) -> jax.Array:
    """:data:`ExpertsFn` on the arrays as given (one device, or arrays the caller already split): x [batch, seq,
    embed] -> [batch, seq, embed]. ``slots`` is not needed: the buffers are the T x K assignments. ``fp8``: the
    experts' FP8 recipe, ``fp8_history`` its histories [3, 3, H] (:class:`GroupedMatmul`)."""
    b, s, d = x.shape
    if fp8 != "none":
        gmm = gmm.with_fp8(fp8, fp8_history)
    y = experts_on_tokens(x.reshape(b * s, d), experts.reshape(b * s, -1), weights.reshape(b * s, -1),
                          w_gate, w_up, w_down, gmm)
    return y.reshape(b, s, d)
