"""Tensor methods and properties on DTensors: ``x.sum(0)``, ``x.view(2, -1)``, ``x.T``.

``DTensor.__getattr__`` ends here for any name it does not define itself: a method of
``torch.Tensor`` becomes a bound dispatcher, a few metadata properties are answered from the
spec. Example::

    >>> import torch
    >>> tensor_method("softmax") is tensor_method("softmax")
    True
"""

from __future__ import annotations

import torch

from .dispatch import dispatch

_methods: dict = {}


def tensor_method(name: str):
    """A function ``(self, *args, **kwargs)`` dispatching ``torch.Tensor.<name>``."""
    fn = _methods.get(name)
    if fn is None:
        func = getattr(torch.Tensor, name)

        def fn(self, *args, **kwargs):
            return dispatch(func, None, (self, *args), kwargs)
        fn.__name__ = name
        fn.__doc__ = f"``torch.Tensor.{name}`` on a DTensor (placement rule: dtorch.ops)."
        _methods[name] = fn
    return fn


def _T(x):
    return dispatch(torch.Tensor.permute, None, (x, tuple(range(x.ndim - 1, -1, -1))))


def _mT(x):
    return dispatch(torch.Tensor.transpose, None, (x, -2, -1))


_PROPERTIES = {
    "T": _T,
    "mT": _mT,
    "device": lambda x: torch.device(x.device_mesh.device_type),
    "is_cuda": lambda x: x.device_mesh.device_type == "cuda",
    "is_cpu": lambda x: x.device_mesh.device_type == "cpu",
    "requires_grad": lambda x: False,
    "grad": lambda x: None,
    "is_leaf": lambda x: True,
    "layout": lambda x: torch.strided,
    "is_sparse": lambda x: False,
    "is_quantized": lambda x: False,
    "is_meta": lambda x: False,
    "itemsize": lambda x: x.dtype.itemsize,
    "nbytes": lambda x: x.numel() * x.dtype.itemsize,
    "data": lambda x: x,
}


def attribute(x, name: str):
    """``x.<name>`` for a name DTensor does not define (see module doc)."""
    prop = _PROPERTIES.get(name)
    if prop is not None:
        return prop(x)
    fn = _methods.get(name)
    if fn is None:
        attr = getattr(torch.Tensor, name, None)
        if attr is None or not callable(attr) or name.startswith("_"):
            raise AttributeError(f"'DTensor' object has no attribute {name!r}")
        fn = tensor_method(name)
    return fn.__get__(x)
