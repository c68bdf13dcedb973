"""Dispatch: a torch call on DTensors -> one ``Call`` instruction and DTensor handles.

``DTensor.__torch_function__``, the operator dunders and ``dtorch.<name>`` all end here. A
call is keyed by (function, input specs, non-tensor arguments); the first call with a key
is planned by ``signature_plan.py`` (output shapes on ``meta``, the placement rule) and its
:class:`Plan` cached here; later calls only fill it in (a few microseconds). Nothing waits
for the workers and no collective is issued. Example::

    y = dispatch(torch.add, None, (x, 1.0))     # what ``x + 1.0`` and ``torch.add(x, 1.0)`` do
"""

from __future__ import annotations

import torch

from .. import comm_debug
from ..autograd.record import NOT_RECORDED, record_call, wants_grad
from ..errors import UnsupportedOpError
from ..runtime import messages as m
from ..runtime import session
from ..tensor import DTensor
from ..spec import make_spec
from ..placement import Replicate
from . import constants, generic
from .infer import rebuild
from .registry import DECOMPOSED as _DECOMPOSED
from .registry import DECOMPOSED_WHEN as _DECOMPOSED_WHEN
from .registry import PREP as _PREP
from .registry import TArg, display_name, prep_call
from .signature_plan import EAGER, Plan, plan_signature

_CACHE_MAX = 50_000
_NOCACHE = object()
_new_tuple = tuple.__new__
_Ref, _Call = m.Ref, m.Call


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
        with comm_debug.origin(lambda: display_name(func)):
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
        plan = _store(key, plan_signature(func, args, kwargs or {}, tensors))
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
            comm_debug.record_steps(plan.fn.collectives, display_name(func))
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
    return _cache.get(key) or _store(key, plan_signature(func, args, kwargs, tensors))


_wrap = DTensor._wrap


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


def _store(key, plan):
    if _NOCACHE not in key:
        if len(_cache) >= _CACHE_MAX:
            _cache.clear()
        _cache[key] = plan
    return plan


__all__ = ["dispatch", "clear_cache", "UnsupportedOpError", "Plan"]
