"""Dispatch: a torch call on DTensors -> one ``Call`` instruction and DTensor handles.

``DTensor.__torch_function__``, the operator dunders and ``dtorch.<name>`` all end here. A
call is keyed by (function, input specs, non-tensor arguments); the first call with a key
infers output shapes on ``meta``, runs the placement rule and stores a :class:`Plan`; later
calls only fill the plan in (a few microseconds). Nothing waits for the workers and no
collective is issued. Example::

    y = dispatch(torch.add, None, (x, 1.0))     # what ``x + 1.0`` and ``torch.add(x, 1.0)`` do
"""

from __future__ import annotations

import math
from typing import Callable, NamedTuple

import torch
import torch.utils._pytree as pytree

from .. import comm_debug
from ..autograd.record import NOT_RECORDED, record_call, wants_grad
from ..errors import PlacementError, UnsupportedOpError
from ..runtime import messages as m
from ..runtime import session
from ..tensor import DTensor
from ..spec import make_spec
from ..placement import Replicate
from . import constants, derived, generic, value_shapes
from .infer import Outputs, describe, rebuild, to_meta, to_zeros
from .registry import DECOMPOSED as _DECOMPOSED
from .registry import DECOMPOSED_WHEN as _DECOMPOSED_WHEN
from .registry import PREP as _PREP
from .registry import OpCall, TArg, as_decision, display_name, lookup, prep_call

_CACHE_MAX = 50_000
_NOCACHE = object()
_new_tuple = tuple.__new__
_Ref, _Call = m.Ref, m.Call


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


_cache: dict = {}


def clear_cache() -> None:
    """Forget every cached plan (rules changed, or for measuring first-call cost)."""
    _cache.clear()


# the hot path ------------------------------------------------------------------------------------
def _prep(a, key: list, tensors: list):
    """The call-side value of one argument (a Ref for a DTensor); extends the cache key."""
    t = type(a)
    if t is DTensor:
        tensors.append(a)
        key.append(a._spec)
        return _new_tuple(_Ref, (a._tid,))
    if t is int or t is float or t is bool:
        key.append(t)
        key.append(a if a == a else _NOCACHE)
        return a
    if a is None or t is str or t is torch.dtype:
        key.append(a)
        return a
    if t is tuple or t is list or t is torch.Size:
        key.append(t)
        key.append(len(a))
        out = [_prep(x, key, tensors) for x in a]
        return out if t is list else tuple(out)
    return _prep_other(a, key, tensors)


def _prep_other(a, key, tensors):
    if isinstance(a, DTensor):  # a constant not sent yet too: its Load goes before the call
        tensors.append(a)
        key.append(a._spec)
        return _new_tuple(_Ref, (constants.tid_of(a),))
    if type(a) is slice:
        if any(isinstance(v, DTensor) for v in (a.start, a.stop, a.step)):
            raise TypeError("slice bounds must be ints, not DTensors; use int(t) or t.item()")
        key.append(slice)
        key.append(a.start)
        key.append(a.stop)
        key.append(a.step)
        return a
    if isinstance(a, torch.Tensor):
        if a.dim() != 0:  # beside DTensors a Replicate constant: see dtorch.ops.constants
            raise constants.PlainTensor
        key.append(torch.Tensor)
        key.append(a.dtype)
        key.append(a.item())  # cached plans replay their arguments: the value is part of it
        return a
    if isinstance(a, dict):
        key.append(dict)
        return {k: _prep(v, key, tensors) for k, v in a.items()}
    try:
        hash(a)
    except TypeError:
        key.append(_NOCACHE)
        return a
    key.append(type(a))
    key.append(a)
    return a


def dispatch(func, types, args=(), kwargs=None):
    """Run ``func(*args, **kwargs)`` where some arguments are DTensors (see module doc).

    The signature of ``__torch_function__`` (``types`` is not used: every argument type is
    read from ``args``)."""
    if not kwargs and len(args) == 2 and type(args[0]) is DTensor:
        plan = _fast_binary(func, args)
        if plan is not None:
            return plan
    return _dispatch(func, args, kwargs)


