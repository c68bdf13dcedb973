"""``zeros_like ones_like empty_like full_like`` and ``new_zeros new_ones new_empty new_full``
on DTensors: made on the ranks, nothing sent.

``*_like`` keep the input's Shard/Replicate placements; a Partial input gives Replicate
(``zeros_like`` keeps it: zeros are a valid partial sum). ``new_*(size)`` are Replicate on the
input's mesh. Random ``*_like`` are not here: use ``dtorch.rand(..., device_mesh=,
placements=)`` so values match single-device torch. Example::

    >>> import torch
    >>> from dtorch.ops.registry import lookup
    >>> lookup(torch.zeros_like).family
    'factory'
"""

from __future__ import annotations

from ..placement import Replicate
from .registry import rule

R = Replicate()


@rule("zeros_like", "empty_like", family="factory", arg_names=("input",))
def zeros_like_rule(op):
    return op.tensors[0].placements


@rule("ones_like", "full_like", family="factory", arg_names=("input",))
def ones_like_rule(op):
    return tuple(R if p.is_partial() else p for p in op.tensors[0].placements)


@rule("new_zeros", "new_ones", "new_empty", "new_full", family="factory", arg_names=("input",))
def new_rule(op):
    return tuple(R for _ in op.tensors[0].placements)

