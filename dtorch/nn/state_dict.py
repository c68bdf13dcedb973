"""Loading and gathering state_dicts: one tensor at a time, each rank sent only its shard.

``load_value`` shards a full torch tensor by a parameter's placements and sends it rank by rank,
waiting for each rank to hold its shard before staging the next, so the controller never holds
more than one shard's bytes beyond the caller's own tensor. ``full_state_dict`` gathers.
Example::

    model.load_state_dict(torch_model.state_dict())        # calls load_value per entry
    full = full_state_dict(model)                          # {key: torch.Tensor}
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from .. import layout
from ..runtime import messages as m
from ..runtime import session
from ..tensor import DTensor
from ..spec import make_spec


def load_value(value, like: DTensor) -> DTensor:
    """``value`` (a torch tensor, array or DTensor) as a new DTensor with ``like``'s mesh,
    placements and dtype."""
    mesh, placements = like.device_mesh, like.placements
    if isinstance(value, DTensor):
        if value.device_mesh.shape == mesh.shape:
            return value.to(like.dtype).redistribute(device_mesh=mesh, placements=placements)
        value = value.to_torch()
    return send_streamed(torch.as_tensor(value).detach(), mesh, placements, like.dtype)


def send_streamed(value: torch.Tensor, mesh, placements, dtype=None) -> DTensor:
    """Like ``dtorch.distribute_tensor``, but rank by rank: each shard is cast, sent and
    delivered before the next is made (the controller's extra memory is one shard)."""
    dtype = dtype or value.dtype
    spec = make_spec(value.shape, dtype, mesh, placements)
    c = session.get_controller()
    c.ensure_mesh(mesh)
    tid = c.new_tid()
    for rank in mesh.ranks:
        coord = mesh.get_coordinate(rank)
        block = layout.rank_block(spec.shape, mesh, spec.placements, coord)
        if layout.holds_value(mesh, spec.placements, coord):
            shard = value[block.slices()].to(dtype)
        else:
            shard = torch.zeros(block.shape, dtype=dtype)
        c.stage(rank, tid, shard)
        del shard
        c.issue(m.Load(tid, (rank,)))
        c.deliver()
    return DTensor._wrap(spec, tid, c)


def full_state_dict(module) -> "OrderedDict[str, torch.Tensor]":
    """``module.state_dict()`` with every DTensor gathered into a torch tensor (one at a time)."""
    out = OrderedDict()
    for key, value in module.state_dict().items():
        out[key] = value.to_torch() if isinstance(value, DTensor) else value
    return out