def _fast_binary(func, args):
    """``x <op> y`` / ``x <op> 2.0`` with a cached plan that uses the call's own arguments."""
    a, b = args
    tb = type(b)
    c = a._controller
    if tb is DTensor:
        key = (func, a._spec, b._spec)
        if b._controller is not c or b._tid is None:
            b._live()
        cargs = (_new_tuple(_Ref, (a._tid,)), _new_tuple(_Ref, (b._tid,)))
    elif (tb is float or tb is int) and b == b:
        key = (func, a._spec, tb, b)
        cargs = (_new_tuple(_Ref, (a._tid,)), b)
    else:
        return None
    plan = _cache.get(key)
    if plan is None or not plan.simple or a._ag is not None or (tb is DTensor and
                                                                 b._ag is not None):
        return None  # autograd state: the full path decides whether to record
    if c is not session._controller or a._tid is None:
        a._live()
    tid = c.new_tid()
    c.issue(_new_tuple(_Call, ((tid,), plan.fn, cargs, {}, plan.ranks)))
    return _wrap(plan.out_specs[0], tid, c)


def _decomposes(func, args, kwargs) -> bool:
    """Whether the decomposed form takes this call (its ``when`` test; see registry)."""
    when = _DECOMPOSED_WHEN.get(func)
    return when is None or when(args, kwargs or {})


def _dispatch(func, args, kwargs=None):
    if func in _DECOMPOSED and _decomposes(func, args, kwargs):  # runs as other DTensor ops
        result = _DECOMPOSED[func](func, *constants.swap_plain(func, args, kwargs or {}))
        if result is not NotImplemented:
            return result
    if func in _PREP:  # index/size values given as tensors (tensor_split's indices) -> ints
        args, kwargs = prep_call(func, args, kwargs)
    key = [func]
    tensors: list = []
    cargs = []
    try:
        for a in args:  # the common argument types inline; the rest through _prep
            t = type(a)
            if t is DTensor:
                tensors.append(a)
                key.append(a._spec)
                cargs.append(_new_tuple(_Ref, (a._tid,)))
            elif t is float or t is int:
                key.append(t)
                key.append(a if a == a else _NOCACHE)
                cargs.append(a)
            else:
                cargs.append(_prep(a, key, tensors))
        ckwargs = {}
        if kwargs:
            for k, v in kwargs.items():
                key.append(k)
                ckwargs[k] = _prep(v, key, tensors)
    except constants.PlainTensor:
        tensors = key = None
    if not tensors:
        if key is None:  # plain tensors: cached Replicate constants, then dispatch again
            return _with_constants(func, args, kwargs)
        return func(*args, **(kwargs or {}))
    key = tuple(key)
    plan = _cache.get(key)
    if plan is None:
        plan = _plan(func, args, kwargs or {}, tensors, key)
    c = tensors[0]._controller
    for t in tensors:
        if t._controller is not c or t._tid is None:
            t._live()
    if c is not session._controller:
        tensors[0]._live()
    if wants_grad(tensors):  # some input requires grad: record a node, keep the local graph
        out = record_call(c, func, plan, key, args, kwargs or {}, tensors, cargs, ckwargs,
                          _fill, _fill_kwargs)
        if out is not NOT_RECORDED:
            return out
    outputs = plan.outputs
    if outputs.kind == "value":
        return outputs.value
    if outputs is EAGER:
        return generic.run_eager(c, plan.fn, cargs, ckwargs, tensors[0]._spec.mesh, _eager_wrap(
            tensors[0]._spec.mesh, c))
    if plan.args is not None:
        cargs = _fill(plan.args, tensors)
        ckwargs = _fill_kwargs(plan.kwargs, tensors)
        if type(plan.fn) is m.CompositePlan:  # a composite op: the ledger counts its steps
            comm_debug.record_steps(plan.fn.collectives)
    if plan.inplace is not None:
        target = tensors[plan.inplace]
        c.issue(_new_tuple(_Call, ((target._tid,), plan.fn, tuple(cargs), ckwargs, plan.ranks)))
        if target._version is not None:  # a node saved it: its backward checks the version
            target._version[0] += 1
        return target
    specs = plan.out_specs
    if len(specs) == 1:
        tid = c.new_tid()
        c.issue(_new_tuple(_Call, ((tid,), plan.fn, tuple(cargs), ckwargs, plan.ranks)))
        out = _wrap(specs[0], tid, c)
        return out if outputs.kind == "one" else rebuild(outputs, [out])
    tids = tuple(c.new_tid() for _ in specs)
    c.issue(_new_tuple(_Call, (tids, plan.fn, tuple(cargs), ckwargs, plan.ranks)))
    return rebuild(outputs, [_wrap(s, t, c) for s, t in zip(specs, tids)])


