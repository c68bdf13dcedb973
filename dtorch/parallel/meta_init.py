"""Initialising ``meta``-device parameters on the ranks with torch.nn's own init distributions.

A module built under ``torch.device("meta")`` has shapes but no values. Its own
``reset_parameters()`` (torch.nn's init code, unchanged) runs once on the meta tensors while a
dispatch mode records what it does to each: ``uniform_(a, b)`` (kaiming / xavier uniform),
``normal_(mean, std)``, ``fill_(v)`` / ``zero_()``, fills of an indexed part (an
Embedding's ``padding_idx`` row), and ``copy_`` of a real tensor (a rotary table). The recipe
is then replayed on the ranks, shard by shard (``dtorch.nn.init``), so no full tensor is made
on the controller (a copied value is sent shard by shard). A Hugging Face transformers model
has no ``reset_parameters`` on its own modules: its ``_init_weights(module)`` (what
``from_config`` runs) is each module's init. A meta tensor whose module has no init or whose
init does something else (``trunc_normal_``, ``orthogonal_``) is refused before anything is
sent. Example::

    with torch.device("meta"):
        lin = torch.nn.Linear(8, 4)
    recipes = record_inits(lin)       # {id(lin.weight): Recipe(('uniform', -b, b), ()), ...}
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ..errors import DTorchError

_aten = torch.ops.aten
_VIEWS = {_aten.select.int: "select", _aten.slice.Tensor: "slice"}


class MetaInitError(DTorchError, ValueError):
    """A meta-device parameter whose torch.nn init dtorch cannot replay on the ranks."""


class Recipe(NamedTuple):
    """How to make one tensor: a whole-tensor draw, then fills of indexed parts."""

    draw: tuple  # ("uniform", low, high) | ("normal", mean, std) | ("fill", v) | ("value", t)
    fills: tuple = ()        # ((index, value), ...): ``t[index] = value`` after the draw


def _arg(args, kwargs, pos, name, default):
    return args[pos] if len(args) > pos else kwargs.get(name, default)


class _Recorder(TorchDispatchMode):
    def __init__(self, tracked: dict[int, str]):
        super().__init__()
        self.tracked = tracked            # id(tensor) -> its name
        self.draws: dict[int, tuple] = {}
        self.fills: dict[int, list] = {}
        self.views: dict[int, tuple] = {}  # id(view) -> (id(base), select/slice chain)
        self.ndims: dict[int, int] = {}
        self.keep: list = []               # views stay alive so their ids stay unique
        self.bad: dict[int, str] = {}

    def _target(self, t):
        if id(t) in self.tracked:
            self.ndims[id(t)] = t.dim()
            return id(t), None
        return self.views.get(id(t), (None, None))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if not args or not isinstance(args[0], torch.Tensor):
            return out
        base, index = self._target(args[0])
        if base is None:
            return out
        if func in _VIEWS:
            self.keep.append(out)
            self.views[id(out)] = (base, (index or ()) + ((_VIEWS[func],) + tuple(args[1:]),))
        elif func is _aten.uniform_.default and index is None:
            self.draws[base] = ("uniform", float(_arg(args, kwargs, 1, "from", 0.0)),
                                float(_arg(args, kwargs, 2, "to", 1.0)))
            self.fills[base] = []
        elif func is _aten.normal_.default and index is None:
            self.draws[base] = ("normal", float(_arg(args, kwargs, 1, "mean", 0.0)),
                                float(_arg(args, kwargs, 2, "std", 1.0)))
            self.fills[base] = []
        elif func in (_aten.fill_.Scalar, _aten.zero_.default):
            value = args[1] if func is _aten.fill_.Scalar else 0
            if index is None:
                self.draws[base], self.fills[base] = ("fill", value), []
            else:
                self.fills.setdefault(base, []).append((_index(index, self.ndims[base]), value))
        elif (func is _aten.copy_.default and index is None and isinstance(args[1], torch.Tensor)
              and not args[1].is_meta and tuple(args[1].shape) == tuple(args[0].shape)):
            self.draws[base] = ("value", args[1].detach().clone())
            self.fills[base] = []
        elif func._schema.is_mutable or func in (_aten.copy_.default,):
            self.bad[base] = func.__name__
        return out


def _index(chain, ndim: int) -> tuple:
    """A select/slice chain (dims counted on each view) as one ``t[...]`` on the base."""
    index: list = [slice(None)] * ndim
    for op, dim, *rest in chain:
        live = [i for i, x in enumerate(index) if not isinstance(x, int)]
        pos = live[dim % len(live)]
        if op == "select":
            index[pos] = int(rest[0])
        elif index[pos] == slice(None):
            start, end, step = (list(rest) + [None, None, 1])[:3]
            index[pos] = slice(start, end, step)
        else:
            raise MetaInitError("an init that slices one dim twice cannot be replayed; build "
                                "the module on the cpu instead")
    return tuple(index)


def _owned_meta(module) -> dict[int, str]:
    out = {}
    for table in (module._parameters, module._buffers):
        for name, t in table.items():
            if isinstance(t, torch.Tensor) and t.is_meta:
                out[id(t)] = name
    return out


def record_inits(root: torch.nn.Module) -> dict[int, Recipe]:
    """Run each meta module's ``reset_parameters`` on its meta tensors, recording; refuse what
    cannot be replayed (on the controller, before anything is sent). Children run first and a
    parent's init of its children's tensors wins (``MultiheadAttention`` zeroes its
    ``out_proj.bias``, ``Transformer`` re-inits every child weight), as torch's construction
    order makes it."""
    modules = list(root.named_modules())
    owners: dict[int, tuple] = {}  # id(tensor) -> (path, module, name): its first owner
    for path, module in modules:
        # a tensor shared by two modules (tied) keeps its first owner's init, as when the tie
        # is made after both modules were built
        for tid, name in _owned_meta(module).items():
            owners.setdefault(tid, (path, module, name))
    recipes: dict[int, Recipe] = {}
    for path, module in reversed(modules):  # every child before its parent
        tracked = {tid: name for tid, (p, owner, name) in owners.items()
                   if owner is module or p.startswith(f"{path}.") or (not path and p)}
        reset = _init_of(module, root)
        if not tracked or reset is None:
            continue
        rec = _Recorder(tracked)
        with torch.no_grad(), rec:
            reset()
        for tid in tracked:
            if tid in rec.bad:
                raise MetaInitError(
                    f"{_where(owners[tid])} is on the meta device and the init of "
                    f"{type(module).__name__} calls {rec.bad[tid]} on it, which dtorch cannot "
                    f"replay shard by shard (it replays uniform_, normal_, fill_, zero_). Fix: "
                    f"build the module on the cpu, or load real values with load_state_dict "
                    f"after parallelize_module")
            if tid in rec.draws:
                recipes[tid] = Recipe(rec.draws[tid], tuple(rec.fills.get(tid, ())))
    for tid, (path, module, name) in owners.items():
        if tid not in recipes:
            has = _init_of(module, root)
            how = ("its init (reset_parameters(), or transformers' _init_weights) leaves "
                   "it untouched" if has is not None else
                   f"{type(module).__name__} has no reset_parameters()")
            raise MetaInitError(
                f"{_where(owners[tid])} is on the meta device and {how}, so it has no values "
                f"to make. Fix: give {type(module).__name__} a reset_parameters() that "
                f"initialises it (torch.nn.init), build it on the cpu, or load_state_dict "
                f"afterwards")
    return recipes


def _init_of(module, root):
    """The function that initialises ``module``'s own tensors, as its construction did: its
    ``reset_parameters`` (torch.nn), then, under a transformers root model, that model's
    ``_init_weights(module)``, which wins (transformers runs it after the constructors);
    None when there is neither."""
    reset = getattr(module, "reset_parameters", None) or getattr(
        module, "_reset_parameters", None)
    init_weights = getattr(root, "_init_weights", None)
    if init_weights is None or not hasattr(root, "config"):
        return reset

    def both():
        if reset is not None:
            reset()
        init_weights(module)
    return both


def _where(owner) -> str:
    path, _, name = owner
    return f"{path + '.' if path else ''}{name}"


def make(recipe: Recipe, like: torch.Tensor, mesh, placements):
    """The DTensor a recipe describes, drawn block by block on the ranks."""
    from .. import factories
    from ..nn import init
    kind, *vals = recipe.draw
    shape, dtype = tuple(like.shape), like.dtype
    if kind == "uniform":
        out = init.uniform(shape, vals[0], vals[1], dtype=dtype, device_mesh=mesh,
                           placements=placements)
    elif kind == "normal":
        out = init.normal(shape, vals[0], vals[1], dtype=dtype, device_mesh=mesh,
                          placements=placements)
    elif kind == "value":
        from ..nn.state_dict import send_streamed
        out = send_streamed(vals[0].to(dtype), mesh, placements)
    else:
        out = factories.full(shape, vals[0], dtype=dtype, device_mesh=mesh, placements=placements)
    for index, value in recipe.fills:
        out[index] = value
    return out
