"""Losses on sharded inputs (a batch on "dp", uneven shards, ignored targets).

``reduction="none"`` is a placement rule: each rank computes the loss of its own samples and
the output keeps the batch's ``Shard`` (no communication). ``"sum"`` and ``"mean"`` are
re-expressed on the controller as DTensor ops that dtorch already plans, so their collectives
are counted and their backward comes from the ops': the sum of the per-sample losses is a
``Partial("sum")``; a mean divides it by a count - static (the number of elements: no
collective) or itself reduced (``cross_entropy`` / ``nll_loss`` with class indices divide by
the weights of the targets that are not ``ignore_index``; ``mse_loss`` / ``l1_loss`` with a
``weight`` by its sum: one all_reduce of that scalar per mesh dim the batch is sharded on).
The loss comes back ``Partial("sum")`` where the batch is sharded (``loss.item()`` reduces it;
its backward needs nothing more). ``cross_entropy`` on logits sharded on the class dim is loss
parallel (:mod:`dtorch.ops.loss_parallel`). Example::

    x = dtorch.tensor(torch.randn(6, 5), device_mesh=mesh, placements=[Shard(0)])
    t = dtorch.tensor(torch.tensor([0, 1, -100, 3, 4, 2]), device_mesh=mesh,
                      placements=[Shard(0)])
    F.cross_entropy(x, t)          # torch's value; one all_reduce (the count of valid targets)

    >>> bind(F.mse_loss, (1, 2), {"reduction": "sum"})["reduction"]
    'sum'
    >>> reduction_of(F.kl_div, {"size_average": None, "reduce": None, "reduction": "batchmean"})
    'batchmean'
    >>> target_dim(2, 3)
    1
"""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F
from torch.nn.modules.loss import _Reduction

from ..placement import Replicate, Shard
from .binary import broadcast_rule
from .explain import with_dim
from .generic import all_replicate
from .local_dims import Operand, free_labels, local_decision
from .registry import TArg, decomposed, rule

R = Replicate()
POINTWISE = (F.mse_loss, F.l1_loss, F.smooth_l1_loss, F.huber_loss, F.binary_cross_entropy,
             F.binary_cross_entropy_with_logits, F.kl_div)
CLASS = (F.cross_entropy, F.nll_loss)
LOSSES = POINTWISE + CLASS
_SIGNATURES = {f: inspect.signature(f) for f in LOSSES}
_TENSOR_PARAMS = ("input", "target", "weight", "pos_weight")
_LEGACY = ("size_average", "reduce")
CLASS_LEGAL = ("input S(d) (d not the class dim) with target S(the same sample dim) -> "
               "S(that dim), a Replicate input or target narrowed to those samples; R with R "
               "-> R; weight R; no Partial")


def params(func) -> tuple[str, ...]:
    """The parameter names of a loss, in torch's order (what rules bind arguments by)."""
    return tuple(_SIGNATURES[func].parameters)


def bind(func, args, kwargs) -> dict:
    """``{parameter: value}`` of a call, torch's defaults filled in (torch's signature)."""
    bound = _SIGNATURES[func].bind(*args, **kwargs)
    bound.apply_defaults()
    return dict(bound.arguments)


def reduction_of(func, bound: dict) -> str:
    """The reduction a call asks for (the legacy ``size_average`` / ``reduce`` win, as in
    torch); an unknown one raises on the controller."""
    if any(bound.get(k) is not None for k in _LEGACY):
        return _Reduction.legacy_get_string(bound.get("size_average"), bound.get("reduce"))
    reduction = bound["reduction"]
    legal = ("none", "mean", "sum") + (("batchmean",) if func is F.kl_div else ())
    if reduction not in legal:
        raise ValueError(f"{func.__name__}: reduction={reduction!r} is not one of "
                         f"{', '.join(map(repr, legal))}")
    return reduction


def target_dim(d: int, ndim: int) -> int:
    """The dim of a class-index target (and of the unreduced loss) that input dim ``d`` of an
    ``ndim``-dim input ``(N, C, d1, ...)`` maps to."""
    return d if d == 0 or ndim < 2 else d - 1


