"""``cumsum`` / ``cumprod`` along a sharded dim, as DTensor ops (``registry.decomposed``).

Each rank scans its own block (:func:`block_scan`), the per-block totals (one value per
block and row: :func:`~dtorch.ops.sharded_blocks.block_reduce`) are gathered along the mesh
dims that shard the dim (one all_gather each), and each rank adds (multiplies by) the
exclusive prefix of the totals of the blocks before its own (:func:`scan_combine`). An empty
block's total is 0 (1). The backward is the ops'. Example::

    x = dtorch.distribute_tensor(torch.randn(4, 10), mesh, [Shard(1)])
    x.cumsum(1)                    # torch's; one all_gather of 4 totals per row

    >>> y = block_scan(torch.arange(1., 6.), 0, ((2, 2, 1),), "sum")
    >>> y, scan_combine(y, torch.tensor([3., 7., 5.]), 0, ((2, 2, 1),), "sum")
    (tensor([1., 3., 3., 7., 5.]), tensor([ 1.,  3.,  6., 10., 15.]))
"""

from __future__ import annotations

import torch

from ..runtime.messages import Coord
from ..tensor import DTensor
from .dispatch import dispatch
from .registry import Decision, decomposed, rule
from .sharded_blocks import (block_index, block_reduce, gathered, grid_of, has_partial,
                             on_grid, sharding_mesh_dims, torch_check)

_SCAN = {"sum": torch.cumsum, "prod": torch.cumprod}


def _scan_kernel(block, offsets, dims, kind):
    return _SCAN[kind](block, dims[0])


def total_kernel(block, offsets, dims, kind):
    """The sum (product) of ``block`` along its dim, kept (0 / 1 when empty)."""
    return (torch.sum if kind == "sum" else torch.prod)(block, dims[0], keepdim=True)


def block_scan(x, d, grid, kind):
    """The scan of every block along ``d`` on its own (each rank scans its block)."""
    return on_grid(x, _scan_kernel, (d,), grid, (kind,))


def _combine(block, totals, d, i, kind):
    before = totals.narrow(d, 0, i)
    if kind == "sum":
        return block + before.sum(d, keepdim=True, dtype=block.dtype)
    return block * before.prod(d, keepdim=True, dtype=block.dtype)


def scan_combine(y, totals, d, grid, kind):
    """Every block of ``y`` along ``d`` combined with the exclusive prefix of ``totals``."""
    parts, start = [], 0
    for i, s in enumerate(grid[0]):
        parts.append(_combine(y.narrow(d, start, s), totals, d, i, kind))
        start += s
    return torch.cat(parts, d)


def _rank_scan(x, d, kind):
    return _SCAN[kind](x, d)


def _rank_combine(table, coord, y, totals, d, kind):
    return _combine(y, totals, d, table[coord], kind)


@rule(block_scan, family="composite", arg_names=("input",))
def block_scan_rule(op):
    x = op.tensors[0]
    return Decision((x.placements,), _rank_scan, (x, op.arg(1, "d"), op.arg(3, "kind")), {})


@rule(scan_combine, family="composite", arg_names=("y", "totals"))
def scan_combine_rule(op):
    """``y`` keeps its placements; the totals are Replicate along the scanned dim."""
    y, totals = op.tensors
    d = op.arg(2, "d")
    for m, p in enumerate(totals.placements):
        if p.is_partial() or (p.is_shard() and p.dim == d):
            op.fail(m, "totals gathered along the scanned dim", {}, "the totals are split")
    mesh = y.mesh
    table = {mesh.get_coordinate(r): block_index(mesh, y.placements, d, mesh.get_coordinate(r))
             for r in mesh.ranks}
    return Decision((y.placements,), _rank_combine,
                    (table, Coord(mesh), y, totals, d, op.arg(4, "kind")), {})


@decomposed(torch.cumsum, torch.Tensor.cumsum, torch.cumprod, torch.Tensor.cumprod)
def scan_along_shard(func, args, kwargs):
    """``cumsum(x, dim, dtype=...)`` / ``cumprod`` along a sharded dim (see module doc)."""
    x = args[0] if args else kwargs.get("input")
    dim = kwargs.get("dim", args[1] if len(args) > 1 else None)
    if not isinstance(x, DTensor) or x.ndim == 0 or not isinstance(dim, int):
        return NotImplemented
    d = dim % x.ndim
    if has_partial(x.placements) or not sharding_mesh_dims(x.placements, (d,)):
        return NotImplemented
    out = torch_check(func, x, args, kwargs)
    kind = "sum" if func in (torch.cumsum, torch.Tensor.cumsum) else "prod"
    if x.dtype != out.dtype:
        x = x.to(out.dtype)
    grid = grid_of(x.shape, x.device_mesh, x.placements, (d,))
    y = dispatch(block_scan, None, (x, d, grid, kind))
    totals = gathered(dispatch(block_reduce, None, (x, total_kernel, (d,), grid, 1, kind)), (d,))
    return dispatch(scan_combine, None, (y, totals, d, grid, kind))
