"""Indexing: ``x[...]`` and ``x[...] = value``.

Basic indexing (ints, slices, ``None``, ``...``) is a view (:mod:`dtorch.ops.shape`): a
sharded dim may only be taken whole (``:``). One DTensor of indices among full slices
(``x[idx]``, ``x[:, idx]``) gathers: ``x`` must not be sharded on the indexed dim; the
index's Shard lands on the matching output dim. ``x[...] = value`` writes in place: the
written region keeps ``x``'s placements, a DTensor value must match them (a Replicate value is
narrowed locally), a scalar is legal except into ``Partial('sum')``. Example::

    >>> expand_index((Ellipsis, 0), 3)
    (slice(None, None, None), slice(None, None, None), 0)
"""

from __future__ import annotations

import torch

from ..placement import Replicate, Shard
from ..runtime.messages import Coord
from ..spec import TensorSpec
from .binary import elementwise_placements, narrow_table, sliced_call
from .explain import with_dim
from .infer import to_meta
from .registry import Decision, TArg, rule
from .shape import _PRIMES, view_placements

R = Replicate()
FULL = slice(None, None, None)
LEGAL_GATHER = ("x[idx] with x not sharded on the indexed dim: idx S(d) -> S(k + d); x S(e) -> "
                "S(e) shifted past the index dims; x P(op) with R idx -> P(op)")
LEGAL_SET = ("x[basic index] = value: the region keeps x's placements; value a scalar (not into "
             "P(sum)) or a DTensor placed like the region (R is narrowed locally)")


def expand_index(index, ndim: int) -> tuple:
    """The index as a tuple with ``...`` expanded to full slices."""
    if type(index) is not tuple:  # a TArg is a (named) tuple too
        index = (index,)
    consumed = sum(1 for i in index if i is not None and i is not Ellipsis)
    out = []
    for i in index:
        if i is Ellipsis:
            out.extend([FULL] * (ndim - consumed))
        else:
            out.append(i)
    return tuple(out)


def _tensor_positions(index):
    return [k for k, i in enumerate(index) if type(i) is TArg]


def _strided(x):
    return torch.empty_strided(x.shape, _PRIMES[:x.ndim], dtype=x.dtype, device="meta")


@rule(torch.Tensor.__getitem__, family="indexing", arg_names=("input", "index"))
def getitem_rule(op):
    x, index = op.args[0], op.args[1]
    if not _tensor_positions(expand_index(index, x.ndim)):
        out = torch.Tensor.__getitem__(_strided(x), to_meta(index))
        return view_placements(op, x, [out])[0]
    return _gather(op, x, expand_index(index, x.ndim))


def gather_local(x, index, k, idx):
    """Local kernel: ``x[index]`` with this rank's index shard put back at position ``k``
    (the shard travels as a top-level argument, so a failed index poisons cleanly)."""
    return x[index[:k] + (idx,) + index[k + 1:]]


def _gather(op, x, index):
    positions = _tensor_positions(index)
    if len(positions) != 1 or any(i != FULL for k, i in enumerate(index) if k not in positions):
        op.fail(None, LEGAL_GATHER, {},
                "dtorch supports one DTensor index among full slices (x[idx], x[:, idx])")
    k = positions[0]
    idx = index[k]
    out = []
    for m, (p, q) in enumerate(zip(x.placements, idx.placements)):
        if q.is_partial() or (isinstance(p, Shard) and p.dim == k) or (
                isinstance(q, Shard) and not p.is_replicate()) or (
                p.is_partial() and not q.is_replicate()):
            fix = {idx: with_dim(idx.placements, m, R)} if not q.is_replicate() else {
                x: with_dim(x.placements, m, R)}
            op.fail(m, LEGAL_GATHER, fix, f"x is {p} and the index {q} on this mesh dim")
        if isinstance(q, Shard):
            out.append(Shard(k + q.dim))
        elif isinstance(p, Shard):
            out.append(Shard(p.dim if p.dim < k else p.dim - 1 + idx.ndim))
        else:
            out.append(p)
    hole = index[:k] + (None,) + index[k + 1:]
    return Decision((tuple(out),), gather_local, (x, hole, k, idx), {})


def setitem_local(x, index, value):
    """Local kernel: ``x[index] = value``; returns ``x`` (the op is in place)."""
    x[index] = value
    return x


def _setitem_meta(x, index, value):
    x[index] = value
    return x


@rule(torch.Tensor.__setitem__, family="indexing", meta=_setitem_meta,
      arg_names=("input", "index", "value"))
def setitem_rule(op):
    x, index, value = op.args
    if _tensor_positions(expand_index(index, x.ndim)):
        op.fail(None, LEGAL_SET, {}, "assigning through a DTensor index is not supported")
    region = torch.Tensor.__getitem__(_strided(x), to_meta(index))
    region_pl = view_placements(op, x, [region])[0]
    if type(value) is not TArg:
        for m, p in enumerate(x.placements):
            if p.is_partial("sum"):
                op.fail(m, LEGAL_SET, {x: with_dim(x.placements, m, R)},
                        "writing a value into every rank's share of a Partial('sum') would "
                        "count it once per rank")
        return Decision((x.placements,), setitem_local, op.args, {}, 0)
    pseudo = TArg(-1, "x[index]", TensorSpec(tuple(region.shape), x.dtype, x.mesh, region_pl))
    placements, narrow = elementwise_placements(op, [(None, pseudo), (2, value)], "copy",
                                                tuple(region.shape))
    if placements != region_pl:
        m = next(i for i, (a, b) in enumerate(zip(placements, region_pl)) if a != b)
        op.fail(m, LEGAL_SET, {value: with_dim(value.placements, m, region_pl[m])},
                f"the region x[index] is {region_pl[m]} but the value makes it {placements[m]}")
    if not narrow:
        return Decision((x.placements,), setitem_local, op.args, {}, 0)
    (where, (t, target)), = narrow.items()
    table = narrow_table(t.shape, t.mesh, t.placements, target)
    if table is None:
        op.fail(None, LEGAL_SET, {t: target}, "the value's blocks do not contain the region's")
    return Decision((x.placements,), sliced_call,
                    (setitem_local, ((where, table),), Coord(op.mesh), *op.args), {}, 0)

