"""Constants: plain torch tensors beside DTensors, sent once as Replicate and cached.

In ``x + mask`` with ``x`` a DTensor and ``mask`` a plain torch tensor (a causal mask,
position ids, ``torch.arange(seq)``, a rotary table), ``mask`` is a Replicate DTensor on x's
mesh and the op's own rule plans it (beside a ``Shard(0)`` x it is narrowed locally: no
collective). The controller sends it to each rank once (as ``dtorch.tensor(t,
device_mesh=mesh)`` does), when the first op using it has been planned (a refused op sends
nothing), and keeps it while its content is unchanged: the cache is keyed by
(mesh, dtype, shape, blake2b digest of the bytes); the digest is memoized per tensor object on
its version counter and data pointer, so an unchanged tensor is not even hashed again. The
cache is bounded by ``dtorch.config.constant_cache_bytes`` (least recently used out first,
their rank-side values freed). Nothing is communicated among ranks; ``constants_sent()`` and
every ``CommDebugMode`` / per-cell table count the bytes sent. A plain tensor that requires
grad, is the target of an in-place op or ``out=``, or sits on another device type than the
mesh's raises ``MixedTensorError`` (replicating it would be wrong). Example::

    >>> t = torch.ones(3)
    >>> digest(t) == digest(torch.ones(3)), digest(t) == digest(torch.zeros(3))
    (True, False)
"""

from __future__ import annotations

import hashlib
import threading
import warnings
import weakref
from collections import OrderedDict
from typing import NamedTuple

import torch

from .. import comm_debug, config
from ..errors import MixedTensorError
from ..placement import Replicate
from ..runtime import messages as m
from ..runtime import session
from ..tensor import DTensor
from ..spec import make_spec


class PlainTensor(Exception):
    """Dispatch's argument pass met a plain torch tensor (dim != 0): substitute, dispatch
    again."""


class ConstantSizeWarning(UserWarning):
    """A constant over ``dtorch.config.constant_warn_bytes`` was sent to every rank."""


class ConstantStats(NamedTuple):
    """What ``dtorch.constants_sent()`` returns (counts since start or ``clear_constants``)."""

    sends: int  # constants sent from the controller (cache misses)
    bytes_per_rank: int  # bytes each receiving rank got
    total_bytes: int  # summed over the receiving ranks
    hits: int  # uses that found their constant cached (nothing sent)
    cached: int  # entries held now
    cached_bytes: int  # their bytes (each rank holds each one whole)
    evicted: int  # entries dropped by the size bound


_INPLACE_DUNDERS = frozenset(f"__i{n}__" for n in (
    "add", "sub", "mul", "truediv", "floordiv", "div", "mod", "pow", "and", "or", "xor",
    "lshift", "rshift", "matmul")) | {"__setitem__"}
_lock = threading.RLock()
_cache: OrderedDict = OrderedDict()  # key -> (DTensor, bytes)
_memo: dict = {}  # id(tensor) -> (weakref, signature, digest)
_warned: set = set()
_owner = [None]  # the controller the cached DTensors live on
_counts = {"sends": 0, "bytes_per_rank": 0, "total_bytes": 0, "hits": 0, "evicted": 0}


def constants_sent() -> ConstantStats:
    """Constant bytes sent from the controller, cache hits and what the cache holds."""
    with _lock:
        return ConstantStats(_counts["sends"], _counts["bytes_per_rank"],
                             _counts["total_bytes"], _counts["hits"], len(_cache),
                             sum(n for _, n in _cache.values()), _counts["evicted"])


def clear_constants() -> None:
    """Drop every cached constant (the ranks free them) and zero the counts."""
    with _lock:
        _cache.clear()
        _memo.clear()
        _warned.clear()
        for k in _counts:
            _counts[k] = 0


# dispatch's entry -----------------------------------------------------------------------------
def substitute(func, args, kwargs):
    """``(args, kwargs)`` with every plain tensor (dim != 0) a cached Replicate DTensor on the
    mesh of the first DTensor, or None when no DTensor is among them. Refuses first (nothing
    sent) where a constant would be wrong."""
    dtensors, plains = [], []
    _scan((args, kwargs or {}), dtensors, plains)
    if not dtensors:
        return None
    check_plain_target(func, args)
    if not plains:
        return args, kwargs
    first = dtensors[0]
    mesh, c = first._spec.mesh, first._controller
    _check(func, args, kwargs or {}, plains, mesh)
    values = {}
    for p in plains:
        if id(p) not in values:
            values[id(p)] = constant(p, mesh, c)
    return _swap(tuple(args), values), _swap(kwargs or {}, values)


