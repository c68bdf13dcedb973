"""What the placement explorer shows, as plain values: the two layouts, the plan's steps, each
step's predicted time and the transfers that animate it. Pure (no Dask, no widgets).

A step on mesh dim ``k`` runs in the rank groups ``step.groups``. In each group, receiver
``r`` gets from every other member ``s``:

* a reducing step (``all_reduce``, ``reduce_scatter``: the source is Partial): the part of
  ``s``'s block before the step that lies in ``r``'s block after it (added into ``r``'s);
* a gathering step (``all_gather``, ``all_to_all``): the part of ``s``'s block before that
  lies in ``r``'s block after and that ``r`` did not hold before;
* ``send_recv`` (a move to another mesh): ``s`` sends its whole block to its pair.

Local steps (``slice``, ``to_partial``) follow the gathering rule and move nothing: every rank
held all it keeps.

Empty intersections (empty shards, the short chunks of uneven ones) are no transfer. Example::

    >>> from dtorch import init_device_mesh
    >>> m = init_device_mesh("cpu", 4)
    >>> e = explore((4, 4), m, ["S(0)"], ["R"])
    >>> [s.step.kind for s in e.steps]
    ['all_gather']
    >>> e.steps[0].frames[0]     # rank 0 gets row 1 from rank 1
    Transfer(src=1, dst=0, offset=(1, 0), shape=(1, 4), reduces=False)
    >>> len(e.steps[0].frames)   # every rank gets the 3 rows it lacks
    12
"""

from __future__ import annotations

import math
import re
from typing import Callable, NamedTuple, Sequence

import torch

from dtorch.errors import PlacementValueError
from dtorch.layout import normalize_placements, rank_block
from dtorch.placement import REDUCE_OPS, Partial, Placement, Replicate, Shard
from dtorch.redistribute import Step, plan_redistribute

REDUCING = ("all_reduce", "reduce_scatter")
_SHARD = re.compile(r"^(?:S|Shard)\((?:dim=)?(-?\d+)\)$")
_PARTIAL = re.compile(r"^(?:P|Partial)(?:\((?:reduce_op=)?['\"]?(\w*)['\"]?\))?$")


# ---------------------------------------------------------------------------------------------
# placements as the pickers write them
# ---------------------------------------------------------------------------------------------
def parse_placement(value) -> Placement:
    """A placement from a Placement or its text: ``S(0)``, ``Shard(0)``, ``R``,
    ``Replicate()``, ``P``, ``P(max)``, ``Partial('avg')``.

    >>> parse_placement("S(1)"), parse_placement("P(max)"), parse_placement("Replicate()")
    (Shard(dim=1), Partial(reduce_op='max'), Replicate())
    """
    if isinstance(value, Placement):
        return value
    text = str(value).replace(" ", "")
    if text in ("R", "Replicate()", "Replicate"):
        return Replicate()
    shard = _SHARD.match(text)
    if shard:
        return Shard(int(shard.group(1)))
    partial = _PARTIAL.match(text)
    if partial:
        return Partial(partial.group(1) or "sum")
    raise PlacementValueError(
        f"cannot read {value!r} as a placement; write S(d) (e.g. S(0)), R, or P(op) with op one "
        f"of {', '.join(REDUCE_OPS)}")


def parse_placements(values, mesh, ndim: int) -> tuple[Placement, ...]:
    """One placement per mesh dim, checked against the mesh and the tensor's rank.

    >>> from dtorch import init_device_mesh
    >>> parse_placements(["S(-1)"], init_device_mesh("cpu", 2), 2)
    (Shard(dim=1),)
    """
    if isinstance(values, (Placement, str)):
        values = [values]
    return normalize_placements([parse_placement(v) for v in values], mesh, ndim)


def placement_choices(ndim: int) -> list[str]:
    """What a picker offers for a tensor of ``ndim`` dims.

    >>> placement_choices(2)
    ['R', 'S(0)', 'S(1)', 'P(sum)', 'P(avg)', 'P(max)', 'P(min)']
    """
    return ["R"] + [f"S({d})" for d in range(ndim)] + [f"P({op})" for op in REDUCE_OPS]


# ---------------------------------------------------------------------------------------------
# blocks
# ---------------------------------------------------------------------------------------------
class RankLayout(NamedTuple):
    """What one rank holds: its block (global offset and shape) and whether the values there
    are a Partial part (to be reduced with the other ranks')."""

    rank: int
    coord: tuple[int, ...]
    offset: tuple[int, ...]
    shape: tuple[int, ...]
    partial: bool


