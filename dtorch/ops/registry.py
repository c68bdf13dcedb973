"""The rule registry: one placement rule per torch callable. Pure (no Dask, no torch.distributed).

A rule is a small function of an :class:`OpCall` (the inputs' specs, the non-tensor arguments,
the output shapes inferred on ``meta``) that returns the output placements, or a
:class:`Decision` when the ranks must run something other than the torch function itself.
It raises :class:`dtorch.PlacementError` through :meth:`OpCall.fail` when no rule fits.
Example::

    @rule("relu", "sigmoid", family="unary")
    def _unary(op):                      # op.tensors[0] is the input's TArg
        return op.tensors[0].placements  # elementwise: placements kept

    >>> import torch
    >>> lookup(torch.add).family, lookup(torch.Tensor.add_).inplace
    ('binary', True)
"""

from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple

import torch
import torch.nn.functional as F

from ..placement import Placement


class TArg(NamedTuple):
    """A DTensor input as a rule sees it: its position among the tensor inputs, a label for
    messages (``input``, ``other``, ``tensors[1]``) and its spec."""

    index: int
    label: str
    spec: Any

    @property
    def shape(self) -> tuple[int, ...]:
        return self.spec.shape

    @property
    def dtype(self) -> torch.dtype:
        return self.spec.dtype

    @property
    def ndim(self) -> int:
        return len(self.spec.shape)

    @property
    def placements(self) -> tuple[Placement, ...]:
        return self.spec.placements

    @property
    def mesh(self):
        return self.spec.mesh


class Decision(NamedTuple):
    """What a rule decided: output placements (one tuple per output) and, optionally, the
    local function the ranks run instead of the torch function, with its argument template
    (``TArg`` slots stand for the local shards; ``inplace`` the mutated input's index)."""

    placements: tuple
    fn: Callable | None = None
    args: tuple | None = None
    kwargs: dict | None = None
    inplace: int | None = None


class Entry(NamedTuple):
    """One registered callable: display name, family, rule, in-place flag, custom meta, and
    the optional ``prep`` that rewrites a call's arguments before dispatch keys it."""

    name: str
    family: str
    rule: Callable
    inplace: bool
    meta: Callable | None
    arg_names: tuple[str, ...]
    prep: Callable | None = None


_RULES: dict[Any, Entry] = {}
PREP: dict[Any, Callable] = {}  # callable -> prep(args, kwargs) -> (args, kwargs)
DECOMPOSED: dict[Any, Callable] = {}  # callable -> fn(func, args, kwargs) (see decomposed)
DECOMPOSED_WHEN: dict[Any, Callable] = {}  # callable -> when(args, kwargs) (see decomposed)
_NAMESPACES = (("torch", torch), ("Tensor", torch.Tensor), ("F", F), ("linalg", torch.linalg),
               ("special", torch.special))


def display_name(func) -> str:
    """``torch.add``, ``Tensor.add``, ``F.softmax``, ``special.erfcx``: how messages and
    coverage name a callable."""
    if isinstance(func, torch._ops.OpOverloadPacket):
        return func._qualified_op_name.replace("::", ".")
    if isinstance(func, torch._ops.OpOverload):  # aten._softmax.default is aten._softmax
        packet = display_name(func.overloadpacket)
        return packet if func._overloadname == "default" else f"{packet}.{func._overloadname}"
    name = getattr(func, "__name__", None)
    for prefix, ns in _NAMESPACES:
        if name and getattr(ns, name, None) is func:
            return f"{prefix}.{name}"
    found = _by_identity().get(id(func))  # torch.special.erfcx is named "special_erfcx"
    if found is not None:
        return found
    return getattr(func, "__qualname__", None) or getattr(func, "__name__", repr(func))


@functools.lru_cache(maxsize=1)
def _by_identity() -> dict:
    """``{id(callable): "special.erfcx"}`` over the public names of the namespaces."""
    out = {}
    for prefix, ns in (*_NAMESPACES, ("fft", torch.fft)):
        for attr in dir(ns):
            if not attr.startswith("_"):
                out.setdefault(id(getattr(ns, attr, None)), f"{prefix}.{attr}")
    return out


def _resolve(name_or_func) -> list:
    """``[(callable, display name)]``: a string names every torch / Tensor / F callable spelled
    that way; a callable is itself."""
    if not isinstance(name_or_func, str):
        return [(name_or_func, display_name(name_or_func))]
    found = []
    for prefix, ns in _NAMESPACES[:3]:
        f = getattr(ns, name_or_func, None)
        if f is not None and callable(f) and f not in [g for g, _ in found]:
            found.append((f, f"{prefix}.{name_or_func}"))
    return found


