"""The matmul family (``matmul mm bmm mv dot outer linear addmm einsum``) as einsum labels.

Every op is read as an einsum over dim labels; per mesh dim:

- all Replicate -> Replicate;
- the operands that have the sharded label are ``Shard`` on it, or Replicate and narrowed
  locally to the Shard operand's block (``bmm(S(0), R)``): a label kept in the output ->
  ``Shard`` of that output dim (``S(0) @ R -> S(0)``, ``R @ S(1) -> S(1)``, batch dims), a
  contracted label -> ``Partial("sum")`` (``S(1) @ S(0) -> P(sum)``, ``dot(S(0), R)``);
- one operand ``Partial(sum|avg)``, the others Replicate -> the same Partial (linearity).

A bias (``linear``, ``addmm``) must match the product's placement: Shard like the output
dim it spans (a Replicate bias is narrowed locally), Replicate beside Replicate, and
``Partial('sum')`` beside ``Partial('sum')`` (a Replicate bias is made so locally, as
``bias.redistribute(placements=[Partial()])`` would: its value on the first rank of that mesh
dim, zeros elsewhere). Example::

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
         "(contracted dim); S(batch) @ S(batch) or R -> S(batch) (a broadcast batch dim stays R; a "
         "Replicate operand is narrowed); "
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


def einsum_placements(op, operands, out_labels, narrow=None, bias=None):
    """Output placements for ``operands`` = ``[(TArg, labels)]`` (see module doc); the
    Replicate operands to narrow go to ``narrow`` (``{TArg.index: (TArg, target)}``; without
    it, a Replicate operand beside a Shard on its label raises). A ``bias`` (spanning the
    output's trailing dims) takes part on the mesh dims where it is a Shard."""
    extra = [] if type(bias) is not TArg else [(bias, tuple(out_labels)[len(out_labels)
                                                                        - bias.ndim:])]
    sizes = {}
    for t, labels in operands + extra:
        for lab, s in zip(labels, t.shape):
            sizes[lab] = s if sizes.get(lab, 1) == 1 else sizes[lab]  # 1 broadcasts (to 0 too)
    out = []
    for m in range(op.mesh.ndim):
        here = operands + [e for e in extra if e[0].placements[m].is_shard()]
        out.append(_mesh_dim(op, here, out_labels, sizes, m, narrow))
    return tuple(out)


def _mesh_dim(op, operands, out_labels, sizes, m, narrow=None):
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
            if lab == label:
                _check_label(op, t, labels, d, sizes, m, narrow, (t0, p0))
    for t, labels, p in sharded:
        if labels[p.dim] != label:
            want = labels.index(label) if label in labels else None
            op.fail(m, LEGAL, {t: with_dim(t.placements, m, Shard(want) if want is not None
                                              else R)},
                    f"{t0.label} and {t.label} are sharded on dims that do not match")
    if label in out_labels:
        return Shard(out_labels.index(label))
    return Partial("sum")


def _check_label(op, t, labels, d, sizes, m, narrow, first):
    """Operand ``t`` has the sharded label at dim ``d``: it must be Shard there, or Replicate
    (narrowed), or broadcast (size 1, Replicate)."""
    t0, p0 = first
    p = t.placements[m]
    broadcast = t.shape[d] == 1 and sizes[labels[d]] != 1
    if broadcast and p.is_shard():
        op.fail(m, LEGAL, {t: with_dim(t.placements, m, R)},
                f"{t.label} is sharded on a broadcast dim {d}")
    if labels.count(labels[d]) > 1:
        op.fail(m, LEGAL, {t0: with_dim(t0.placements, m, R)},
                f"{t.label} repeats the sharded label (a diagonal)")
    if not broadcast and p == R and narrow is not None:
        _, target = narrow.get(t.index, (t, t.placements))
        narrow[t.index] = (t, with_dim(target, m, Shard(d)))
    elif not broadcast and p != Shard(d):
        op.fail(m, LEGAL, {t: with_dim(t.placements, m, Shard(d))},
                f"{t0.label} is sharded on dim {p0.dim}; {t.label} must be sharded on "
                f"the matching dim {d}")


def bias_target(op, placements, bias, out_shape) -> tuple:
    """The bias's placements beside the product's (see module doc): a Replicate bias is
    narrowed to the product's Shard; a mismatch raises."""
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
        if b == want or (b == R and (isinstance(want, Shard) or want == Partial("sum"))):
            target[m] = want
            continue
        op.fail(m, LEGAL + "; bias: like the product (Replicate is narrowed locally, or made "
                "Partial('sum') beside a Partial('sum') product)",
                {bias: with_dim(bias.placements, m, want)},
                f"the product is {o} on this mesh dim, the bias {b}")
    return tuple(target)


def product_decision(op, operands, out_labels, bias=None, fn=None, args=None, kwargs=None
                     ) -> Decision:
    """The Decision of a product of ``operands`` (plus an optional ``bias``): its placements,
    the Replicate operands narrowed; ``fn``/``args``/``kwargs`` replace the local call."""
    narrow: dict = {}
    placements = einsum_placements(op, operands, out_labels, narrow, bias)
    if type(bias) is TArg:
        target = bias_target(op, placements, bias, op.out.shapes[0])
        if target != bias.placements:
            narrow[bias.index] = (bias, target)
    return narrowed(op, (placements,), narrow, fn, args, kwargs)


def narrowed(op, placements, narrow, fn=None, args=None, kwargs=None) -> Decision:
    """``Decision(placements)`` whose local call first narrows the ``narrow`` operands."""
    if not narrow:
        return Decision(placements, fn, args, kwargs)
    base_args = op.args if args is None else args
    base_kwargs = dict(op.kwargs if kwargs is None else kwargs)
    cuts = []
    for t, target in narrow.values():
        table = narrow_table(t.shape, t.mesh, t.placements, target)
        if table is None:
            m = next(i for i, (a, b) in enumerate(zip(t.placements, target)) if a != b)
            op.fail(m, LEGAL, {t: target}, f"{t.label}'s blocks do not contain the blocks it "
                    f"needs (nested sharding in a different mesh-dim order)")
        where = next((i for i, a in enumerate(base_args) if a is t), None)
        if where is None:
            where = next(k for k, v in base_kwargs.items() if v is t)
        cuts.append((where, table))
    return Decision(placements, sliced_call, (fn or op.func, tuple(cuts), Coord(op.mesh),
                                              *base_args), base_kwargs)


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
    return product_decision(op, [(a, labels[0]), (b, labels[1])], out)


rule(torch.Tensor.__rmatmul__, family="matmul")(matmul_rule)


@rule("outer", "ger", family="matmul", arg_names=("input", "vec2"))
def outer_rule(op):
    return product_decision(op, [(op.args[0], ("i",)), (op.arg(1, "vec2"), ("j",))], ("i", "j"))


@rule("linear", family="matmul", arg_names=("input", "weight", "bias"))
def linear_rule(op):
    x, w = op.arg(0, "input"), op.arg(1, "weight")
    batch = tuple(f"b{i}" for i in range(x.ndim - 1))
    w_labels = ("m", "k") if w.ndim == 2 else ("k",)
    out = (*batch, "m") if w.ndim == 2 else batch
    return product_decision(op, [(x, (*batch, "k")), (w, w_labels)], out, op.arg(2, "bias"),
                            fn=F.linear)


@rule("addmm", family="matmul", arg_names=("input", "mat1", "mat2"))
def addmm_rule(op):
    bias, m1, m2 = op.arg(0, "input"), op.arg(1, "mat1"), op.arg(2, "mat2")
    return product_decision(op, [(m1, ("n", "k")), (m2, ("k", "m"))], ("n", "m"), bias)


@rule("einsum", family="matmul", arg_names=("equation",))
def einsum_rule(op):
    equation = op.args[0]
    tensors = list(op.args[1:])
    if len(tensors) == 1 and type(tensors[0]) in (list, tuple):  # (a TArg is a tuple too)
        tensors = list(tensors[0])
    if not all(type(t) is TArg for t in tensors):
        op.fail(None, LEGAL, {}, "einsum operands must all be DTensors")
    ins, out = parse_einsum(equation, [t.ndim for t in tensors])
    return product_decision(op, list(zip(tensors, ins)), out, fn=torch.einsum,
                            args=(equation, *tensors), kwargs={})
