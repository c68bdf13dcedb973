"""Modules without parameters: torch.nn's own, made dtorch Modules so they sit in a dtorch
model (and take its hooks). ``Dropout`` is the identity in eval mode; in training mode with
``p > 0`` it raises (its random mask would differ from single-device torch). Example::

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
    """``torch.nn.Dropout``: the identity in eval mode (``model.eval()``) or with ``p=0``."""

    def forward(self, input):
        if self.training and self.p > 0:
            raise NotImplementedError(
                "dtorch.nn.Dropout in training mode draws a random mask, which dtorch does not "
                "support yet (the original DTorch is inference only); call model.eval() or use "
                "p=0")
        return input
