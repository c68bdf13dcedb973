"""Rules derived from torch's own op metadata, for callables no hand-written rule covers.

- **Pointwise**: a call whose aten operators are all tagged ``torch.Tag.pointwise`` (found by
  running it once on ``meta`` tensors under a dispatch mode that records them) is
  elementwise: it gets the broadcasting rule of :mod:`dtorch.ops.binary` (Shard kept,
  Replicate narrowed locally; a Partial operand refuses, since only the hand-kept linear ops
  of :mod:`dtorch.ops.partial` commute with a pending sum). ``torch.special.erfcx``,
  ``torch.frexp`` and a torch function added in a later release are covered the day they
  exist, if their tags say so.
- **View copies**: ``torch.transpose_copy`` and the other ``*_copy`` functions whose aten
  operator is tagged ``torch.Tag.view_copy`` share their view op's rule.

The derivation runs on the first call of a signature only; the plan is cached like any
other. Example::

    >>> import torch
    >>> pointwise_call(torch.special.erfcx, (torch.empty(2, 3, device="meta"),), {})
    True
    >>> pointwise_call(torch.cumsum, (torch.empty(2, 3, device="meta"), 0), {})
    False
    >>> copy_base(torch.transpose_copy) is torch.transpose
    True
"""

from __future__ import annotations

import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from . import generic, value_shapes

from .binary import broadcast_rule
from .generic import picklable
from .registry import Entry, OpCall, TArg, as_decision, display_name, lookup

# aten ops that are elementwise though torch does not tag them pointwise
_UNTAGGED_ELEMENTWISE = {"aten::complex", "aten::log_sigmoid_forward", "aten::clone",
                         "aten::alias", "aten::detach", "aten::lift_fresh"}
_PLACES = ("device", "layout", "memory_format", "pin_memory")


class _Recorder(TorchDispatchMode):
    """Records whether every aten op that runs is elementwise."""

    def __init__(self):
        super().__init__()
        self.elementwise = True
        self.ran = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.ran = True
        if self.elementwise and not _elementwise_op(func, args, kwargs):
            self.elementwise = False
        return func(*args, **kwargs)


def _elementwise_op(func, args, kwargs) -> bool:
    tags = func.tags
    if torch.Tag.nondeterministic_seeded in tags:
        return False
    if torch.Tag.pointwise in tags or func._schema.name in _UNTAGGED_ELEMENTWISE:
        return True
    if func._schema.name == "aten::_to_copy":  # a dtype cast, not a move
        return not any(kwargs.get(k) is not None for k in _PLACES[1:]) and \
            kwargs.get("device") in (None, torch.device("meta"))
    # a constant made inside (``torch.tensor(2.0)``): a 0-dim factory with no tensor input
    has_tensor = any(isinstance(a, torch.Tensor) for a in args) or any(
        isinstance(v, torch.Tensor) for v in kwargs.values())
    return not has_tensor and func._schema.name in ("aten::scalar_tensor", "aten::lift_fresh_copy",
                                                     "aten::_local_scalar_dense")


