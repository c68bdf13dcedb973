"""Parameter initialisation shard by shard: each rank draws only the block it holds.

The distributions are torch.nn's (uniform for Linear, normal for Embedding); the values are not
those of single-device init (real weights come from ``load_state_dict``), but ranks holding the
same block agree, and the draws follow ``torch.manual_seed`` on the controller. Example::

    w = uniform((8, 4), -0.5, 0.5, device_mesh=mesh, placements=[Shard(0)])
"""

from __future__ import annotations

import torch

from ..factories import _create


def _seed() -> int:
    return int(torch.randint(0, 2**62, (1,)).item())


def uniform(shape, low: float, high: float, *, dtype=None, device_mesh=None, placements=None):
    """A DTensor of U(low, high) values, drawn block by block on the ranks."""
    return _create("init_uniform", tuple(shape), dtype or torch.get_default_dtype(), device_mesh,
                   placements, args=(_seed(), float(low), float(high)))


def normal(shape, mean: float = 0.0, std: float = 1.0, *, dtype=None, device_mesh=None,
           placements=None):
    """A DTensor of N(mean, std^2) values, drawn block by block on the ranks."""
    return _create("init_normal", tuple(shape), dtype or torch.get_default_dtype(), device_mesh,
                   placements, args=(_seed(), float(mean), float(std)))
