"""Reductions (``sum mean amax amin max min prod argmax argmin norm std var logsumexp any all``)
and scans (``cumsum cumprod``) with ``dim``/``keepdim``.

Per mesh dim: a Shard on a kept dim moves to that dim's output index; a Shard on a reduced
dim leaves a pending reduction: ``sum -> Partial("sum")``, ``amax``/``max`` (no dim) ->
``Partial("max")``, ``amin``/``min`` -> ``Partial("min")``, ``mean -> Partial("avg")`` when
every rank holds the same number of elements of the reduced dims (otherwise each rank sums and
divides by the global count: ``Partial("sum")``), ``norm(p=inf) -> Partial("max")``.
Along a sharded dim (no Partial input), ``max``/``min`` with ``dim``, ``argmax``/``argmin``,
``topk``/``kthvalue`` (while ``k x blocks < n / 2``), ``logsumexp``, ``var``/``std`` (and
``_mean``), every vector ``norm`` and ``cumsum``/``cumprod`` never reach these rules: they
run as composites that gather per-block candidates only (``registry.decomposed`` in
:mod:`~dtorch.ops.sharded_reductions`, :mod:`~dtorch.ops.sharded_moments`,
:mod:`~dtorch.ops.sharded_scans`). ``any`` over a sharded dim is
``Partial("max")``, ``all`` ``Partial("min")``. What is left raises here: ``prod``,
``median``, ``sort``, ``cummax``/``logcumsumexp`` along a sharded dim, these ops on Partial
inputs they do not commute with, and ``topk``/``kthvalue`` with a large ``k``. Example::

    >>> reduced_dims(None, 3), reduced_dims(-1, 3), reduced_dims((0, 2), 3)
    ((0, 1, 2), (2,), (0, 2))
    >>> reduced_dims(0, 0), reduced_dims(-1, 0), reduced_dims(None, 0)
    ((), (), ())
    >>> out_dim(2, (0,), keepdim=False)
    1
"""

from __future__ import annotations

import torch

from ..layout import local_shape
from ..placement import Partial, Replicate, Shard
from .explain import with_dim
from .registry import Decision, rule
from .sharded_blocks import identity

R = Replicate()
_OF = {"sum": "sum", "nansum": "sum", "mean": "avg", "nanmean": "avg", "amax": "max",
       "amin": "min", "max": "max", "min": "min"}


def reduced_dims(dim, ndim: int) -> tuple[int, ...]:
    """Normalized reduced dims; ``None`` or ``()`` means all. A 0-dim tensor has no dim to
    reduce (torch accepts ``dim=0`` / ``-1`` there, and checks the value): ``()``."""
    if ndim == 0:
        return ()
    if dim is None or (isinstance(dim, (tuple, list)) and len(dim) == 0):
        return tuple(range(ndim))
    if isinstance(dim, (tuple, list)):
        return tuple(sorted(d % max(ndim, 1) for d in dim))
    return (dim % max(ndim, 1),)


def out_dim(d: int, dims, keepdim: bool) -> int:
    return d if keepdim else d - sum(1 for r in dims if r < d)


def _legal(kind: str) -> str:
    partial = {"sum": "P(sum)", "avg": "P(avg) (even shards) or P(sum)", "max": "P(max)",
               "min": "P(min)"}.get(kind)
    reduced = f"S(reduced dim) -> {partial}" if partial else "no Shard on a reduced dim"
    linear = {"sum": "P(sum|avg) input kept", "avg": "P(sum|avg) input kept",
              "max": "P(max) input kept", "min": "P(min) input kept"}.get(kind, "no Partial input")
    return f"R -> R; S(kept dim) -> S(its output dim); {reduced}; {linear}"


# reductions that return a 0-dim input itself (indices: 0), so its placements are kept
_SAME_ON_0D = {"sum", "nansum", "mean", "nanmean", "amax", "amin", "max", "min", "prod",
               "argmax", "argmin", "logsumexp", "median", "nanmedian"}


def reduce_placements(op, x, dims, keepdim, kind):
    """Output placements of reducing ``x`` over ``dims`` (``kind``: sum/avg/max/min/None).
    A 0-dim input keeps its placements (Partial too) for the ops in ``_SAME_ON_0D``."""
    if x.ndim == 0 and op.name.split(".")[-1] in _SAME_ON_0D:
        return tuple(x.placements)
    out = []
    for m, p in enumerate(x.placements):
        if isinstance(p, Shard):
            if p.dim in dims:
                if kind is None:
                    op.fail(m, _legal(kind), {x: with_dim(x.placements, m, R)},
                            f"{op.name} over a sharded dim cannot be combined from per-rank "
                            f"results")
                out.append(Partial(kind))
            else:
                out.append(Shard(out_dim(p.dim, dims, keepdim)))
        elif isinstance(p, Partial):
            ok = (kind in ("sum", "avg") and p.reduce_op in ("sum", "avg")) or (
                kind in ("max", "min") and p.reduce_op == kind)
            if not ok:
                op.fail(m, _legal(kind), {x: with_dim(x.placements, m, R)},
                        f"{op.name} does not commute with the pending {p.reduce_op}")
            out.append(p)
        else:
            out.append(R)
    return tuple(out)


