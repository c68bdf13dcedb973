"""Loss parallel: ``F.cross_entropy`` on logits sharded on the class dim (tp's ``Shard(-1)``),
on any mesh, without a context manager.

Each rank holds a slice of the classes of every row. Written as DTensor ops that dtorch plans
(each collective planned and counted, the backward the ops'): per row the max
(``amax`` -> ``Partial("max")``, one all_reduce; detached, it only keeps ``exp`` in range),
the sum of exponentials (``Partial("sum")``, one all_reduce) and the target's logit, which
only the rank holding that class picks (:func:`class_logit`, ``Partial("sum")``, one
all_reduce). With ``label_smoothing`` the (weighted) sum of the logits adds one more. The
loss is ``logsumexp - target logit``, Replicate on those mesh dims; the batch's own dims and
the reduction are those of :mod:`dtorch.ops.losses`. The backward communicates nothing on the
class dims: each rank's gradient is ``softmax - one_hot`` of its own classes, from the local
graphs of ``exp`` and ``class_logit`` (a reduction's backward from Replicate to Partial moves
nothing). Example::

    logits = dtorch.tensor(torch.randn(8, 100), device_mesh=mesh, placements=[Shard(1)])
    target = dtorch.tensor(torch.randint(0, 100, (8,)), device_mesh=mesh)
    F.cross_entropy(logits, target)    # 3 all_reduce on the class dim's mesh dim, torch's value

    >>> class_logit(torch.tensor([[1., 2.], [3., 4.]]), torch.tensor([3, 0]), -100, 2)
    tensor([2., 0.])
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..errors import PlacementError
from ..layout import local_offset
from ..placement import Partial, Replicate, Shard
from ..runtime.messages import Coord
from .explain import code_placements, fix_line, with_dim
from .losses import dispatch_op, reduce_loss, target_weights
from .registry import Decision, rule

R = Replicate()
LEGAL = ("input S(class dim) with target R -> P(sum); input S(sample dim) with target "
         "S(the same samples) -> S; R with R -> R")


def class_dim(x) -> int:
    """The class dim of ``cross_entropy``'s input ``(C,)`` or ``(N, C, d1, ...)``."""
    return 1 if x.ndim >= 2 else 0


def class_mesh_dims(x) -> tuple[int, ...]:
    """The mesh dims on which the input's classes are sharded."""
    c = class_dim(x)
    return tuple(m for m, p in enumerate(x.placements) if isinstance(p, Shard) and p.dim == c)


def class_logit(input, target, ignore_index: int, start: int = 0, classes: int | None = None):
    """Per row, the logit of its target class when this block of classes (which begins at
    class ``start``) holds it, else 0 (also where the target is ``ignore_index``). A target
    outside ``[0, classes)`` raises torch's error (every rank sees the same targets, so every
    rank raises: the result is poisoned everywhere, no rank waits)."""
    c = class_dim(input)
    if classes is not None:
        bad = target[(target != ignore_index) & ((target < 0) | (target >= classes))]
        if bad.numel():
            raise IndexError(f"Target {int(bad[0])} is out of bounds.")
    local = target - start
    hit = (local >= 0) & (local < input.shape[c]) & (target != ignore_index)
    if input.shape[c] == 0:
        return torch.zeros(target.shape, dtype=input.dtype)
    picked = input.gather(c, local.masked_fill(~hit, 0).unsqueeze(c)).squeeze(c)
    return torch.where(hit, picked, torch.zeros((), dtype=picked.dtype))


def class_logit_on_rank(starts: dict, classes: int, coord, input, target, ignore_index: int):
    """Local kernel: :func:`class_logit` of this rank's block of classes."""
    return class_logit(input, target, ignore_index, starts[coord], classes)


@rule(class_logit, family="loss", arg_names=("input", "target", "ignore_index"))
def class_logit_rule(op):
    """Classes sharded -> ``Partial("sum")`` (one rank holds each target); the samples as
    the target's placements."""
    x, t = op.tensors[0], op.tensors[1]
    c = class_dim(x)
    out = []
    for m, (px, pt) in enumerate(zip(x.placements, t.placements)):
        if isinstance(px, Shard) and px.dim == c and pt.is_replicate():
            out.append(Partial("sum"))
        elif px.is_replicate() and pt.is_replicate():
            out.append(R)
        elif isinstance(px, Shard) and pt == Shard(px.dim if px.dim == 0 else px.dim - 1):
            out.append(pt)
        else:
            op.fail(m, LEGAL, {}, "the logits and the targets must hold the same samples")
    mesh = op.mesh
    starts = {mesh.get_coordinate(r): local_offset(x.shape, mesh, x.placements,
                                                   mesh.get_coordinate(r))[c]
              for r in mesh.ranks}
    return Decision((tuple(out),), class_logit_on_rank,
                    (starts, x.shape[c], Coord(mesh), x, t, op.arg(2, "ignore_index", -100)), {})


