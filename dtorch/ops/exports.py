"""``dtorch.<name>`` and ``dtorch.nn.functional.<name>``: torch functions that have a rule,
routed straight to dispatch (no ``__torch_function__`` round trip).

With no DTensor among the arguments they are the plain torch functions. Example::

    >>> import torch
    >>> routed("matmul").__wrapped__ is torch.matmul
    True
    >>> routed("no_such_function") is None
    True
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from .dispatch import dispatch
from .registry import lookup

_routed: dict = {}


def _wrap(func):
    @functools.wraps(func)
    def call(*args, **kwargs):
        return dispatch(func, None, args, kwargs)
    return call


def routed(name: str, namespaces=(torch, F)):
    """The dispatching function for the first ``namespace.<name>`` that has a rule, or None."""
    key = (name, namespaces)
    if key not in _routed:
        found = None
        for ns in namespaces:
            func = getattr(ns, name, None)
            if func is not None and lookup(func) is not None:
                found = _wrap(func)
                break
        _routed[key] = found
    return _routed[key]


def missing(module: str, name: str) -> AttributeError:
    return AttributeError(f"module {module!r} has no attribute {name!r}; the torch functions "
                          f"dtorch can run on DTensors are listed by dtorch.ops.coverage()")
