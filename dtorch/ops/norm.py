"""``layer_norm``, ``rms_norm``, ``normalize``: placements kept, never over a sharded dim;
``batch_norm`` (and ``native_batch_norm``): in eval mode any Shard off the channel dim is kept.

The normalized dims (the last ``len(normalized_shape)``; ``dim`` for ``normalize``) must not be
sharded and the input must not be Partial; ``weight``/``bias`` span the normalized dims, so
they are Replicate. Batch and sequence dims may be sharded, unevenly too. Example::

    >>> normalized_dims(3, (8,)), normalized_dims(4, (4, 8))
    ((2,), (2, 3))
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

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


# batch norm --------------------------------------------------------------------------------------
LEGAL_BN = ("eval: input R or S(d) with d not the channel dim 1, no Partial; training: every "
            "input R (the batch statistics need every row); weight/bias/running stats R")


def _bn_training(args, kwargs) -> bool:
    """The ``training`` flag: the keyword, else the first bool after the input and weights."""
    if "training" in kwargs:
        return bool(kwargs["training"])
    return next((a for a in args[3:] if isinstance(a, bool)), False)


def bn_meta(fn):
    """Meta inference for ``native_batch_norm`` / ``_native_batch_norm_legit``: torch's meta
    kernel gives ``save_mean``/``save_invstd`` of shape (C,) in eval mode, where the cpu kernel
    the ranks run gives (0,); this gives the cpu shapes."""
    def meta(*args, **kwargs):
        out = fn(*args, **kwargs)
        if _bn_training(args, kwargs):
            return out
        return (out[0], out[1].new_empty((0,)), out[2].new_empty((0,)))
    meta.__name__ = f"{fn.__name__}_meta"
    return meta


def batch_norm_rule(op):
    """Eval mode normalizes each element with the running statistics of its channel: any
    Shard off the channel dim is kept. Training needs the whole batch: all Replicate."""
    x = op.tensors[0]
    training = _bn_training(op.args, op.kwargs)
    for m, p in enumerate(x.placements):
        if p.is_partial() or (isinstance(p, Shard) and (training or p.dim == 1)):
            why = ("batch norm does not commute with a pending reduction" if p.is_partial()
                   else "training batch statistics need every row" if training
                   else "the channel dim 1 is sharded: weight and running stats span it")
            op.fail(m, LEGAL_BN, {x: with_dim(x.placements, m, R)}, why)
    for w in op.tensors[1:]:
        if any(not p.is_replicate() for p in w.placements):
            op.fail(next(m for m, p in enumerate(w.placements) if not p.is_replicate()),
                    LEGAL_BN, {w: tuple(R for _ in w.placements)},
                    f"{w.label} spans the channel dim, so it must be Replicate")
    stats = tuple(R for _ in x.placements)
    return [x.placements] + [stats] * (len(op.out.shapes) - 1)


rule(F.batch_norm, family="norm", arg_names=("input", "running_mean", "running_var", "weight",
                                             "bias"))(batch_norm_rule)
rule(torch.batch_norm, family="norm",
     arg_names=("input", "weight", "bias", "running_mean", "running_var"))(batch_norm_rule)
for _fn in (torch.native_batch_norm, torch._native_batch_norm_legit):
    rule(_fn, family="norm", meta=bn_meta(_fn),
         arg_names=("input", "weight", "bias", "running_mean", "running_var"))(batch_norm_rule)
