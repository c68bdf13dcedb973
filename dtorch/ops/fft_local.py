"""``torch.fft.*`` along unsharded dims: the transformed dims are mixed, every other dim is
free, so a tensor sharded on another dim transforms each rank's block, nothing moves.

The transformed dims come from the call's ``dim`` (bound by the function's parameters,
:mod:`dtorch.ops.bind`) with torch's defaults: the last dim (``fft``, ``rfft``, ...), the last
two (``fft2``, ...), every dim or the last ``len(s)`` (``fftn``, ...; ``fftshift``: every dim).
The output has the input's dims (sizes of the transformed ones may change). Example::

    >>> import torch
    >>> transformed(torch.fft.fft, 3, {})
    (2,)
    >>> transformed(torch.fft.rfftn, 4, {"s": (5, 6)})
    (2, 3)
    >>> transformed(torch.fft.fftshift, 2, {})
    (0, 1)
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch

from .bind import bind, value
from .linalg_batched import decide, tensor_params
from .local_dims import Operand, free_labels
from .registry import rule

LEGAL = "fft mixes values along its transformed dims: Shard another dim"
ONE = ("fft", "ifft", "rfft", "irfft", "hfft", "ihfft")
TWO = ("fft2", "ifft2", "rfft2", "irfft2", "hfft2", "ihfft2")
ALL = ("fftn", "ifftn", "rfftn", "irfftn", "hfftn", "ihfftn")
SHIFT = ("fftshift", "ifftshift")


class EmptySafe(NamedTuple):
    """``fn`` on a rank whose block is empty along a free dim (MKL's FFT refuses empty
    tensors): transform one row of zeros there, keep none of it (the graph stays connected)."""

    fn: Callable

    def __call__(self, x, *args, **kwargs):
        if x.numel() == 0:
            empty = [d for d, s in enumerate(x.shape) if s == 0]
            for d in empty:
                x = torch.cat([x, x.new_zeros(x.shape[:d] + (1,) + x.shape[d + 1:])], d)
            out = self.fn(x, *args, **kwargs)
            for d in empty:
                out = out.narrow(d, 0, 0)
            return out
        return self.fn(x, *args, **kwargs)


def _funcs(names):
    return tuple(getattr(torch.fft, n) for n in names if hasattr(torch.fft, n))


def transformed(func, ndim: int, bound: dict) -> tuple:
    """The dims (non-negative, sorted) ``func`` mixes on an ``ndim``-D input; ``bound`` maps
    parameter names to values (``dim``, ``s``)."""
    dim = bound.get("dim")
    if dim is None:
        s = bound.get("s")
        if func in _funcs(ONE):
            dim = -1
        elif func in _funcs(TWO):
            dim = (-2, -1)
        elif s is not None:
            dim = tuple(range(-len(s), 0))
        else:
            dim = tuple(range(ndim))
    dims = tuple(dim) if isinstance(dim, (tuple, list)) else (dim,)
    return tuple(sorted({d % ndim for d in dims})) if ndim else ()


@rule(*_funcs(ONE + TWO + ALL + SHIFT), family="fft")
def fft_rule(op):
    b = bind(op)
    _, where, t = tensor_params(op)[0]
    dims = transformed(op.func, t.ndim, {k: value(b, k) for k in ("dim", "s")})
    labels = free_labels(t.ndim, dims)
    if where != 0:
        op.fail(None, LEGAL, {}, "pass the input positionally")
    return decide(op, [Operand(where, t, labels)], [labels], LEGAL, fn=EmptySafe(op.func))
