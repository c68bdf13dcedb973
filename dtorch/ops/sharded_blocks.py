"""Per-block candidates along sharded dims: the first step of the reductions and scans that
run along a sharded dim (:mod:`dtorch.ops.sharded_reductions`, :mod:`dtorch.ops.sharded_scans`).

A tensor sharded on dim ``d`` over mesh dims ``M`` is cut along ``d`` into ``W`` blocks
(``W`` the product of the sizes of ``M``; the same tensor dim on two mesh dims gives the
nested ``torch.chunk`` blocks, in mixed-radix order of the coordinates, which is their order
along ``d``). ``block_reduce(x, kernel, dims, grid, width, *extra)`` is the DTensor op that
runs ``kernel(block, offsets, dims, *extra)`` on each block of the grid over ``dims`` (each
rank on its own block: no communication) and lays the results side by side: the output has
``width`` per block on every reduced dim and keeps ``x``'s placements, so a
``redistribute`` of the reduced dims to Replicate (:func:`gathered`) moves the candidates
only. On a plain tensor it computes the same thing (what the ranks compute together)::

    >>> import torch
    >>> def total(block, offsets, dims):
    ...     return block.sum(dims, keepdim=True)
    >>> block_reduce(torch.arange(6.), total, (0,), ((2, 2, 1, 1),), 1)
    tensor([1., 5., 4., 5.])
    >>> grid_of((6,), __import__("dtorch").init_device_mesh("cpu", 4), (Shard(0),), (0,))
    ((2, 2, 2, 0),)
"""

from __future__ import annotations

import math

import torch

from ..errors import PlacementError
from ..layout import rank_block
from ..placement import Replicate, Shard
from ..runtime.messages import Coord
from .explain import code_placements, fix_line
from .registry import Decision, rule

R = Replicate()
BIG = torch.iinfo(torch.int64).max  # the index of a candidate from an empty block: never wins


def sharding_mesh_dims(placements, dims) -> tuple[int, ...]:
    """The mesh dims whose Shard is on one of ``dims``."""
    return tuple(m for m, p in enumerate(placements) if isinstance(p, Shard) and p.dim in dims)


def has_partial(placements) -> bool:
    return any(p.is_partial() for p in placements)


def block_index(mesh, placements, d: int, coord) -> int:
    """Which block along dim ``d`` the rank at ``coord`` holds (mixed radix over the mesh dims
    sharding ``d``, in mesh-dim order)."""
    index = 0
    for m, p in enumerate(placements):
        if isinstance(p, Shard) and p.dim == d:
            index = index * mesh.shape[m] + coord[m]
    return index


def n_blocks(mesh, placements, d: int) -> int:
    return math.prod(mesh.shape[m] for m in sharding_mesh_dims(placements, (d,)))


def grid_of(shape, mesh, placements, dims) -> tuple[tuple[int, ...], ...]:
    """Per reduced dim, the sizes of its blocks in order along that dim (one block of the whole
    size where the dim is not sharded)."""
    out = []
    for d in dims:
        sizes = [0] * n_blocks(mesh, placements, d)
        for rank in mesh.ranks:
            coord = mesh.get_coordinate(rank)
            sizes[block_index(mesh, placements, d, coord)] = rank_block(
                shape, mesh, placements, coord).shape[d]
        out.append(tuple(sizes))
    return tuple(out)


def _cat(parts, d):
    if isinstance(parts[0], tuple):
        return tuple(torch.cat([p[i] for p in parts], d) for i in range(len(parts[0])))
    return torch.cat(parts, d)


def on_grid(x, kernel, dims, grid, extra, offsets=()):
    """``kernel(block, offsets, dims, *extra)`` on every block of the grid, results
    concatenated along each reduced dim (the global value of :func:`block_reduce`)."""
    if len(offsets) == len(dims):
        return kernel(x, offsets, dims, *extra)
    d, sizes, parts, start = dims[len(offsets)], grid[len(offsets)], [], 0
    for s in sizes:
        parts.append(on_grid(x.narrow(d, start, s), kernel, dims, grid, extra,
                             offsets + (start,)))
        start += s
    return _cat(parts, d)


def block_reduce(x, kernel, dims, grid, width, *extra):
    """The candidates of ``kernel`` per block (see module doc); on DTensors, each rank runs
    the kernel on its own block (:func:`_rank_block_reduce`)."""
    return on_grid(x, kernel, dims, grid, extra)


def _rank_block_reduce(kernel, dims, offsets, coord, x, *extra):
    """Rank side of :func:`block_reduce`: this rank's block, its global offsets on ``dims``."""
    return kernel(x, offsets[coord], dims, *extra)


@rule(block_reduce, family="composite", arg_names=("input",))
def block_reduce_rule(op):
    """The candidates keep the input's placements (a Shard on a reduced dim now splits the
    candidates, ``width`` per rank); a Partial input is refused (the composites never make
    one)."""
    x = op.tensors[0]
    dims = op.arg(2, "dims")
    for m, p in enumerate(x.placements):
        if p.is_partial():
            op.fail(m, "no Partial input", {x: tuple(R if q.is_partial() else q
                                                     for q in x.placements)},
                    "per-block candidates of a pending reduction")
    mesh = x.mesh
    offsets = {mesh.get_coordinate(r): tuple(rank_block(x.shape, mesh, x.placements,
                                                        mesh.get_coordinate(r)).offset[d]
                                             for d in dims) for r in mesh.ranks}
    n_out = len(op.out.shapes)
    kernel = op.arg(1, "kernel")
    extra = tuple(op.args[5:])
    return Decision((x.placements,) * n_out, _rank_block_reduce,
                    (kernel, dims, offsets, Coord(mesh), x, *extra), {})


def gathered(t, dims):
    """``t`` with every mesh dim that shards one of ``dims`` made Replicate (an all_gather per
    such mesh dim, of the candidates only)."""
    placements = [R if isinstance(p, Shard) and p.dim in dims else p for p in t.placements]
    return t.redistribute(placements=placements)


def flatten_dims(t, dims):
    """``t`` with ``dims`` moved last and flattened into one: ``(*other dims, n)``."""
    moved = t.movedim(tuple(dims), tuple(range(t.ndim - len(dims), t.ndim)))
    kept = moved.shape[:t.ndim - len(dims)]
    return moved.reshape(*kept, math.prod(moved.shape[t.ndim - len(dims):]))  # -1: ambiguous at 0


def reduced_shape(shape, dims, keepdim: bool, width: int = 1) -> list[int]:
    return [width if d in dims else s for d, s in enumerate(shape)] if keepdim else [
        s for d, s in enumerate(shape) if d not in dims]


def identity(kind: str, dtype: torch.dtype):
    """The value a candidate from an empty block takes: it never beats a real one."""
    if dtype.is_floating_point:
        return float("-inf") if kind == "max" else float("inf")
    if dtype is torch.bool:
        return kind == "min"
    info = torch.iinfo(dtype)
    return info.min if kind == "max" else info.max


def torch_check(func, x, args, kwargs):
    """torch's own result on ``meta`` (its errors for a bad call, before anything is sent)."""
    meta = torch.empty(x.shape, dtype=x.dtype, device="meta")
    return func(meta, *args[1:], **kwargs)


def refuse_gather(name: str, x, dims, why: str):
    """PlacementError naming the fix: gather the reduced dims first."""
    fix = [R if isinstance(p, Shard) and p.dim in dims else p for p in x.placements]
    raise PlacementError(
        f"{name} on input {code_placements(x.placements)}: {why}. Gather the reduced dim "
        f"first:\n" + fix_line("x", x, fix))
