"""The redistribute planner: from a change of placements to an ordered list of steps. Pure.

Each :class:`Step` changes the placement of one mesh dim (or moves shards to another mesh) and
names the collective that does it, the rank groups it runs in and the bytes each rank puts into
it. Workers interpret the steps; the collective counts users see come from the same steps.
Example::

    >>> from dtorch import init_device_mesh, Shard, Replicate
    >>> m = init_device_mesh("cpu", 4)
    >>> [s.kind for s in plan_redistribute(m, (4, 4), [Shard(0)], [Replicate()])]
    ['all_gather']
    >>> [s.kind for s in plan_redistribute(m, (4, 4), [Replicate()], [Shard(0)])]
    ['slice']

The order rule: a collective along mesh dim ``i`` on tensor dim ``d`` is only valid while no
mesh dim after ``i`` also shards ``d`` (those nest inside ``i``'s blocks). So the planner first
gathers such inner shardings, innermost first, then walks mesh dims outermost first to the
target. ``[S(0), S(0)] -> [R, R]`` is two all_gathers: mesh dim 1, then mesh dim 0.
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import NamedTuple, Sequence

from .errors import PlacementValueError
from .layout import chunk_sizes, local_shape, normalize_placements
from .mesh import DeviceMesh
from .placement import Partial, Placement, Replicate, Shard

COLLECTIVES = ("all_gather", "all_reduce", "reduce_scatter", "all_to_all", "send_recv",
               "broadcast")
LOCAL_ACTIONS = ("slice", "to_partial")


class Step(NamedTuple):
    """One planned action. ``kind`` is a collective (see COLLECTIVES) or a local action:
    ``slice`` (Replicate -> Shard: keep your chunk) or ``to_partial`` (Replicate -> Partial:
    zeros off the first rank for sum, the value kept for avg/max/min).

    ``before``/``after`` are the full placement lists around the step; ``groups`` the rank
    tuples the step runs in (for ``send_recv``: ``(src_rank, dst_rank)`` pairs);
    ``bytes_per_rank`` what each rank puts into the collective, padding included.
    """

    kind: str
    mesh_dim: int
    mesh_dim_name: str | None
    src: Placement
    dst: Placement
    before: tuple[Placement, ...]
    after: tuple[Placement, ...]
    groups: tuple[tuple[int, ...], ...]
    bytes_per_rank: int
    padded: bool

    @property
    def is_collective(self) -> bool:
        return self.kind in COLLECTIVES


def transition_kinds(src: Placement, dst: Placement) -> tuple[str, ...]:
    """The actions one mesh dim needs to go from ``src`` to ``dst`` (DESIGN.md's table).

    >>> transition_kinds(Shard(0), Shard(1))
    ('all_to_all',)
    >>> transition_kinds(Partial(), Shard(0))
    ('reduce_scatter',)
    """
    if src == dst:
        return ()
    if isinstance(src, Shard):
        if isinstance(dst, Replicate):
            return ("all_gather",)
        if isinstance(dst, Shard):
            return ("all_to_all",)
        return ("all_gather", "to_partial")
    if isinstance(src, Replicate):
        return ("slice",) if isinstance(dst, Shard) else ("to_partial",)
    # Partial source
    if isinstance(dst, Replicate):
        return ("all_reduce",)
    if isinstance(dst, Shard):
        return ("reduce_scatter",)
    return ("all_reduce", "to_partial")


def _nested_inside(i: int, current: list, dst: Sequence[Placement]) -> bool:
    """True when mesh dim ``i`` shards a tensor dim that an outer, changing mesh dim touches."""
    p = current[i]
    if not isinstance(p, Shard):
        return False
    for k in range(i):
        if current[k] != dst[k] and (current[k] == p or dst[k] == p):
            return True
    return False


def _group_local_shapes(shape, mesh, placements, group) -> list[tuple[int, ...]]:
    return [local_shape(shape, mesh, placements, mesh.get_coordinate(r)) for r in group]


def _padded_bytes(kind, shape, mesh, before, after, mesh_dim, groups, itemsize):
    """Bytes per rank into the collective, and whether any group needs padding."""
    worst, padded = 0, False
    n = mesh.shape[mesh_dim] if mesh_dim >= 0 else 1
    for group in groups:
        shapes = _group_local_shapes(shape, mesh, before, group)
        buf = list(shapes[0])
        if kind == "all_gather":
            d = before[mesh_dim].dim
            buf[d] = max(s[d] for s in shapes)
            padded |= len({s[d] for s in shapes}) > 1
        elif kind == "all_to_all":
            d_src, d_dst = before[mesh_dim].dim, after[mesh_dim].dim
            buf[d_src] = max(s[d_src] for s in shapes)
            pieces = chunk_sizes(shapes[0][d_dst], n)
            buf[d_dst] = max(pieces) * n
            padded |= len({s[d_src] for s in shapes}) > 1 or len(set(pieces)) > 1
        elif kind == "reduce_scatter":
            d = after[mesh_dim].dim
            pieces = chunk_sizes(shapes[0][d], n)
            buf[d] = max(pieces) * n
            padded |= len(set(pieces)) > 1
        worst = max(worst, math.prod(buf) * itemsize)
    return worst, padded


def _step(kind, mesh, shape, before, after, mesh_dim, itemsize) -> Step:
    groups = mesh.groups(mesh_dim)
    nbytes, padded = 0, False
    if kind in COLLECTIVES:
        nbytes, padded = _padded_bytes(kind, shape, mesh, before, after, mesh_dim, groups,
                                       itemsize)
    name = mesh.mesh_dim_names[mesh_dim] if mesh.mesh_dim_names else None
    return Step(kind, mesh_dim, name, before[mesh_dim], after[mesh_dim], tuple(before),
                tuple(after), groups, nbytes, padded)


def _transition(mesh, shape, current: list, mesh_dim: int, target: Placement, itemsize):
    steps = []
    kinds = transition_kinds(current[mesh_dim], target)
    for idx, kind in enumerate(kinds):
        last = idx == len(kinds) - 1
        step_target = target if last else Replicate()
        after = list(current)
        after[mesh_dim] = step_target
        steps.append(_step(kind, mesh, shape, current, after, mesh_dim, itemsize))
        current[mesh_dim] = step_target
    return steps


def _move_step(src_mesh: DeviceMesh, dst_mesh: DeviceMesh, shape, placements, itemsize) -> Step:
    pairs = tuple((src_mesh.rank_at(c), dst_mesh.rank_at(c)) for c in
                  (src_mesh.get_coordinate(r) for r in src_mesh.ranks))
    moving = tuple(p for p in pairs if p[0] != p[1])
    nbytes = max((math.prod(local_shape(shape, src_mesh, placements, src_mesh.get_coordinate(s)))
                  * itemsize for s, _ in moving), default=0)
    return Step("send_recv", -1, None, Replicate(), Replicate(), tuple(placements),
                tuple(placements), moving, nbytes, False)


@lru_cache(maxsize=4096)
def _plan(mesh, shape, src, dst, itemsize, dst_mesh) -> tuple[Step, ...]:
    current = list(src)
    steps: list[Step] = []
    for i in reversed(range(mesh.ndim)):
        if _nested_inside(i, current, dst):
            steps += _transition(mesh, shape, current, i, Replicate(), itemsize)
    for i in range(mesh.ndim):
        if current[i] != dst[i]:
            steps += _transition(mesh, shape, current, i, dst[i], itemsize)
    if dst_mesh is not None and dst_mesh != mesh:
        move = _move_step(mesh, dst_mesh, shape, dst, itemsize)
        if move.groups:
            steps.append(move)
    return tuple(steps)


def plan_redistribute(mesh: DeviceMesh, shape: Sequence[int], src: Sequence[Placement],
                      dst: Sequence[Placement], itemsize: int = 4,
                      dst_mesh: DeviceMesh | None = None) -> tuple[Step, ...]:
    """Ordered steps that turn ``src`` shards on ``mesh`` into ``dst`` shards (on ``dst_mesh``).

    Cached. Moving to another mesh needs the same mesh shape and device type; the placements
    change on the source mesh first, then shards move point to point, rank by coordinate.
    """
    shape = tuple(shape)
    src = normalize_placements(src, mesh, len(shape))
    if dst_mesh is not None and dst_mesh != mesh:
        if dst_mesh.shape != mesh.shape or dst_mesh.device_type != mesh.device_type:
            raise PlacementValueError(
                f"redistribute can move a tensor only to a mesh of the same shape and device "
                f"type; {mesh} -> {dst_mesh} differ. Build the target mesh with shape "
                f"{mesh.shape} on {mesh.device_type!r}, or go through to_torch() and "
                f"dtorch.tensor(..., device_mesh=target)")
        dst = normalize_placements(dst, dst_mesh, len(shape))
    else:
        dst_mesh = None
        dst = normalize_placements(dst, mesh, len(shape))
    return _plan(mesh, shape, src, dst, int(itemsize), dst_mesh)


def count_collectives(steps: Sequence[Step]) -> dict[str, int]:
    """``{collective kind: count}`` of a plan; local actions count nothing."""
    out: dict[str, int] = {}
    for s in steps:
        if s.is_collective:
            out[s.kind] = out.get(s.kind, 0) + 1
    return out
