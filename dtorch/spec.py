"""A DTensor's metadata, as a value: global shape, dtype, mesh and placements.

Pure (no runtime, no Dask): rules and planners take and return these.

>>> from dtorch import DeviceMesh
>>> make_spec((4, 2), torch.float32, DeviceMesh("cpu", [0, 1]), None).placements
(Replicate(),)
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from . import layout
from .errors import PlacementValueError
from .mesh import DeviceMesh
from .placement import Placement, Replicate


class TensorSpec(NamedTuple):
    """A DTensor's metadata: global shape, dtype, mesh and normalized placements."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    mesh: DeviceMesh
    placements: tuple[Placement, ...]


def make_spec(shape, dtype, mesh, placements) -> TensorSpec:
    """Validate and normalize; placements default to all Replicate."""
    if not isinstance(mesh, DeviceMesh):
        raise PlacementValueError(f"device_mesh must be a dtorch.DeviceMesh; got {mesh!r}")
    shape = tuple(int(s) for s in shape)
    if placements is None:
        placements = (Replicate(),) * mesh.ndim
    return TensorSpec(shape, dtype, mesh, layout.normalize_placements(placements, mesh,
                                                                      len(shape)))
