"""Formatting ``PlacementError``: the op, each input's placements, what is legal, the fix.

Built only when an error is raised (never on the hot path). A rule may offer several fixes
(``op.fail(m, legal, [{x: ...}, {y: ...}], why)``): they are listed cheapest first by the
planner's bytes (``Step.bytes_per_rank`` summed over each fix's collectives; ties keep the
rule's order). The first line keeps the ``fix: ...   # <collectives>`` form the op_db report
reads. Example message (``x * x.sum(0)``, x ``Shard(0)`` of shape (10, 3))::

    Tensor.__mul__: no placement rule fits these inputs on mesh dim 0
      inputs: input [S(0)], other [P(sum)]
      why: a Partial operand beside a Shard operand
      legal per mesh dim: S(d) with S(d) or R -> S(d) ...
      fix: other.redistribute(placements=[Replicate()])   # all_reduce
       or: input.redistribute(placements=[Replicate()])   # all_gather
      bytes per rank, cheapest fix first: 12 B (all_reduce), 36 B (all_gather)

    >>> from dtorch import Shard, Replicate, Partial, init_device_mesh
    >>> code_placements((Shard(0), Replicate(), Partial("max")))
    "[Shard(0), Replicate(), Partial('max')]"
    >>> import torch
    >>> from dtorch.ops.registry import TArg
    >>> from dtorch.spec import make_spec
    >>> mesh = init_device_mesh("cpu", 4)
    >>> x = TArg(0, "input", make_spec((10, 3), torch.float32, mesh, [Shard(0)]))
    >>> m = TArg(1, "other", make_spec((3,), torch.float32, mesh, [Partial()]))
    >>> fixes = ranked([{x: (Replicate(),)}, {m: (Replicate(),)}])   # cheapest first
    >>> [(alt[0][0].label, fix_cost(alt)) for alt in fixes]
    [('other', (12, ['all_reduce'])), ('input', (36, ['all_gather']))]
"""

from __future__ import annotations

import itertools

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


def _plan(mesh, shape, dtype, current, target):
    """The planner's steps for one redistribute, or None when it cannot plan it."""
    from ..redistribute import plan_redistribute
    try:
        return plan_redistribute(mesh, tuple(shape), tuple(current), tuple(target),
                                 dtype.itemsize)
    except Exception:  # noqa: BLE001 - the hint is best effort
        return None


def _kinds_note(steps) -> str:
    if steps is None:
        return ""
    kinds = [s.kind for s in steps if s.is_collective]
    return "   # " + (", ".join(kinds) if kinds else "no data moves (local slice)")


def _steps(targ, placements):
    """The planner's steps for one redistribute of a fix (a TArg to ``placements``)."""
    return _plan(targ.mesh, targ.shape, targ.dtype, targ.placements, placements)


def fix_line(label: str, x, target) -> str:
    """``  fix: x.redistribute(placements=[Replicate()])   # all_gather`` for DTensor ``x``."""
    steps = _plan(x.device_mesh, x.shape, x.dtype, x.placements, target)
    return f"  fix: {label}.redistribute(placements={code_placements(target)})" + _kinds_note(
        steps)


def alternatives(fix) -> list[tuple]:
    """The fixes a rule offered, each a tuple of ``(TArg, placements)`` to apply together.

    ``fix`` is ``{targ: placements}`` (one fix, every entry needed), ``{targ: [placements,
    ...]}`` (one of these per input) or a list of such dicts (alternative fixes).
    """
    out = []
    for one in (fix if isinstance(fix, list) else [fix]):
        per_input = []
        for targ, options in one.items():
            if options and not isinstance(options[0], (tuple, list)):
                options = [options]
            per_input.append([(targ, tuple(p)) for p in options])
        for combo in itertools.product(*per_input):
            if combo and combo not in out:
                out.append(combo)
    return out


def fix_cost(alternative):
    """``(bytes per rank, collective kinds)`` of one fix by the planner (Step.bytes_per_rank
    summed over its collectives); bytes None when some redistribute cannot be planned."""
    total, kinds = 0, []
    for targ, placements in alternative:
        steps = _steps(targ, placements)
        if steps is None:
            return None, kinds
        for s in steps:
            if s.is_collective:
                total += s.bytes_per_rank
                kinds.append(s.kind)
    return total, kinds


def ranked(fix) -> list[tuple]:
    """The alternatives, cheapest first by :func:`fix_cost` (ties keep the rule's order)."""
    alts = alternatives(fix)
    costs = [fix_cost(a)[0] for a in alts]
    order = sorted(range(len(alts)), key=lambda i: (costs[i] is None, costs[i] or 0, i))
    return [alts[i] for i in order]


def _fix_lines(fix) -> list[str]:
    lines, costs = [], []
    for k, alt in enumerate(ranked(fix)):
        for j, (targ, placements) in enumerate(alt):
            word = "fix:" if k == 0 else (" or:" if j == 0 else "and:")
            lines.append(f"  {word} {targ.label}.redistribute(placements="
                         f"{code_placements(placements)})" + _kinds_note(_steps(targ, placements)))
        nbytes, kinds = fix_cost(alt)
        if nbytes is not None:
            costs.append(f"{nbytes:,} B ({', '.join(kinds) or 'no data moves'})")
    if costs:
        head = "bytes per rank, cheapest fix first" if len(costs) > 1 else "bytes per rank"
        lines.append(f"  {head}: " + ", ".join(costs))
    return lines


def placement_error(op, mesh_dim, legal: str, fix, why: str | None) -> PlacementError:
    """The PlacementError for ``op`` (an OpCall); ``fix`` as :func:`alternatives` reads it,
    listed cheapest first, in the text and as ``err.fixes`` (each alternative a tuple of
    ``(tensor input index, label, placements)`` to apply together: what tools read)."""
    lines = [f"{op.name}: no placement rule fits these inputs{_mesh_dim_text(op.mesh, mesh_dim)}"]
    lines.append("  inputs: " + ", ".join(f"{t.label} {format_placements(t.placements)}"
                                          for t in op.tensors))
    if why:
        lines.append(f"  why: {why}")
    lines.append(f"  legal per mesh dim: {legal}")
    lines += _fix_lines(fix)
    if not fix:
        lines.append("  fix: redistribute the inputs to one of the legal combinations above "
                     "(x.redistribute(placements=[...]))")
    err = PlacementError("\n".join(lines))
    err.op = op.name
    # the same fixes as data, cheapest first: ((tensor input index, label, placements), ...)
    err.fixes = tuple(tuple((targ.index, targ.label, tuple(p)) for targ, p in alt)
                      for alt in ranked(fix)) if fix else ()
    return err
