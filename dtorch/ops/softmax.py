"""``softmax``, ``log_softmax``, ``softmin``: placements kept, never over a sharded dim.

Normalizing over a sharded dim would need every rank's values (a max and a sum across
ranks), so it raises; redistribute that dim to Replicate, or shard another dim. A Partial
input raises (softmax is not linear). Example::

    >>> softmax_dim(None, 3), softmax_dim(-1, 2)
    (0, 1)
"""

from __future__ import annotations

from ..placement import Replicate, Shard
from .explain import with_dim
from .registry import rule

R = Replicate()
LEGAL = "R -> R; S(d) -> S(d) for d other than the softmax dim; no Partial input"


def softmax_dim(dim, ndim: int) -> int:
    """The dim softmax normalizes over (torch's legacy choice when ``dim`` is None)."""
    if dim is None:
        dim = 0 if ndim in (0, 1, 3) else 1
    return dim % max(ndim, 1)


def fix_for(x, m, d):
    """Shard another dim when there is one, or Replicate."""
    others = [i for i in range(x.ndim) if i != d and x.shape[i] > 1]
    options = [with_dim(x.placements, m, Shard(others[0]))] if others else []
    return {x: options + [with_dim(x.placements, m, R)]}


@rule("softmax", "log_softmax", "softmin", family="softmax", arg_names=("input", "dim"))
def softmax_rule(op):
    x = op.tensors[0]
    d = softmax_dim(op.arg(1, "dim"), x.ndim)
    for m, p in enumerate(x.placements):
        if isinstance(p, Shard) and p.dim == d:
            op.fail(m, LEGAL, fix_for(x, m, d),
                    f"{op.name} over dim {d}, which is sharded: it needs every rank's values")
        if p.is_partial():
            op.fail(m, LEGAL, {x: with_dim(x.placements, m, R)},
                    f"{op.name} does not commute with the pending {p.reduce_op}")
    return x.placements