# reduction="none": the placement rules --------------------------------------------------------
def _param(op, name: str, default=None):
    """The argument of parameter ``name`` (by torch's signature), positional or keyword."""
    names = params(op.func)
    return op.arg(names.index(name), name, default) if name in names else default


def _is_none(op) -> bool:
    legacy = any(_param(op, k) is not None for k in _LEGACY)
    return not legacy and _param(op, "reduction", "mean") == "none"


def _reduced_only_replicate(op) -> None:
    """A reduction other than "none" reaches a rule only on all-Replicate inputs (the
    composition below takes the others); anything else is a bug, said plainly."""
    if not _is_none(op) and not all_replicate(op.tensors):
        raise AssertionError(f"{op.name}: a reduced loss on sharded inputs must go through "
                             f"dtorch.ops.losses.compose_loss")


def _tensor_operands(op) -> list:
    """``[(position or keyword, TArg)]`` of the tensor parameters (input, target, weight,
    pos_weight) the call passed as DTensors."""
    out = []
    for pos, name in enumerate(params(op.func)):
        value = _param(op, name)
        if name in _TENSOR_PARAMS and type(value) is TArg:
            out.append((name if name in op.kwargs else pos, value))
    return out


def pointwise_loss_rule(op):
    """``mse_loss(x, y, reduction="none")`` and kin: elementwise with broadcasting (a
    Replicate weight beside a Shard input is narrowed locally); no Partial input."""
    _reduced_only_replicate(op)
    return broadcast_rule(op, _tensor_operands(op), "none")


def _class_target(op):
    """``(input, target, weight, probabilities?)`` of a nll_loss / cross_entropy call."""
    x, t, w = op.tensors[0], _param(op, "target"), _param(op, "weight")
    probabilities = type(t) is TArg and t.dtype.is_floating_point
    return x, t, w if type(w) is TArg else None, probabilities


def class_loss_rule(op):
    """``cross_entropy(x, t, reduction="none")`` / ``nll_loss``: input ``(N, C, d1, ...)``,
    target ``(N, d1, ...)`` (class indices) or like the input (probabilities). Per mesh dim,
    a sample dim sharded on both (the same samples) stays sharded; the class dim may not be
    (loss parallel takes ``cross_entropy`` there); the weight is Replicate."""
    _reduced_only_replicate(op)
    x, t, w, probabilities = _class_target(op)
    if type(t) is not TArg:
        op.fail(None, CLASS_LEGAL, {}, "the target is not a DTensor beside a sharded input: "
                "make it one, sharded like the input's batch (dtorch.tensor(t, device_mesh=..., "
                "placements=[...]))")
    for m in range(op.mesh.ndim):
        _check_class_dim(op, x, m)
        if w is not None and not w.placements[m].is_replicate():
            op.fail(m, CLASS_LEGAL, {w: with_dim(w.placements, m, R)},
                    "the class weight must be Replicate")
    c = 1 if x.ndim >= 2 else 0
    x_labels = free_labels(x.ndim, mixed=(c,))
    t_labels = x_labels if probabilities else x_labels[:c] + x_labels[c + 1:]
    out = x_labels[:c] + x_labels[c + 1:]
    labels = {id(x): x_labels, id(t): t_labels, id(w): (None,)}
    operands = [Operand(where, a, labels[id(a)]) for where, a in _tensor_operands(op)]
    return local_decision(op, operands, [out], CLASS_LEGAL)


def _check_class_dim(op, x, m):
    """The class dim may not be sharded here: loss parallel (cross_entropy) takes it."""
    px, c = x.placements[m], 1 if x.ndim >= 2 else 0
    if isinstance(px, Shard) and px.dim == c:
        why = ("the class dim is sharded: loss parallel needs class-index targets, Replicate "
               "on that mesh dim" if op.func is F.cross_entropy else
               "nll_loss over a sharded class dim (F.cross_entropy runs loss parallel there)")
        op.fail(m, CLASS_LEGAL, {x: with_dim(x.placements, m, R)}, why)


for _f in POINTWISE:
    rule(_f, family="loss", arg_names=params(_f))(pointwise_loss_rule)
for _f in CLASS:
    rule(_f, family="loss", arg_names=params(_f))(class_loss_rule)


