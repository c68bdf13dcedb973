"""Tiles: the global tensor cut at every rank-block boundary, each tile with its owners.

Inside one tile every element is held by the same ranks, so a drawing of the tiles shows
the whole layout: sharded blocks, replicated (shared) blocks, partial stacks and uneven
sizes. A tile is a tuple of half-open ``(start, stop)`` intervals, one per tensor dim. Pure:
no torch, no widgets. Example::

    >>> from dtorch import init_device_mesh, Shard, Replicate
    >>> t = Tiling((5,), init_device_mesh("cpu", 2), [Shard(0)])
    >>> t.owners
    {((0, 3),): (0,), ((3, 5),): (1,)}
    >>> t.uneven
    True
"""

from __future__ import annotations

import bisect
import itertools
import math
from functools import cached_property

from dtorch.layout import normalize_placements, rank_blocks
from dtorch.placement import Partial, Replicate, Shard

Tile = tuple  # tuple[tuple[int, int], ...]


class Tiling:
    """Which ranks hold which tile of a ``shape`` tensor laid out by ``placements`` on ``mesh``.

    >>> from dtorch import init_device_mesh, Shard, Replicate, Partial
    >>> m = init_device_mesh("cpu", (2, 2))
    >>> Tiling((4, 4), m, [Shard(0), Replicate()]).owners[((0, 2), (0, 4))]
    (0, 1)
    >>> Tiling((4,), m, [Shard(0), Partial()]).layers[((2, 4),)]
    ((2,), (3,))
    """

    def __init__(self, shape, mesh, placements):
        self.shape = tuple(int(n) for n in shape)
        self.mesh = mesh
        self.placements = normalize_placements(placements, mesh, len(self.shape))

    @cached_property
    def blocks(self):
        """``{rank: RankBlock(shape, offset)}`` from dtorch's layout math."""
        return rank_blocks(self.shape, self.mesh, self.placements)

    @cached_property
    def cuts(self) -> tuple[tuple[int, ...], ...]:
        """Per tensor dim, the sorted boundaries of all non-empty rank blocks (0 and size too).

        >>> from dtorch import init_device_mesh, Shard
        >>> Tiling((4, 7), init_device_mesh("cpu", 3), [Shard(1)]).cuts
        ((0, 4), (0, 3, 6, 7))
        """
        out = []
        for d, size in enumerate(self.shape):
            points = {0, size}
            for b in self.blocks.values():
                if all(b.shape):
                    points.update((b.offset[d], b.offset[d] + b.shape[d]))
            out.append(tuple(sorted(points)) if size else (0,))
        return tuple(out)

    @cached_property
    def owners(self) -> dict[Tile, tuple[int, ...]]:
        """``{tile: ranks holding it}``, tiles in row-major order, ranks in mesh order."""
        found: dict[tuple[int, ...], list[int]] = {}
        for rank in self.mesh.ranks:
            b = self.blocks[rank]
            if not all(b.shape):
                continue
            ranges = []
            for d, cuts in enumerate(self.cuts):
                lo = bisect.bisect_left(cuts, b.offset[d])
                hi = bisect.bisect_left(cuts, b.offset[d] + b.shape[d])
                ranges.append(range(lo, hi))
            for idx in itertools.product(*ranges):
                found.setdefault(idx, []).append(rank)
        return {self.tile_at(idx): tuple(found[idx]) for idx in sorted(found)}

    def tile_at(self, idx) -> Tile:
        """The tile with interval numbers ``idx`` (one per dim)."""
        return tuple((self.cuts[d][i], self.cuts[d][i + 1]) for d, i in enumerate(idx))

    def tile_of(self, index) -> Tile:
        """The tile that holds global element ``index``.

        >>> from dtorch import init_device_mesh, Shard
        >>> Tiling((5,), init_device_mesh("cpu", 2), [Shard(0)]).tile_of((4,))
        ((3, 5),)
        """
        idx = []
        for d, i in enumerate(index):
            if not 0 <= i < self.shape[d]:
                raise IndexError(f"index {tuple(index)} is outside a tensor of shape {self.shape}")
            idx.append(bisect.bisect_right(self.cuts[d], i) - 1)
        return self.tile_at(idx)

    def owners_of(self, index) -> tuple[int, ...]:
        """Ranks that hold global element ``index`` (a tuple, one int per dim)."""
        return self.owners[self.tile_of(tuple(index))]

    @cached_property
    def partial_dims(self) -> tuple[int, ...]:
        """Mesh dims whose placement is ``Partial``."""
        return tuple(i for i, p in enumerate(self.placements) if isinstance(p, Partial))

    @cached_property
    def replicate_dims(self) -> tuple[int, ...]:
        """Mesh dims whose placement is ``Replicate``."""
        return tuple(i for i, p in enumerate(self.placements) if isinstance(p, Replicate))

    @cached_property
    def shard_dims(self) -> dict[int, int]:
        """``{mesh dim: tensor dim}`` for every ``Shard`` placement."""
        return {i: p.dim for i, p in enumerate(self.placements) if isinstance(p, Shard)}

    @cached_property
    def layers(self) -> dict[Tile, tuple[tuple[int, ...], ...]]:
        """``{tile: (ranks of partial value 0, ranks of partial value 1, ...)}``.

        Without Partial every tile has one layer (its owners); with Partial, ranks that differ
        along a Partial mesh dim hold different partial values: one layer each.
        """
        out = {}
        for tile, ranks in self.owners.items():
            by_key: dict[tuple, list[int]] = {}
            for r in ranks:
                coord = self.mesh.get_coordinate(r)
                by_key.setdefault(tuple(coord[i] for i in self.partial_dims), []).append(r)
            out[tile] = tuple(tuple(v) for _, v in sorted(by_key.items()))
        return out

    @cached_property
    def uneven(self) -> bool:
        """True when some ranks hold blocks of different shapes (uneven shards)."""
        return len({b.shape for b in self.blocks.values()}) > 1

    @cached_property
    def empty_ranks(self) -> tuple[int, ...]:
        """Ranks whose block has no elements (more ranks than rows to shard)."""
        return tuple(r for r in self.mesh.ranks if math.prod(self.blocks[r].shape) == 0
                     and math.prod(self.shape) > 0)
