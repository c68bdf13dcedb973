"""Ops that work along some dims and leave the others alone, run on tensors sharded on the
others with no communication (:mod:`dtorch.ops.local_dims`): ``fliplr flipud rot90 renorm
narrow_copy diff diag_embed *_scatter searchsorted bucketize isin mode aminmax gradient
trapezoid cumulative_trapezoid tile sum_to_size unfold slice``, the ``*stack`` family,
``broadcast_tensors`` and ``meshgrid``; ``atleast_*d`` keep each input's placements on its
moved dims; ``diag diagflat block_diag cartesian_prod combinations as_strided`` mix every
dim (a sharded input refuses).

``TABLE`` maps each op to its parameter names and a *spec*: a small function of the bound
arguments giving, per tensor operand, one label per dim (``None`` where the op mixes values)
and the labels of each output. Example::

    >>> promoted(1, 2), promoted(2, 3), promoted(4, 3)
    ((1,), (0, 1), (0, 1, 2, 3))
    >>> kept(('d0', None, 'd2'), 1)
    ('d0', 'd2')
"""

from __future__ import annotations

import math

import torch

from ..placement import Replicate, Shard
from .index_local import bind, operands
from .local_dims import Operand, free_labels, local_decision
from .registry import TArg, rule

R = Replicate()
LEGAL = ("R -> R; S(d) -> S(d') for d a dim the op does not work along (d' where it lands), "
         "other operands with that dim sharded alike or Replicate (narrowed locally); no "
         "Partial")


def _norm(d, ndim):
    return d % max(ndim, 1) if isinstance(d, int) else d


def _get(b, name, default=None):
    return b.get(name, (None, default))[1]


def kept(labels, dim) -> tuple:
    """``labels`` without ``dim`` (a reduced dim)."""
    return tuple(lab for k, lab in enumerate(labels) if k != dim)


# specs: (op, bound arguments) -> (operands, output labels[, fn, args, kwargs]) -----------------
def mixing(dims_of):
    """Output shaped like the input (sizes may change on the mixed dims)."""
    def spec(op, b):
        x = _get(b, "input")
        lx = free_labels(x.ndim, mixed=dims_of(b, x.ndim))
        return operands(b, {"input": lx}), [lx]
    return spec


def _rot90_dims(b, n):
    return tuple(_get(b, "dims", (0, 1)))


def _renorm_dims(b, n):
    d = _norm(_get(b, "dim"), n)
    return tuple(k for k in range(n) if k != d)


def _dim_arg(name, default):
    return lambda b, n: (_norm(_get(b, name, default), n),)


def diff_spec(op, b):
    x = _get(b, "input")
    d = _norm(_get(b, "dim", -1), x.ndim)
    lx = free_labels(x.ndim, mixed=(d,))
    ends = {k: lx if type(_get(b, k)) is TArg and _get(b, k).ndim == x.ndim else
            (None,) * getattr(_get(b, k), "ndim", 0) for k in ("prepend", "append")}
    return operands(b, {"input": lx, **ends}), [lx]


def reducing(dim_name, default, n_out):
    """Reduce along one dim (``None``: all): the output has the input's other labels."""
    def spec(op, b):
        x = _get(b, "input")
        d = _norm(_get(b, dim_name, default), x.ndim)
        out_nd = len(op.out.shapes[0])
        if d is None or x.ndim == 0:
            return operands(b, {"input": (None,) * x.ndim}), [(None,) * out_nd] * n_out
        lx = free_labels(x.ndim, mixed=(d,))
        lo = lx if out_nd == x.ndim else kept(lx, d)
        return operands(b, {"input": lx}), [lo] * n_out
    return spec


def trapezoid_spec(op, b):
    y, x = _get(b, "y"), _get(b, "x")
    d = _norm(_get(b, "dim", -1), y.ndim)
    ly = free_labels(y.ndim, mixed=(d,))
    lx = None if type(x) is not TArg else ((None,) if x.ndim == 1 else ly[y.ndim - x.ndim:])
    out = ly if len(op.out.shapes[0]) == y.ndim else kept(ly, d)
    return operands(b, {"y": ly, "x": lx}), [out]