def layouts(shape, mesh, placements) -> tuple[RankLayout, ...]:
    """Every rank's block, in rank order.

    >>> from dtorch import init_device_mesh, Shard
    >>> layouts((5,), init_device_mesh("cpu", 2), [Shard(0)])[1]
    RankLayout(rank=1, coord=(1,), offset=(3,), shape=(2,), partial=False)
    """
    partial = any(isinstance(p, Partial) for p in placements)
    out = []
    for r in mesh.ranks:
        coord = tuple(mesh.get_coordinate(r))
        block = rank_block(shape, mesh, placements, coord)
        out.append(RankLayout(r, coord, block.offset, block.shape, partial))
    return tuple(out)


class Transfer(NamedTuple):
    """One piece a step moves: from rank ``src`` to rank ``dst``, the global region at
    ``offset`` of ``shape``; ``reduces`` when ``dst`` adds it into its own values."""

    src: int
    dst: int
    offset: tuple[int, ...]
    shape: tuple[int, ...]
    reduces: bool


def intersect(a: RankLayout, b: RankLayout):
    """``(offset, shape)`` where the blocks of ``a`` and ``b`` overlap, or None.

    >>> a = RankLayout(0, (0,), (0, 0), (2, 4), False)
    >>> intersect(a, RankLayout(1, (1,), (1, 2), (4, 4), False))
    ((1, 2), (1, 2))
    """
    offset, shape = [], []
    for ao, an, bo, bn in zip(a.offset, a.shape, b.offset, b.shape):
        lo, hi = max(ao, bo), min(ao + an, bo + bn)
        if hi <= lo:
            return None
        offset.append(lo)
        shape.append(hi - lo)
    return tuple(offset), tuple(shape)


def box_minus(offset, shape, held: RankLayout) -> list[tuple[tuple, tuple]]:
    """The region ``(offset, shape)`` less what ``held`` holds, as disjoint boxes.

    >>> box_minus((0, 0), (4, 4), RankLayout(0, (0,), (0, 0), (1, 4), False))
    [((1, 0), (3, 4))]
    """
    if intersect(RankLayout(-1, (), offset, shape, False), held) is None:
        return [(tuple(offset), tuple(shape))]
    pieces, off, shp = [], list(offset), list(shape)
    for d, (ho, hn) in enumerate(zip(held.offset, held.shape)):
        lo, hi = max(off[d], ho), min(off[d] + shp[d], ho + hn)
        for start, stop in ((off[d], lo), (hi, off[d] + shp[d])):
            if stop > start:
                pieces.append((tuple(off[:d]) + (start,) + tuple(off[d + 1:]),
                               tuple(shp[:d]) + (stop - start,) + tuple(shp[d + 1:])))
        off[d], shp[d] = lo, hi - lo
    return pieces


def _is_empty(block: RankLayout) -> bool:
    return math.prod(block.shape) == 0


def step_frames(shape, mesh, step: Step) -> tuple[Transfer, ...]:
    """The transfers of one planned step (see the module doc for the rule).

    >>> from dtorch import init_device_mesh, Partial, Shard, plan_redistribute
    >>> m = init_device_mesh("cpu", 2)
    >>> step, = plan_redistribute(m, (2, 2), [Partial()], [Shard(0)])
    >>> for t in step_frames((2, 2), m, step):   # each rank adds the other's part of its row
    ...     print(t)
    Transfer(src=1, dst=0, offset=(0, 0), shape=(1, 2), reduces=True)
    Transfer(src=0, dst=1, offset=(1, 0), shape=(1, 2), reduces=True)
    """
    before = layouts(shape, mesh, step.before)
    if step.kind == "send_recv":
        return tuple(Transfer(s, d, before[mesh.ranks.index(s)].offset,
                              before[mesh.ranks.index(s)].shape, False)
                     for s, d in step.groups if not _is_empty(before[mesh.ranks.index(s)]))
    after = layouts(shape, mesh, step.after)
    index = {r: i for i, r in enumerate(mesh.ranks)}
    reduces = step.kind in REDUCING
    out = []
    for group in step.groups:
        for r in group:
            for s in group:
                if s != r:
                    out += _pieces(before[index[s]], after[index[r]], before[index[r]], reduces)
    return tuple(out)


def _pieces(sent: RankLayout, wanted: RankLayout, held: RankLayout, reduces: bool) -> list:
    """What ``wanted.rank`` gets from ``sent.rank``: the overlap, less what it held before
    unless the step reduces (then every partial part counts)."""
    region = intersect(sent, wanted)
    if region is None:
        return []
    boxes = [region] if reduces else box_minus(*region, held)
    return [Transfer(sent.rank, wanted.rank, o, s, reduces) for o, s in boxes]


