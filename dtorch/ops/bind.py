"""Bind a call's arguments by the torch function's parameter names, not by position guesses.

The names come from ``inspect.signature`` where Python has one, else from the function's aten
schema (``torch.linalg.solve`` is ``aten::linalg_solve(Tensor A, Tensor B, *, bool left)``;
a schema's ``self`` is Python's ``input``), else from :data:`PARAMS`. Example::

    >>> import torch
    >>> params(torch.linalg.solve)[:2], params(torch.fft.fft), params(torch.tensordot)[:3]
    (('A', 'B'), ('input', 'n', 'dim', 'norm'), ('a', 'b', 'dims'))
    >>> params(torch.Tensor.det)
    ('input',)
"""

from __future__ import annotations

import functools
import inspect

import torch

# functions whose Python signature is ``(*args, **kwargs)`` and that have no aten schema
PARAMS = {torch.lu: ("A", "pivot", "get_infos"), torch.Tensor.lu: ("input", "pivot", "get_infos")}
_NAMED = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD,
          inspect.Parameter.KEYWORD_ONLY)


@functools.lru_cache(maxsize=None)
def params(func) -> tuple[str, ...]:
    """The parameter names of ``func`` in order (see module doc); ``()`` when unknown."""
    if func in PARAMS:
        return PARAMS[func]
    try:
        names = tuple(p.name for p in inspect.signature(func).parameters.values()
                      if p.kind in _NAMED)
        if names:
            return names
    except (TypeError, ValueError):
        pass
    name = getattr(func, "__name__", "")
    for schema in torch._C._jit_get_schemas_for_operator(f"aten::{name}"):
        if not schema.overload_name.startswith("out"):
            return tuple("input" if a.name == "self" else a.name for a in schema.arguments)
    return ()


def bind(op) -> dict:
    """``{name: (where, value)}`` for a call: ``where`` is the position or the keyword the value
    was passed at (what :func:`dtorch.ops.binary.sliced_call` narrows); ``name`` its
    parameter's name (``arg3`` past the known ones)."""
    names = params(op.func)
    out = {}
    for i, value in enumerate(op.args):
        out[names[i] if i < len(names) else f"arg{i}"] = (i, value)
    for key, value in op.kwargs.items():
        out[key] = (key, value)
    return out


def value(bound: dict, name: str, default=None):
    """The bound value of ``name`` (``default`` when the call left it out)."""
    return bound[name][1] if name in bound else default
