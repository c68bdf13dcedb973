"""``layer_norm``, ``rms_norm``, ``normalize``: placements kept, never over a sharded dim.

The normalized dims (the last ``len(normalized_shape)``; ``dim`` for ``normalize``) must not be
sharded and the input must not be Partial; ``weight``/``bias`` span the normalized dims, so
they are Replicate. Batch and sequence dims may be sharded, unevenly too. Example::

    >>> normalized_dims(3, (8,)), normalized_dims(4, (4, 8))
    ((2,), (2, 3))
"""

from __future__ import annotations

from ..placement import Replicate, Shard
from .explain import with_dim
from .registry import TArg, rule
from .softmax import fix_for

R = Replicate()
LEGAL = ("input: R or S(d) on a dim that is not normalized, no Partial; weight/bias: R -> the "
         "input's placements")


def normalized_dims(ndim: int, normalized_shape) -> tuple[int, ...]:
    if isinstance(normalized_shape, int):
        normalized_shape = (normalized_shape,)
    k = len(normalized_shape)
    return tuple(range(ndim - k, ndim))


def check_norm(op, x, dims, params):
    for m, p in enumerate(x.placements):
        if isinstance(p, Shard) and p.dim in dims:
            op.fail(m, LEGAL, fix_for(x, m, p.dim),
                    f"{op.name} normalizes over dim {p.dim}, which is sharded")
        if p.is_partial():
            op.fail(m, LEGAL, {x: with_dim(x.placements, m, R)},
                    f"{op.name} does not commute with the pending {p.reduce_op}")
    for w in params:
        if type(w) is TArg and any(not p.is_replicate() for p in w.placements):
            op.fail(next(m for m, p in enumerate(w.placements) if not p.is_replicate()), LEGAL,
                    {w: tuple(R for _ in w.placements)},
                    f"{w.label} spans the normalized dims, so it must be Replicate")
    return x.placements


@rule("layer_norm", family="norm", arg_names=("input", "normalized_shape", "weight", "bias"))
def layer_norm_rule(op):
    x = op.tensors[0]
    dims = normalized_dims(x.ndim, op.arg(1, "normalized_shape"))
    return check_norm(op, x, dims, (op.arg(2, "weight"), op.arg(3, "bias")))


@rule("rms_norm", family="norm", arg_names=("input", "normalized_shape", "weight"))
def rms_norm_rule(op):
    x = op.tensors[0]
    dims = normalized_dims(x.ndim, op.arg(1, "normalized_shape"))
    return check_norm(op, x, dims, (op.arg(2, "weight"),))


@rule("normalize", family="norm", arg_names=("input", "p", "dim"))
def normalize_rule(op):
    x = op.tensors[0]
    d = op.arg(2, "dim", 1) % max(x.ndim, 1)
    return check_norm(op, x, (d,), ())
