"""Composite ops: planning a sequence of local calls and collective steps. Pure.

A rule that needs data movement inside one op (ring or Ulysses attention) returns a
:class:`~dtorch.registry.Decision` whose ``fn`` is a ``CompositePlan`` built here; dispatch
caches it per call signature like any plan, ships it in a ``Call``, records its collectives
in ``CommDebugMode``, and every rank interprets it (``dtorch.runtime.composite``). Every
per-rank number a step needs (shapes, piece sizes, peers) is computed here from the layout
math, so the ranks agree without talking. Example::

    >>> import torch
    >>> from dtorch import init_device_mesh
    >>> mesh = init_device_mesh("cpu", 2, mesh_dim_names=("ring_cp",))
    >>> b = PlanBuilder("demo", 1, torch.float32)
    >>> moved = b.shift(mesh, 0, (0,), [{0: (2,), 1: (2,)}])
    >>> b.wait(moved)
    >>> plan = b.build(moved)
    >>> [s.kind for s in plan.collectives], plan.collectives[0].groups
    (['send_recv'], ((0, 1),))
"""

from __future__ import annotations

import math

from ..layout import chunk_sizes
from ..runtime import messages as m


def _replace(shape, dim: int, size: int) -> tuple[int, ...]:
    out = list(shape)
    out[dim] = size
    return tuple(out)


def exchange_step(mesh, mesh_dim: int, src: int, out: int, shapes: dict, split_dim: int,
                  cat_dim: int, split_sizes: dict | None = None,
                  itemsize: int = 4) -> m.Exchange:
    """An all_to_all along ``mesh_dim``: each rank cuts its slot ``src`` (local shape
    ``shapes[rank]``) along ``split_dim`` into ``split_sizes[rank]`` (default: torch.chunk
    sizes), one piece per coordinate, and concatenates what it receives along ``cat_dim``.

    >>> from dtorch import init_device_mesh
    >>> mesh = init_device_mesh("cpu", 2)
    >>> s = exchange_step(mesh, 0, 0, 1, {0: (4, 3), 1: (4, 2)}, 0, 1)
    >>> dict(s.table)[1]        # (in shape, sizes sent, shapes received, padded piece)
    ((4, 2), (2, 2), ((2, 3), (2, 2)), (2, 3))
    """
    n = mesh.shape[mesh_dim]
    table, worst = [], 0
    for group in mesh.groups(mesh_dim):
        sizes = {r: tuple(split_sizes[r]) if split_sizes else
                 chunk_sizes(shapes[r][split_dim], n) for r in group}
        piece = {(a, j): _replace(shapes[a], split_dim, sizes[a][j])
                 for a in group for j in range(n)}
        pad = tuple(max(p[d] for p in piece.values()) for d in range(len(shapes[group[0]])))
        worst = max(worst, n * math.prod(pad) * itemsize)
        for j, b in enumerate(group):
            recv = tuple(piece[(a, j)] for a in group)
            table.append((b, (tuple(shapes[b]), sizes[b], recv, pad)))
    name = mesh.mesh_dim_names[mesh_dim] if mesh.mesh_dim_names else None
    return m.Exchange(src, out, split_dim, cat_dim, tuple(table), mesh_dim, name,
                      mesh.groups(mesh_dim), worst)


def shift_step(mesh, mesh_dim: int, srcs: tuple, outs: tuple, shapes: list,
               itemsize: int = 4) -> m.Shift:
    """A send_recv along ``mesh_dim``: each rank sends slots ``srcs`` (local shapes
    ``shapes[i][rank]``) to its next coordinate (cyclically) and receives ``outs`` from its
    previous one, which hold that rank's shapes."""
    n = mesh.shape[mesh_dim]
    table, worst = [], 0
    for group in mesh.groups(mesh_dim):
        for i, r in enumerate(group):
            nxt, prev = group[(i + 1) % n], group[(i - 1) % n]
            mine = tuple(tuple(s[r]) for s in shapes)
            table.append((r, (nxt, prev, mine, tuple(tuple(s[prev]) for s in shapes))))
            worst = max(worst, sum(math.prod(s) for s in mine) * itemsize)
    name = mesh.mesh_dim_names[mesh_dim] if mesh.mesh_dim_names else None
    return m.Shift(tuple(srcs), tuple(outs), tuple(table), mesh_dim, name,
                   mesh.groups(mesh_dim), worst)


def per_rank(values: dict) -> m.PerRank:
    """``{rank: value}`` as a step argument each rank reads its own entry of."""
    return m.PerRank(tuple(sorted(values.items())))


class PlanBuilder:
    """Collect steps and hand out slot numbers; ``build`` freezes them into a plan."""

    def __init__(self, name: str, n_inputs: int, dtype, itemsize: int | None = None):
        self.name, self.n_inputs, self.dtype = name, n_inputs, dtype
        self.itemsize = itemsize if itemsize is not None else getattr(dtype, "itemsize", 4)
        self.steps: list = []
        self._next = n_inputs

    def slots(self, n: int) -> tuple[int, ...]:
        out = tuple(range(self._next, self._next + n))
        self._next += n
        return out

    def local(self, fn, *args, outs: int | tuple = 1, **kwargs) -> tuple[int, ...]:
        """Run ``fn`` on every rank; returns its output slots (new ones unless given)."""
        slots = outs if isinstance(outs, tuple) else self.slots(outs)
        self.steps.append(m.Local(fn, tuple(args), dict(kwargs), slots))
        return slots

    def exchange(self, mesh, mesh_dim, src, shapes, split_dim, cat_dim, split_sizes=None) -> int:
        out, = self.slots(1)
        self.steps.append(exchange_step(mesh, mesh_dim, src, out, shapes, split_dim, cat_dim,
                                        split_sizes, self.itemsize))
        return out

    def shift(self, mesh, mesh_dim, srcs, shapes) -> tuple[int, ...]:
        outs = self.slots(len(srcs))
        self.steps.append(shift_step(mesh, mesh_dim, srcs, outs, shapes, self.itemsize))
        return outs

    def wait(self, outs) -> None:
        self.steps.append(m.Wait(tuple(outs)))

    def drop(self, *slots) -> None:
        self.steps.append(m.Drop(tuple(slots)))

    def build(self, outputs, watch=()) -> m.CompositePlan:
        return m.CompositePlan(self.name, self.n_inputs, tuple(self.steps), tuple(outputs),
                               self.dtype, tuple(watch))
