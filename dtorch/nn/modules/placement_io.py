"""Module inputs: a plain torch tensor given to a dtorch module becomes a DTensor on the
module's mesh (Replicate, or what the module expects on its tensor-parallel dim), so model code
written for torch.nn can be fed torch tensors. Example::

    x = as_dtensor(torch.randn(2, 4), mesh, None, None)    # Replicate on every mesh dim
"""

from __future__ import annotations

import torch

from ...placement import Replicate, Shard
from ...tensor import DTensor


def as_dtensor(value, mesh, tp_dim, expected) -> DTensor:
    """``value`` itself when it is a DTensor, else it distributed on ``mesh``."""
    if isinstance(value, DTensor):
        return value
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"a dtorch module takes DTensors or torch tensors; got "
                        f"{type(value).__name__}")
    from ...factories import distribute_tensor
    placements = [Replicate()] * mesh.ndim
    if tp_dim is not None and expected is not None:
        placements[tp_dim] = Shard(value.dim() - 1) if isinstance(expected, Shard) else expected
    return distribute_tensor(value, mesh, placements)
