"""The rank side of the counter-based random stream: a dropout mask's block.

A ``Create`` whose ``fn`` is in :data:`FACTORIES` carries ``args = (p, seed, counter,
noise)``: the rank hashes the global indices of its own block only (see
:mod:`dtorch.random`), so the mask is the same whatever the placements and costs O(local).
With ``noise`` the block holds torch's dropout noise (``1 / (1 - p)`` where kept, 0
elsewhere), else the keep mask itself in the Create's dtype (bool for attention dropout,
0/1 floats for alpha dropout). Example::

    >>> import torch
    >>> from dtorch import init_device_mesh, Shard
    >>> from dtorch.runtime.messages import Create
    >>> mesh = init_device_mesh("cpu", 2)
    >>> instr = Create(0, "dropout_mask", (0.5, 0, 0, True), {}, (4,), torch.float32, mesh,
    ...                (Shard(0),), mesh.ranks, False)
    >>> block_of(instr, (1,), torch.device("cpu")).shape
    torch.Size([2])
"""

from __future__ import annotations

import torch

from .. import layout
from .. import random as stream

FACTORIES = ("dropout_mask",)


def block_of(instr, coord, device) -> torch.Tensor:
    """This rank's block (at mesh ``coord``) of the mask ``instr`` describes."""
    p, seed, counter, noise = instr.args
    block = layout.rank_block(instr.shape, instr.mesh, instr.placements, coord)
    keep = stream.dropout_mask(instr.shape, p, seed=seed, counter=counter,
                               offset=block.offset, block=block.shape, device=device)
    if noise:
        return stream.dropout_noise(keep, p, instr.dtype)
    return keep.to(instr.dtype)