def pointwise_call(func, args, kwargs) -> bool:
    """Whether ``func(*args, **kwargs)`` (meta tensors) runs only elementwise aten ops and
    returns tensors of the broadcast shape of its tensor arguments."""
    recorder = _Recorder()
    try:
        with recorder:
            result = func(*args, **kwargs)
    except Exception:  # noqa: BLE001 - not derivable; the caller raises its own error
        return False
    if not (recorder.ran and recorder.elementwise):
        return False
    outs = [result] if isinstance(result, torch.Tensor) else result
    if not isinstance(outs, (tuple, list)) or not outs or \
            not all(isinstance(o, torch.Tensor) for o in outs):
        return False
    shapes = [tuple(a.shape) for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
    try:
        want = tuple(torch.broadcast_shapes(*shapes))
    except RuntimeError:
        return False
    return all(tuple(o.shape) == want for o in outs)


def pointwise_rule(op):
    """The broadcasting rule over every top-level DTensor argument; no Partial operand."""
    operands = [(i, a) for i, a in enumerate(op.args) if type(a) is TArg]
    operands += [(k, v) for k, v in op.kwargs.items() if type(v) is TArg]
    fn = picklable(op.func)  # an aten OpOverload travels by name
    decision = broadcast_rule(op, operands, "none", fn=None if fn is op.func else fn,
                              inplace=_inplace(op))
    n = len(op.out.shapes)
    return decision._replace(placements=decision.placements * n)


def _inplace(op) -> int | None:
    name = getattr(op.func, "__name__", "")
    return 0 if name.endswith("_") and not name.endswith("__") else None


def _nested_targs(obj) -> bool:
    return any(type(x) is TArg or (type(x) in (list, tuple, dict) and _nested_targs(x))
               for x in (obj.values() if type(obj) is dict else obj)) if obj else False


def derived_entry(func, targs, tkwargs, meta_args, meta_kwargs) -> Entry | None:
    """The derived Entry for a call (``meta_*``: the arguments as meta tensors), or None."""
    base = copy_base(func)
    if base is not None:
        entry = lookup(base)
        return entry._replace(name=display_name(func), family=entry.family + " (view copy)",
                              rule=_copy_rule(base, entry))
    nested = [v for v in (*targs, *tkwargs.values()) if type(v) in (list, tuple, dict)]
    if _nested_targs(nested):
        return None  # DTensors inside lists: not an elementwise call
    if not pointwise_call(func, meta_args, meta_kwargs):
        return None
    return Entry(display_name(func), "pointwise (derived)", pointwise_rule, _inplace_name(func), None,
                 ("input", "other"))


def _copy_rule(base, entry):
    """The view op's rule, planned as the view op (its meta trace follows the strides) and
    run as the copy (the ranks' outputs do not alias their inputs)."""
    def rule_fn(op):
        as_view = OpCall(entry, base, op.args, op.kwargs, op.tensors, op.mesh, op.out)
        decision = as_decision(entry.rule(as_view))
        return decision if decision.fn is not None else decision._replace(fn=op.func)
    return rule_fn


def _inplace_name(func) -> bool:
    name = getattr(func, "__name__", "")
    return name.endswith("_") and not name.endswith("__")


def copy_base(func):
    """The view op whose rule ``torch.<view>_copy`` shares (its aten operator is tagged
    ``view_copy``), or None."""
    name = getattr(func, "__name__", "")
    if not name.endswith("_copy") or getattr(torch, name, None) is not func:
        return None
    packet = getattr(torch.ops.aten, name, None)
    bases = [getattr(ns, name[:-len("_copy")], None) for ns in (torch, torch.Tensor)]
    base = next((b for b in bases if b is not None and lookup(b) is not None), None)
    if base is None or packet is None:
        return None
    tagged = any(torch.Tag.view_copy in getattr(packet, o).tags for o in packet.overloads())
    return base if tagged else None


def derived_or_raise(func, name, targs, tkwargs) -> Entry:
    """The derived Entry for a call without a hand-written rule on sharded or Partial
    inputs; else the PlacementError of a value-dependent op, or UnsupportedOpError."""
    from ..errors import UnsupportedOpError
    from .infer import to_meta
    entry = derived_entry(func, targs, tkwargs, to_meta(targs), to_meta(tkwargs))
    if entry is not None:
        return entry
    random = generic.random_error(func, targs, tkwargs)
    if random is not None:
        raise random
    if value_shapes.shape_depends_on_values(func, targs, tkwargs):
        leaves = pytree.tree_leaves((targs, tkwargs), is_leaf=lambda v: type(v) is TArg)
        raise value_shapes.refusal(name, [t for t in leaves if type(t) is TArg])
    raise UnsupportedOpError(
        f"{name} has no dtorch placement rule for sharded or Partial inputs, so it cannot "
        f"run on these DTensors. It runs when every DTensor input is Replicate "
        f"(x.redistribute(placements=[Replicate()] * mesh.ndim)); see dtorch.ops.coverage() "
        f"for the functions with rules, or gather with .to_torch() to use plain torch")