def swap_plain(func, args, kwargs):
    """``(args, kwargs)``, plain tensors substituted when DTensors are there too (ops that
    run as other DTensor ops: their own arithmetic on a plain target would stay plain)."""
    return substitute(func, args, kwargs) or (args, kwargs)


def _scan(obj, dtensors, plains) -> None:
    """The DTensors and plain tensors where dispatch looks for them (lists, tuples, dicts)."""
    t = type(obj)
    if t is DTensor or isinstance(obj, DTensor):
        dtensors.append(obj)
    elif isinstance(obj, torch.Tensor):
        if obj.dim() != 0:
            plains.append(obj)
    elif t is list or t is tuple:
        for x in obj:
            _scan(x, dtensors, plains)
    elif t is dict:
        for x in obj.values():
            _scan(x, dtensors, plains)


def _swap(obj, values):
    t = type(obj)
    if isinstance(obj, torch.Tensor):
        return values.get(id(obj), obj)
    if t is list or t is tuple:
        out = [_swap(x, values) for x in obj]
        return out if t is list else tuple(out)
    if t is dict:
        return {k: _swap(v, values) for k, v in obj.items()}
    return obj


def _check(func, args, kwargs, plains, mesh) -> None:
    """MixedTensorError where replicating a plain tensor would be wrong."""
    from .registry import display_name
    out = kwargs.get("out")
    if isinstance(out, torch.Tensor) or (type(out) in (list, tuple) and any(
            isinstance(o, torch.Tensor) for o in out)):
        name = display_name(func)
        raise MixedTensorError(f"{name}: out= is a plain torch.Tensor, but the result is a "
                               f"DTensor; use the returned DTensor (y = {name}(...))")
    targets = args[0] if args and type(args[0]) in (list, tuple) else args[:1]
    for target in targets:  # torch._foreach_add_([plain, ...], [dtensor, ...]) too
        if isinstance(target, torch.Tensor) and _inplace(func):
            _refuse_plain_target(func, target)
    for p in plains:
        if p.requires_grad and torch.is_grad_enabled():
            name = display_name(func)
            what = "a torch.nn.Parameter" if isinstance(p, torch.nn.Parameter) else \
                "a plain torch.Tensor"
            raise MixedTensorError(
                f"{name}: {what} of shape {tuple(p.shape)} that requires grad met DTensors; "
                f"as a constant its gradient would be lost. Convert its module with "
                f"dtorch.parallelize_module(module, mesh, plan) or dtorch.distribute_module("
                f"module, mesh), or make it a DTensor: dtorch.tensor(t, device_mesh=mesh, "
                f"placements=[...], requires_grad=True)")
        if p.device.type != mesh.device_type:
            name = display_name(func)
            raise MixedTensorError(
                f"{name}: a plain torch.Tensor of shape {tuple(p.shape)} on {p.device} met "
                f"DTensors on a {mesh.device_type!r} mesh; move it first: "
                f"t.to({mesh.device_type!r}), or make it a DTensor: dtorch.tensor(t, "
                f"device_mesh=mesh, placements=[...])")
        if p.layout != torch.strided:
            name = display_name(func)
            raise MixedTensorError(f"{name}: a plain {p.layout} tensor met DTensors; constants "
                                   f"are dense: pass t.to_dense()")


def check_plain_target(func, args) -> None:
    """MixedTensorError when an in-place op's target is a plain tensor (0-dim too: it is no
    scalar operand there; ``total.add_(loss)`` would change ``loss``)."""
    if args and isinstance(args[0], torch.Tensor) and _inplace(func):
        _refuse_plain_target(func, args[0])


def _refuse_plain_target(func, target) -> None:
    from .registry import display_name
    name = display_name(func)
    raise MixedTensorError(
        f"{name}: the in-place target is a plain torch.Tensor of shape {tuple(target.shape)} "
        f"and the other operands are DTensors; a constant copy (or the DTensor) would be "
        f"changed, not your tensor. Make it a DTensor first: t = dtorch.tensor(t, "
        f"device_mesh=mesh, placements=[...]), or use the out-of-place op (t = t + x)")