def mixing_all(op, b):
    return [Operand(None, t, (None,) * t.ndim) for t in op.tensors], [
        (None,) * len(s) for s in op.out.shapes]


def diag_embed_spec(op, b):
    x = _get(b, "input")
    n = x.ndim + 1
    d1, d2 = _norm(_get(b, "dim1", -2), n), _norm(_get(b, "dim2", -1), n)
    lx = free_labels(x.ndim, mixed=(-1,))
    batch = iter(lx[:-1])
    return operands(b, {"input": lx}), [tuple(None if k in (d1, d2) else next(batch)
                                              for k in range(n))]


def diagonal_scatter_spec(op, b):
    x = _get(b, "input")
    d1, d2 = _norm(_get(b, "dim1", 0), x.ndim), _norm(_get(b, "dim2", 1), x.ndim)
    lx = free_labels(x.ndim, mixed=(d1, d2))
    src = tuple(lab for k, lab in enumerate(lx) if k not in (d1, d2)) + (None,)
    return operands(b, {"input": lx, "src": src}), [lx]


def select_scatter_spec(op, b):
    x = _get(b, "input")
    d = _norm(_get(b, "dim"), x.ndim)
    lx = free_labels(x.ndim, mixed=(d,))
    return operands(b, {"input": lx, "src": kept(lx, d)}), [lx]


def slice_scatter_spec(op, b):
    x = _get(b, "input")
    lx = free_labels(x.ndim, mixed=(_norm(_get(b, "dim", 0), x.ndim),))
    return operands(b, {"input": lx, "src": lx}), [lx]


def searchsorted_spec(op, b):
    """Rows of a sorted N-D sequence go with the input's rows; a 1-D one is needed whole."""
    seq, v = _get(b, "sorted_sequence"), _get(b, "input")
    lv = free_labels(v.ndim) if type(v) is TArg else ()
    ls = (None,) if seq.ndim == 1 else free_labels(seq.ndim, mixed=(-1,))
    if seq.ndim > 1:
        lv = lv[:-1] + ("v",)
    return operands(b, {"sorted_sequence": ls, "sorter": ls, "input": lv}), [lv]


def elementwise_in(name, whole):
    """Elementwise in ``name``; ``whole`` is needed whole by every element."""
    def spec(op, b):
        v, w = _get(b, name), _get(b, whole)
        lv = free_labels(v.ndim) if type(v) is TArg else ()
        lw = (None,) * w.ndim if type(w) is TArg else ()
        return operands(b, {name: lv, whole: lw}), [lv]
    return spec


def gradient_spec(op, b):
    x = _get(b, "input")
    d = _get(b, "dim")
    dims = range(x.ndim) if d is None else ((d,) if isinstance(d, int) else tuple(d))
    lx = free_labels(x.ndim, mixed=tuple(dims))
    spacing = _get(b, "spacing")
    coords = [Operand(None, t, (None,) * t.ndim) for t in (
        spacing if isinstance(spacing, (list, tuple)) else [spacing]) if type(t) is TArg]
    return operands(b, {"input": lx}) + coords, [lx] * len(op.out.shapes)


def tile_spec(op, b):
    """``reps`` shorter than ``ndim`` are padded with 1s on the left; longer add dims."""
    x = _get(b, "input")
    reps = tuple(_get(b, "dims"))
    lead = max(0, len(reps) - x.ndim)
    last = ((1,) * x.ndim + reps)[-x.ndim:] if x.ndim else ()
    lx = tuple(f"d{k}" if r == 1 else None for k, r in enumerate(last))
    return operands(b, {"input": lx}), [(None,) * lead + lx]


def sum_to_size_spec(op, b):
    x = _get(b, "input")
    size = op.args[1:] if len(op.args) > 2 or not isinstance(_get(b, "size"), (tuple, list)) \
        else tuple(_get(b, "size"))
    lead = x.ndim - len(size)
    lx = tuple(f"d{k}" if k >= lead and size[k - lead] == x.shape[k] else None
               for k in range(x.ndim))
    return operands(b, {"input": lx}), [lx[lead:]], sum_to_local, (x, tuple(size)), {}


