"""Elementwise ops with broadcasting (binary and ternary): one rule per mesh dim.

Per mesh dim, with torch's right-aligned broadcasting:

- every operand Replicate -> Replicate;
- some operand ``Shard(d)`` (all sharded operands on the same output dim, none on a dim it
  broadcasts) -> ``Shard(d)``; a Replicate operand beside it that has that dim is narrowed on
  each rank to the block the Shard operand holds (the seed's exception: a local slice, no data
  moves) by :func:`sliced_call`;
- a Partial operand -> the Partial algebra of :mod:`dtorch.ops.partial`.

Example::

    >>> from dtorch import init_device_mesh, Shard, Replicate
    >>> from dtorch.ops.binary import narrow_table
    >>> mesh = init_device_mesh("cpu", 4)
    >>> narrow_table((6, 5), mesh, (Replicate(),), (Shard(0),))[(3,)]
    ((0, 6, 0),)
    >>> narrow_table((6, 5), mesh, (Replicate(),), (Shard(0),))[(1,)]
    ((0, 2, 2),)
"""

from __future__ import annotations

import torch

from ..layout import rank_block
from ..placement import Replicate, Shard
from ..runtime.messages import Coord
from .explain import with_dim
from .partial import legal_text, partial_result
from .registry import Decision, TArg, rule

R = Replicate()
LEGAL_SHARD = ("S(d) with S(d) or R -> S(d) (an R operand is narrowed locally to the same block; "
               "no data moves); R with R -> R")


def _legal(kind: str) -> str:
    return f"{LEGAL_SHARD}; Partial: {legal_text(kind)}"


def narrow_table(shape, mesh, placements, target) -> dict:
    """``{coord: ((dim, start, length), ...)}`` narrowing each rank's block under
    ``placements`` to its block under ``target``; None when some target block is not inside
    the rank's current block (that change would move data). A Replicate made
    ``Partial('sum')`` keeps its value on coordinate 0 of that mesh dim and is zero elsewhere
    (the entry ``(None, 0, 0)``)."""
    table = {}
    summed = [m for m, (p, q) in enumerate(zip(placements, target))
              if p.is_replicate() and q.is_partial() and q.reduce_op == "sum"]
    for rank in mesh.ranks:
        coord = mesh.get_coordinate(rank)
        have = rank_block(shape, mesh, placements, coord)
        want = rank_block(shape, mesh, target, coord)
        cuts = []
        for d, (hs, ho, ws, wo) in enumerate(zip(have.shape, have.offset, want.shape,
                                                  want.offset)):
            if (hs, ho) == (ws, wo):
                continue
            start = wo - ho
            if start < 0 or start + ws > hs:
                return None
            cuts.append((d, start, ws))
        if any(coord[m] != 0 for m in summed):
            cuts.append((None, 0, 0))
        table[coord] = tuple(cuts)
    return table


def _narrow(t, cuts):
    for dim, start, length in cuts:
        t = torch.zeros_like(t) if dim is None else t.narrow(dim, start, length)
    return t


def sliced_call(fn, cuts, coord, *args, **kwargs):
    """Run ``fn(*args, **kwargs)`` after narrowing the Replicate operands named in ``cuts``
    (``((position or keyword, {coord: narrows}), ...)``) to this rank's block."""
    args = list(args)
    for where, table in cuts:
        narrows = table[coord]
        if narrows:
            if type(where) is int:
                args[where] = _narrow(args[where], narrows)
            else:
                kwargs[where] = _narrow(kwargs[where], narrows)
    return fn(*args, **kwargs)


def operand_placement(value, m):
    return value.placements[m] if type(value) is TArg else R


def elementwise_placements(op, operands, kind, out_shape, scalar=None):
    """Output placements and the Replicate operands to narrow: ``(placements, {where:
    (TArg, target placements)})``. ``operands`` is a list of ``(where, TArg or scalar)``."""
    n_o = len(out_shape)
    tensors = [(w, t) for w, t in operands if type(t) is TArg]
    out, narrow = [], {}
    for m in range(op.mesh.ndim):
        pl = [operand_placement(v, m) for _, v in operands]
        if any(p.is_partial() for p in pl):
            out.append(_partial_dim(op, operands, kind, pl, m, scalar))
            continue
        od = _shard_dim(op, tensors, out_shape, m, kind)
        if od is None:
            out.append(R)
            continue
        out.append(Shard(od))
        for w, t in tensors:
            d = od - (n_o - t.ndim)
            if isinstance(t.placements[m], Replicate) and d >= 0 and t.shape[d] == out_shape[od]:
                target = narrow[w][1] if w in narrow else t.placements
                narrow[w] = (t, with_dim(target, m, Shard(d)))
    return tuple(out), narrow


