"""``F.scaled_dot_product_attention`` without context parallelism: batch and head sharding.

Inputs are ``[..., L, E]`` (query) and ``[..., S, E]`` / ``[..., S, Ev]`` (key / value); per
mesh dim:

- all Replicate -> Replicate;
- query, key and value all ``Shard(d)`` on the same leading (batch or head) dim -> ``Shard(d)``
  (one of them Replicate at the same size on ``d``: narrowed locally to the others' blocks);
  with grouped-query attention every rank must hold whole groups;
- a value ``Partial(sum|avg)`` beside Replicate query/key -> that Partial (linear in value);
- a sharded sequence or feature dim raises, except ``Shard(2)`` on a mesh dim named
  ``ulysses_cp`` / ``ulysess_cp`` / ``ring_cp``: context parallelism, a composite op
  (see :mod:`dtorch.ops.cp_attention`).

``attn_mask`` follows the output like a binary-op operand: sharded alike, or Replicate
(narrowed locally), or broadcast. ``dropout_p > 0`` on DTensors runs through
:mod:`dtorch.ops.dropout`: the mask over the attention weights, sharded like them, then
:func:`dtorch.random.attention_with_mask` (ruled here). Example::

    >>> LEGAL.split(";")[0]
    'R, R, R -> R'
"""

from __future__ import annotations

from .. import random as stream
from ..errors import UnsupportedOpError
from ..layout import rank_block
from ..placement import Replicate, Shard
from ..runtime.messages import Coord
from . import cp_attention
from .binary import elementwise_placements, narrow_table, sliced_call
from .explain import with_dim
from .registry import Decision, TArg, rule

R = Replicate()
LEGAL = ("R, R, R -> R; S(b), S(b), S(b) -> S(b) for a batch or head dim b; R, R, P(sum|avg) "
         "value -> P(sum|avg); the sequence dim S(2) only on a ulysses_cp / ring_cp dim (context "
         "parallelism), the feature dim never")


def _qkv_dim(op, q, k, v, m, narrow):
    """The output's placement on mesh dim ``m``; a Replicate query, key or value beside
    ``Shard(d)`` ones (same size on ``d``) is narrowed to their blocks (added to ``narrow``)."""
    pls = [t.placements[m] for t in (q, k, v)]
    if any(p.is_partial() for p in pls):
        p = v.placements[m]
        if (p.is_partial() and p.reduce_op in ("sum", "avg") and pls[0].is_replicate()
                and pls[1].is_replicate()):
            return p
        bad = next(t for t in (q, k, v) if t.placements[m].is_partial())
        op.fail(m, LEGAL, {bad: with_dim(bad.placements, m, R)}, "attention is not linear in "
                "the query or key, and a Partial value needs Replicate query and key")
    shards = [p for p in pls if isinstance(p, Shard)]
    if not shards:
        return R
    d = shards[0].dim
    if d >= q.ndim - 2:
        t = next(t for t in (q, k, v) if isinstance(t.placements[m], Shard))
        op.fail(m, LEGAL, {t: with_dim(t.placements, m, R)},
                "the sequence or feature dim is sharded: context parallelism shards the "
                "sequence (Shard(2)) on a mesh dim named ulysses_cp or ring_cp")
    size = next(t.shape[d] for t in (q, k, v) if t.placements[m] == Shard(d))
    for where, t in zip(_qkv_where(op), (q, k, v)):
        if t.placements[m] == Shard(d):
            continue
        if not (t.placements[m].is_replicate() and t.shape[d] == size):
            op.fail(m, LEGAL, {t: with_dim(t.placements, m, Shard(d))},
                    f"query, key and value must all be sharded on dim {d} (or Replicate "
                    f"at the same size there: narrowed locally)")
        current = narrow.get(where, (t, t.placements))[1]
        narrow[where] = (t, with_dim(current, m, Shard(d)))
    return Shard(d)


def _qkv_where(op) -> tuple:
    """Where query, key and value sit in the call: their position, or their keyword."""
    return tuple(name if name in op.kwargs else pos
                 for pos, name in enumerate(("query", "key", "value")))