def _inplace(func) -> bool:
    from .registry import lookup
    entry = lookup(func)
    if entry is not None and entry.inplace:
        return True
    name = getattr(func, "__name__", "")
    return (name.endswith("_") and not name.endswith("__")) or name in _INPLACE_DUNDERS


# the cache ------------------------------------------------------------------------------------
def constant(t: torch.Tensor, mesh, c) -> DTensor:
    """The Replicate DTensor holding ``t`` on ``mesh``: cached, or a new one that is sent when
    an op that uses it is planned (so a call that raises sends nothing)."""
    d = digest(t)
    key = (mesh, t.dtype, tuple(t.shape), d)
    with _lock:
        if _owner[0] is not c:  # a new cluster: the old entries are gone with it
            _cache.clear()
            _owner[0] = c
        hit = _cache.get(key)
        if hit is not None:
            _cache.move_to_end(key)
            _counts["hits"] += 1
            return _private(hit[0])
        # a copy: what is sent must be what was digested, whatever the caller does to t
        value = t.detach().resolve_conj().resolve_neg().cpu().clone()
        out = _unsent(value, mesh, c)
        nbytes = value.numel() * value.element_size()
        bound = config.constant_cache_bytes
        if nbytes <= bound:
            _cache[key] = (out, nbytes)
            _evict(bound)
            return _private(out)
        return out


def _cached_live(c) -> int:
    """How many of controller ``c``'s live DTensors are cached constants (sent ones)."""
    with _lock:
        if _owner[0] is not c:
            return 0
        return sum(1 for out, _ in _cache.values() if type(out) is DTensor)


session.cache_holders.append(_cached_live)


def _private(cached: DTensor) -> DTensor:
    """A rank-local copy of a cached constant for one use (made when its op is issued; no
    bytes sent): an op's output may alias its input (``t.view_as(x)``, ``t.type_as(x)``),
    and an in-place op on that output must not change what every later use reads."""
    obj = _Copy.__new__(_Copy)
    obj._spec, obj._controller, obj._tid, obj._ag, obj._version = (
        cached._spec, cached._controller, None, None, None)
    key = id(obj)
    _copies[key] = (cached._controller.new_tid(), cached,
                    weakref.finalize(obj, _copies.pop, key, None))
    return obj


class _Copy(DTensor):
    """A use of a cached constant, copied on the ranks when dispatch calls ``_live()`` (after
    the op's plan is made, before it is issued); then a plain DTensor."""

    __slots__ = ()

    def _live(self):
        return _copy_live(self)


_copies: dict = {}  # id(_Copy) -> (tid, the cached DTensor, finalizer)


def _claim(obj, cls, table):
    """The pending entry of an unsent constant or copy being made live (its finalizer off), or
    None: another thread made it meanwhile, or its cluster is gone (then ``DTensor._live``
    returns the controller or raises FreedTensorError, naming why)."""
    if type(obj) is not cls:
        return None
    c = obj._controller
    entry = table.pop(id(obj), None)
    if entry is None or c.closed or c is not session._controller:
        obj._controller = None
        return None
    entry[-1].detach()
    return entry


def _copy_live(obj: _Copy):
    """Copy the cached constant into this use's id on the ranks (sending it first if it was
    never sent); then it is a DTensor."""
    with _lock:
        entry = _claim(obj, _Copy, _copies)
        if entry is None:
            return DTensor._live(obj)
        c = obj._controller
        tid, cached, _ = entry
        cached._live()  # an unsent constant: its Load goes first
        c.issue(m.Call((tid,), torch.clone, (m.Ref(cached._tid),), {}, cached._spec.mesh.ranks))
        c.live_tensors += 1
        obj._tid = tid
        obj.__class__ = DTensor
        return c


class _Unsent(DTensor):
    """A constant not sent yet. Dispatch calls ``_live()`` on its inputs once the op's plan is
    made, before the op is issued: that sends it (its ``Load`` goes first) and it becomes a
    plain DTensor."""

    __slots__ = ()

    def _live(self):
        return _load(self)


_pending: dict = {}  # id(_Unsent) -> (tid, value, finalizer)


def _unsent(value, mesh, c) -> DTensor:
    obj = _Unsent.__new__(_Unsent)
    obj._spec = make_spec(tuple(value.shape), value.dtype, mesh, (Replicate(),) * mesh.ndim)
    obj._tid, obj._controller, obj._ag, obj._version = None, c, None, None
    key = id(obj)
    _pending[key] = (c.new_tid(), value, weakref.finalize(obj, _pending.pop, key, None))
    return obj


