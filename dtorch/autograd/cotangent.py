"""Gradient placements: the transpose of the forward placements, per mesh dim. Pure.

A gradient DTensor holds dL/d(global value). What each rank's local graph computes is dL/d(its
local value); these rules say how the local gradients make up the global one (JAX's
``to_ct_spec``). Per mesh dim, for an op's input:

- ``Shard(d)`` -> ``Shard(d)`` (each rank differentiates its own block);
- ``Replicate`` -> ``Replicate`` when every output with a gradient is Replicate on that dim
  (every rank computed the same), else ``Partial("sum")`` (each rank's copy fed only its own
  block or partial sum, so the contributions add up);
- ``Partial(sum|avg)`` -> ``Replicate`` (every rank's share has the same derivative).

An output's incoming gradient must be ``Shard(d)`` where the output is ``Shard(d)`` and
``Replicate`` where it is Replicate or Partial. ``Partial("avg")`` is the mean of the shares,
so its incoming gradient is scaled by 1/n and the gradient of a Partial("avg") input by n.
Partial("max"/"min") are not differentiable this way (the maximum's owner is not known).
Example::

    >>> from dtorch import Partial, Replicate, Shard
    >>> grad_placements((Replicate(),), [(Shard(0),)])
    (Partial(reduce_op='sum'),)
    >>> grad_placements((Shard(1), Replicate()), [(Shard(1), Replicate())])
    (Shard(dim=1), Replicate())
    >>> incoming_placements((Partial(), Shard(0)))
    (Replicate(), Shard(dim=0))
    >>> incoming_scale((2, 4), (Partial("avg"), Partial("avg")))
    0.125
"""

from __future__ import annotations

from typing import Sequence

from ..placement import Partial, Placement, Replicate, Shard

R = Replicate()


def grad_placements(inputs: Sequence[Placement], outputs: Sequence[Sequence[Placement]]
                    ) -> tuple[Placement, ...]:
    """The placements of an input's gradient, from its placements and those of the outputs
    that carry a gradient."""
    out = []
    for m, p in enumerate(inputs):
        if isinstance(p, Shard):
            out.append(p)
        elif isinstance(p, Partial):
            out.append(R)
        elif all(isinstance(o[m], Replicate) for o in outputs):
            out.append(R)
        else:
            out.append(Partial("sum"))
    return tuple(out)


def incoming_placements(placements: Sequence[Placement]) -> tuple[Placement, ...]:
    """What an output's incoming gradient must be before the local graph runs."""
    return tuple(R if isinstance(p, Partial) else p for p in placements)


def redistribute_grad_placements(src: Sequence[Placement]) -> tuple[Placement, ...]:
    """The gradient placements of a redistribute's input: its own, Partial -> Replicate (the
    backward of a placement change is the change back)."""
    return tuple(R if isinstance(p, Partial) else p for p in src)


def _avg_factor(mesh_shape, placements) -> int:
    n = 1
    for size, p in zip(mesh_shape, placements):
        if isinstance(p, Partial) and p.reduce_op == "avg":
            n *= size
    return n


def incoming_scale(mesh_shape, placements) -> float | None:
    """1/n over the Partial('avg') dims of an output (None: no scaling)."""
    n = _avg_factor(mesh_shape, placements)
    return None if n == 1 else 1.0 / n


def outgoing_scale(mesh_shape, placements) -> float | None:
    """n over the Partial('avg') dims of an input (None: no scaling)."""
    n = _avg_factor(mesh_shape, placements)
    return None if n == 1 else float(n)


def not_differentiable(placements: Sequence[Placement]) -> Placement | None:
    """The Partial('max'/'min') placement that blocks a gradient, or None."""
    for p in placements:
        if isinstance(p, Partial) and p.reduce_op in ("max", "min"):
            return p
    return None