def sum_to_local(x, size):
    """Local kernel: ``x.sum_to_size(size)`` with each kept dim at this rank's block size."""
    lead = x.ndim - len(size)
    return x.sum_to_size(tuple(1 if s == 1 else x.shape[lead + i] for i, s in enumerate(size)))


def unfold_spec(op, b):
    x = _get(b, "input")
    lx = free_labels(x.ndim, mixed=(_norm(_get(b, "dimension"), x.ndim),))
    return operands(b, {"input": lx}), [lx + (None,)]


# lists and varargs of tensors ---------------------------------------------------------------------
def listed(func, *tensors, **kwargs):
    """Local kernel: ``func(list(tensors))``: the shards travel as top-level arguments (so a
    Replicate one can be narrowed)."""
    return func(list(tensors), **kwargs)


def promoted(ndim: int, at_least: int) -> tuple:
    """Where each dim of an ``ndim``-D tensor lands under ``torch.atleast_{at_least}d``."""
    moves = {(1, 2): (1,), (1, 3): (1,), (2, 3): (0, 1)}
    return moves.get((ndim, at_least), tuple(range(ndim)))


def _tensor_list(op):
    first = op.args[0] if op.args else op.kwargs.get("tensors")
    return list(first) if type(first) in (list, tuple) else list(op.args)


def stacking(promote, cat_dim):
    """``hstack vstack dstack column_stack``: ``promote(ndim)`` says where each input dim
    lands, then ``cat`` along ``cat_dim(first input's ndim)``; every dim but the cat dim is
    shared by the inputs."""
    def spec(op, b):
        tensors = _tensor_list(op)
        out_nd = len(op.out.shapes[0])
        cat = cat_dim(tensors[0].ndim)
        ops = [Operand(i + 1, t, tuple(None if o == cat else f"o{o}" for o in promote(t.ndim)))
               for i, t in enumerate(tensors)]
        out = tuple(None if o == cat else f"o{o}" for o in range(out_nd))
        return ops, [out], listed, (op.func, *tensors), {}
    return spec


def broadcast_spec(op, b):
    out = op.out.shapes[0]
    ops = [Operand(i, t, tuple(f"b{len(out) - t.ndim + k}" for k in range(t.ndim)))
           for i, t in enumerate(op.args) if type(t) is TArg]
    return ops, [free_labels(len(out), prefix="b")] * len(op.out.shapes)


def meshgrid_spec(op, b):
    """``meshgrid(a, b)`` or ``meshgrid([a, b])``: tensor i's dim is output dim i (``xy``
    swaps the first two), every output has every label."""
    tensors = _tensor_list(op)
    n = len(tensors)
    order = list(range(n))
    if op.kwargs.get("indexing") == "xy" and n >= 2:
        order[0], order[1] = 1, 0
    as_list = bool(op.args) and type(op.args[0]) in (list, tuple)
    ops = [Operand(i + as_list, t, (f"m{order[i]}",) if t.ndim else ())
           for i, t in enumerate(tensors)]
    fn, args = (listed, (op.func, *tensors)) if as_list else (op.func, tuple(tensors))
    return ops, [free_labels(n, prefix="m")] * n, fn, args, dict(op.kwargs)


