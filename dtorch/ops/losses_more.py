"""More losses on batch-sharded inputs, beside :mod:`dtorch.ops.losses`.

``reduction="none"``: a labeler on :mod:`dtorch.ops.batch_local` per loss (each rank computes
its own samples' losses; the output keeps the batch's ``Shard``). The kinds:

- *elementwise* (``hinge_embedding``, ``margin_ranking``, ``poisson_nll``, ``soft_margin``,
  ``gaussian_nll``): every dim free, operands broadcast;
- *rows* (``cosine_embedding``, ``multi_margin``, ``multilabel_margin``,
  ``multilabel_soft_margin``, ``triplet_margin``): the last dim of the inputs is mixed, a
  per-row target has the leading dims, a class ``weight`` is Replicate.

``"mean"`` / ``"sum"`` run as the unreduced loss then :func:`dtorch.ops.losses.reduce_loss`
(a ``Partial("sum")`` where the batch is sharded). ``triplet_margin_with_distance_loss`` runs as
DTensor ops (its ``distance_function`` is the user's, called on DTensors); ``ctc_loss`` refuses
sharded inputs. Example::

    >>> KINDS[F.soft_margin_loss]
    'elementwise'
    >>> row_labels(2, {"input": 2, "target": 1})
    {'input': ('b0', None), 'target': ('b0',)}
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .batch_local import aligned, get, register
from .generic import all_replicate
from .losses import reduce_loss, reduction_of
from ..errors import PlacementError
from ..placement import Replicate
from .explain import fix_line
from .registry import TArg, decomposed

LEGAL = ("the inputs and the targets S(a sample dim), alike -> the loss S(that dim); a class "
         "weight R; no Partial")
KINDS = {F.hinge_embedding_loss: "elementwise", F.margin_ranking_loss: "elementwise",
         F.poisson_nll_loss: "elementwise", F.soft_margin_loss: "elementwise",
         F.gaussian_nll_loss: "elementwise", F.cosine_embedding_loss: "rows",
         F.multi_margin_loss: "rows", F.multilabel_margin_loss: "rows",
         F.multilabel_soft_margin_loss: "rows", F.triplet_margin_loss: "rows"}
ROW_TENSORS = ("input", "input1", "input2", "anchor", "positive", "negative")
_LEGACY = ("size_average", "reduce")


def _tensors(op) -> dict:
    """``{parameter: ndim}`` of the tensor parameters the call passed as DTensors."""
    return {n: v.ndim for n in op.entry.arg_names if type(v := get(op, n)) is TArg}


def _reduced_shape(op) -> tuple:
    return op.out.shapes[0]


def elementwise_labels(op) -> tuple:
    ndims = _tensors(op)
    width = max(ndims.values())
    labels = {n: aligned(d, width) for n, d in ndims.items()}
    x, var = get(op, "input"), get(op, "var")
    if type(var) is TArg and type(x) is TArg and var.shape == x.shape[:-1] and x.ndim:
        labels["var"] = aligned(width, width)[:-1]  # torch unsqueezes it at -1
    out = aligned(len(_reduced_shape(op)), width) if _is_none(op) else ()
    return labels, [out]


def row_labels(width: int, ndims: dict) -> dict:
    """Rows: inputs ``(*rows, C)`` (C mixed), a target of ``width - 1`` dims per row, else
    (a class weight, an unbatched target) no free dim."""
    out = {}
    for n, d in ndims.items():
        if n in ROW_TENSORS or (n == "target" and d == width):
            out[n] = aligned(d, width, (-1,))
        elif n == "target" and d == width - 1:
            out[n] = aligned(d, width - 1)
        else:
            out[n] = (None,) * d
    return out


def _rows(op) -> tuple:
    ndims = _tensors(op)
    width = max(d for n, d in ndims.items() if n in ROW_TENSORS)
    shape = _reduced_shape(op)
    out = aligned(width - 1, width - 1) if len(shape) == width - 1 else (None,) * len(shape)
    return row_labels(width, ndims), [out]


def _is_none(op) -> bool:
    legacy = any(get(op, k) is not None for k in _LEGACY)
    return not legacy and get(op, "reduction", "mean") == "none"


def gaussian_meta(input, target, var, full=False, eps=1e-6, reduction="mean"):
    """Shapes of ``gaussian_nll_loss`` on meta (torch's own checks ``var < 0``'s values)."""
    v = var if isinstance(var, torch.Tensor) else torch.ones_like(input)
    if v.shape != input.shape and v.shape == input.shape[:-1]:
        v = v.unsqueeze(-1)
    shape = torch.broadcast_shapes(input.shape, target.shape, v.shape)
    dtype = torch.result_type(input, target)
    return input.new_empty(shape if reduction == "none" else (), dtype=dtype)


for _f, _kind in KINDS.items():
    register([_f], elementwise_labels if _kind == "elementwise" else _rows, LEGAL, "loss",
             meta=gaussian_meta if _f is F.gaussian_nll_loss else None)


# "mean" / "sum": the unreduced loss, then its reduction ---------------------------------------
def _bind(func, args, kwargs) -> dict:
    import inspect
    bound = inspect.signature(func).bind(*args, **kwargs)
    bound.apply_defaults()
    return dict(bound.arguments)


def _dtensors(values) -> list:
    from ..tensor import DTensor
    return [v for v in values if isinstance(v, DTensor)]


@decomposed(*KINDS)
def compose(func, args, kwargs):
    """A reduced loss on DTensors that are not all Replicate (see module doc)."""
    bound = _bind(func, args, kwargs)
    tensors = _dtensors(bound.values())
    if not tensors or all_replicate(tensors):
        return NotImplemented
    reduction = reduction_of(func, bound)
    legacy = any(bound.get(k) is not None for k in _LEGACY)
    if reduction == "none" and not legacy:
        return NotImplemented
    from .dispatch import dispatch
    call = {k: v for k, v in bound.items() if k not in _LEGACY}
    call["reduction"] = "none"
    losses = dispatch(func, None, (), call)
    return reduce_loss(func, losses, {"input": tensors[0]}, reduction)


@decomposed(F.triplet_margin_with_distance_loss)
def triplet_with_distance(func, args, kwargs):
    """torch's composition, on DTensors: the distances (the user's function, or
    ``pairwise_distance``), ``clamp_min(margin + d(a, p) - d(a, n), 0)``, the reduction."""
    bound = _bind(func, args, kwargs)
    a, p, n = bound["anchor"], bound["positive"], bound["negative"]
    tensors = _dtensors((a, p, n))
    if not tensors or all_replicate(tensors):
        return NotImplemented
    if not a.ndim == p.ndim == n.ndim:
        raise RuntimeError("The anchor, positive, and negative tensors are expected to have "
                           "the same number of dimensions")
    if bound["margin"] <= 0:
        raise ValueError(f"triplet_margin_with_distance_loss: expected margin to be greater "
                         f"than 0, got {bound['margin']} instead")
    distance = bound["distance_function"] or F.pairwise_distance
    d_pos, d_neg = distance(a, p), distance(a, n)
    if bound["swap"]:
        d_neg = torch.minimum(d_neg, distance(p, n))
    losses = torch.clamp_min(bound["margin"] + d_pos - d_neg, 0)
    return reduce_loss(func, losses, {"input": a}, reduction_of(func, bound))


@decomposed(F.ctc_loss)
def ctc_refuses(func, args, kwargs):
    """All-Replicate only: a sharded batch would need the ranks' lengths cut alike, and
    torch's ctc refuses empty blocks."""
    tensors = _dtensors(_bind(func, args, kwargs).values())
    if not tensors or all_replicate(tensors):
        return NotImplemented
    x = next(t for t in tensors if not all(p.is_replicate() for p in t.placements))
    raise PlacementError(
        "F.ctc_loss has no rule for sharded inputs (its per-sample lengths would have to be cut "
        "alike on every rank). Replicate its inputs first (or call it on .to_torch() values):\n"
        + fix_line("x", x, [Replicate()] * x.device_mesh.ndim))


__all__ = ["compose", "triplet_with_distance", "gaussian_meta", "row_labels", "KINDS",
           "ctc_refuses"]