def _partial_dim(op, operands, kind, pl, m, scalar):
    if any(p.is_shard() for p in pl):
        op.fail(m, _legal(kind), _partial_beside_shard_fixes(op, operands, kind, pl, m, scalar),
                "a Partial operand beside a Shard operand")
    result = partial_result(kind, pl, scalar)
    if result is None:
        op.fail(m, _legal(kind), _to_replicate(operands, m, lambda p: p.is_partial()),
                "this op does not commute with the pending reduction of the Partial operand")
    return result


def _partial_beside_shard_fixes(op, operands, kind, pl, m, scalar) -> list:
    """The fixes for mesh dim ``m`` (explain lists them cheapest first by bytes): reduce the
    Partial operands (reduce_scatter onto the Shard operand's output dim where their shapes
    allow it, all_reduce), or gather the Shard operands where the Partial algebra then holds."""
    out_shape = op.out.shapes[0]
    tensors = [t for _, t in operands if type(t) is TArg]
    shard = next(t for t in tensors if t.placements[m].is_shard())
    od = shard.placements[m].dim + len(out_shape) - shard.ndim
    scatter = {}
    for t in (t for t in tensors if t.placements[m].is_partial()):
        d = od - (len(out_shape) - t.ndim)
        if d >= 0 and t.shape[d] == out_shape[od]:
            scatter[t] = with_dim(t.placements, m, Shard(d))
    fixes = [_to_replicate(operands, m, lambda p: p.is_partial())]
    if len(scatter) == sum(t.placements[m].is_partial() for t in tensors):
        fixes.insert(0, scatter)
    if partial_result(kind, [R if p.is_shard() else p for p in pl], scalar) is not None:
        fixes.append(_to_replicate(operands, m, lambda p: p.is_shard()))
    return fixes


def _to_replicate(operands, m, pick) -> dict:
    return {t: with_dim(t.placements, m, R) for _, t in operands
            if type(t) is TArg and pick(t.placements[m])}


def _onto(t, od, out_shape):
    """The placement that shards ``t`` along output dim ``od`` (Replicate where it broadcasts)."""
    want = od - (len(out_shape) - t.ndim)
    return Shard(want) if want >= 0 and t.shape[want] == out_shape[od] else R


def _shard_dim(op, tensors, out_shape, m, kind):
    n_o = len(out_shape)
    od = first = None
    on_od = 0
    for _, t in tensors:
        p = t.placements[m]
        if not isinstance(p, Shard):
            continue
        d = p.dim + n_o - t.ndim
        if t.shape[p.dim] != out_shape[d]:
            op.fail(m, _legal(kind), {t: with_dim(t.placements, m, R)},
                    f"{t.label} is sharded on dim {p.dim}, which broadcasts (size 1 -> "
                    f"{out_shape[d]})")
        if od is None:
            od, first = d, t
        elif d != od:  # move t onto od, or (when it is alone there) first onto d
            fixes = [{t: with_dim(t.placements, m, _onto(t, od, out_shape))}]
            if on_od == 1:
                fixes.append({first: with_dim(first.placements, m, _onto(first, d, out_shape))})
            op.fail(m, _legal(kind), fixes,
                    f"{first.label} is sharded on output dim {od} but {t.label} on output "
                    f"dim {d}")
        on_od += 1
    return od


def broadcast_rule(op, operands, kind, scalar=None, fn=None, inplace=None, out_shape=None):
    """The Decision for an elementwise op over ``operands`` (see module doc)."""
    out_shape = op.out.shapes[0] if out_shape is None else out_shape
    placements, narrow = elementwise_placements(op, operands, kind, out_shape, scalar)
    if not narrow:
        return Decision((placements,), fn, None, None, inplace)
    cuts = []
    for where, (t, target) in narrow.items():
        table = narrow_table(t.shape, t.mesh, t.placements, target)
        if table is None:
            m = next(i for i, (a, b) in enumerate(zip(t.placements, target)) if a != b)
            op.fail(m, _legal(kind), {t: target},
                    f"{t.label}'s current blocks do not contain the blocks it needs "
                    f"(nested sharding in a different mesh-dim order)")
        cuts.append((where, table))
    return Decision((placements,), sliced_call,
                    (fn or op.func, tuple(cuts), Coord(op.mesh), *op.args), dict(op.kwargs),
                    inplace)


def operands_of(op, names) -> list:
    """``[(where, value)]`` for the named parameters, ``where`` the position the value sits
    at in the call (int) or its keyword; missing ones are skipped."""
    out = []
    for pos, name in enumerate(names):
        if name in op.kwargs:
            out.append((name, op.kwargs[name]))
        elif pos < len(op.args):
            out.append((pos, op.args[pos]))
    return [(w, v) for w, v in out if v is not None and not isinstance(v, str)]


