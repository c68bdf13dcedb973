"""Containers: torch.nn's ``ModuleList``, ``ModuleDict`` and ``Sequential`` as dtorch Modules
(same indexing, iteration, state_dict prefixes ``layers.0.weight``). Example::

    layers = ModuleList([Linear(4, 4, device_mesh=mesh) for _ in range(3)])
    [k for k in layers.state_dict()][:2]        # ['0.weight', '0.bias']
"""

from __future__ import annotations

import torch

from .module import Module


class ModuleList(Module, torch.nn.ModuleList):
    """``torch.nn.ModuleList``."""


class ModuleDict(Module, torch.nn.ModuleDict):
    """``torch.nn.ModuleDict``."""


class Sequential(Module, torch.nn.Sequential):
    """``torch.nn.Sequential``: each module's output feeds the next."""