def _sizes_along(x, dims, m):
    mesh = x.mesh
    return {tuple(local_shape(x.shape, mesh, x.placements, mesh.get_coordinate(r))[d]
                  for d in dims) for r in mesh.ranks}


def _has_empty(x, dims) -> bool:
    mesh = x.mesh
    return any(any(local_shape(x.shape, mesh, x.placements, mesh.get_coordinate(r))[d] == 0
                   for d in dims) for r in mesh.ranks)


def _dims_keepdim(op, dim_pos=1, keep_pos=2, dim_name="dim"):
    x = op.tensors[0]
    dim = op.arg(dim_pos, dim_name)
    keepdim = bool(op.arg(keep_pos, "keepdim", False))
    return x, reduced_dims(dim, x.ndim), keepdim


def mean_as_sum(x, dims, keepdim, count, dtype=None):
    """Local kernel: this rank's share of a global mean, ``sum(local) / count``."""
    s = torch.sum(x, dims, keepdim, dtype=dtype) if dims else x.to(dtype or x.dtype).clone()
    return s / count


def reduce_or_identity(name, identity, dims, keepdim, x):
    """Local kernel: ``torch.<name>(x, dims, keepdim)``, or the identity of the reduction where
    this rank's shard of a reduced dim is empty (uneven sharding)."""
    if any(x.shape[d] == 0 for d in dims):
        shape = [1 if d in dims else s for d, s in enumerate(x.shape)] if keepdim else [
            s for d, s in enumerate(x.shape) if d not in dims]
        return torch.full(shape, identity, dtype=x.dtype)
    return getattr(torch, name)(x, dims, keepdim)


@rule("sum", "nansum", family="reduction", arg_names=("input", "dim", "keepdim"))
def sum_rule(op):
    x, dims, keepdim = _dims_keepdim(op)
    return reduce_placements(op, x, dims, keepdim, "sum")


@rule("mean", "nanmean", family="reduction", arg_names=("input", "dim", "keepdim"))
def mean_rule(op):
    x, dims, keepdim = _dims_keepdim(op)
    placements = reduce_placements(op, x, dims, keepdim, "avg")
    split = [m for m, p in enumerate(x.placements) if isinstance(p, Shard) and p.dim in dims]
    if not split:
        return placements
    if len(_sizes_along(x, dims, None)) == 1 and not _has_empty(x, dims):
        return placements
    count = 1
    for d in dims:
        count *= x.shape[d]
    if op.entry.name.endswith("nanmean"):
        op.fail(split[0], _legal("avg"), {x: with_dim(x.placements, split[0], R)},
                "nanmean over an unevenly sharded dim")
    placements = tuple(Partial("sum") if m in split else p for m, p in enumerate(placements))
    return Decision((placements,), mean_as_sum, (x, dims, keepdim, count),
                    {"dtype": op.arg(None, "dtype")} if op.arg(None, "dtype") else {})


def _extreme(kind, name):
    def rule_fn(op):
        x, dims, keepdim = _dims_keepdim(op)
        placements = reduce_placements(op, x, dims, keepdim, kind)
        if _has_empty(x, dims):
            return Decision((placements,), reduce_or_identity,
                            (name, identity(kind, x.dtype), dims, keepdim, x), {})
        return placements
    rule_fn.__name__ = f"{name}_rule"
    return rule_fn


rule("amax", family="reduction", arg_names=("input", "dim", "keepdim"))(_extreme("max", "amax"))
rule("amin", family="reduction", arg_names=("input", "dim", "keepdim"))(_extreme("min", "amin"))


def _minmax(kind):
    name = "amax" if kind == "max" else "amin"
    all_rule = _extreme(kind, name)

    def rule_fn(op):
        other = op.arg(1, "other", op.arg(None, "dim"))
        from .registry import TArg
        if type(other) is TArg:  # torch.max(a, b) is maximum
            from .binary import broadcast_rule, operands_of
            return broadcast_rule(op, operands_of(op, ("input", "other")),
                                  "maximum" if kind == "max" else "minimum")
        if other is None:
            return all_rule(op)
        x, dims, keepdim = _dims_keepdim(op)
        placements = reduce_placements(op, x, dims, keepdim, None)
        return [placements, placements]
    rule_fn.__name__ = f"{kind}_rule"
    return rule_fn


rule("max", family="reduction", arg_names=("input", "dim", "keepdim"))(_minmax("max"))
rule("min", family="reduction", arg_names=("input", "dim", "keepdim"))(_minmax("min"))


def _any_all(kind, name):
    def rule_fn(op):
        """``any`` over a sharded dim is the max of the ranks' answers (``Partial("max")``),
        ``all`` the min; an empty block answers the identity (False / True) by itself. A
        Partial input is refused: ``any`` of a pending sum is not the sum of ``any``s."""
        x, dims, keepdim = _dims_keepdim(op)
        partial_input = any(q.is_partial() for q in x.placements)
        return reduce_placements(op, x, dims, keepdim, None if partial_input else kind)
    rule_fn.__name__ = f"{name}_rule"
    return rule_fn


