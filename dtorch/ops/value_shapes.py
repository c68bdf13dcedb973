"""Ops whose result's shape depends on the values (``x[x > 0]``, ``torch.where(x > 0)``,
``nonzero``, ``masked_select``): found when ``meta`` cannot run them but small cpu stand-ins
filled with zeros and with ones give results of different shapes.

With every input Replicate they run eagerly (:mod:`dtorch.ops.generic`). On a sharded input
each rank's piece would have a size of its own, not a ``torch.chunk`` block of one DTensor,
so :func:`refusal` names the fix: a three-argument ``where`` or ``masked_fill`` keeps the
layout and runs locally. Example::

    >>> import torch
    >>> from types import SimpleNamespace as Spec
    >>> from dtorch.ops.registry import TArg
    >>> x = TArg(0, "input", Spec(shape=(4,), dtype=torch.bool))
    >>> shape_depends_on_values(torch.nonzero, (x,), {}), shape_depends_on_values(torch.neg, (x,), {})
    (True, False)
"""

from __future__ import annotations

import math

import torch
import torch.utils._pytree as pytree

from ..errors import PlacementError
from ..placement import format_placements
from .infer import to_zeros

LIMIT = 1 << 20  # elements: bigger calls are not run on cpu stand-ins


class ValueDependentShape(Exception):
    """Raised by shape inference: the op's output shape depends on its input values."""


def _shapes(result) -> list:
    return [tuple(t.shape) for t in pytree.tree_leaves(result) if isinstance(t, torch.Tensor)]


def shape_depends_on_values(fn, targs, tkwargs, to_cpu=None) -> bool:
    """Whether ``fn`` runs on zero-filled and on one-filled stand-ins of the arguments and the
    results' shapes differ (``to_cpu(obj, fill)``: the stand-ins, default :func:`to_zeros`)."""
    to_cpu = to_cpu or to_zeros
    sizes = [math.prod(t.shape) for t in pytree.tree_leaves((targs, tkwargs))
             if hasattr(t, "shape") and hasattr(t, "dtype")]
    if sum(sizes) > LIMIT:
        return False
    try:
        zeros = fn(*to_cpu(targs, torch.zeros), **to_cpu(tkwargs, torch.zeros))
        ones = fn(*to_cpu(targs, torch.ones), **to_cpu(tkwargs, torch.ones))
    except Exception:  # noqa: BLE001 - the caller raises the op's own error
        return False
    return _shapes(zeros) != _shapes(ones)


def refusal(name: str, tensors) -> PlacementError:
    """The PlacementError for a value-dependent op on sharded or Partial inputs."""
    inputs = ", ".join(f"{t.label} {format_placements(t.placements)}" for t in tensors)
    return PlacementError(
        f"{name}: the size of its result depends on the values, so on sharded inputs each "
        f"rank's piece would have its own size, not a block of one DTensor\n"
        f"  inputs: {inputs}\n"
        f"  fix: keep the layout with a three-argument torch.where(mask, x, other) or "
        f"x.masked_fill(~mask, value) (they run locally), or make every input Replicate "
        f"first: x.redistribute(placements=[Replicate()] * mesh.ndim)   # all_gather")