def target_weights(target, weight, ignore_index: int, dtype):
    """Per target, its class weight (1 without ``weight``), 0 where it is ``ignore_index``:
    what ``cross_entropy`` / ``nll_loss`` with ``reduction="mean"`` divide by (summed).

    >>> target_weights(torch.tensor([0, -100, 2]), torch.tensor([1., 2., 3.]), -100,
    ...                torch.float32)
    tensor([1., 0., 3.])
    """
    valid = target != ignore_index
    if weight is None:
        return valid.to(dtype)
    picked = weight[target.masked_fill(~valid, 0)]
    return torch.where(valid, picked, torch.zeros((), dtype=picked.dtype)).to(dtype)


@rule(target_weights, family="loss", arg_names=("target", "weight"))
def target_weights_rule(op):
    """Placements of the target (elementwise); the weight Replicate; no Partial."""
    t, w = op.tensors[0], op.arg(1, "weight")
    for m, p in enumerate(t.placements):
        if type(w) is TArg and not w.placements[m].is_replicate():
            op.fail(m, "target any non-Partial, weight R", {w: with_dim(w.placements, m, R)},
                    "the class weight must be Replicate")
        if p.is_partial():
            op.fail(m, "target any non-Partial, weight R", {t: with_dim(t.placements, m, R)},
                    "a target is not a sum")
    return t.placements


# "sum" / "mean": DTensor ops on the unreduced loss ------------------------------------------
def replicated(x):
    """``x`` with every Partial mesh dim reduced (an all_reduce each, counted)."""
    return x.redistribute(placements=[R if p.is_partial() else p for p in x.placements])


def reduce_loss(func, losses, bound: dict, reduction: str):
    """torch's reduction of the unreduced ``losses`` (see module doc)."""
    if reduction == "none":
        return losses
    if reduction == "sum":
        return losses.sum()
    x = bound["input"]
    if reduction == "batchmean":
        return losses.sum() / x.shape[0] if x.ndim else losses.sum()
    denominator = _denominator(func, losses, bound)
    return losses.mean() if denominator is None else losses.sum() / replicated(denominator)


def _denominator(func, losses, bound):
    """What torch's mean divides by when it is not the number of elements, else None."""
    if func in CLASS and not bound["target"].dtype.is_floating_point:
        return dispatch_op(target_weights, bound["target"], bound["weight"],
                           bound["ignore_index"], losses.dtype).sum()
    if func in (F.mse_loss, F.l1_loss) and bound.get("weight") is not None:
        return bound["weight"].sum()
    return None


def dispatch_op(fn, *args):
    """Run a dtorch-side op (a function with a rule here) on DTensors."""
    from .dispatch import dispatch
    return dispatch(fn, None, args)


def _dtensors(bound: dict) -> list:
    from ..tensor import DTensor
    return [v for v in bound.values() if isinstance(v, DTensor)]


@decomposed(*LOSSES)
def compose_loss(func, args, kwargs):
    """A loss on DTensors that are not all Replicate: loss parallel for ``cross_entropy``
    over sharded classes, else the unreduced loss (the rule above) then its reduction."""
    bound = bind(func, args, kwargs)
    tensors = _dtensors(bound)
    if not tensors or all_replicate(tensors):
        return NotImplemented  # every rank computes the whole loss (the all-Replicate rule)
    reduction = reduction_of(func, bound)
    if func is F.cross_entropy:
        from . import loss_parallel
        if loss_parallel.class_mesh_dims(bound["input"]):
            return loss_parallel.cross_entropy(bound, reduction)
    legacy = any(bound.get(k) is not None for k in _LEGACY)
    if reduction == "none" and not legacy:
        return NotImplemented
    return reduce_loss(func, unreduced(func, bound), bound, reduction)


def unreduced(func, bound: dict):
    """``func`` of the bound call with ``reduction="none"``, straight to dispatch (torch's own
    ``F.l1_loss`` drops ``weight`` on the way to ``__torch_function__``)."""
    from .dispatch import dispatch
    call = {k: v for k, v in bound.items() if k not in _LEGACY}
    call["reduction"] = "none"
    return dispatch(func, None, (call.pop("input"), call.pop("target")), call)


__all__ = ["compose_loss", "reduce_loss", "target_weights", "replicated"]
