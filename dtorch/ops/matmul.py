"""The matmul family (``matmul mm bmm mv dot outer linear addmm einsum``) as einsum labels.

Every op is read as an einsum over dim labels; per mesh dim:

- all Replicate -> Replicate;
- the operands that have the sharded label are all ``Shard`` on it (the rest Replicate):
  a label kept in the output -> ``Shard`` of that output dim (``S(0) @ R -> S(0)``,
  ``R @ S(1) -> S(1)``, batch dims), a contracted label -> ``Partial("sum")``
  (``S(1) @ S(0) -> P(sum)``);
- one operand ``Partial(sum|avg)``, the others Replicate -> the same Partial (linearity).

A bias (``linear``, ``addmm``) must match the product's placement: Shard like the output
dim it spans (a Replicate bias is narrowed locally), Replicate beside Replicate, and
``Partial('sum')`` beside ``Partial('sum')`` (``bias.redistribute(placements=[Partial()])``
is free). Example::

    >>> matmul_labels(2, 2)
    ((('n', 'k'), ('k', 'm')), ('n', 'm'))
    >>> matmul_labels(3, 1)
    ((('b0', 'n', 'k'), ('k',)), ('b0', 'n'))
    >>> parse_einsum("ij,jk->ik", [2, 2])
    ((('i', 'j'), ('j', 'k')), ('i', 'k'))
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..placement import Partial, Replicate, Shard
from ..runtime.messages import Coord
from .binary import narrow_table, sliced_call
from .explain import with_dim
from .registry import Decision, TArg, rule

R = Replicate()
LEGAL = ("R @ R -> R; S(row) @ R -> S(row); R @ S(col) -> S(col); S(k) @ S(k) -> P(sum) "
         "(contracted dim); S(batch) @ S(batch) -> S(batch) (a broadcast batch dim stays R); "
         "P(sum|avg) @ R or R @ P(sum|avg) -> P(sum|avg)")


def matmul_labels(na: int, nb: int):
    """Einsum labels of ``torch.matmul`` for operand ranks ``na``, ``nb``."""
    if na == 1 and nb == 1:
        return (("k",), ("k",)), ()
    if nb == 1:
        batch = tuple(f"b{i}" for i in range(na - 2))
        return ((*batch, "n", "k"), ("k",)), (*batch, "n")
    if na == 1:
        batch = tuple(f"b{i}" for i in range(nb - 2))
        return (("k",), (*batch, "k", "m")), (*batch, "m")
    nbatch = max(na, nb) - 2
    batch = tuple(f"b{i}" for i in range(nbatch))
    a = (*batch[nbatch - (na - 2):], "n", "k")
    b = (*batch[nbatch - (nb - 2):], "k", "m")
    return (a, b), (*batch, "n", "m")


def parse_einsum(equation: str, ndims):
    """Labels per operand and output for an einsum equation (``...`` supported)."""
    eq = equation.replace(" ", "")
    lhs, arrow, rhs = eq.partition("->")
    terms = lhs.split(",")
    if len(terms) != len(ndims):
        raise ValueError(f"einsum(): {len(terms)} operands in the equation, {len(ndims)} given")
    n_ell = max([nd - (len(t) - 3) for t, nd in zip(terms, ndims) if "..." in t] or [0])
    ell = tuple(f"e{i}" for i in range(n_ell))

    def expand(term, nd=None):
        if "..." not in term:
            return tuple(term)
        head, tail = term.split("...")
        k = (nd - len(head) - len(tail)) if nd is not None else n_ell
        return (*head, *ell[n_ell - k:], *tail)

    ins = tuple(expand(t, nd) for t, nd in zip(terms, ndims))
    if arrow:
        out = expand(rhs)
    else:
        counts = {}
        for labels in ins:
            for lab in labels:
                counts[lab] = counts.get(lab, 0) + 1
        out = ell + tuple(sorted(lab for lab, c in counts.items()
                                 if c == 1 and not lab.startswith("e")))
    return ins, out


def einsum_placements(op, operands, out_labels):
    """Output placements for ``operands`` = ``[(TArg, labels)]`` (see module doc)."""
    sizes = {}
    for t, labels in operands:
        for lab, s in zip(labels, t.shape):
            sizes[lab] = max(sizes.get(lab, 1), s)
    out = []
    for m in range(op.mesh.ndim):
        out.append(_mesh_dim(op, operands, out_labels, sizes, m))
    return tuple(out)


def _mesh_dim(op, operands, out_labels, sizes, m):
    pls = [t.placements[m] for t, _ in operands]
    partial = [(t, p) for (t, _), p in zip(operands, pls) if p.is_partial()]
    sharded = [(t, labels, p) for (t, labels), p in zip(operands, pls) if p.is_shard()]
    if partial:
        t, p = partial[0]
        if len(partial) > 1 or sharded or p.reduce_op not in ("sum", "avg"):
            fix = {t: with_dim(t.placements, m, R) for t, _ in partial[1:] or partial}
            op.fail(m, LEGAL, fix, "a matmul is linear in one operand at a time: one "
                    "Partial(sum|avg) operand, the others Replicate")
        return p
    if not sharded:
        return R
    t0, labels0, p0 = sharded[0]
    label = labels0[p0.dim]
    for t, labels in operands:
        for d, lab in enumerate(labels):
            if lab != label:
                continue
            p = t.placements[m]
            broadcast = t.shape[d] == 1 and sizes[lab] != 1
            if broadcast and p.is_shard():
                op.fail(m, LEGAL, {t: with_dim(t.placements, m, R)},
                        f"{t.label} is sharded on a broadcast dim {d}")
            if not broadcast and p != Shard(d):
                op.fail(m, LEGAL, {t: with_dim(t.placements, m, Shard(d))},
                        f"{t0.label} is sharded on dim {p0.dim}; {t.label} must be sharded on "
                        f"the matching dim {d}")
    for t, labels, p in sharded:
        if labels[p.dim] != label:
            want = labels.index(label) if label in labels else None
            op.fail(m, LEGAL, {t: with_dim(t.placements, m, Shard(want) if want is not None
                                              else R)},
                    f"{t0.label} and {t.label} are sharded on dims that do not match")
    if label in out_labels:
        return Shard(out_labels.index(label))
    if list(labels0).count(label) > 1:
        op.fail(m, LEGAL, {t0: with_dim(t0.placements, m, R)}, "a repeated (diagonal) label")
    return Partial("sum")


def bias_decision(op, placements, bias, where, out_shape, base_fn):
    """Combine a bias with the product's placements (see module doc)."""
    if bias is None or type(bias) is not TArg:
        return Decision((placements,))
    n_o = len(out_shape)
    target = list(bias.placements)
    for m, o in enumerate(placements):
        b = bias.placements[m]
        want = R
        if isinstance(o, Shard):
            bd = o.dim - (n_o - bias.ndim)
            if bd >= 0 and bias.shape[bd] == out_shape[o.dim]:
                want = Shard(bd)
        elif isinstance(o, Partial):
            want = o if o.reduce_op == "sum" or b.is_partial() else R
        if b == want or (b == R and isinstance(want, Shard)):
            target[m] = want
            continue
        op.fail(m, LEGAL + "; bias: like the product (Replicate is narrowed locally), "
                "Partial('sum') beside a Partial('sum') product",
                {bias: with_dim(bias.placements, m, want)},
                f"the product is {o} on this mesh dim, the bias {b}")
    target = tuple(target)
    if target == bias.placements:
        return Decision((placements,))
    table = narrow_table(bias.shape, bias.mesh, bias.placements, target)
    return Decision((placements,), sliced_call,
                    (base_fn, ((where, table),), Coord(op.mesh), *op.args), dict(op.kwargs))