rule("any", family="reduction", arg_names=("input", "dim", "keepdim"))(_any_all("max", "any"))
rule("all", family="reduction", arg_names=("input", "dim", "keepdim"))(_any_all("min", "all"))


@rule("prod", "argmax", "argmin", "logsumexp", "median", "nanmedian",
      "count_nonzero", family="reduction", arg_names=("input", "dim", "keepdim"))
def no_partial_rule(op):
    x, dims, keepdim = _dims_keepdim(op)
    return [reduce_placements(op, x, dims, keepdim, None)] * len(op.out.shapes)


@rule("std", "var", "std_mean", "var_mean", family="reduction",
      arg_names=("input", "dim", "unbiased", "keepdim"))
def std_rule(op):
    x = op.tensors[0]
    dim = op.arg(1, "dim")
    if isinstance(dim, bool):  # std(x, unbiased)
        dim = None
    dims = reduced_dims(dim, x.ndim)
    keepdim = bool(op.kwargs.get("keepdim", op.args[3] if len(op.args) > 3 and
                                  isinstance(op.args[3], bool) else False))
    placements = reduce_placements(op, x, dims, keepdim, None)
    return [placements] * len(op.out.shapes)


def _norm_args(op):
    """``(p, dims, keepdim)`` of ``torch.norm`` / ``Tensor.norm`` / ``linalg.vector_norm``."""
    x = op.tensors[0]
    if op.func is torch.linalg.vector_norm:
        p = op.arg(1, "ord", 2)
        dim, keepdim = op.arg(2, "dim"), op.arg(3, "keepdim", False)
    else:
        p = op.arg(1, "p", "fro")
        dim, keepdim = op.arg(2, "dim"), op.arg(3, "keepdim", False)
    return p, reduced_dims(dim, x.ndim), bool(keepdim)


@rule("norm", torch.linalg.vector_norm, family="reduction", arg_names=("input", "p", "dim"))
def norm_rule(op):
    x = op.tensors[0]
    p, dims, keepdim = _norm_args(op)
    if p in (float("inf"), "inf"):
        partial = any(q.is_partial() for q in x.placements)
        placements = reduce_placements(op, x, dims, keepdim, None if partial else "max")
        return Decision((placements,), _inf_norm_or_zero, (x, dims, keepdim), {})
    for m, q in enumerate(x.placements):
        if isinstance(q, Shard) and q.dim in dims:
            op.fail(m, _legal(None) + "; norm(p=inf) -> P(max)",
                    {x: with_dim(x.placements, m, R)},
                    "a p-norm over a sharded dim: compute x.abs().pow(p).sum(dim) (Partial "
                    "sum), redistribute it, then take the root")
    return reduce_placements(op, x, dims, keepdim, None)


def _inf_norm_or_zero(x, dims, keepdim):
    """Local kernel: ``max |x|`` over ``dims``; 0 where this rank's shard is empty."""
    return reduce_or_identity("amax", 0, dims, keepdim, x.abs())


@rule("cumsum", "cumprod", "cummax", "cummin", "logcumsumexp", family="reduction",
      arg_names=("input", "dim"))
def scan_rule(op):
    x = op.tensors[0]
    d = op.arg(1, "dim") % max(x.ndim, 1)
    linear = op.entry.name.split(".")[-1] == "cumsum"
    for m, p in enumerate(x.placements):
        if (isinstance(p, Shard) and p.dim == d) or (
                isinstance(p, Partial) and not (linear and p.reduce_op in ("sum", "avg"))):
            op.fail(m, "R -> R; S(other dim) -> S(other dim); cumsum keeps P(sum|avg)",
                    {x: with_dim(x.placements, m, R)},
                    f"{op.name} along a sharded dim needs the earlier ranks' totals")
    return [x.placements] * len(op.out.shapes)


rule("cumsum_", "cumprod_", family="reduction", inplace=True,
     arg_names=("input", "dim"))(scan_rule)


@rule("topk", "sort", "argsort", "kthvalue", "msort", family="reduction",
      arg_names=("input", "k", "dim"))
def sort_rule(op):
    """Sorting and top-k work along one dim, which must not be sharded (nor Partial)."""
    x = op.tensors[0]
    short = op.entry.name.split(".")[-1]
    pos = {"topk": 2, "kthvalue": 2}.get(short, 1)
    default = 0 if short == "msort" else -1
    d = op.arg(pos, "dim", default)
    d = (d if isinstance(d, int) else default) % max(x.ndim, 1)
    for m, p in enumerate(x.placements):
        if (isinstance(p, Shard) and p.dim == d) or p.is_partial():
            op.fail(m, "R -> R; S(d) -> S(d) for d other than the sorted dim; no Partial",
                    {x: with_dim(x.placements, m, R)}, f"{op.name} along a sharded dim {d}")
    keepdim = short != "kthvalue" or bool(op.arg(3, "keepdim", False))
    placements = tuple(Shard(out_dim(p.dim, (d,), keepdim)) if isinstance(p, Shard) else p
                       for p in x.placements)
    return [placements] * len(op.out.shapes)