def _check(bound) -> None:
    """What loss parallel needs, said before anything is sent."""
    from ..tensor import DTensor
    x, t, w = bound["input"], bound["target"], bound["weight"]
    dims = class_mesh_dims(x)
    if not isinstance(t, DTensor) or t.dtype.is_floating_point:
        raise PlacementError(
            f"F.cross_entropy: the logits' classes are sharded ({code_placements(x.placements)})"
            f"; loss parallel takes class-index targets as a DTensor on the same mesh. For "
            f"class probabilities, redistribute the logits' class dim to Replicate first:\n"
            + fix_line("input", x, [R if m in dims else p for m, p in enumerate(x.placements)]))
    for m in range(x.device_mesh.ndim):
        want = _target_placement(x.placements[m], m in dims)
        if want is None or t.placements[m] != want:
            raise PlacementError(
                f"F.cross_entropy: on mesh dim {m} the logits are "
                f"{code_placements(x.placements)} and the target "
                f"{code_placements(t.placements)}; the target must hold the rows the logits "
                f"hold there (every row where the classes are sharded)" + (
                    "; a Partial input is not a loss's input: redistribute it first"
                    if want is None else f". Fix: target.redistribute(placements="
                    f"{code_placements(with_dim(t.placements, m, want))})"))
    if w is not None and not (isinstance(w, DTensor) and all(
            p.is_replicate() for p in w.placements)):
        raise PlacementError("F.cross_entropy: the class weight must be a Replicate DTensor on "
                             "the logits' mesh (weight.redistribute(placements=[Replicate()] * "
                             "mesh.ndim))")


def _target_placement(p, classes: bool):
    """The target's placement beside a logits' placement on one mesh dim (None: none fits)."""
    if classes or p.is_replicate():
        return R
    if isinstance(p, Shard):
        return Shard(p.dim if p.dim == 0 else p.dim - 1)
    return None


def _classes_reduced(x, dims):
    """``x`` with its Partial class mesh dims all_reduced (one collective each)."""
    return x.redistribute(placements=[R if m in dims else p for m, p in enumerate(x.placements)])


def cross_entropy(bound: dict, reduction: str):
    """``F.cross_entropy`` of the bound call, its classes sharded (see module doc)."""
    _check(bound)
    x, t, w = bound["input"], bound["target"], bound["weight"]
    ignore, eps = bound["ignore_index"], float(bound["label_smoothing"])
    c, dims = class_dim(x), class_mesh_dims(x)
    top = _classes_reduced(x.detach().amax(c, keepdim=True), dims)
    sumexp = _classes_reduced((x - top).exp().sum(c, keepdim=True), dims)
    lse = (sumexp.log() + top).squeeze(c)
    picked = _classes_reduced(dispatch_op(class_logit, x, t, ignore), dims)
    weights = dispatch_op(target_weights, t, w, ignore, x.dtype)
    # where, not a product: with every target ignored the mean is 0/0 (NaN, as torch's) and
    # the gradient coming down is inf; rows of weight 0 must still get 0, not inf * 0
    losses = torch.where(weights != 0, (lse - picked) * weights, 0.0)
    if eps > 0:
        losses = (1 - eps) * losses + eps * _smoothing(x, t, w, ignore, lse, c, dims)
    return reduce_loss(F.cross_entropy, losses, bound, reduction)


def _smoothing(x, t, w, ignore, lse, c, dims):
    """torch's smoothing term per row: ``-sum_k w_k log p_k / C``, 0 at ignored targets."""
    n = x.shape[c]
    if w is None:
        total, weight_sum = x.sum(c), float(n)
    else:
        shape = [n] + [1] * (x.ndim - c - 1)
        total, weight_sum = (x * w.view(*shape)).sum(c), w.sum()
    total = _classes_reduced(total, dims)
    return torch.where(t != ignore, (lse * weight_sum - total) / n, 0.0)
