"""``cat`` / ``concat`` / ``concatenate`` / ``stack`` (``split chunk narrow unbind`` are views:
:mod:`dtorch.ops.shape`).

Per mesh dim every input must have the same placement: Replicate -> Replicate, the same
Partial -> that Partial (concatenation is linear), ``Shard(d)`` on a dim other than the cat
dim -> ``Shard(d)`` (``stack`` shifts it past the new dim), and a Replicate input beside such
Shards is narrowed to their blocks on each rank (:mod:`dtorch.ops.local_dims`: no data
moves). Concatenating along a sharded dim would interleave the shards, so it raises. Example::

    >>> stacked_dim(1, 0), stacked_dim(1, 2)
    (2, 1)
"""

from __future__ import annotations

from ..placement import Replicate, Shard
from .explain import with_dim
from .local_dims import Operand, free_labels, local_decision
from .registry import Decision, TArg, rule

R = Replicate()
LEGAL = ("all inputs alike: R -> R; P(op) -> P(op); S(d) -> S(d) for d other than the cat "
         "dim (stack: S(d) -> S(d + 1) at or after the new dim); R beside S(d) is narrowed")


def stacked_dim(d: int, dim: int) -> int:
    return d + 1 if d >= dim else d


def joined(func, dim, *tensors):
    """Local kernel: ``func(tensors, dim)``; the shards travel as top-level arguments, so a
    failed input poisons the output cleanly."""
    return func(list(tensors), dim)


def _decision(op, tensors, placements, dim):
    if len(tensors) != len(_raw_inputs(op)):
        return placements  # mixed in non-DTensor entries: run as called
    return Decision((placements,), joined, (op.func, dim, *tensors), {})


def _narrowing(op, tensors, dim, stack: bool):
    """The local-dims Decision when Replicate inputs sit beside Shards (no Partial, every
    input a DTensor of one rank); None otherwise (the all-alike rule decides)."""
    if len(tensors) != len(_raw_inputs(op)) or len({t.ndim for t in tensors}) != 1:
        return None
    alike = all(t.placements == tensors[0].placements for t in tensors)
    if alike or any(p.is_partial() for t in tensors for p in t.placements):
        return None
    labels = free_labels(tensors[0].ndim, mixed=() if stack else (dim,))
    out = labels[:dim] + (None,) + labels[dim:] if stack else labels
    operands = [Operand(2 + i, t, labels) for i, t in enumerate(tensors)]
    return local_decision(op, operands, [out], LEGAL, joined, (op.func, dim, *tensors), {})


def _raw_inputs(op):
    tensors = op.arg(0, "tensors")
    return list(tensors) if isinstance(tensors, (list, tuple)) else [tensors]


def _inputs(op):
    tensors = op.arg(0, "tensors")
    if not isinstance(tensors, (list, tuple)):
        tensors = [tensors]
    return [t for t in tensors if type(t) is TArg]


def cat_placements(op, tensors, dim, stack: bool):
    first = tensors[0]
    out = []
    for m, p in enumerate(first.placements):
        for t in tensors[1:]:
            if t.placements[m] != p:
                op.fail(m, LEGAL, {t: with_dim(t.placements, m, p)},
                        f"{first.label} is {p} but {t.label} is {t.placements[m]}")
        if isinstance(p, Shard):
            if not stack and p.dim == dim:
                op.fail(m, LEGAL, {t: with_dim(t.placements, m, R) for t in tensors},
                        f"{op.name} along dim {dim}, which is sharded")
            out.append(Shard(stacked_dim(p.dim, dim)) if stack else p)
        else:
            out.append(p)
    return tuple(out)


@rule("cat", "concat", "concatenate", family="concat", arg_names=("tensors", "dim"))
def cat_rule(op):
    tensors = _inputs(op)
    ndim = max(t.ndim for t in tensors)
    dim = op.arg(1, "dim", 0) % max(ndim, 1)
    narrowed = _narrowing(op, tensors, dim, stack=False)
    if narrowed is not None:
        return narrowed
    placements = cat_placements(op, [t for t in tensors if t.ndim == ndim], dim, stack=False)
    return _decision(op, tensors, placements, dim)


@rule("stack", family="concat", arg_names=("tensors", "dim"))
def stack_rule(op):
    tensors = _inputs(op)
    dim = op.arg(1, "dim", 0) % (tensors[0].ndim + 1)
    narrowed = _narrowing(op, tensors, dim, stack=True)
    if narrowed is not None:
        return narrowed
    return _decision(op, tensors, cat_placements(op, tensors, dim, stack=True), dim)
