"""Comparisons: broadcasting like binary ops, bool outputs, no Partial input (a 0-dim
Partial is all-reduced first: :mod:`~dtorch.ops.scalar_partials`).

``x == y`` is elementwise (as on torch.Tensor); the result keeps the operands' Shard and
Replicate placements (a Replicate operand beside a Shard one is narrowed locally). Example::

    >>> import torch
    >>> from dtorch.ops.registry import lookup
    >>> lookup(torch.Tensor.__lt__).family
    'compare'
"""

from __future__ import annotations

from .binary import broadcast_rule, operands_of
from .registry import rule

COMPARISONS = ("eq", "ne", "lt", "le", "gt", "ge", "greater", "less", "greater_equal",
               "less_equal", "not_equal", "__eq__", "__ne__", "__lt__", "__le__", "__gt__",
               "__ge__", "isclose")


@rule(*COMPARISONS, family="compare")
def compare_rule(op):
    return broadcast_rule(op, operands_of(op, ("input", "other")), "none")


rule("eq_", "ne_", "lt_", "le_", "gt_", "ge_", family="compare", inplace=True)(compare_rule)
