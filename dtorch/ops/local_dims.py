"""Ops that act independently along some dims: a Shard there stays a Shard, no data moves.

A rule names, per tensor operand, a *label* for each dim the op acts independently along (a
batch dim of ``conv2d``, every dim but ``dim`` of ``cumsum``, the rows of ``cdist``) and
``None`` for a dim the op mixes values along; and, per output, the label of each output dim.
Per mesh dim:

- every operand Replicate -> Replicate;
- operands ``Shard`` on dims of one label -> every output ``Shard`` on that label's dim; an
  operand that has the label at full size but is Replicate is narrowed on each rank to the
  block the Shard operand holds (a local slice, as :mod:`dtorch.ops.binary` does);
- a Shard on a mixed (``None``) dim, on a dim broadcast from size 1, on two labels, a label
  an output lacks, or a Partial operand -> ``PlacementError`` naming the fix.

Example::

    >>> free_labels(3, mixed=(1,))
    ('d0', None, 'd2')
    >>> free_labels(2)
    ('d0', 'd1')
"""

from __future__ import annotations

from typing import NamedTuple

from ..placement import Replicate, Shard
from ..runtime.messages import Coord
from .binary import narrow_table, sliced_call
from .explain import with_dim
from .registry import Decision, TArg

R = Replicate()


class Operand(NamedTuple):
    """A tensor operand as a local-dims rule sees it: where it sits in the call (position or
    keyword, for narrowing), its TArg, and one label (or None: mixed) per dim."""

    where: int | str
    targ: TArg
    labels: tuple


def free_labels(ndim: int, mixed=(), prefix: str = "d") -> tuple:
    """``(prefix0, prefix1, ...)`` with ``None`` at the ``mixed`` dims (negative allowed)."""
    mixed = {d % ndim for d in mixed} if ndim else set()
    return tuple(None if d in mixed else f"{prefix}{d}" for d in range(ndim))


def local_decision(op, operands, outs, legal: str, fn=None, args=None, kwargs=None
                   ) -> Decision:
    """The Decision for ``operands`` (a list of :class:`Operand`) and ``outs`` (one label
    tuple per output): placements per output, and the narrowing of Replicate operands.
    ``fn``/``args``/``kwargs`` replace the local call (default: the op itself, its args)."""
    sizes = _label_sizes(operands)
    per_out = [[] for _ in outs]
    narrow: dict = {}
    for m in range(op.mesh.ndim):
        label = _mesh_dim_label(op, operands, sizes, m, legal)
        for out_labels, pl, shape in zip(outs, per_out, op.out.shapes):
            pl.append(R if label is None else _out_shard(op, out_labels, shape, label,
                                                         sizes, operands, m, legal))
        if label is not None:
            _narrowing(operands, label, sizes, m, narrow)
    placements = tuple(tuple(p) for p in per_out)
    base_fn = fn or op.func
    base_args = op.args if args is None else args
    base_kwargs = dict(op.kwargs if kwargs is None else kwargs)
    if not narrow:
        return Decision(placements, fn, args, kwargs)
    cuts = []
    for where, (t, target) in narrow.items():
        table = narrow_table(t.shape, t.mesh, t.placements, target)
        if table is None:
            m = next(i for i, (a, b) in enumerate(zip(t.placements, target)) if a != b)
            op.fail(m, legal, {t: target}, f"{t.label}'s blocks do not contain the blocks it "
                    f"needs (nested sharding in a different mesh-dim order)")
        cuts.append((where, table))
    return Decision(placements, sliced_call, (base_fn, tuple(cuts), Coord(op.mesh),
                                              *base_args), base_kwargs)


def _label_sizes(operands) -> dict:
    sizes: dict = {}
    for o in operands:
        for lab, s in zip(o.labels, o.targ.shape):
            if lab is not None:
                sizes[lab] = s if sizes.get(lab, 1) == 1 else sizes[lab]  # 1 broadcasts
    return sizes


def _mesh_dim_label(op, operands, sizes, m, legal):
    """The label sharded on mesh dim ``m`` (None: every operand Replicate there)."""
    label = first = None
    for o in operands:
        p = o.targ.placements[m]
        if p.is_partial():
            op.fail(m, legal, {o.targ: with_dim(o.targ.placements, m, R)},
                    f"{op.name} is not linear in {o.targ.label}: a Partial input must be "
                    f"reduced first")
        if not isinstance(p, Shard):
            continue
        lab = o.labels[p.dim]
        if lab is None:
            op.fail(m, legal, {o.targ: _fix_for(o, m)},
                    f"{op.name} combines values along dim {p.dim} of {o.targ.label}, which is "
                    f"sharded")
        if o.targ.shape[p.dim] != sizes[lab] or o.labels.count(lab) > 1:
            op.fail(m, legal, {o.targ: with_dim(o.targ.placements, m, R)},
                    f"dim {p.dim} of {o.targ.label} is broadcast or repeated against the other "
                    f"operands")
        if label is None:
            label, first = lab, o
        elif lab != label:
            op.fail(m, legal, {o.targ: _matching(o, label, m)},
                    f"{first.targ.label} and {o.targ.label} are sharded on dims that do not "
                    f"match")
    return label


def _fix_for(o: Operand, m: int) -> list:
    """Alternatives for an operand sharded on a mixed dim: Shard on a free dim, or Replicate."""
    free = [d for d, lab in enumerate(o.labels) if lab is not None]
    options = [with_dim(o.targ.placements, m, Shard(d)) for d in free[:1]]
    return options + [with_dim(o.targ.placements, m, R)]


def _matching(o: Operand, label, m):
    want = o.labels.index(label) if label in o.labels else None
    return with_dim(o.targ.placements, m, Shard(want) if want is not None else R)


def _out_shard(op, out_labels, shape, label, sizes, operands, m, legal):
    if label not in out_labels or shape[out_labels.index(label)] != sizes[label]:
        sharded = next(o.targ for o in operands if isinstance(o.targ.placements[m], Shard))
        op.fail(m, legal, {sharded: with_dim(sharded.placements, m, R)},
                f"{op.name} does not keep the sharded dim whole in its output")
    return Shard(out_labels.index(label))


def _narrowing(operands, label, sizes, m, narrow: dict) -> None:
    """Record the Replicate operands that have ``label`` at full size: narrowed to the
    block of the Shard operand on mesh dim ``m``."""
    for o in operands:
        p = o.targ.placements[m]
        if p.is_shard() or label not in o.labels:
            continue
        d = o.labels.index(label)
        if o.targ.shape[d] != sizes[label]:
            continue  # broadcast along the label: every rank needs it whole
        target = narrow[o.where][1] if o.where in narrow else o.targ.placements
        narrow[o.where] = (o.targ, with_dim(target, m, Shard(d)))
