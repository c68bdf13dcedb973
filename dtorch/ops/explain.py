"""Formatting ``PlacementError``: the op, each input's placements, what is legal, the fix.

Built only when an error is raised (never on the hot path). Example message::

    torch.add: no placement rule fits on mesh dim 0
      inputs: input [S(0)], other [S(1)]
      why: the operands are sharded on different dims
      legal per mesh dim: S(d) with S(d) or R -> S(d) | R with R -> R | ...
      fix: other.redistribute(placements=[Shard(0)])   # all_to_all

    >>> from dtorch import Shard, Replicate, Partial
    >>> code_placements((Shard(0), Replicate(), Partial("max")))
    "[Shard(0), Replicate(), Partial('max')]"
"""

from __future__ import annotations

from ..errors import PlacementError
from ..placement import Partial, Replicate, Shard, format_placements


def code_placement(p) -> str:
    """How a user would write the placement: ``Shard(0)``, ``Replicate()``, ``Partial('sum')``."""
    if isinstance(p, Shard):
        return f"Shard({p.dim})"
    if isinstance(p, Replicate):
        return "Replicate()"
    if isinstance(p, Partial):
        return f"Partial({p.reduce_op!r})"
    return repr(p)


def code_placements(placements) -> str:
    return "[" + ", ".join(code_placement(p) for p in placements) + "]"


def with_dim(placements, mesh_dim: int, placement) -> tuple:
    """``placements`` with the entry of ``mesh_dim`` replaced."""
    out = list(placements)
    out[mesh_dim] = placement
    return tuple(out)


def _mesh_dim_text(mesh, mesh_dim) -> str:
    if mesh_dim is None:
        return ""
    names = mesh.mesh_dim_names
    name = f" ({names[mesh_dim]!r})" if names else ""
    return f" on mesh dim {mesh_dim}{name}"


def redistribute_cost(mesh, shape, dtype, current, target) -> str:
    """The ``   # all_gather`` note of a fix line: the collectives the planner would run."""
    from ..redistribute import plan_redistribute
    try:
        steps = plan_redistribute(mesh, tuple(shape), tuple(current), tuple(target),
                                  dtype.itemsize)
    except Exception:  # noqa: BLE001 - the hint is best effort
        return ""
    kinds = [s.kind for s in steps if s.is_collective]
    return "   # " + (", ".join(kinds) if kinds else "no data moves (local slice)")


def fix_line(label: str, x, target) -> str:
    """``  fix: x.redistribute(placements=[Replicate()])   # all_gather`` for DTensor ``x``."""
    return (f"  fix: {label}.redistribute(placements={code_placements(target)})"
            + redistribute_cost(x.device_mesh, x.shape, x.dtype, x.placements, target))


def _cost(targ, placements) -> str:
    return redistribute_cost(targ.mesh, targ.shape, targ.dtype, targ.placements, placements)


def placement_error(op, mesh_dim, legal: str, fix: dict, why: str | None) -> PlacementError:
    """The PlacementError for ``op`` (an OpCall); ``fix`` maps a TArg to its target
    placements, or to a list of alternatives."""
    lines = [f"{op.name}: no placement rule fits these inputs{_mesh_dim_text(op.mesh, mesh_dim)}"]
    lines.append("  inputs: " + ", ".join(f"{t.label} {format_placements(t.placements)}"
                                          for t in op.tensors))
    if why:
        lines.append(f"  why: {why}")
    lines.append(f"  legal per mesh dim: {legal}")
    for targ, options in fix.items():
        if options and not isinstance(options[0], (tuple, list)):
            options = [options]  # one target, or a list of alternatives
        for word, placements in zip(["fix:"] + ["  or:"] * len(options), options):
            lines.append(f"  {word} {targ.label}.redistribute(placements="
                         f"{code_placements(placements)})" + _cost(targ, placements))
    if not fix:
        lines.append("  fix: redistribute the inputs to one of the legal combinations above "
                     "(x.redistribute(placements=[...]))")
    err = PlacementError("\n".join(lines))
    err.op = op.name
    return err
