"""Planning a call signature the first time dispatch sees it: output shapes and dtypes
inferred on ``meta`` (torch's own error from small cpu tensors when meta words it
differently), the op's placement rule (a dedicated one, a derived one, or every rank running
the op when all inputs are Replicate), and the in-place and layout checks. Cold path: the
:class:`~dtorch.ops.dispatch.Plan` it returns is cached by ``dispatch``. Example::

    plan = plan_signature(torch.add, (x, 1.0), {}, [x])   # plan.out_specs[0].placements
"""

from __future__ import annotations

import math
from typing import Callable, NamedTuple

import torch
import torch.utils._pytree as pytree

from ..errors import PlacementError, UnsupportedOpError
from ..placement import Replicate
from ..spec import make_spec
from ..tensor import DTensor
from . import constants, derived, generic, value_shapes
from .infer import Outputs, describe, to_meta, to_zeros
from .registry import OpCall, TArg, as_decision, display_name, lookup


class Plan(NamedTuple):
    """What one cached call signature does: output specs, the local function, the argument
    template (None: the call's own arguments), the ranks, how to rebuild the result."""

    out_specs: tuple
    fn: Callable
    args: tuple | None
    kwargs: dict | None
    ranks: tuple
    outputs: Outputs
    inplace: int | None
    simple: bool = False  # one new output, the call's own arguments: the fast path applies


EAGER = Outputs((), (), "eager")  # the outputs depend on the values: run now, then wrap


def plan_signature(func, args, kwargs, tensors) -> Plan:
    """The plan of a call signature seen for the first time (dispatch caches it): output
    shapes inferred on ``meta``, the op's rule (or a derived one, or every rank running it
    on Replicate inputs), in-place and layout checks; raises what the user must change."""
    entry = lookup(func)
    name = entry.name if entry is not None else display_name(func)
    if "out" in kwargs and kwargs["out"] is not None:
        raise TypeError(f"{name}: out= is not supported on DTensors; use the returned DTensor")
    constants.check_plain_target(func, args)
    plain = _has_plain_tensors((args, kwargs))  # beyond the constants scan (other containers)
    counter = iter(range(len(tensors)))
    labels = entry.arg_names if entry is not None else ("input", "other")
    targs = tuple(_targ(a, labels[i] if i < len(labels) else f"arg{i}", counter)
                  for i, a in enumerate(args))
    tkwargs = {k: _targ(v, k, counter) for k, v in kwargs.items()}
    flat = _flatten_targs((targs, tkwargs))
    if entry is None and not generic.all_replicate(tensors):
        entry = derived.derived_or_raise(func, name, targs, tkwargs)
    mesh = flat[0].mesh
    for t in flat[1:]:
        if t.mesh != mesh:
            raise PlacementError(
                f"{name}: inputs live on different meshes: {flat[0].label} on {mesh}, "
                f"{t.label} on {t.mesh}. Move one with x.redistribute(device_mesh=...) (same "
                f"mesh shape), or make both on one mesh")
    if entry is None or plain:
        return _replicated_plan(func, targs, tkwargs, flat, mesh)
    try:
        return _ruled_plan(entry, func, targs, tkwargs, flat, mesh)
    except PlacementError:
        if not generic.all_replicate(flat):
            raise
    except value_shapes.ValueDependentShape:  # x[x > 0], torch.where(x > 0)
        if not generic.all_replicate(flat):
            raise value_shapes.refusal(name, flat) from None
    return _replicated_plan(func, targs, tkwargs, flat, mesh)


def _ruled_plan(entry, func, targs, tkwargs, flat, mesh) -> Plan:
    """The plan a dedicated rule gives."""
    result = _infer(entry.meta or func, targs, tkwargs)
    _refuse_layouts(func, result)
    outputs = describe(result)
    if outputs.kind == "value":
        return Plan((), func, None, None, mesh.ranks, outputs, None)
    op = OpCall(entry, func, targs, tkwargs, tuple(flat), mesh, outputs)
    decision = as_decision(entry.rule(op))
    if len(decision.placements) != len(outputs.shapes):
        raise AssertionError(f"rule for {entry.name} gave {len(decision.placements)} outputs; "
                             f"torch returns {len(outputs.shapes)}")
    specs = tuple(make_spec(s, d, mesh, p)
                  for s, d, p in zip(outputs.shapes, outputs.dtypes, decision.placements))
    inplace = decision.inplace if decision.inplace is not None else (0 if entry.inplace else None)
    if inplace is not None:
        _check_inplace(op, flat[inplace], specs)
    simple = decision.args is None and outputs.kind == "one" and inplace is None
    return Plan(specs, generic.picklable(decision.fn or func), decision.args, decision.kwargs,
                mesh.ranks, outputs, inplace, simple)


def _replicated_plan(func, targs, tkwargs, flat, mesh) -> Plan:
    """Every input is Replicate: every rank runs ``func`` on whole tensors, outputs are
    Replicate (see :mod:`dtorch.ops.generic`); eager when the outputs depend on values."""
    random = generic.random_error(func, targs, tkwargs)
    if random is not None:
        raise random
    outputs = _infer_replicated(func, targs, tkwargs)
    if outputs is None or outputs.kind == "value":
        return Plan((), generic.picklable(func), None, None, mesh.ranks, EAGER, None)
    replicate = (Replicate(),) * mesh.ndim
    specs = tuple(make_spec(s, d, mesh, replicate)
                  for s, d in zip(outputs.shapes, outputs.dtypes))
    inplace = _generic_inplace(func, flat, specs)
    return Plan(specs, generic.picklable(func), None, None, mesh.ranks, outputs, inplace,
                outputs.kind == "one" and inplace is None)


