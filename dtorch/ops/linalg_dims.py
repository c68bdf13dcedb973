"""Linear-algebra ops that mix values along named dims only (``vecdot``, ``cross``, matrix and
vector norms, ``linalg.diagonal``, ``diag_embed``, ``vander``, ``multi_dot``) run on each rank's
block when the sharded dim is another one; ops that mix every dim (``trace``, ``tensorinv``,
``tensorsolve``) refuse any Shard with the fix.

Each rule names the mixed dims (from the call's ``dim``/``dim1``/``dim2`` arguments, bound by the
function's parameters, with torch's defaults) and maps the other dims to the output's; the
engine is :func:`dtorch.ops.local_dims.local_decision`. Example::

    >>> broadcast_labels([(5, 3), (3,)], mixed=-1)
    [('d0', None), (None,)]
    >>> reduced(('d0', 'd1', 'd2'), (1, 2), keepdim=True)
    ('d0', None, None)
"""

from __future__ import annotations

import torch

from .bind import bind, value
from .linalg_batched import decide, tensor_params
from .local_dims import Operand, free_labels
from .registry import TArg, rule

LEGAL = ("the op mixes values along its dim / matrix dims: Shard another dim (the other "
         "operands Replicate or Shard on the matching dim)")
MIXES_ALL = "the op mixes every dim: every operand Replicate"


def broadcast_labels(shapes, mixed=None):
    """Labels of operands broadcast together (right-aligned ``d0..``), ``mixed`` (a dim of
    the broadcast shape, negative allowed) None."""
    n = max(len(s) for s in shapes)
    m = None if mixed is None else mixed % n
    return [tuple(None if n - len(s) + i == m else f"d{n - len(s) + i}" for i in range(len(s)))
            for s in shapes]


def reduced(labels, dims, keepdim=False):
    """The output labels of a reduction over ``dims``."""
    dims = {d % len(labels) for d in dims} if labels else set()
    return tuple(None if d in dims else lab for d, lab in enumerate(labels)
                 if keepdim or d not in dims)


def _dims(dim, default):
    if dim is None:
        return default
    return tuple(dim) if isinstance(dim, (tuple, list)) else (dim,)


def _paired(op, dim, keep):
    """Two broadcast operands, ``dim`` mixed; output labels = broadcast labels (``keep``) or
    without ``dim``."""
    ts = tensor_params(op)
    labels = broadcast_labels([t.shape for _, _, t in ts], dim)
    n = max(t.ndim for _, _, t in ts)
    out = tuple(f"d{i}" if i != dim % n else None for i in range(n))
    if not keep:
        out = tuple(lab for i, lab in enumerate(out) if i != dim % n)
    operands = [Operand(w, t, lab) for (_, w, t), lab in zip(ts, labels)]
    return decide(op, operands, [out], LEGAL)


@rule(torch.linalg.vecdot, family="linalg")
def vecdot_rule(op):
    return _paired(op, value(bind(op), "dim", -1), keep=False)


@rule(torch.linalg.cross, "cross", family="linalg")
def cross_rule(op):
    dim = value(bind(op), "dim", -1 if op.func is torch.linalg.cross else None)
    if dim is None:  # torch.cross: the first dim of size 3 of the input
        x = op.tensors[0]
        dim = next(d for d, s in enumerate(x.shape) if s == 3) - x.ndim
    return _paired(op, dim, keep=True)


def _one(op):
    name, where, t = tensor_params(op)[0]
    return where, t


@rule(torch.linalg.matrix_norm, torch.linalg.norm, family="linalg")
def norm_rule(op):
    b = bind(op)
    where, t = _one(op)
    default = (-2, -1) if op.func is torch.linalg.matrix_norm else tuple(range(t.ndim))
    dims = _dims(value(b, "dim"), default)
    labels = free_labels(t.ndim, dims)
    out = reduced(free_labels(t.ndim), dims, bool(value(b, "keepdim", False)))
    return decide(op, [Operand(where, t, labels)], [out], LEGAL)


@rule(torch.linalg.diagonal, family="linalg")
def diagonal_rule(op):
    b = bind(op)
    where, t = _one(op)
    dims = (value(b, "dim1", -2), value(b, "dim2", -1))
    labels = free_labels(t.ndim, dims)
    out = tuple(lab for lab in labels if lab is not None) + (None,)
    return decide(op, [Operand(where, t, labels)], [out], LEGAL)


@rule("diag_embed", family="linalg")
def diag_embed_rule(op):
    b = bind(op)
    where, t = _one(op)
    n = t.ndim + 1
    new = {value(b, "dim1", -2) % n, value(b, "dim2", -1) % n}
    labels = free_labels(t.ndim, (-1,))
    lead = iter(labels[:-1])
    out = tuple(None if d in new else next(lead) for d in range(n))
    return decide(op, [Operand(where, t, labels)], [out], LEGAL)


@rule(torch.linalg.vander, family="linalg")
def vander_rule(op):
    where, t = _one(op)  # x[..., i] ** j: every dim of x is free
    labels = free_labels(t.ndim)
    b = bind(op)
    args, kwargs = list(op.args), dict(op.kwargs)
    if value(b, "N") is None:  # torch's default N is x's last size: pass the global one
        if "N" in b and b["N"][0] == 1:
            args[1] = t.shape[-1]
        else:
            kwargs["N"] = t.shape[-1]
    return decide(op, [Operand(where, t, labels)], [labels + (None,)], LEGAL,
                  args=tuple(args), kwargs=kwargs)


@rule("trace", torch.linalg.tensorinv, torch.linalg.tensorsolve, family="linalg")
def mixes_all_rule(op):
    operands = [Operand(w, t, (None,) * t.ndim) for _, w, t in tensor_params(op)]
    outs = [(None,) * len(s) for s in op.out.shapes]
    legal = ("trace sums the diagonal: " if op.func in (torch.trace, torch.Tensor.trace)
             else "") + MIXES_ALL
    return decide(op, operands, outs, legal)


def multi_dot_local(*tensors):
    """``torch.linalg.multi_dot`` of positional tensors (so each can be narrowed)."""
    return torch.linalg.multi_dot(list(tensors))


def chain_labels(ndims):
    """A matrix chain: the first's rows and the last's columns are free, the rest mixed."""
    labels = [(None, None)] * len(ndims)
    first = ("r", None) if ndims[0] == 2 else (None,)
    last = (None, "c") if ndims[-1] == 2 else (None,)
    labels[0] = first if len(ndims) > 1 else ("r", "c")
    if len(ndims) > 1:
        labels[-1] = last
    out = tuple(lab for lab in (first[0], last[-1]) if lab is not None)
    return labels, out


@rule(torch.linalg.multi_dot, "chain_matmul", family="linalg")
def multi_dot_rule(op):
    tensors = op.args[0] if op.func is torch.linalg.multi_dot else op.args
    tensors = list(op.kwargs.get("tensors", tensors))
    if not all(type(t) is TArg for t in tensors):
        op.fail(None, LEGAL, {}, "every matrix of the chain must be a DTensor")
    labels, out = chain_labels([t.ndim for t in tensors])
    operands = [Operand(i, t, lab) for i, (t, lab) in enumerate(zip(tensors, labels))]
    fn = multi_dot_local if op.func is torch.linalg.multi_dot else torch.chain_matmul
    return decide(op, operands, [out], LEGAL, fn=fn, args=tuple(tensors), kwargs={})
