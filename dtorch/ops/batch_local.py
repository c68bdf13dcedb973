"""Tables of batch-local ops on the :mod:`dtorch.ops.local_dims` engine: labels by parameter.

A family is one *labeler*: a function of the call that returns ``({parameter: labels},
[labels per output])``, one label (or None: the op mixes values there) per dim of each tensor
parameter. :func:`register` binds it to torch callables with their parameter names (from
``inspect.signature`` where it works, else written once per family as data); the rule then
looks every parameter up by name (:func:`get`), never by display name. Where some rank's block
of a sharded operand is empty, the local call goes through :func:`empty_safe` (torch's pooling,
``interpolate`` and ``conv`` refuse empty channels). Example::

    >>> aligned(2, 4)
    ('b2', 'b3')
    >>> aligned(3, 3, mixed=(2,))
    ('b0', 'b1', None)
    >>> param_names(torch.cdist)
    ('x1', 'x2', 'p', 'compute_mode')
"""

from __future__ import annotations

import functools
import inspect

import torch
import torch.utils._pytree as pytree

from ..layout import rank_block
from . import generic
from .local_dims import Operand, local_decision
from .registry import TArg, rule


def param_names(func, fallback=()) -> tuple:
    """The parameter names of ``func`` by its signature; ``fallback`` for builtins (and for
    ``boolean_dispatch`` wrappers, whose signature is ``(*args, **kwargs)``)."""
    try:
        names = tuple(inspect.signature(func).parameters)
    except (TypeError, ValueError):
        return tuple(fallback)
    return tuple(fallback) if names in ((), ("args", "kwargs")) else names


def get(op, name: str, default=None):
    """The argument of parameter ``name`` (positional or keyword) of the call."""
    names = op.entry.arg_names
    return op.arg(names.index(name) if name in names else None, name, default)


def where(op, name: str):
    """Where parameter ``name`` sits in the call: its keyword, or its position."""
    return name if name in op.kwargs else op.entry.arg_names.index(name)


def aligned(ndim: int, width: int, mixed=()) -> tuple:
    """Labels of an ``ndim``-dim operand broadcast to ``width`` dims (aligned on the right):
    ``b<position>``, None at the broadcast positions in ``mixed``."""
    mixed = {m % width for m in mixed} if width else set()
    return tuple(None if p in mixed else f"b{p}" for p in range(width - ndim, width))


def ndim_of(op, name: str) -> int | None:
    v = get(op, name)
    return v.ndim if type(v) is TArg else None


def decide(op, labels: dict, outs: list, legal: str, fn=None, args=None, kwargs=None):
    """The local_dims Decision for ``labels`` (``{parameter: labels}``) and ``outs``, with the
    empty-shard guard when some rank's block of a sharded operand is empty."""
    operands = []
    for name, labs in labels.items():
        v = get(op, name)
        if type(v) is TArg:
            if len(labs) != v.ndim:
                raise AssertionError(f"{op.name}: labels {labs} for {v.label} {v.shape}")
            operands.append(Operand(where(op, name), v, tuple(labs)))
    outs = [tuple(o) for o in outs]
    for o, shape in zip(outs, op.out.shapes):
        if len(o) != len(shape):
            raise AssertionError(f"{op.name}: output labels {o} for shape {shape}")
    if _some_block_empty(operands):
        base = generic.picklable(fn or op.func)
        spec = (tuple((o.where, o.labels) for o in operands), tuple(outs))
        fn = functools.partial(empty_safe, base, spec)
    return local_decision(op, operands, outs, legal, fn=fn, args=args, kwargs=kwargs)


def _some_block_empty(operands) -> bool:
    for o in operands:
        t = o.targ
        if any(p.is_shard() for p in t.placements):
            mesh = t.mesh
            if any(0 in rank_block(t.shape, mesh, t.placements, mesh.get_coordinate(r)).shape
                   for r in mesh.ranks):
                return True
    return False


def empty_safe(fn, spec, *args, **kwargs):
    """Rank-side: ``fn(*args, **kwargs)``, except where a labelled dim of an operand is empty:
    then the call runs on that dim padded to one zero and each output is cut back to empty
    along that label (torch refuses some empty inputs and gets some wrong:
    ``pixel_unshuffle`` returns its empty input unchanged); the graph still reaches the
    inputs."""
    flat = [a for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
    if all(t.numel() for t in flat):
        return fn(*args, **kwargs)
    operands, outs = spec
    args, empty = list(args), set()
    for at, labels in operands:
        holder = args if type(at) is int else kwargs
        t = holder[at]
        for d, lab in enumerate(labels):
            if lab is not None and t.shape[d] == 0:
                empty.add(lab)
                pad = list(t.shape)
                pad[d] = 1
                t = torch.cat([t, t.new_zeros(pad)], d)
        holder[at] = t
    result = fn(*args, **kwargs)
    if not empty:
        return result
    leaves, tree = pytree.tree_flatten(result)
    tensors = iter(outs)
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, torch.Tensor):
            for d, lab in enumerate(next(tensors)):
                if lab in empty:
                    leaf = leaf.narrow(d, 0, 0)
            leaves[i] = leaf
    return pytree.tree_unflatten(leaves, tree)


def register(funcs, labeler, legal: str, family: str, names=(), fn=None, meta=None) -> None:
    """A rule for each of ``funcs`` (callables; names this torch lacks are skipped): the
    ``labeler(op) -> (labels, outs)`` on the local_dims engine; ``names`` the parameter names
    where the signature does not tell them; ``fn(op)`` an optional local function."""
    def local_rule(op):
        labels, outs = labeler(op)
        return decide(op, labels, outs, legal, fn=fn(op) if fn else None)
    for f in funcs:
        if f is None:
            continue
        rule(f, family=family, arg_names=param_names(f, names), meta=meta)(local_rule)


def attr(ns, *names):
    """The callables ``ns.<name>`` that exist (a torch build may lack one)."""
    return [getattr(ns, n) for n in names if getattr(ns, n, None) is not None]


__all__ = ["register", "decide", "get", "where", "aligned", "param_names", "empty_safe",
           "attr", "ndim_of"]