def _infer_replicated(func, targs, tkwargs) -> Outputs | None:
    """Outputs inferred on meta, or None when they depend on the values (meta cannot run the
    op, or it returns no tensor, or a mix of tensors and other values). An op that fails on
    zero stand-ins and on ones is the user's error, raised here; one that fails only on zeros
    (``torch.cov``'s weights must not sum to zero) depends on values and runs eagerly."""
    margs, mkwargs = _plain_to_meta(to_meta(targs)), _plain_to_meta(to_meta(tkwargs))
    try:
        result = func(*margs, **mkwargs)
    except Exception:  # noqa: BLE001 - a real error shows on the cpu stand-ins
        error = _cpu_error(func, targs, tkwargs)
        if error is not None and _cpu_error(func, targs, tkwargs, fill=torch.ones) is not None:
            raise error from None
        return None
    _refuse_layouts(func, result)
    try:
        return describe(result)
    except TypeError:  # tensors mixed with other values: the eager path unpacks them
        return None


def _refuse_layouts(func, result) -> None:
    for t in pytree.tree_leaves(result):
        if isinstance(t, torch.Tensor) and t.layout != torch.strided:
            generic.refuse_layout(func, t.layout)


def _plain_to_meta(obj):
    """Plain torch tensors (constants beside Replicate DTensors) as meta tensors."""
    return pytree.tree_map(lambda t: t.to("meta") if isinstance(t, torch.Tensor) and
                           t.device.type != "meta" else t, obj)


def _has_plain_tensors(obj) -> bool:
    return any(isinstance(t, torch.Tensor) and t.dim() != 0 for t in pytree.tree_leaves(obj))


def _generic_inplace(func, flat, specs) -> int | None:
    """``x.addmv_(...)``: a trailing underscore mutates the first DTensor input."""
    name = getattr(func, "__name__", "")
    if not (name.endswith("_") and not name.endswith("__")) or not flat:
        return None
    target = flat[0]
    if len(specs) != 1 or specs[0].shape != target.shape or specs[0].dtype != target.dtype:
        raise UnsupportedOpError(f"{display_name(func)}: in-place ops that change the shape or "
                                 f"dtype of a DTensor are not supported; use the out-of-place "
                                 f"op")
    return 0


def _infer(fn, targs, tkwargs):
    """Run ``fn`` on meta tensors; on an error, show the message torch gives on cpu."""
    try:
        return fn(*to_meta(targs), **to_meta(tkwargs))
    except Exception:  # noqa: BLE001 - re-raised below
        cpu_error = _cpu_error(fn, targs, tkwargs)
        if cpu_error is not None:
            raise cpu_error from None
        if value_shapes.shape_depends_on_values(fn, targs, tkwargs):
            raise value_shapes.ValueDependentShape() from None
        raise


def _cpu_error(fn, targs, tkwargs, limit: int = 1 << 20, fill=torch.zeros):
    """The exception ``fn`` raises on small cpu tensors of the same shapes filled by ``fill``
    (meta kernels word some errors differently), or None when it does not raise or is too
    big."""
    flat = _flatten_targs((targs, tkwargs))
    if sum(math.prod(t.shape) for t in flat) > limit:
        return None
    try:
        fn(*to_zeros(targs, fill), **to_zeros(tkwargs, fill))
    except Exception as exc:  # noqa: BLE001
        return exc
    return None


def _check_inplace(op, target: TArg, specs) -> None:
    spec = specs[0]
    if len(specs) != 1 or spec.shape != target.shape or spec.dtype != target.dtype:
        raise TypeError(f"{op.name}: in-place ops that change the shape or dtype of a DTensor "
                        f"are not supported; use the out-of-place op")
    if spec.placements != target.placements:
        from .explain import code_placements
        raise PlacementError(
            f"{op.name}: an in-place op cannot change placements, but {target.label} "
            f"{code_placements(target.placements)} would become "
            f"{code_placements(spec.placements)}. Use the out-of-place op, or redistribute "
            f"{target.label} first: {target.label}.redistribute(placements="
            f"{code_placements(spec.placements)})")


def _targ(a, label, counter):
    if isinstance(a, DTensor):
        return TArg(next(counter), label, a._spec)
    if type(a) is list or type(a) is tuple:
        out = [_targ(x, f"{label}[{j}]", counter) for j, x in enumerate(a)]
        return out if type(a) is list else tuple(out)
    if type(a) is dict:
        return {k: _targ(v, f"{label}[{k!r}]", counter) for k, v in a.items()}
    return a


def _flatten_targs(obj, out=None) -> list:
    out = [] if out is None else out
    if type(obj) is TArg:
        out.append(obj)
    elif type(obj) in (list, tuple):
        for x in obj:
            _flatten_targs(x, out)
    elif type(obj) is dict:
        for x in obj.values():
            _flatten_targs(x, out)
    return out
