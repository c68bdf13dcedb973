"""What the op explorer shows, as plain values: the output placements a torch function's rule
gives for input layouts (no data, no cluster), or its ``PlacementError`` with each suggested
fix, the fix's plan and predicted cost. Pure (no Dask, no widgets).

The rule runs as dispatch would run it (:func:`dtorch.ops.dispatch.plan_of`) on handles that
carry metadata only. A fix is a redistribute of one or more inputs; the fixes are the ones
the error lists, cheapest first (see :mod:`dtorch.ops.explain`). Example::

    >>> import torch
    >>> from dtorch import init_device_mesh, Shard, Partial
    >>> m = init_device_mesh("cpu", 4)
    >>> r = explain_op(torch.matmul, [((4, 4), m, [Shard(1)]), ((4, 4), m, [Shard(0)])])
    >>> r.outputs[0].placements, r.error
    ((Partial(reduce_op='sum'),), '')
    >>> r = explain_op(torch.relu, [((4, 4), m, [Partial()])])
    >>> [(c.label, c.placements) for c in r.fixes[0].changes], r.fixes[0].kinds
    ([('input', (Replicate(),))], ('all_reduce',))
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import torch

from dtorch.errors import DTorchError
from dtorch.ops.dispatch import plan_of
from dtorch.ops.registry import display_name
from dtorch.redistribute import Step, plan_redistribute
from dtorch.spec import TensorSpec, make_spec
from dtorch.tensor import DTensor

from .explorer_model import Predictor, parse_placement

USAGE = ("give each input as a TensorSpec, a DTensor, or (shape, mesh, placements[, dtype]), "
         "e.g. OpExplorer(torch.matmul, ((8, 4), mesh, [Shard(1)]), ((4, 8), mesh, [Shard(0)]))")


def as_spec(value) -> TensorSpec:
    """A TensorSpec from a TensorSpec, a DTensor, or ``(shape, mesh, placements[, dtype])``.

    >>> from dtorch import init_device_mesh
    >>> as_spec(((2, 3), init_device_mesh("cpu", 2), ["S(1)"])).placements
    (Shard(dim=1),)
    """
    if isinstance(value, TensorSpec):
        return value
    if isinstance(value, DTensor):
        return value._spec
    if isinstance(value, (tuple, list)) and len(value) in (3, 4):
        shape, mesh, placements = value[:3]
        dtype = value[3] if len(value) == 4 else torch.float32
        if isinstance(placements, str):
            placements = [placements]
        return make_spec(shape, dtype, mesh, [parse_placement(p) for p in placements])
    raise TypeError(f"{USAGE}; got {value!r}")


def metadata_tensor(spec: TensorSpec) -> DTensor:
    """A DTensor handle with metadata only: no cluster, no shards. What a rule reads."""
    t = DTensor.__new__(DTensor)
    t._spec, t._tid, t._controller, t._ag, t._version = spec, None, None, None, None
    return t


class Change(NamedTuple):
    """One input's redistribute in a fix: which input, to what, and the planner's steps."""

    index: int
    label: str
    placements: tuple
    steps: tuple[Step, ...]


class Fix(NamedTuple):
    """A suggested fix: its redistributes, the bytes per rank and kinds of their collectives,
    the predicted seconds (None without a cost model) and the op's output placements once it
    is applied (None when it still does not fit)."""

    changes: tuple[Change, ...]
    bytes_per_rank: int
    kinds: tuple[str, ...]
    seconds: float | None
    outputs: tuple | None


class OpOutcome(NamedTuple):
    """The op's outputs (TensorSpecs; ``()`` when it raised or its outputs depend on values),
    the error text (``""`` when none) and the fixes it suggested, cheapest first."""

    name: str
    outputs: tuple[TensorSpec, ...]
    error: str
    fixes: tuple[Fix, ...]


def explain_op(fn, specs: Sequence, kwargs: dict | None = None,
               predict: Predictor | None = None) -> OpOutcome:
    """Run ``fn``'s rule on ``specs`` (see :func:`as_spec`) and, when it refuses, describe each
    fix. ``predict(steps)`` gives a :class:`dtorch.cost.Prediction` for a fix's steps."""
    specs = [as_spec(s) for s in specs]
    name = display_name(fn)
    try:
        return OpOutcome(name, outputs_of(fn, specs, kwargs), "", ())
    except DTorchError as err:  # PlacementError, UnsupportedOpError: what the user must change
        fixes = tuple(_fix(fn, specs, kwargs, changes, predict)
                      for changes in fixes_of(err, specs))
        return OpOutcome(name, (), str(err), fixes)


def outputs_of(fn, specs, kwargs=None) -> tuple[TensorSpec, ...]:
    """The output specs the rule gives (raises what the call would raise)."""
    plan = plan_of(fn, tuple(metadata_tensor(s) for s in specs), kwargs or {})
    return tuple(plan.out_specs)


def fixes_of(err: BaseException, specs) -> list[list[Change]]:
    """The fixes a PlacementError suggests (``err.fixes``: cheapest first, each a list of
    redistributes applied together), as Changes with the planner's steps."""
    fixes = []
    for alternative in getattr(err, "fixes", ()):
        changes = []
        for index, label, placements in alternative:
            spec = specs[index]
            steps = plan_redistribute(spec.mesh, spec.shape, spec.placements, placements,
                                      spec.dtype.itemsize)
            changes.append(Change(index, label, tuple(placements), steps))
        fixes.append(changes)
    return fixes


def _fix(fn, specs, kwargs, changes, predict) -> Fix:
    steps = tuple(s for c in changes for s in c.steps)
    collectives = [s for s in steps if s.is_collective]
    seconds = None
    prediction = None if predict is None else predict(steps)
    if prediction is not None:
        total = prediction.total_s
        seconds = None if total != total else float(total)  # nan: a kind with no fit
    fixed = list(specs)
    for c in changes:
        fixed[c.index] = specs[c.index]._replace(placements=c.placements)
    try:
        outputs = tuple(s.placements for s in outputs_of(fn, fixed, kwargs))
    except DTorchError:
        outputs = None
    return Fix(tuple(changes), sum(s.bytes_per_rank for s in collectives),
               tuple(s.kind for s in collectives), seconds, outputs)
