"""Controller -> worker instructions: one small NamedTuple each.

A batch is a list of these, pickled once and sent as the same bytes to every rank; each
instruction names the ranks that execute it (``ranks``), the others skip it. Example::

    >>> Free(tids=(3, 4))
    Free(tids=(3, 4))
"""

from __future__ import annotations

from typing import Any, NamedTuple


class Ref(NamedTuple):
    """A placeholder in op arguments for the local shard of tensor ``tid``."""

    tid: int


class Coord(NamedTuple):
    """A placeholder in op arguments for this rank's coordinate in ``mesh`` (per-rank args:
    a kernel that needs to know which block it holds takes a ``Coord`` argument)."""

    mesh: Any


class SetupMesh(NamedTuple):
    """Every rank creates the process groups of these rank tuples, in this order."""

    groups: tuple[tuple[int, ...], ...]
    backend: str


class Seed(NamedTuple):
    """Every rank reseeds its random generator (``dtorch.manual_seed``)."""

    seed: int


class Create(NamedTuple):
    """A factory: ``fn`` in zeros/ones/full/empty/arange/rand/randn/randint/...; random ones
    run on every rank so generators stay in step, members keep their block."""

    tid: int
    fn: str
    args: tuple
    kwargs: dict
    shape: tuple[int, ...]
    dtype: Any
    mesh: Any
    placements: tuple
    ranks: tuple[int, ...]
    all_ranks: bool


class Load(NamedTuple):
    """Take this rank's shard of ``tid`` from the data staged with this batch."""

    tid: int
    ranks: tuple[int, ...]


class Redistribute(NamedTuple):
    """Apply the planned ``steps`` to ``src``'s shards, store the result as ``out``."""

    out: int
    src: int
    shape: tuple[int, ...]
    dtype: Any
    mesh: Any
    dst_mesh: Any
    steps: tuple
    ranks: tuple[int, ...]


class Call(NamedTuple):
    """Run ``fn(*args, **kwargs)`` on local shards (``Ref`` placeholders), store outputs."""

    outs: tuple[int, ...]
    fn: Any
    args: tuple
    kwargs: dict
    ranks: tuple[int, ...]


class Fetch(NamedTuple):
    """Send the local shard of ``tid`` back under request id ``req``."""

    req: int
    tid: int
    ranks: tuple[int, ...]


class Sync(NamedTuple):
    """Answer request ``req`` with the errors raised since the last Sync."""

    req: int


class Free(NamedTuple):
    """Drop the local shards of these tensors."""

    tids: tuple[int, ...]


class Eager(NamedTuple):
    """Run ``fn`` on local shards and keep its whole result as ``out``; ``answer_rank``
    answers ``req`` with its structure (ops whose outputs depend on the values)."""

    req: int
    out: int
    fn: Any
    args: tuple
    kwargs: dict
    ranks: tuple[int, ...]
    answer_rank: int


class Unflatten(NamedTuple):
    """Replace the kept result ``src`` by its tensor leaves, stored as ``outs``."""

    src: int
    outs: tuple[int, ...]
    ranks: tuple[int, ...]
