"""``dtorch.<name>`` and ``dtorch.nn.functional.<name>``: torch functions routed straight to
dispatch (no ``__torch_function__`` round trip); those with a rule come first.

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
    """The dispatching function for the first ``namespace.<name>`` that has a rule, else for
    the first torch function of that name (it runs on all-Replicate inputs), or None."""
    key = (name, namespaces)
    if key not in _routed:
        found = [f for f in (getattr(ns, name, None) for ns in namespaces)
                 if callable(f) and not isinstance(f, type)]
        ruled = [f for f in found if lookup(f) is not None]
        _routed[key] = _wrap((ruled or found)[0]) if found else None
    return _routed[key]


def missing(module: str, name: str) -> AttributeError:
    return AttributeError(f"module {module!r} has no attribute {name!r}; the torch functions "
                          f"dtorch can run on DTensors are listed by dtorch.ops.coverage()")
