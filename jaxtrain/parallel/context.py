"""Context parallelism: causal attention over a sequence split across the ``context`` mesh axis.

Each of the ``n`` devices of a context ring holds ``k`` chunks of the sequence (``k = 2``: the zigzag order, device
``i`` holding chunks ``i`` and ``2n - 1 - i`` of ``2n``, so every device's causal work is the same; ``k = 1``: a
plain split, for the closed form it is compared with). The data arrive in that order (:func:`token_order`, applied
once per step to the int32 tokens, targets, positions and segment ids, jaxtrain/train/step.py): nothing is permuted per
layer, and rotary embeddings read the real positions.

Two variants, both in ``shard_map`` over ``context`` (batch, heads and the other axes stay as the logical rules map
them, so the variants compose with data, fsdp, tensor and the pipeline's stage vmap):

- ``ring``: K, V and the kv segment ids travel round the ring with ``ppermute``; each step's partial outputs are
  merged by their log-sum-exp; the next block's transfer is issued before the current block's compute so that XLA
  can overlap them. The backward (``jax.custom_vjp``) runs the ring again with dK/dV travelling with their blocks.
  Memory: two K/V blocks per device; traffic: ``n - 1`` K/V block sends forward, ``n - 1`` K/V plus ``n`` dK/dV
  sends backward, per layer.
- ``allgather``: K/V gathered once (autodiff's transpose reduce-scatters dK/dV); chosen for rings of 2, where it
  moves the same bytes as the ring in one collective.

Both run on a block interface ``Blocks(fwd, bwd)``: ``fwd(q, k, v, *, causal, segment_ids, kv_segment_ids,
q_offset, kv_offset, sm_scale, out_dtype) -> (out, lse [b, h, sq] float32)`` and ``bwd(q, k, v, out, lse, dout,
*, same keywords, grad_dtype) -> (dq, dk, dv)`` (the final merged out/lse; this key block's share). XLA_BLOCKS here;
the flash kernels' :func:`kernel_blocks`. Chunk pairs that the causal mask hides entirely are skipped (``lax.cond``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from jaxtrain.kernels.flash.pallas import CHECKPOINT_NAMES
from jaxtrain.parallel.dims import Axis

_F32 = jnp.float32


# -- the schedule (pure numbers) -----------------------------------------------------------------------------------

def chunk_order(context: int, balanced: bool = True) -> np.ndarray:
    """int [context, k]: the global chunk index of each device's local chunks; zigzag (k = 2, chunks i and
    2n - 1 - i of 2n) when ``balanced``, else contiguous (k = 1)."""
    i = np.arange(context)
    return np.stack([i, 2 * context - 1 - i], axis=1) if balanced else i[:, None]


def token_order(seq_len: int, context: int, balanced: bool = True) -> np.ndarray:
    """int [seq_len]: the original position of each slot of the reordered sequence (device 0's chunks first)."""
    order = chunk_order(context, balanced).reshape(-1)
    c = seq_len // order.size
    return (order[:, None] * c + np.arange(c)).reshape(-1)


def causal_pairs(seq_len: int, context: int, balanced: bool = True) -> np.ndarray:
    """float [context]: the (query, key) pairs each device's queries attend to under the causal mask, a closed
    form of the schedule (attention FLOPs are 4 * head_dim * heads per pair): a chunk of c queries starting at
    position g * c sees g * c * c earlier keys plus c (c + 1) / 2 in its own chunk."""
    order = chunk_order(context, balanced)
    c = seq_len // order.size
    return (order * c * c + c * (c + 1) / 2).sum(axis=1).astype(np.float64)


def choose_variant(context: int) -> str:
    """``allgather`` for a ring of 2 (one exchange either way, one collective fewer), ``ring`` beyond."""
    return "allgather" if context <= 2 else "ring"


def kv_traffic(rows: int, seq_len: int, kv_heads: int, head_dim: int, itemsize: int, context: int,
               variant: str) -> tuple[float, float]:
    """Bytes one device sends per layer over the context axis: (forward, backward), for ``rows`` sequences of
    ``seq_len`` tokens with ``kv_heads`` x ``head_dim`` keys and values of ``itemsize`` bytes (the planner's figure).

    ring: forward n - 1 sends of its K/V block (b S / n tokens); backward the same K/V sends plus n sends of the
    float32 dK/dV accumulators. allgather: each device receives the other n - 1 blocks, and the backward
    reduce-scatters dK/dV (in the inputs' dtype): (n - 1) / n of the whole sequence's K/V each way."""
    if context == 1:
        return 0.0, 0.0
    block = 2 * rows * (seq_len // context) * kv_heads * head_dim  # K and V elements of one device's block
    if variant == "ring":
        return float((context - 1) * block * itemsize), float((context - 1) * block * itemsize + context * block * 4)
    return float((context - 1) * block * itemsize), float((context - 1) * block * itemsize)


# -- the XLA block implementation ----------------------------------------------------------------------------------

def _scores_and_mask(q, k, *, causal, segment_ids, kv_segment_ids, q_offset, kv_offset, sm_scale, window=None):
    """Scores float32 [b, kvh, g, sq, skv] and the visibility mask (broadcastable) of one query/key block pair;
    ``window``: with causal, keys within that many positions up to the query only."""
    b, sq, h, d = q.shape
    kvh = k.shape[2]
    scale = d ** -0.5 if sm_scale is None else sm_scale
    qg = q.reshape(b, sq, kvh, h // kvh, d)
    s = jnp.einsum("bqkgd,bskd->bkgqs", qg, k, preferred_element_type=_F32,
                   precision=jax.lax.Precision.HIGHEST) * scale
    mask = jnp.ones((1, 1, 1, sq, k.shape[1]), bool)
    if causal:
        q_pos = q_offset + jnp.arange(sq)
        kv_pos = kv_offset + jnp.arange(k.shape[1])
        mask = mask & (kv_pos[None, :] <= q_pos[:, None])[None, None, None]
        if window is not None:
            mask = mask & (q_pos[:, None] - kv_pos[None, :] < window)[None, None, None]
    if segment_ids is not None:
        mask = mask & (segment_ids[:, :, None] == kv_segment_ids[:, None, :])[:, None, None]
    return s, mask, scale


def xla_fwd(q, k, v, *, causal=True, segment_ids=None, kv_segment_ids=None, q_offset=0, kv_offset=0, sm_scale=None,
            out_dtype=None, window=None, **_):
    """One block pair: (out [b, sq, h, d] in ``out_dtype`` (default q's), lse float32 [b, h, sq]); rows with no
    visible key give out 0 and lse -inf."""
    b, sq, h, d = q.shape
    s, mask, _ = _scores_and_mask(q, k, causal=causal, segment_ids=segment_ids, kv_segment_ids=kv_segment_ids,
                                  q_offset=q_offset, kv_offset=kv_offset, sm_scale=sm_scale, window=window)
    s = jnp.where(mask, s, -jnp.inf)
    m = s.max(axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.exp(s - m)
    total = p.sum(axis=-1, keepdims=True)
    lse = jnp.where(total > 0, m + jnp.log(jnp.where(total > 0, total, 1.0)), -jnp.inf)[..., 0]
    p = p / jnp.where(total > 0, total, 1.0)
    out = jnp.einsum("bkgqs,bskd->bqkgd", p, v.astype(_F32), precision=jax.lax.Precision.HIGHEST)
    return out.reshape(b, sq, h, d).astype(out_dtype or q.dtype), lse.reshape(b, h, sq)


def xla_bwd(q, k, v, out, lse, dout, *, causal=True, segment_ids=None, kv_segment_ids=None, q_offset=0, kv_offset=0,
            sm_scale=None, grad_dtype=None, window=None, **_):
    """This key block's share of the gradients (dq [b, sq, h, d], dk, dv [b, skv, kvh, d]) given the final merged
    ``out`` and ``lse`` of the queries: the flash backward, p = exp(s - lse), ds = p (dp - rowsum(dout * out))."""
    b, sq, h, d = q.shape
    kvh = k.shape[2]
    g = h // kvh
    s, mask, scale = _scores_and_mask(q, k, causal=causal, segment_ids=segment_ids, kv_segment_ids=kv_segment_ids,
                                      q_offset=q_offset, kv_offset=kv_offset, sm_scale=sm_scale, window=window)
    lse = lse.reshape(b, kvh, g, sq)[..., None]
    p = jnp.where(mask & jnp.isfinite(lse), jnp.exp(s - jnp.where(jnp.isfinite(lse), lse, 0.0)), 0.0)
    do = dout.astype(_F32).reshape(b, sq, kvh, g, d)
    delta = jnp.einsum("bqkgd,bqkgd->bkgq", do, out.astype(_F32).reshape(b, sq, kvh, g, d))
    hi = jax.lax.Precision.HIGHEST
    dv = jnp.einsum("bkgqs,bqkgd->bskd", p, do, precision=hi)
    dp = jnp.einsum("bqkgd,bskd->bkgqs", do, v.astype(_F32), precision=hi)
    ds = p * (dp - delta[..., None])
    dq = jnp.einsum("bkgqs,bskd->bqkgd", ds, k.astype(_F32), precision=hi).reshape(b, sq, h, d) * scale
    dk = jnp.einsum("bkgqs,bqkgd->bskd", ds, q.astype(_F32).reshape(b, sq, kvh, g, d), precision=hi) * scale
    cast = (lambda x, ref: x.astype(grad_dtype or ref.dtype))
    return cast(dq, q), cast(dk, k), cast(dv, v)


class Blocks(NamedTuple):
    fwd: Callable
    bwd: Callable


XLA_BLOCKS = Blocks(xla_fwd, xla_bwd)


def kernel_blocks(impl: str, interpret: bool) -> Blocks:
    """The flash kernels' block functions (kernels.flash_attention_fwd / _bwd) for ``impl`` pallas or triton."""
    from jaxtrain.kernels import flash_attention_bwd, flash_attention_fwd  # here: the kernels import Pallas/Triton

    return Blocks(functools.partial(flash_attention_fwd, impl=impl, interpret=interpret),
                  functools.partial(flash_attention_bwd, impl=impl, interpret=interpret))


# -- chunk pairs ---------------------------------------------------------------------------------------------------

def _merge(acc, new):
    """Merge two partial attentions (out float32 [b, sq, h, d], lse [b, h, sq]) by their log-sum-exp."""
    if acc is None:
        return new
    (o1, l1), (o2, l2) = acc, new
    lse = jnp.logaddexp(l1, l2)
    ref = jnp.where(jnp.isfinite(lse), lse, 0.0)
    w1 = jnp.swapaxes(jnp.exp(l1 - ref), 1, 2)[..., None]  # [b, sq, h, 1]
    w2 = jnp.swapaxes(jnp.exp(l2 - ref), 1, 2)[..., None]
    return o1 * w1 + o2 * w2, lse


def _hidden(q_off, kv_off, sq, sk, window=None):
    """True when every key of a block of ``sk`` starting at ``kv_off`` lies after every query of the block of ``sq``
    at ``q_off``, or (sliding ``window``) before every query's window."""
    after = kv_off > q_off + sq - 1
    return after if window is None else after | (kv_off + sk - 1 <= q_off - window)


def _pairs_fwd(blocks, qs, sqs, q_offs, ks, vs, sks, kv_offs, acc, kw):
    """Attend each query chunk to each key chunk, merging into ``acc`` (one (out, lse) or None per query chunk);
    hidden pairs skipped by lax.cond."""
    acc = list(acc)
    for a, (q, sq_) in enumerate(zip(qs, sqs)):
        b, n_q, h, d = q.shape
        for k, v, sk, kv_off in zip(ks, vs, sks, kv_offs):
            def compute(q=q, sq_=sq_, k=k, v=v, sk=sk, kv_off=kv_off, a=a):
                return blocks.fwd(q, k, v, causal=True, segment_ids=sq_, kv_segment_ids=sk, q_offset=q_offs[a],
                                  kv_offset=kv_off, out_dtype=_F32, **kw)

            def skip(b=b, n_q=n_q, h=h, d=d):
                return jnp.zeros((b, n_q, h, d), _F32), jnp.full((b, h, n_q), -jnp.inf, _F32)

            hidden = _hidden(q_offs[a], kv_off, n_q, k.shape[1], kw.get("window"))
            acc[a] = _merge(acc[a], jax.lax.cond(hidden, skip, compute))
    return acc


def _pairs_bwd(blocks, qs, sqs, q_offs, outs, lses, douts, ks, vs, sks, kv_offs, kw):
    """(dq per query chunk, dk per key chunk, dv per key chunk) of all chunk pairs; hidden pairs skipped."""
    dqs = [jnp.zeros(q.shape, _F32) for q in qs]
    dks = [jnp.zeros(k.shape, _F32) for k in ks]
    dvs = [jnp.zeros(v.shape, _F32) for v in vs]
    for a, q in enumerate(qs):
        for c, (k, v, sk, kv_off) in enumerate(zip(ks, vs, sks, kv_offs)):
            def compute(q=q, a=a, k=k, v=v, sk=sk, kv_off=kv_off):
                return blocks.bwd(q, k, v, outs[a], lses[a], douts[a], causal=True, segment_ids=sqs[a],
                                  kv_segment_ids=sk, q_offset=q_offs[a], kv_offset=kv_off, grad_dtype=_F32, **kw)

            def skip(q=q, k=k, v=v):
                return jnp.zeros(q.shape, _F32), jnp.zeros(k.shape, _F32), jnp.zeros(v.shape, _F32)

            hidden = _hidden(q_offs[a], kv_off, q.shape[1], k.shape[1], kw.get("window"))
            dq, dk, dv = jax.lax.cond(hidden, skip, compute)
            dqs[a], dks[c], dvs[c] = dqs[a] + dq, dks[c] + dk, dvs[c] + dv
    return dqs, dks, dvs


def _named(out, lse):
    """The output and log-sum-exp under the flash kernels' checkpoint names: model.remat's policies save them, so
    the backward does not run the forward ring again."""
    return checkpoint_name(out, CHECKPOINT_NAMES[0]), checkpoint_name(lse, CHECKPOINT_NAMES[1])


def _split(x, parts, axis=1):
    return [None] * parts if x is None else jnp.split(x, parts, axis=axis)


def _cat(xs, axis=1):
    return jnp.concatenate(xs, axis=axis)


# -- the variants, per device (inside shard_map over the context axis) ------------------------------------------------

def _offsets(n: int, k: int, seq_local: int, balanced: bool):
    """int32 [n, k]: the global offset of each device's local chunks."""
    return jnp.asarray(chunk_order(n, balanced) * (seq_local // k), jnp.int32)


def ring_local(q, k, v, segment_ids, *, n: int, balanced: bool, blocks: Blocks, kw: dict):
    """Ring attention on this device's shard: q [b, L, h, d], k/v [b, L, kvh, d], segment ids [b, L] or None
    (L = seq / n, this device's chunks in the schedule's order) -> out [b, L, h, d]."""
    kc = 2 if balanced else 1
    perm = [(j, (j + 1) % n) for j in range(n)]

    def offsets():
        table = _offsets(n, kc, q.shape[1], balanced)
        me = jax.lax.axis_index(Axis.CONTEXT)
        return table, me

    def forward(q, k, v, seg):
        table, me = offsets()
        qs, sqs = _split(q, kc), _split(seg, kc)
        acc: list = [None] * kc
        kv = (k, v, seg)
        for r in range(n):
            # The next block's transfer is issued before this block's compute: XLA may overlap the two.
            nxt = jax.lax.ppermute(kv, Axis.CONTEXT, perm) if r < n - 1 else None
            src = (me - r) % n
            ks, vs, sks = _split(kv[0], kc), _split(kv[1], kc), _split(kv[2], kc)
            acc = _pairs_fwd(blocks, qs, sqs, table[me], ks, vs, sks, table[src], acc, kw)
            kv = nxt
        return _cat([o for o, _ in acc]).astype(q.dtype), _cat([lse for _, lse in acc], axis=2)

    @jax.custom_vjp
    def attend(q, k, v, seg):
        return forward(q, k, v, seg)[0]

    def attend_fwd(q, k, v, seg):
        out, lse = _named(*forward(q, k, v, seg))
        return out, (q, k, v, seg, out, lse)

    def attend_bwd(res, dout):
        q, k, v, seg, out, lse = res
        table, me = offsets()
        qs, sqs, outs, douts = _split(q, kc), _split(seg, kc), _split(out, kc), _split(dout, kc)
        lses = jnp.split(lse, kc, axis=2)
        dq = [jnp.zeros(x.shape, _F32) for x in qs]
        kv = (k, v, seg)
        dkv = (jnp.zeros(k.shape, _F32), jnp.zeros(v.shape, _F32))
        for r in range(n):
            nxt = jax.lax.ppermute(kv, Axis.CONTEXT, perm) if r < n - 1 else None
            src = (me - r) % n
            ks, vs, sks = _split(kv[0], kc), _split(kv[1], kc), _split(kv[2], kc)
            dqs, dks, dvs = _pairs_bwd(blocks, qs, sqs, table[me], outs, lses, douts, ks, vs, sks, table[src], kw)
            dq = [x + y for x, y in zip(dq, dqs)]
            # dK/dV travel with their block: after the last step the sums arrive at the block's owner.
            dkv = jax.lax.ppermute((dkv[0] + _cat(dks), dkv[1] + _cat(dvs)), Axis.CONTEXT, perm)
            kv = nxt
        return _cat(dq).astype(q.dtype), dkv[0].astype(k.dtype), dkv[1].astype(v.dtype), None

    attend.defvjp(attend_fwd, attend_bwd)
    return attend(q, k, v, segment_ids)


def allgather_local(q, k, v, segment_ids, *, n: int, balanced: bool, blocks: Blocks, kw: dict):
    """All-gather attention on this device's shard (shapes as :func:`ring_local`): K/V and segment ids gathered
    over the ring and put back in sequence order, then each local query chunk attends to the whole sequence."""
    kc = 2 if balanced else 1
    seq_local = q.shape[1]
    inverse = jnp.asarray(np.argsort(chunk_order(n, balanced).reshape(-1)))

    def natural(x):  # [b, n * L, ...] in the schedule's chunk order -> [b, seq, ...] in sequence order
        chunks = x.reshape(x.shape[0], n * kc, seq_local // kc, *x.shape[2:])
        return jnp.take(chunks, inverse, axis=1).reshape(x.shape)

    kf, vf = (natural(jax.lax.all_gather(x, Axis.CONTEXT, axis=1, tiled=True)) for x in (k, v))
    sf = None if segment_ids is None else natural(jax.lax.all_gather(segment_ids, Axis.CONTEXT, axis=1, tiled=True))

    def q_offsets():
        return _offsets(n, kc, seq_local, balanced)[jax.lax.axis_index(Axis.CONTEXT)]

    def zero():  # the gathered keys start at position 0 (created inside: custom_vjp closes over no tracer)
        return jnp.zeros((1,), jnp.int32)

    def forward(q, kf, vf, seg, sf):
        acc = _pairs_fwd(blocks, _split(q, kc), _split(seg, kc), q_offsets(), [kf], [vf], [sf], zero(), [None] * kc, kw)
        return _cat([o for o, _ in acc]).astype(q.dtype), _cat([lse for _, lse in acc], axis=2)

    @jax.custom_vjp
    def attend(q, kf, vf, seg, sf):
        return forward(q, kf, vf, seg, sf)[0]

    def attend_fwd(q, kf, vf, seg, sf):
        out, lse = _named(*forward(q, kf, vf, seg, sf))
        return out, (q, kf, vf, seg, sf, out, lse)

    def attend_bwd(res, dout):
        q, kf, vf, seg, sf, out, lse = res
        dqs, dks, dvs = _pairs_bwd(blocks, _split(q, kc), _split(seg, kc), q_offsets(), _split(out, kc),
                                   jnp.split(lse, kc, axis=2), _split(dout, kc), [kf], [vf], [sf], zero(), kw)
        return _cat(dqs).astype(q.dtype), dks[0].astype(kf.dtype), dvs[0].astype(vf.dtype), None, None

    attend.defvjp(attend_fwd, attend_bwd)
    return attend(q, kf, vf, segment_ids, sf)


def context_attention(q, k, v, segment_ids, *, mesh, specs, n: int, variant: str = "auto", balanced: bool = True,
                      blocks: Blocks = XLA_BLOCKS, **kw):
    """Causal attention of q [batch, seq, heads, d] over k, v [batch, seq, kv_heads, d] (GQA: heads a multiple of
    kv_heads), the sequence in the schedule's order (:func:`token_order`) and split over ``context`` (n devices);
    ``segment_ids`` int [batch, seq] or None. ``specs``: PartitionSpecs (q, kv, segment ids) from the logical
    rules, their sequence entry ``context``. ``variant``: ring, allgather or auto (:func:`choose_variant`). ``kw``
    reaches the block functions (e.g. ``window``: a causal sliding window, whose wholly hidden chunk pairs are
    skipped like the causal mask's)."""
    variant = choose_variant(n) if variant == "auto" else variant
    local = {"ring": ring_local, "allgather": allgather_local}[variant]
    fn = functools.partial(local, n=n, balanced=balanced, blocks=blocks, kw=kw)
    q_spec, kv_spec, seg_spec = specs
    if segment_ids is None:
        return jax.shard_map(lambda q, k, v: fn(q, k, v, None), mesh=mesh, in_specs=(q_spec, kv_spec, kv_spec),
                             out_specs=q_spec, check_vma=False)(q, k, v)
    return jax.shard_map(fn, mesh=mesh, in_specs=(q_spec, kv_spec, kv_spec, seg_spec), out_specs=q_spec,
                         check_vma=False)(q, k, v, segment_ids)