def rule(*funcs, family: str, inplace: bool = False, meta: Callable | None = None,
         arg_names: tuple[str, ...] = ("input", "other"), prep: Callable | None = None):
    """Register the decorated rule for ``funcs`` (callables, or names resolved in ``torch``,
    ``torch.Tensor`` and ``torch.nn.functional``). ``inplace=True`` marks variants that mutate
    their first tensor (``add_``); ``meta`` replaces the torch call used for shape inference;
    ``prep(args, kwargs) -> (args, kwargs)`` rewrites the call before it is keyed (index or
    size values given as tensors become Python ints; see :func:`prep_call`)."""
    def deco(fn):
        _register(funcs, family, inplace, meta, arg_names, fn, prep)
        return fn
    return deco


def _register(funcs, family, inplace, meta, arg_names, fn, prep=None) -> None:
    for spec in funcs:
        resolved = _resolve(spec)
        if not resolved and isinstance(spec, str):
            continue  # a name this torch version lacks
        for f, name in resolved:
            _RULES[f] = Entry(name, family, fn, inplace, meta, tuple(arg_names), prep)
            if prep is not None:
                PREP[f] = prep


def decomposed(*funcs, when: Callable | None = None):
    """Register the decorated ``fn(func, args, kwargs)`` to run calls of ``funcs`` (callables,
    or names resolved as :func:`rule` resolves them) as other DTensor ops (dropout in
    training: a mask factory and a multiply); dispatch calls it first, and its
    ``NotImplemented`` leaves the call to the rule. ``when(args, kwargs)``, if given, is a
    cheap test on the call as made: False leaves it to the rule without calling ``fn`` (nor
    turning its plain tensors into constants first)."""
    def deco(fn):
        for spec in funcs:
            for f, _ in _resolve(spec):
                DECOMPOSED[f] = fn
                if when is not None:
                    DECOMPOSED_WHEN[f] = when
        return fn
    return deco


def prep_call(func, args: tuple, kwargs: dict | None):
    """``(args, kwargs)`` of a call after the ``prep`` registered for ``func`` (unchanged when
    there is none); dispatch runs it before anything else."""
    prep = PREP.get(func)
    if prep is None:
        return args, kwargs
    return prep(tuple(args), dict(kwargs or {}))


def lookup(func) -> Entry | None:
    """The entry for a torch callable, or None."""
    return _RULES.get(func)


def entries() -> dict:
    """``{callable: Entry}`` for everything registered."""
    return dict(_RULES)


class OpCall:
    """One call as a rule sees it (built on a cache miss only, so clarity beats speed).

    ``args``/``kwargs`` hold :class:`TArg` where the user passed DTensors; ``tensors`` lists
    them in order; ``out`` holds ``(shape, dtype)`` per output from shape inference.
    """

    __slots__ = ("entry", "func", "args", "kwargs", "tensors", "mesh", "out")

    def __init__(self, entry: Entry, func, args, kwargs, tensors, mesh, out):
        self.entry, self.func, self.args, self.kwargs = entry, func, args, kwargs
        self.tensors, self.mesh, self.out = tensors, mesh, out

    @property
    def name(self) -> str:
        return self.entry.name

    def arg(self, pos: int | None, name: str | None, default=None):
        """Argument by position or keyword: ``op.arg(1, "dim", None)``."""
        if name is not None and name in self.kwargs:
            return self.kwargs[name]
        if pos is not None and pos < len(self.args):
            return self.args[pos]
        return default

    def fail(self, mesh_dim: int | None, legal: str, fix: dict | list | None = None,
             why: str | None = None):
        """Raise PlacementError (see :mod:`dtorch.ops.explain` for the format). ``fix`` is
        ``{targ: placements}``, or a list of such dicts: alternatives, listed cheapest first."""
        from .explain import placement_error
        raise placement_error(self, mesh_dim, legal, fix or {}, why)


def is_placement_tuple(value) -> bool:
    return isinstance(value, tuple) and bool(value) and isinstance(value[0], Placement)


def as_decision(result) -> Decision:
    """Normalize a rule's return: placements of one output, a list per output, or Decision."""
    if isinstance(result, Decision):
        return result
    if is_placement_tuple(result):
        return Decision((result,))
    return Decision(tuple(tuple(p) for p in result))
