"""Index ops along a dim other than the sharded one: ``gather scatter scatter_add
scatter_reduce index_select index_add index_copy index_fill index_reduce index_put
take_along_dim take put masked_scatter``, run with no communication through
:mod:`dtorch.ops.local_dims`.

Each op's arguments are bound by its parameter names (``PARAMS``: builtins have no
``inspect.signature``), and one function per family labels the tensor operands' dims: every
dim but ``dim`` is free and shared by ``input``, ``index`` and ``src`` (torch lets the index
be smaller there, and uses only its first entries: a Shard on such a dim refuses), ``dim``
itself is mixed, except that an index's ``dim`` lands on the output's (``gather``,
``index_select``, ``take_along_dim``: a sharded index with a Replicate input stays sharded).
Flat-index ops (``take put``) refuse a sharded input (``masked_select``, whose size depends
on the values, refuses in :mod:`dtorch.ops.value_shapes`); ``masked_scatter`` runs on a sharded input when mask and source are Replicate (each
rank counts the mask entries before its block). Example::

    >>> gather_labels(2, 0, (5, 5), (5, 5))
    ((None, 'd1'), ('g', 'd1'), ('g', 'd1'))
    >>> index_labels("index_select", 3, 1)
    (('d0', None, 'd2'), ('g',), None, ('d0', 'g', 'd2'))
"""

from __future__ import annotations

import torch

from ..layout import rank_block
from ..placement import Replicate
from ..runtime.messages import Coord
from .explain import with_dim
from .local_dims import Operand, free_labels, local_decision
from .registry import Decision, TArg, rule

R = Replicate()
LEGAL = ("R -> R; S(d) -> S(d) for d other than the op's dim, with every operand that has "
         "dim d at the same size sharded alike or Replicate (narrowed locally); no Partial")

# parameter names per op (Tensor methods too: ``self`` is ``input``)
PARAMS = {
    "gather": ("input", "dim", "index"),
    "take_along_dim": ("input", "indices", "dim"),
    "scatter": ("input", "dim", "index", "src", "reduce"),
    "scatter_add": ("input", "dim", "index", "src"),
    "scatter_reduce": ("input", "dim", "index", "src", "reduce", "include_self"),
    "index_select": ("input", "dim", "index"),
    "index_add": ("input", "dim", "index", "source", "alpha"),
    "index_copy": ("input", "dim", "index", "source"),
    "index_fill": ("input", "dim", "index", "value"),
    "index_reduce": ("input", "dim", "index", "source", "reduce", "include_self"),
    "index_put": ("input", "indices", "values", "accumulate"),
    "take": ("input", "index"),
    "put": ("input", "index", "source", "accumulate"),
    "masked_scatter": ("input", "mask", "source"),
}


def short_name(op) -> str:
    return op.entry.name.split(".")[-1].rstrip("_")


def bind(op, params) -> dict:
    """``{parameter name: (where, value)}``: ``where`` is the position in the call, or the
    keyword (what :func:`~dtorch.ops.local_dims.local_decision` narrows)."""
    bound = {name: (i, v) for i, (name, v) in enumerate(zip(params, op.args))}
    for k, v in op.kwargs.items():
        bound["src" if k == "value" and "src" in params else k] = (k, v)
    return bound


def operands(bound, labelled) -> list:
    """Operands for ``{parameter name: labels}`` (entries whose value is no DTensor skipped)."""
    out = []
    for name, labels in labelled.items():
        where, value = bound.get(name, (None, None))
        if type(value) is TArg and labels is not None:
            out.append(Operand(where, value, tuple(labels)))
    return out


def _dim(bound, name, ndim, default=None):
    d = bound.get(name, (None, default))[1]
    return d % max(ndim, 1) if isinstance(d, int) else d


def gather_labels(ndim, dim, in_shape, idx_shape):
    """``(input, index, output)`` labels of ``gather``: the index's ``dim`` is the output's."""
    lx = free_labels(ndim, mixed=(dim,))
    li = tuple("g" if k == dim else lab for k, lab in enumerate(lx))
    return lx, li, li