def _binary(kind, names=("input", "other")):
    def rule_fn(op):
        k = kind
        if k in ("div", "rdiv") and op.arg(None, "rounding_mode") is not None:
            k = "none"  # floor/trunc division does not commute with a sum
        return broadcast_rule(op, operands_of(op, names), k)
    rule_fn.__name__ = f"{kind}_rule"
    return rule_fn


def _reg(kind, names, out_of_place, in_place, arg_names=("input", "other")):
    fn = _binary(kind, names)
    rule(*out_of_place, family="binary", arg_names=arg_names)(fn)
    if in_place:
        rule(*in_place, family="binary", inplace=True, arg_names=arg_names)(fn)


_reg("add", ("input", "other"), ("add", "__add__", "__radd__"), ("add_", "__iadd__"))
_reg("sub", ("input", "other"), ("sub", "subtract", "__sub__"), ("sub_", "subtract_", "__isub__"))
_reg("rsub", ("input", "other"), ("rsub", "__rsub__"), ())
_reg("mul", ("input", "other"), ("mul", "multiply", "__mul__", "__rmul__"),
     ("mul_", "multiply_", "__imul__"))
_reg("div", ("input", "other"), ("div", "divide", "true_divide", "__truediv__"),
     ("div_", "divide_", "true_divide_", "__itruediv__"))
_reg("rdiv", ("input", "other"), ("__rtruediv__", "__rdiv__"), ())
_reg("maximum", ("input", "other"), ("maximum", "fmax"), ())
_reg("minimum", ("input", "other"), ("minimum", "fmin"), ())
_reg("none", ("input", "other"),
     ("pow", "__pow__", "__rpow__", "float_power", "floor_divide", "__floordiv__",
      "__rfloordiv__", "remainder", "fmod", "__mod__", "__rmod__", "atan2", "arctan2", "hypot",
      "copysign", "xlogy", "nextafter", "logaddexp", "logaddexp2", "bitwise_and",
      "bitwise_or", "bitwise_xor", "__and__", "__or__", "__xor__", "__rand__", "__ror__",
      "__rxor__", "__lshift__", "__rshift__", "__rlshift__", "__rrshift__", "bitwise_left_shift",
      "bitwise_right_shift",
      "logical_and", "logical_or", "logical_xor", "heaviside", "polar"),
     ("pow_", "__ipow__", "float_power_", "floor_divide_", "__ifloordiv__", "remainder_",
      "fmod_", "__imod__", "atan2_", "arctan2_", "hypot_", "copysign_", "xlogy_",
      "logaddexp_", "bitwise_and_", "bitwise_or_", "bitwise_xor_", "__iand__", "__ior__",
      "__ixor__", "__ilshift__", "__irshift__", "bitwise_left_shift_", "bitwise_right_shift_",
      "logical_and_", "logical_or_", "logical_xor_"))
_reg("none", ("input", "end", "weight"), ("lerp",), ("lerp_",), ("input", "end", "weight"))
_reg("none", ("input", "tensor1", "tensor2"), ("addcmul", "addcdiv"), ("addcmul_", "addcdiv_"),
     ("input", "tensor1", "tensor2"))


@rule("where", family="binary", arg_names=("condition", "input", "other"))
def where_rule(op):
    """``torch.where(cond, x, y)``; the method ``x.where(cond, y)`` puts ``x`` first."""
    if op.func is _TENSOR_WHERE:
        return broadcast_rule(op, operands_of(op, ("input", "condition", "other")),
                              "where_method")
    return broadcast_rule(op, operands_of(op, ("condition", "input", "other")), "where")


@rule("masked_fill", family="binary", arg_names=("input", "mask", "value"))
def masked_fill_rule(op):
    value = op.arg(2, "value")
    scalar = None if type(value) is TArg else value
    return broadcast_rule(op, operands_of(op, ("input", "mask", "value")), "masked_fill",
                          scalar=scalar)


rule("masked_fill_", family="binary", inplace=True,
     arg_names=("input", "mask", "value"))(masked_fill_rule)


@rule("clamp", "clip", "clamp_min", "clamp_max", family="binary",
      arg_names=("input", "min", "max"))
def clamp_rule(op):
    return broadcast_rule(op, operands_of(op, ("input", "min", "max")), "clamp")


rule("clamp_", "clip_", "clamp_min_", "clamp_max_", family="binary", inplace=True,
     arg_names=("input", "min", "max"))(clamp_rule)


@rule("copy_", family="binary", inplace=True, arg_names=("input", "src"))
def copy_rule(op):
    return broadcast_rule(op, operands_of(op, ("input", "src")), "copy")


_TENSOR_WHERE = torch.Tensor.where