def tid_of(x: DTensor):
    """The id a DTensor's shards have (or will have once sent or copied: a constant's)."""
    if x._tid is not None:
        return x._tid
    table = _pending if type(x) is _Unsent else _copies if type(x) is _Copy else None
    entry = table.get(id(x)) if table is not None else None
    return entry[0] if entry is not None else None


def _load(obj: _Unsent):
    """Send an unsent constant to each rank of its mesh (from the controller, as
    ``dtorch.tensor(t, device_mesh=mesh)`` does), count it; then it is a DTensor."""
    with _lock:
        entry = _claim(obj, _Unsent, _pending)
        if entry is None:
            return DTensor._live(obj)
        c = obj._controller
        tid, value, _ = entry
        mesh = obj._spec.mesh
        nbytes = value.numel() * value.element_size()
        _warn_if_big(value, nbytes)
        c.ensure_mesh(mesh)
        for rank in mesh.ranks:  # Replicate: every rank holds the whole value
            c.stage(rank, tid, value)
        c.issue(m.Load(tid, mesh.ranks))
        c.live_tensors += 1
        obj._tid = tid
        obj.__class__ = DTensor
        _counts["sends"] += 1
        _counts["bytes_per_rank"] += nbytes
        _counts["total_bytes"] += nbytes * len(mesh.ranks)
        comm_debug.record_constant(nbytes, len(mesh.ranks))
        return c


def _evict(bound: int) -> None:
    total = sum(n for _, n in _cache.values())
    while total > bound and _cache:
        _, (_, n) = _cache.popitem(last=False)  # the DTensor's __del__ frees it on the ranks
        total -= n
        _counts["evicted"] += 1


def _warn_if_big(t, nbytes: int) -> None:
    shape = tuple(t.shape)
    if nbytes <= config.constant_warn_bytes or shape in _warned:
        return
    _warned.add(shape)
    warnings.warn(
        f"dtorch: a plain torch.Tensor of shape {shape} ({t.dtype}, {nbytes / 2**20:.1f} MiB) "
        f"met DTensors and is sent whole to every rank as a Replicate constant (over "
        f"dtorch.config.constant_warn_bytes); make it a DTensor instead, sharded so each rank "
        f"gets its part: dtorch.tensor(t, device_mesh=mesh, placements=[Shard(0)])",
        ConstantSizeWarning, stacklevel=7)


# digests --------------------------------------------------------------------------------------
ALWAYS_HASHED = 4096  # bytes: smaller tensors are hashed at every use, never memoized


def digest(t: torch.Tensor) -> bytes:
    """blake2b of ``t``'s bytes; for a tensor over :data:`ALWAYS_HASHED` bytes memoized per
    object while its version counter, data pointer and strides are unchanged (``t.add_(1)``
    bumps the version: hashed again; a write through ``t.data`` or a NumPy view of a large
    tensor does not, and is not seen: change it through torch, or pass a new tensor)."""
    try:
        version = t._version
    except (RuntimeError, AttributeError):  # inference tensors have no version counter
        version = None
    sig = (version, t.data_ptr(), t.shape, t.stride())  # data_ptr includes the offset
    if t.numel() * t.element_size() <= ALWAYS_HASHED:  # writes via t.data / NumPy: seen
        return hashlib.blake2b(_bytes(t), digest_size=16).digest()
    key = id(t)
    memo = _memo.get(key)
    if memo is not None and memo[0]() is t and memo[1] == sig:
        return memo[2]
    d = hashlib.blake2b(_bytes(t), digest_size=16).digest()
    if version is not None:
        with _lock:
            if len(_memo) > 8192:
                _memo.clear()
            _memo[key] = (weakref.ref(t, lambda r, k=key: _forget(k, r)), sig, d)
    return d


def _forget(key, ref) -> None:
    memo = _memo.get(key)
    if memo is not None and memo[0] is ref:
        _memo.pop(key, None)


def _bytes(t: torch.Tensor):
    flat = t.detach().resolve_conj().resolve_neg().cpu().contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy() if flat.numel() else b""


__all__ = ["constants_sent", "clear_constants", "ConstantStats", "ConstantSizeWarning"]
