"""More of the matmul family as einsum labels (:mod:`dtorch.ops.matmul`): ``baddbmm addbmm addmv
addr tensordot``, and ``kron``.

``addbmm`` sums its products over the batch dim, so a batch-sharded pair gives
``Partial('sum')`` (its bias then ``Partial('sum')`` too); the others keep a sharded free label
as a Shard and narrow Replicate operands locally. ``kron(a, b)``'s dim ``d`` has size
``a_d * b_d``: a Shard of ``a`` on ``d`` (``b`` Replicate) holds whole output rows
``[i0 * b_d, i1 * b_d)``, a Shard of the output when those blocks are ``torch.chunk``'s (``a_d``
divisible by the mesh dim, or ``b_d == 1``); a Shard of ``b`` on ``d`` only where ``a_d == 1``.
Example::

    >>> tensordot_labels(3, 2, 1)
    ((('a0', 'a1', 'k0'), ('k0', 'c1')), ('a0', 'a1', 'c1'))
    >>> tensordot_labels(2, 2, ([0], [1]))
    ((('k0', 'a1'), ('c0', 'k0')), ('a1', 'c0'))
"""

from __future__ import annotations

import torch

from ..layout import rank_block
from ..placement import Replicate, Shard
from .bind import bind, value
from .explain import with_dim
from .matmul import product_decision
from .registry import TArg, rule

R = Replicate()
KRON = ("kron(a, b): a Shard of a on dim d with b Replicate when the output's blocks along d are "
        "a's blocks times b's size (a's size divisible by the mesh dim, or b's size 1); a Shard "
        "of b on d where a's size on d is 1")

# op -> (labels of the two factors, output labels); the bias is the call's ``input``
PRODUCTS = {
    "baddbmm": ((("b", "n", "k"), ("b", "k", "m")), ("b", "n", "m")),
    "addbmm": ((("b", "n", "k"), ("b", "k", "m")), ("n", "m")),
    "addmv": ((("n", "k"), ("k",)), ("n",)),
    "addr": ((("i",), ("j",)), ("i", "j")),
}


def biased_rule(labels, out):
    """The rule of a :data:`PRODUCTS` row: ``input + product(second, third)``."""
    def rule_(op):
        b = bind(op)
        names = [n for n, (_, v) in b.items() if type(v) is TArg and n != "input"]
        factors = [(value(b, n), lab) for n, lab in zip(names, labels)]
        return product_decision(op, factors, out, value(b, "input"))
    return rule_


for _name, (_labels, _out) in PRODUCTS.items():
    rule(_name, family="matmul", arg_names=("input", "mat1", "mat2"))(biased_rule(_labels, _out))


def tensordot_labels(na: int, nb: int, dims):
    """Einsum labels of ``torch.tensordot(a, b, dims)`` (``dims`` an int or two lists)."""
    if isinstance(dims, int):
        da, db = list(range(na - dims, na)), list(range(dims))
    else:
        da, db = [list(x) if isinstance(x, (list, tuple)) else [x] for x in dims]
    da, db = [d % na for d in da], [d % nb for d in db]
    la = [f"a{i}" for i in range(na)]
    lb = [f"c{i}" for i in range(nb)]
    for j, (x, y) in enumerate(zip(da, db)):
        la[x] = lb[y] = f"k{j}"
    out = tuple(lab for lab in la if not lab.startswith("k")) + tuple(
        lab for lab in lb if not lab.startswith("k"))
    return (tuple(la), tuple(lb)), out


@rule("tensordot", family="matmul", arg_names=("a", "b", "dims"))
def tensordot_rule(op):
    b = bind(op)
    x, y, dims = value(b, "a"), value(b, "b"), value(b, "dims", 2)
    if not isinstance(dims, (int, list, tuple)):
        op.fail(None, "tensordot dims as an int or two lists", {}, "dims must be plain ints")
    (la, lb), out = tensordot_labels(x.ndim, y.ndim, dims)
    return product_decision(op, [(x, la), (y, lb)], out)


@rule("kron", family="matmul")
def kron_rule(op):
    b = bind(op)
    x, y = value(b, "input"), value(b, "other")
    n = max(x.ndim, y.ndim)
    xs, ys = (1,) * (n - x.ndim) + x.shape, (1,) * (n - y.ndim) + y.shape
    out = []
    for m in range(op.mesh.ndim):
        out.append(_kron_dim(op, x, y, xs, ys, m))
    out = tuple(out)
    _kron_aligned(op, x, y, xs, ys, out)
    return out


def _kron_dim(op, x, y, xs, ys, m):
    px, py = x.placements[m], y.placements[m]
    n = len(xs)
    for t, p in ((x, px), (y, py)):
        if p.is_partial():
            op.fail(m, KRON, {t: with_dim(t.placements, m, R)}, "a Partial input of kron")
    if px.is_shard() and py.is_shard():
        op.fail(m, KRON, {y: with_dim(y.placements, m, R)}, "kron of two sharded inputs")
    if py.is_shard():
        d = py.dim + n - y.ndim
        if xs[d] != 1:
            op.fail(m, KRON, {y: with_dim(y.placements, m, R)},
                    f"{y.label}'s blocks of dim {py.dim} are spread over kron's output")
        return Shard(d)
    if px.is_shard():
        return Shard(px.dim + n - x.ndim)
    return R


def _kron_aligned(op, x, y, xs, ys, out):
    """Every rank's local kron is its block of the output (see module doc)."""
    mesh, shape = op.mesh, op.out.shapes[0]
    lead = len(xs) - x.ndim
    for rank in mesh.ranks:
        coord = mesh.get_coordinate(rank)
        have = rank_block(x.shape, mesh, x.placements, coord)
        want = rank_block(shape, mesh, out, coord)
        for d in range(x.ndim):
            scale = ys[d + lead]
            if (have.offset[d] * scale, have.shape[d] * scale) == (want.offset[d + lead],
                                                                   want.shape[d + lead]):
                continue
            if not any(p == Shard(d) for p in x.placements):
                continue  # dim d is b's (a Shard of b where a's size is 1)
            m = next(i for i, p in enumerate(x.placements) if p == Shard(d))
            op.fail(m, KRON, {x: with_dim(x.placements, m, R)},
                    f"{x.label}'s blocks of dim {d} times {ys[d + lead]} are not the "
                    f"output's blocks ({x.shape[d]} rows on {mesh.shape[m]} ranks)")