# ---------------------------------------------------------------------------------------------
# the whole exploration
# ---------------------------------------------------------------------------------------------
class PlanStep(NamedTuple):
    """A planned step as the explorer shows it: the planner's ``Step``, its predicted seconds
    (None without a cost model), its transfers and the layouts around it."""

    step: Step
    seconds: float | None
    frames: tuple[Transfer, ...]
    before: tuple[RankLayout, ...]
    after: tuple[RankLayout, ...]


class Exploration(NamedTuple):
    """``src`` -> ``dst`` for one tensor on one mesh: both layouts, the steps and the
    predicted total (None without a cost model)."""

    src: tuple[Placement, ...]
    dst: tuple[Placement, ...]
    src_layout: tuple[RankLayout, ...]
    dst_layout: tuple[RankLayout, ...]
    steps: tuple[PlanStep, ...]
    predicted_s: float | None


Predictor = Callable[[Sequence[Step]], object]  # steps -> dtorch.cost.Prediction or None


def explore(shape, mesh, src, dst, dtype: torch.dtype = torch.float32,
            predict: Predictor | None = None) -> Exploration:
    """Plan ``src`` -> ``dst`` (placements or their text) and describe every step.
    ``predict(steps)`` gives a :class:`dtorch.cost.Prediction` (e.g.
    ``functools.partial(dtorch.cost.predict, model=links)``); without it, or where it gives
    None, no time is predicted.
    Raises :class:`dtorch.PlacementValueError` for placements that do not fit.

    >>> from dtorch import init_device_mesh
    >>> e = explore((4, 4), init_device_mesh("cpu", 4), ["P(sum)"], ["S(0)"])
    >>> [(s.step.kind, s.seconds) for s in e.steps], e.predicted_s
    ([('reduce_scatter', None)], None)
    """
    shape = tuple(int(n) for n in shape)
    src, dst = parse_placements(src, mesh, len(shape)), parse_placements(dst, mesh, len(shape))
    steps = plan_redistribute(mesh, shape, src, dst, dtype.itemsize)
    seconds, total = _predicted(steps, predict)
    views = tuple(PlanStep(s, t, step_frames(shape, mesh, s), layouts(shape, mesh, s.before),
                           layouts(shape, mesh, s.after)) for s, t in zip(steps, seconds))
    return Exploration(src, dst, layouts(shape, mesh, src), layouts(shape, mesh, dst), views,
                       total)


def _predicted(steps, predict) -> tuple[list, float | None]:
    """Seconds per step and in all; None where there is no prediction (nan: no fit)."""
    p = None if predict is None else predict(steps)
    if p is None:
        return [None] * len(steps), None
    return [_seconds(c.seconds) for c in p.steps], _seconds(p.total_s)


def _seconds(value) -> float | None:
    return None if value is None or value != value else float(value)


# ---------------------------------------------------------------------------------------------
# as JSON, for the widget's traitlets
# ---------------------------------------------------------------------------------------------
def layout_rows(layout: Sequence[RankLayout]) -> list[dict]:
    """Layouts as JSON rows.

    >>> layout_rows([RankLayout(0, (0,), (0,), (2,), False)])
    [{'rank': 0, 'coord': [0], 'offset': [0], 'shape': [2], 'partial': False}]
    """
    return [{"rank": b.rank, "coord": list(b.coord), "offset": list(b.offset),
             "shape": list(b.shape), "partial": b.partial} for b in layout]


def frame_rows(frames: Sequence[Transfer]) -> list[dict]:
    """Transfers as JSON rows.

    >>> frame_rows([Transfer(1, 0, (1,), (1,), True)])
    [{'src': 1, 'dst': 0, 'offset': [1], 'shape': [1], 'reduces': True}]
    """
    return [{"src": t.src, "dst": t.dst, "offset": list(t.offset), "shape": list(t.shape),
             "reduces": t.reduces} for t in frames]


def step_row(view: PlanStep) -> dict:
    """One step as a JSON row: what the plan list shows (frames and layouts apart)."""
    s = view.step
    return {"kind": s.kind, "mesh_dim": s.mesh_dim, "mesh_dim_name": s.mesh_dim_name,
            "src": str(s.src), "dst": str(s.dst), "before": [str(p) for p in s.before],
            "after": [str(p) for p in s.after], "groups": [list(g) for g in s.groups],
            "bytes_per_rank": s.bytes_per_rank, "padded": s.padded,
            "collective": s.is_collective, "predicted_s": view.seconds,
            "layout_before": layout_rows(view.before), "layout_after": layout_rows(view.after)}
