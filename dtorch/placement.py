"""Placements: how one mesh dimension divides a tensor.

``Shard(dim)`` splits tensor dim ``dim`` across the ranks of that mesh dim (``torch.chunk``
sizes), ``Replicate()`` gives every rank the whole value, ``Partial(op)`` gives every rank a
partial value that reduces (sum / avg / max / min) to the whole. Example::

    >>> from dtorch import Shard, Replicate, Partial
    >>> [str(p) for p in (Shard(0), Replicate(), Partial())]
    ['S(0)', 'R', 'P(sum)']
    >>> Shard(0) == Shard(0), hash(Shard(1)) == hash(Shard(1))
    (True, True)
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

from .errors import PlacementValueError

REDUCE_OPS = ("sum", "avg", "max", "min")


class Placement:
    """Base of the three placement kinds; immutable, hashable, picklable."""

    __slots__ = ()

    def is_shard(self, dim: int | None = None) -> bool:
        return False

    def is_replicate(self) -> bool:
        return False

    def is_partial(self, reduce_op: str | None = None) -> bool:
        return False


@dataclass(frozen=True, slots=True)
class Shard(Placement):
    """Split tensor dim ``dim`` across the ranks of a mesh dim: ``Shard(0)``."""

    dim: int

    def __post_init__(self):
        try:
            if isinstance(self.dim, bool):
                raise TypeError
            dim = operator.index(self.dim)  # numpy and torch ints too
        except TypeError:
            raise PlacementValueError(
                f"Shard(dim) needs an int tensor dim, got {self.dim!r}; pass e.g. Shard(0)"
            ) from None
        object.__setattr__(self, "dim", dim)

    def is_shard(self, dim: int | None = None) -> bool:
        return dim is None or self.dim == dim

    def __str__(self) -> str:
        return f"S({self.dim})"

    def __repr__(self) -> str:
        return f"Shard(dim={self.dim})"


@dataclass(frozen=True, slots=True)
class Replicate(Placement):
    """Every rank of the mesh dim holds the whole value: ``Replicate()``."""

    def is_replicate(self) -> bool:
        return True

    def __str__(self) -> str:
        return "R"

    def __repr__(self) -> str:
        return "Replicate()"


@dataclass(frozen=True, slots=True)
class Partial(Placement):
    """Every rank holds a partial value; reducing with ``reduce_op`` gives the value."""

    reduce_op: str = "sum"

    def __post_init__(self):
        if self.reduce_op not in REDUCE_OPS:
            raise PlacementValueError(
                f"Partial reduce_op must be one of {', '.join(REDUCE_OPS)}; got {self.reduce_op!r}. "
                f"Pass e.g. Partial('sum')")

    def is_partial(self, reduce_op: str | None = None) -> bool:
        return reduce_op is None or self.reduce_op == reduce_op

    def __str__(self) -> str:
        return f"P({self.reduce_op})"

    def __repr__(self) -> str:
        return f"Partial(reduce_op={self.reduce_op!r})"


def format_placements(placements) -> str:
    """Short form of a placement list: ``[S(0), R]``."""
    return "[" + ", ".join(str(p) for p in placements) + "]"