# the table ---------------------------------------------------------------------------------------
TABLE = {
    "fliplr": (("input",), mixing(lambda b, n: (1,))),
    "flipud": (("input",), mixing(lambda b, n: (0,))),
    "rot90": (("input", "k", "dims"), mixing(_rot90_dims)),
    "renorm": (("input", "p", "dim", "maxnorm"), mixing(_renorm_dims)),
    "narrow_copy": (("input", "dim", "start", "length"), mixing(_dim_arg("dim", 0))),
    torch.ops.aten.slice.Tensor: (("input", "dim", "start", "end", "step"),
                                  mixing(_dim_arg("dim", 0))),
    "cumulative_trapezoid": (("y", "x"), trapezoid_spec),
    "trapezoid": (("y", "x"), trapezoid_spec),
    "trapz": (("y", "x"), trapezoid_spec),
    "diff": (("input", "n", "dim", "prepend", "append"), diff_spec),
    "mode": (("input", "dim", "keepdim"), reducing("dim", -1, 2)),
    "aminmax": (("input",), reducing("dim", None, 2)),
    "diag_embed": (("input", "offset", "dim1", "dim2"), diag_embed_spec),
    "diagonal_scatter": (("input", "src", "offset", "dim1", "dim2"), diagonal_scatter_spec),
    "select_scatter": (("input", "src", "dim", "index"), select_scatter_spec),
    "slice_scatter": (("input", "src", "dim", "start", "end", "step"), slice_scatter_spec),
    "searchsorted": (("sorted_sequence", "input"), searchsorted_spec),
    "bucketize": (("input", "boundaries"), elementwise_in("input", "boundaries")),
    "isin": (("elements", "test_elements"), elementwise_in("elements", "test_elements")),
    "gradient": (("input",), gradient_spec),
    "tile": (("input", "dims"), tile_spec),
    "sum_to_size": (("input", "size"), sum_to_size_spec),
    torch.Tensor.unfold: (("input", "dimension", "size", "step"), unfold_spec),
    "hstack": (("tensors",), stacking(lambda n: promoted(n, 1), lambda n: 0 if n <= 1 else 1)),
    "vstack": (("tensors",), stacking(lambda n: promoted(n, 2), lambda n: 0)),
    "dstack": (("tensors",), stacking(lambda n: promoted(n, 3), lambda n: 2)),
    "column_stack": (("tensors",), stacking(lambda n: tuple(range(n)), lambda n: 1)),
    "broadcast_tensors": (("tensors",), broadcast_spec),
    "meshgrid": (("tensors",), meshgrid_spec),
    torch._C._VariableFunctions.meshgrid: (("tensors",), meshgrid_spec),  # meshgrid([a, b])
    "diag": (("input", "diagonal"), mixing_all),
    "diagflat": (("input", "offset"), mixing_all),
    "block_diag": (("tensors",), mixing_all),
}
def _table_rule(params, spec):
    def rule_fn(op):
        found = spec(op, bind(op, params))
        ops, outs = found[0], found[1]
        fn, args, kwargs = found[2:] if len(found) > 2 else (None, None, None)
        return local_decision(op, ops, outs, LEGAL, fn, args, kwargs)
    return rule_fn


for _name, (_params, _spec) in TABLE.items():
    rule(_name, family="dim-local", arg_names=_params)(_table_rule(_params, _spec))


def _refused(why):
    def rule_fn(op):
        for t in op.tensors:
            for m, p in enumerate(t.placements):
                if not p.is_replicate():
                    op.fail(m, "every input R", {t: tuple(R for _ in t.placements)}, why)
        return [(R,) * op.mesh.ndim] * len(op.out.shapes)
    return rule_fn


def combinations_meta(input, r=2, with_replacement=False):
    """``torch.combinations``'s output on meta (its meta kernel calls masked_select)."""
    n = input.shape[0] if input.ndim else 1
    rows = math.comb(n + r - 1, r) if with_replacement else math.comb(n, r)
    shape = (0,) if r == 0 else (rows if n else 0, r)
    return torch.empty(shape, dtype=input.dtype, device="meta")


# ops whose every output element can depend on every input position: a sharded input refuses
# (name: (why, meta function or None))
REFUSED = {
    "cartesian_prod": ("cartesian_prod's rows pair every element with every other: its output "
                       "blocks follow no input block under torch.chunk sizes", None),
    "combinations": ("combinations pairs every element with every other", combinations_meta),
    "as_strided": ("as_strided's sizes and strides address the whole tensor's storage", None),
}
for _name, (_why, _meta) in REFUSED.items():
    rule(_name, family="dim-local", arg_names=("input",), meta=_meta)(_refused(_why))


def _atleast(at_least):
    def rule_fn(op):
        """Each output keeps its own input's placements, the Shard moved with its dim."""
        out = []
        for t in _tensor_list(op):
            dims = promoted(t.ndim, at_least)
            out.append(tuple(Shard(dims[p.dim]) if isinstance(p, Shard) else p
                             for p in t.placements))
        return out
    return rule_fn


for _n in (1, 2, 3):
    rule(f"atleast_{_n}d", family="dim-local", arg_names=("tensors",))(_atleast(_n))