def _prefix_sizes(op, ops, legal):
    """A Shard on a dim where the operands' sizes differ (torch reads only the first entries
    of the bigger one): refuse, naming it."""
    for m in range(op.mesh.ndim):
        for o in ops:
            p = o.targ.placements[m]
            if not p.is_shard() or o.labels[p.dim] is None:
                continue
            lab = o.labels[p.dim]
            sizes = {q.targ.label: q.targ.shape[q.labels.index(lab)] for q in ops
                     if lab in q.labels}
            if len(set(sizes.values())) > 1:
                op.fail(m, LEGAL, {o.targ: with_dim(o.targ.placements, m, R)},
                        f"{op.name} reads only the first entries of the bigger operands along "
                        f"dim {p.dim}, which is sharded, and the sizes differ there ({sizes}): "
                        f"the blocks would not line up")


@rule("gather", family="index-local", arg_names=PARAMS["gather"])
def gather_rule(op):
    b = bind(op, PARAMS["gather"])
    x, idx = b["input"][1], b["index"][1]
    d = _dim(b, "dim", x.ndim)
    lx, li, lo = gather_labels(x.ndim, d, x.shape, idx.shape)
    ops = operands(b, {"input": lx, "index": li})
    _prefix_sizes(op, ops, LEGAL)
    return local_decision(op, ops, [lo], LEGAL)


@rule("take_along_dim", family="index-local", arg_names=PARAMS["take_along_dim"])
def take_along_dim_rule(op):
    """Broadcasts ``input`` and ``indices`` on every dim but ``dim`` (``dim=None``: flat)."""
    b = bind(op, PARAMS["take_along_dim"])
    x, idx = b["input"][1], b["indices"][1]
    d = _dim(b, "dim", x.ndim)
    if d is None:
        lx, li, lo = (None,) * x.ndim, (None,) * idx.ndim, ("g",)
    else:
        lx, li, lo = gather_labels(x.ndim, d, x.shape, idx.shape)
    return local_decision(op, operands(b, {"input": lx, "indices": li}), [lo], LEGAL)


@rule("scatter", "scatter_add", "scatter_reduce", family="index-local",
      arg_names=PARAMS["scatter_reduce"])
def scatter_rule(op):
    """The output is ``input``'s; ``index`` and ``src`` share its labels but on ``dim``."""
    b = bind(op, PARAMS[short_name(op)])
    x = b["input"][1]
    d = _dim(b, "dim", x.ndim)
    lx = free_labels(x.ndim, mixed=(d,))
    ops = operands(b, {"input": lx, "index": lx, "src": lx})
    _prefix_sizes(op, ops, LEGAL)
    return local_decision(op, ops, [lx], LEGAL)


rule("scatter_", "scatter_add_", "scatter_reduce_", family="index-local", inplace=True,
     arg_names=PARAMS["scatter_reduce"])(scatter_rule)


def index_labels(name, ndim, dim):
    """``(input, index, source, output)`` labels of the ``index_*`` ops (source: the
    input's labels but on ``dim``, where it follows the index)."""
    lx = free_labels(ndim, mixed=(dim,))
    if name == "index_select":  # the output's dim is the index's
        return lx, ("g",), None, tuple("g" if k == dim else lab for k, lab in enumerate(lx))
    return lx, (None,), lx, lx


@rule("index_select", "index_add", "index_copy", "index_fill", "index_reduce",
      family="index-local", arg_names=("input", "dim", "index", "source"))
def index_rule(op):
    name = short_name(op)
    b = bind(op, PARAMS[name])
    x, idx = b["input"][1], b["index"][1]
    d = _dim(b, "dim", x.ndim)
    lx, li, ls, lo = index_labels(name, x.ndim, d)
    li = li[:idx.ndim] if type(idx) is TArg else li
    return local_decision(op, operands(b, {"input": lx, "index": li, "source": ls,
                                           "value": ()}), [lo], LEGAL)


rule("index_add_", "index_copy_", "index_fill_", "index_reduce_", family="index-local",
     inplace=True, arg_names=("input", "dim", "index", "source"))(index_rule)


@rule("index_put", family="index-local", arg_names=PARAMS["index_put"])
def index_put_rule(op):
    """``input[indices] = values``: the indexed dims (a prefix) are mixed, the rest free;
    ``values`` broadcasts against ``input[indices]`` (index dims first, then the rest)."""
    b = bind(op, PARAMS["index_put"])
    x, indices = b["input"][1], list(b["indices"][1])
    values = b["values"][1]
    if any(i is None for i in indices):
        lx = (None,) * x.ndim  # None entries move the index dims: keep it simple, refuse
        k, nb = x.ndim, 0
    else:
        k = sum(i.ndim if i.dtype is torch.bool else 1 for i in indices)
        nb = max((i.ndim if i.dtype is not torch.bool else 1) for i in indices) if indices else 0
        lx = free_labels(x.ndim, mixed=range(k))
    region = (None,) * nb + lx[k:]
    lv = None if type(values) is not TArg else (
        region[len(region) - values.ndim:] if values.ndim <= len(region) else
        (None,) * values.ndim)
    ops = operands(b, {"input": lx, "values": lv})
    ops += [Operand(None, i, (None,) * i.ndim) for i in indices if type(i) is TArg]
    args, kwargs = list(op.args), dict(op.kwargs)  # the ranks fill DTensors in lists only
    where = b["indices"][0]
    if type(where) is int:
        args[where] = indices
    else:
        kwargs[where] = indices
    return local_decision(op, ops, [lx], LEGAL, args=tuple(args), kwargs=kwargs)


