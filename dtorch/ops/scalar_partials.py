"""Comparing a 0-dim Partial: the one documented exception that moves data.

``t.max() == 0`` on a sharded ``t`` compares a pending maximum (``Partial("max")``) with a
number; a comparison does not commute with the pending reduction, so the rules refuse it. The
answer of such a comparison is read by Python control flow (transformers' ``generate`` asks
``bool(unfinished.max() == 0)`` after every token), so the one element is all-reduced first
(counted by ``CommDebugMode`` like any collective) and the comparison runs on the Replicate
value. A Partial operand with one element or more dims is still refused, naming the fix.
Example::

    done = (unfinished.max() == 0)   # unfinished: Shard(0); one all_reduce of one element
"""

from __future__ import annotations

from ..placement import Replicate
from ..tensor import DTensor
from .compare import COMPARISONS
from .dispatch import dispatch
from .registry import decomposed


def is_scalar_partial(value) -> bool:
    """A 0-dim DTensor with a pending reduction on some mesh dim."""
    return isinstance(value, DTensor) and value.ndim == 0 and any(
        p.is_partial() for p in value.placements)


def reduced(value: DTensor) -> DTensor:
    """``value`` with its Partial mesh dims all-reduced, its other placements kept."""
    return value.redistribute(placements=[Replicate() if p.is_partial() else p
                                          for p in value.placements])


def has_scalar_partial(args, kwargs) -> bool:
    """Whether an operand of the call is a 0-dim Partial DTensor (dispatch asks first)."""
    return any(map(is_scalar_partial, (*args, *kwargs.values())))


@decomposed(*COMPARISONS, when=has_scalar_partial)
def compare_scalar_partials_reduced(func, args, kwargs):
    """Run a comparison with every 0-dim Partial operand reduced first (see module doc)."""
    args = tuple(reduced(a) if is_scalar_partial(a) else a for a in args)
    kwargs = {k: reduced(v) if is_scalar_partial(v) else v for k, v in kwargs.items()}
    return dispatch(func, None, args, kwargs)