@rule("matmul", "__matmul__", "mm", "bmm", "mv", "dot", "inner", "vdot", family="matmul")
def matmul_rule(op):
    a, b = op.arg(0, "input"), op.arg(1, "other")
    if op.func is torch.Tensor.__rmatmul__:
        a, b = b, a
    if op.func in (torch.inner,) and (a.ndim > 1 or b.ndim > 1):
        op.fail(None, LEGAL, {}, "inner() of tensors with more than 1 dim: use matmul/einsum")
    if op.func in (torch.mv, torch.Tensor.mv):
        labels, out = (("n", "k"), ("k",)), ("n",)
    else:
        labels, out = matmul_labels(a.ndim, b.ndim)
    return einsum_placements(op, [(a, labels[0]), (b, labels[1])], out)


rule(torch.Tensor.__rmatmul__, family="matmul")(matmul_rule)


@rule("outer", "ger", family="matmul", arg_names=("input", "vec2"))
def outer_rule(op):
    return einsum_placements(op, [(op.args[0], ("i",)), (op.arg(1, "vec2"), ("j",))], ("i", "j"))


@rule("linear", family="matmul", arg_names=("input", "weight", "bias"))
def linear_rule(op):
    x, w = op.arg(0, "input"), op.arg(1, "weight")
    bias = op.arg(2, "bias")
    batch = tuple(f"b{i}" for i in range(x.ndim - 1))
    w_labels = ("m", "k") if w.ndim == 2 else ("k",)
    out = (*batch, "m") if w.ndim == 2 else batch
    placements = einsum_placements(op, [(x, (*batch, "k")), (w, w_labels)], out)
    where = "bias" if "bias" in op.kwargs else 2
    return bias_decision(op, placements, bias, where, op.out.shapes[0], F.linear)


@rule("addmm", family="matmul", arg_names=("input", "mat1", "mat2"))
def addmm_rule(op):
    bias, m1, m2 = op.arg(0, "input"), op.arg(1, "mat1"), op.arg(2, "mat2")
    placements = einsum_placements(op, [(m1, ("n", "k")), (m2, ("k", "m"))], ("n", "m"))
    where = "input" if "input" in op.kwargs else 0
    return bias_decision(op, placements, bias, where, op.out.shapes[0], op.func)


@rule("einsum", family="matmul", arg_names=("equation",))
def einsum_rule(op):
    equation = op.args[0]
    tensors = list(op.args[1:])
    if len(tensors) == 1 and isinstance(tensors[0], (list, tuple)):
        tensors = list(tensors[0])
    if not all(type(t) is TArg for t in tensors):
        op.fail(None, LEGAL, {}, "einsum operands must all be DTensors")
    ins, out = parse_einsum(equation, [t.ndim for t in tensors])
    placements = einsum_placements(op, list(zip(tensors, ins)), out)
    return Decision((placements,), torch.einsum, (equation, *tensors), {})