rule("index_put_", family="index-local", inplace=True,
     arg_names=PARAMS["index_put"])(index_put_rule)


@rule("take", "put", family="index-local", arg_names=PARAMS["put"])
def flat_index_rule(op):
    """Flat indices into the whole ``input``: ``take`` keeps a sharded index's layout when
    ``input`` is Replicate; anything else sharded refuses."""
    name = short_name(op)
    b = bind(op, PARAMS[name])
    x = b["input"][1]
    mixed = (None,) * x.ndim
    if name == "take":
        idx = b["index"][1]
        li = free_labels(idx.ndim)
        return local_decision(op, operands(b, {"input": mixed, "index": li}), [li],
                              "input R (flat indices address the whole tensor); index S(d) "
                              "-> S(d)")
    labelled = {"input": mixed, "index": (None,) * b["index"][1].ndim,
                "source": (None,) * b["source"][1].ndim}
    return local_decision(op, operands(b, labelled), [mixed],
                          "every operand R (flat indices address the whole tensor)")


rule("put_", family="index-local", inplace=True, arg_names=PARAMS["put"])(flat_index_rule)


# masked ops ---------------------------------------------------------------------------------------
LEGAL_MASKED = ("input R or S(d) with mask and source R (each rank counts the mask entries "
                "before its block); no Partial")


def masked_scatter_block(x, mask, source, shape, table, coord):
    """Local kernel: this rank's block of ``masked_scatter`` (``x`` the rank's block of
    ``input``, ``mask`` and ``source`` whole): each masked entry takes the source element
    numbered by how many masked entries precede it in the whole tensor."""
    slices = table[coord]
    full = mask.expand(shape)
    block = full[slices]
    if source.numel() == 0 or not block.any():
        return x.clone()
    pos = (full.reshape(-1).cumsum(0) - 1).reshape(shape)[slices]
    return torch.where(block, source.reshape(-1)[pos.clamp(min=0)], x)


@rule("masked_scatter", family="index-local", arg_names=PARAMS["masked_scatter"])
def masked_scatter_rule(op):
    b = bind(op, PARAMS["masked_scatter"])
    x, mask, source = b["input"][1], b["mask"][1], b["source"][1]
    shape = op.out.shapes[0]
    for m in range(op.mesh.ndim):
        for t in (mask, source):
            if type(t) is TArg and not t.placements[m].is_replicate():
                op.fail(m, LEGAL_MASKED, {t: with_dim(t.placements, m, R)},
                        "masked_scatter takes source elements in mask order over the whole "
                        "tensor: where a rank's block starts in source depends on the mask "
                        "entries of every block before it (for aligned values, "
                        "torch.where(mask, values, input) runs locally)")
        p = x.placements[m]
        if p.is_partial() or (p.is_shard() and tuple(x.shape) != tuple(shape)):
            op.fail(m, LEGAL_MASKED, {x: with_dim(x.placements, m, R)},
                    "a Partial input, or an input broadcast against the mask")
    if all(p.is_replicate() for p in x.placements):
        return x.placements
    mesh = x.mesh
    table = {mesh.get_coordinate(r): rank_block(shape, mesh, x.placements,
                                                mesh.get_coordinate(r)).slices()
             for r in mesh.ranks}
    fn = masked_scatter_block_ if op.entry.inplace else masked_scatter_block
    return Decision((x.placements,), fn, (x, mask, source, tuple(shape), table, Coord(mesh)),
                    {})


def masked_scatter_block_(x, *args):
    """Local kernel of ``masked_scatter_``: :func:`masked_scatter_block` written into ``x``."""
    return x.copy_(masked_scatter_block(x, *args))


rule("masked_scatter_", family="index-local", inplace=True,
     arg_names=PARAMS["masked_scatter"])(masked_scatter_rule)
