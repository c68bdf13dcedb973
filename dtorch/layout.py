"""Layout math: which block of the global tensor each rank holds. Pure, cached.

Shard placements apply in mesh-dim order: each ``Shard(d)`` splits the block the earlier mesh
dims left along tensor dim ``d`` into ``torch.chunk`` pieces (empty pieces allowed). Example::

    >>> from dtorch import init_device_mesh, Shard, Replicate
    >>> m = init_device_mesh("cpu", 4)
    >>> [local_shape((4, 11), m, (Shard(1),), m.get_coordinate(r)) for r in m.ranks]
    [(4, 3), (4, 3), (4, 3), (4, 2)]
    >>> chunk_sizes(3, 4)
    (1, 1, 1, 0)
"""

from __future__ import annotations

from functools import lru_cache
from typing import NamedTuple, Sequence

from .errors import PlacementValueError
from .mesh import DeviceMesh
from .placement import Partial, Placement, Replicate, Shard, format_placements


@lru_cache(maxsize=4096)
def chunk_sizes(size: int, n: int) -> tuple[int, ...]:
    """Sizes ``torch.chunk(size, n)`` gives, padded with zeros to ``n`` pieces."""
    step = -(-size // n) if size else 0
    out = []
    left = size
    for _ in range(n):
        take = min(step, left)
        out.append(take)
        left -= take
    return tuple(out)


def normalize_placements(placements: Sequence[Placement], mesh: DeviceMesh,
                         ndim: int) -> tuple[Placement, ...]:
    """Check placements against a mesh and a tensor rank; make Shard dims non-negative.

    >>> m = DeviceMesh("cpu", [0, 1])
    >>> normalize_placements([Shard(-1)], m, 2)
    (Shard(dim=1),)
    """
    if isinstance(placements, Placement):
        placements = (placements,)
    placements = tuple(placements)
    if len(placements) != mesh.ndim:
        raise PlacementValueError(
            f"got {len(placements)} placements {format_placements(placements)} for a "
            f"{mesh.ndim}-D mesh of shape {mesh.shape}; give exactly one placement per mesh dim, "
            f"e.g. {format_placements([Replicate()] * mesh.ndim)}")
    out = []
    for p in placements:
        if not isinstance(p, Placement):
            raise PlacementValueError(
                f"{p!r} is not a placement; use Shard(dim), Replicate() or Partial(reduce_op)")
        if isinstance(p, Shard):
            if not -ndim <= p.dim < ndim:
                raise PlacementValueError(
                    f"Shard({p.dim}) is out of range for a {ndim}-D tensor; shard a dim in "
                    f"[{-ndim}, {ndim})" + ("" if ndim else " (a 0-D tensor can only be "
                                            "Replicate or Partial)"))
            p = Shard(p.dim % ndim)
        out.append(p)
    return tuple(out)


class RankBlock(NamedTuple):
    """One rank's block: its local shape and the offset of that block in the global tensor."""

    shape: tuple[int, ...]
    offset: tuple[int, ...]

    def slices(self) -> tuple[slice, ...]:
        return tuple(slice(o, o + s) for o, s in zip(self.offset, self.shape))


@lru_cache(maxsize=65536)
def _block(shape: tuple[int, ...], mesh_shape: tuple[int, ...], placements: tuple,
           coord: tuple[int, ...]) -> RankBlock:
    size = list(shape)
    offset = [0] * len(shape)
    for p, n, c in zip(placements, mesh_shape, coord):
        if isinstance(p, Shard):
            sizes = chunk_sizes(size[p.dim], n)
            offset[p.dim] += sum(sizes[:c])
            size[p.dim] = sizes[c]
    return RankBlock(tuple(size), tuple(offset))


def rank_block(shape: Sequence[int], mesh: DeviceMesh, placements: Sequence[Placement],
               coord: Sequence[int]) -> RankBlock:
    """Shape and global offset of the block at mesh coordinate ``coord``."""
    return _block(tuple(shape), mesh.shape, tuple(placements), tuple(coord))


def local_shape(shape, mesh, placements, coord) -> tuple[int, ...]:
    """Local shape of the rank at ``coord``."""
    return rank_block(shape, mesh, placements, coord).shape


def local_offset(shape, mesh, placements, coord) -> tuple[int, ...]:
    """Offset of that rank's block in the global tensor."""
    return rank_block(shape, mesh, placements, coord).offset


def rank_blocks(shape, mesh: DeviceMesh, placements) -> dict[int, RankBlock]:
    """``{rank: RankBlock}`` for every rank of the mesh.

    >>> from dtorch import init_device_mesh, Shard
    >>> m = init_device_mesh("cpu", (2, 2))
    >>> rank_blocks((4, 4), m, (Shard(0), Shard(1)))[3]
    RankBlock(shape=(2, 2), offset=(2, 2))
    """
    return {r: rank_block(shape, mesh, placements, mesh.get_coordinate(r)) for r in mesh.ranks}


def local_shapes(shape, mesh: DeviceMesh, placements) -> dict[int, tuple[int, ...]]:
    """``{rank: local shape}`` for every rank of the mesh."""
    return {r: b.shape for r, b in rank_blocks(shape, mesh, placements).items()}


def holds_value(mesh: DeviceMesh, placements, coord) -> bool:
    """False where a ``Partial('sum')`` made from a full value stores zeros at ``coord``."""
    return all(c == 0 for p, c in zip(placements, coord)
               if isinstance(p, Partial) and p.reduce_op == "sum")


def shard_of(tensor, mesh: DeviceMesh, placements, coord):
    """The local tensor a rank stores when the full value is ``tensor`` (a torch.Tensor).

    Shard: its block; Replicate: the whole; Partial sum: the value on the first rank of that
    mesh dim and zeros elsewhere; Partial avg/max/min: the value everywhere.
    """
    block = rank_block(tuple(tensor.shape), mesh, placements, coord)
    local = tensor[block.slices()]
    if not holds_value(mesh, placements, coord):
        return local.new_zeros(local.shape)
    return local.clone()