def _with_constants(func, args, kwargs):
    """The call with its plain tensors as cached Replicate constants (dtorch.ops.constants),
    or plain torch when no DTensor is among the arguments."""
    swapped = constants.substitute(func, args, kwargs)
    if swapped is None:
        return func(*args, **(kwargs or {}))
    return dispatch(func, None, *swapped)


def plan_of(func, args, kwargs=None) -> Plan:
    """The plan a call would run, from the cache or planned now; nothing is issued, and it
    raises what the call would raise (a rule's PlacementError). Example::

        plan_of(torch.mul, (x, y)).out_specs[0].placements     # (Shard(0),)
    """
    args, kwargs = prep_call(func, tuple(args), kwargs or {})
    kwargs = kwargs or {}
    key, tensors = [func], []
    try:
        for a in args:
            _prep(a, key, tensors)
        for k, v in kwargs.items():
            key.append(k)
            _prep(v, key, tensors)
    except constants.PlainTensor:
        key = None
    if key is None:  # as the call would see them: cached Replicate constants
        swapped = constants.substitute(func, args, kwargs)
        if swapped is None:
            raise TypeError("plan_of needs a DTensor among the arguments")
        return plan_of(func, *swapped)
    key = tuple(key)
    return _cache.get(key) or _plan(func, args, kwargs, tensors, key)


_wrap = DTensor._wrap
EAGER = Outputs((), (), "eager")  # the outputs depend on the values: run now, then wrap


def _eager_wrap(mesh, c):
    replicate = (Replicate(),) * mesh.ndim
    return lambda shape, dtype, tid: _wrap(make_spec(shape, dtype, mesh, replicate), tid, c)


def _fill(template, tensors):
    out = []
    for x in template:
        if type(x) is TArg:
            out.append(_new_tuple(_Ref, (tensors[x.index]._tid,)))
        elif type(x) is list:
            out.append([_new_tuple(_Ref, (tensors[y.index]._tid,)) if type(y) is TArg else y
                        for y in x])
        else:
            out.append(x)
    return out


def _fill_kwargs(template, tensors):
    if not template:
        return {}
    return {k: (_new_tuple(_Ref, (tensors[v.index]._tid,)) if type(v) is TArg else v)
            for k, v in template.items()}


# the first call of a signature --------------------------------------------------------------------
def _plan(func, args, kwargs, tensors, key) -> Plan:
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
        return _store(key, _replicated_plan(func, targs, tkwargs, flat, mesh))
    try:
        return _store(key, _ruled_plan(entry, func, targs, tkwargs, flat, mesh))
    except PlacementError:
        if not generic.all_replicate(flat):
            raise
    except value_shapes.ValueDependentShape:  # x[x > 0], torch.where(x > 0)
        if not generic.all_replicate(flat):
            raise value_shapes.refusal(name, flat) from None
    return _store(key, _replicated_plan(func, targs, tkwargs, flat, mesh))


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


def _store(key, plan):
    if _NOCACHE not in key:
        if len(_cache) >= _CACHE_MAX:
            _cache.clear()
        _cache[key] = plan
    return plan


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


__all__ = ["dispatch", "clear_cache", "UnsupportedOpError", "Plan"]
