"""Python operators on DTensor (``x + y``, ``-x``, ``x[i]``, ``x[i] = v``): each runs the
``torch.Tensor`` operator through dtorch's dispatch, as ``torch.add`` would. NumPy operands
are taken as torch takes them: an ndarray as ``torch.as_tensor(ndarray)`` (never gathered into
an ndarray), a NumPy scalar as a Python scalar. Example::

    >>> import torch
    >>> _operand(torch.tensor(1.0)).shape, _operand(__import__("numpy").float32(2.5))
    (torch.Size([]), 2.5)
"""

from __future__ import annotations

import numpy as np
import torch

BINARY = ("__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__",
          "__truediv__", "__rtruediv__", "__floordiv__", "__rfloordiv__", "__mod__", "__rmod__",
          "__pow__", "__rpow__", "__matmul__", "__rmatmul__", "__and__", "__rand__", "__or__",
          "__ror__", "__xor__", "__rxor__", "__lshift__", "__rshift__", "__rlshift__",
          "__rrshift__", "__eq__", "__ne__", "__lt__", "__le__", "__gt__", "__ge__",
          "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__", "__imod__",
          "__ipow__", "__iand__", "__ior__", "__ixor__", "__ilshift__", "__irshift__")
UNARY = ("__neg__", "__pos__", "__abs__", "__invert__")


def _operand(other):
    """``other`` as an operator's second operand: NumPy values as torch reads them."""
    if isinstance(other, np.ndarray):
        return torch.as_tensor(other)
    if isinstance(other, np.generic):
        return other.item()
    return other


def install(cls, tensor_module) -> None:
    """Set the operators on ``cls``; each calls ``tensor_module._dispatch`` (late-bound)."""
    operands = (cls, int, float, bool, complex, torch.Tensor)

    def binary(func):
        def dunder(self, other):
            if not isinstance(other, operands):  # the common operands skip the NumPy checks
                other = _operand(other)
                if not isinstance(other, operands):
                    return NotImplemented
            return tensor_module._dispatch(func, None, (self, other))
        dunder.__name__ = func.__name__
        return dunder

    def unary(func):
        def dunder(self):
            return tensor_module._dispatch(func, None, (self,))
        dunder.__name__ = func.__name__
        return dunder

    def getitem(self, index):
        return tensor_module._dispatch(torch.Tensor.__getitem__, None, (self, index))

    def setitem(self, index, value):
        tensor_module._dispatch(torch.Tensor.__setitem__, None, (self, index, value))

    for name in BINARY:
        setattr(cls, name, binary(getattr(torch.Tensor, name)))
    for name in UNARY:
        setattr(cls, name, unary(getattr(torch.Tensor, name)))
    cls.__getitem__, cls.__setitem__ = getitem, setitem
