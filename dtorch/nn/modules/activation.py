"""Modules without parameters: torch.nn's own, made dtorch Modules so they sit in a dtorch
model (and take its hooks). ``Dropout`` is the identity in eval mode; in training mode it
draws its mask from dtorch's counter-based stream (the same whatever the placements, see
dtorch.random). Example::

    mlp = Sequential(ColumnParallelLinear(8, 32), GELU(), RowParallelLinearWithReplicateOutput(32, 8))
"""

from __future__ import annotations

import torch

from .module import Module


class SiLU(Module, torch.nn.SiLU):
    """``torch.nn.SiLU``."""


class GELU(Module, torch.nn.GELU):
    """``torch.nn.GELU(approximate='none')``."""


class ReLU(Module, torch.nn.ReLU):
    """``torch.nn.ReLU``."""


class Identity(Module, torch.nn.Identity):
    """``torch.nn.Identity``."""


class Dropout(Module, torch.nn.Dropout):
    """``torch.nn.Dropout``: the identity in eval mode (``model.eval()``) or with ``p=0``; in
    training, ``F.dropout`` on DTensors (see dtorch.ops.dropout)."""