def _check_groups(op, q, k, out):
    """Grouped-query attention: each rank's query heads must map to its own kv heads."""
    hq, hk = q.shape[-3] if q.ndim >= 3 else 1, k.shape[-3] if k.ndim >= 3 else 1
    if q.ndim < 3 or hq == hk:
        return
    g = hq // hk
    mesh, d = q.mesh, q.ndim - 3
    for r in mesh.ranks:
        c = mesh.get_coordinate(r)
        a, b = rank_block(q.shape, mesh, q.placements, c), rank_block(k.shape, mesh,
                                                                      k.placements, c)
        if (a.offset[d], a.shape[d]) != (b.offset[d] * g, b.shape[d] * g):
            m = next(i for i, p in enumerate(out) if p == Shard(d))
            op.fail(m, LEGAL, {q: with_dim(q.placements, m, R), k: with_dim(k.placements, m, R)},
                    f"grouped-query attention ({hq} query heads, {hk} kv heads): rank {r} "
                    f"would hold query heads that do not match its kv heads")


@rule("scaled_dot_product_attention", family="attention",
      arg_names=("query", "key", "value", "attn_mask"))
def sdpa_rule(op):
    q, k, v = op.arg(0, "query"), op.arg(1, "key"), op.arg(2, "value")
    cp = cp_attention.active(q, k, v) if type(q) is type(k) is type(v) is TArg else {}
    if op.arg(4, "dropout_p", 0.0):  # DTensor inputs take dtorch.ops.dropout before rules
        raise UnsupportedOpError(f"{op.name} with dropout_p > 0 needs query, key and value "
                                 f"all DTensors; make them DTensors, or pass dropout_p=0.0")
    if cp:
        _check_ndims(op, q, k, v)
        return cp_attention.cp_rule(op, q, k, v, op.arg(3, "attn_mask"), cp)
    return _local_attention(op, q, k, v)


@rule(stream.attention_with_mask, family="attention",
      arg_names=("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale",
                 "enable_gqa"))
def attention_with_mask_rule(op):
    """Attention with its dropout mask given (see dtorch.ops.dropout): the mask is sharded
    like the attention weights, as a sharded ``attn_mask``."""
    q, k, v = op.arg(0, "query"), op.arg(1, "key"), op.arg(2, "value")
    cp = cp_attention.active(q, k, v)
    if cp:
        raise UnsupportedOpError(f"attention dropout under context parallelism ({', '.join(cp)}) "
                                 f"is not supported; pass dropout_p=0.0")
    return _local_attention(op, q, k, v)


def _check_ndims(op, q, k, v) -> None:
    if q.ndim != k.ndim or q.ndim != v.ndim:
        op.fail(None, LEGAL, {}, "query, key and value must have the same number of dims")


def _local_attention(op, q, k, v):
    """Batch and head sharding (see the module doc); masks Replicate (narrowed locally) or
    sharded like the attention weights."""
    _check_ndims(op, q, k, v)
    narrow: dict = {}
    out = tuple(_qkv_dim(op, q, k, v, m, narrow) for m in range(op.mesh.ndim))
    _check_groups(op, q, k, out)
    for where, mask in _masks(op):
        narrow.update(_mask_narrowing(op, q, k, out, where, mask))
    if not narrow:
        return out
    cuts = tuple((w, narrow_table(t.shape, t.mesh, t.placements, target))
                 for w, (t, target) in narrow.items())
    return Decision((out,), sliced_call, (op.func, cuts, Coord(op.mesh), *op.args),
                    dict(op.kwargs))


def _masks(op) -> list:
    """``[(where, TArg)]``: the ``attn_mask`` (position 3 or keyword) and ``dropout_mask``
    (keyword only) given as DTensors."""
    found = [("attn_mask" if "attn_mask" in op.kwargs else 3, op.arg(3, "attn_mask")),
             ("dropout_mask", op.arg(None, "dropout_mask"))]
    return [(w, t) for w, t in found if type(t) is TArg]


def _mask_narrowing(op, q, k, out, where, mask) -> dict:
    """The narrowing ``mask`` needs (``{where: (TArg, target placements)}``); raises unless it
    is Replicate or sharded like the attention weights."""
    from ..spec import TensorSpec
    shape = op.out.shapes[0][:-1] + (k.shape[-2],)
    scores = tuple(R if p.is_partial() else p for p in out)  # a Partial value: scores are R
    pseudo = TArg(-1, "attention scores", TensorSpec(shape, q.dtype, q.mesh, scores))
    placements, narrow = elementwise_placements(op, [(None, pseudo), (where, mask)], "none",
                                                shape)
    if placements != scores:
        m = next(i for i, (a, b) in enumerate(zip(placements, scores)) if a != b)
        op.fail(m, LEGAL, {mask: with_dim(mask.placements, m, R)},
                f"{mask.label} must be Replicate or sharded like the attention scores")
    return narrow
