"""How tensors travel between the controller and the ranks: raw bytes plus dtype and shape.

Dask ships numpy arrays without copies, but its torch serializer goes through ``numpy()``,
which fails for bfloat16 (and a failed answer never arrives). Sending every tensor as a uint8
numpy view of its bytes works for every dtype and stays zero-copy for dense tensors. Any strided
tensor packs (views, expanded stride-0 tensors, conjugate views, zero elements); received bytes
are checked against the dtype and shape before a tensor is built over them. Example::

    >>> import torch
    >>> t = torch.arange(6, dtype=torch.bfloat16).reshape(2, 3)
    >>> torch.equal(unpack(pack(t.t())), t.t())
    True
    >>> unpack(WireTensor("float32", (2,), pack(t).data))
    Traceback (most recent call last):
    ...
    dtorch.runtime.wire.WireFormatError: received 12 bytes for a float32 tensor of shape (2,), which needs 8
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
import torch

from ..errors import DTorchError

_ALIGN = 64  # received frames can start at any byte; complex128 copies need 16-byte alignment


class WireFormatError(DTorchError, ValueError):
    """Bytes received for a tensor do not match its dtype and shape."""


class WireTensor(NamedTuple):
    """A tensor's bytes (uint8 numpy array), dtype name and shape."""

    dtype: str
    shape: tuple[int, ...]
    data: np.ndarray


def _dense(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a plain dense tensor whose flattened view has stride 1."""
    if t.layout != torch.strided:
        raise TypeError(f"a {t.layout} tensor cannot be sent; convert it with .to_dense()")
    t = t.detach().cpu().resolve_conj().resolve_neg()
    flat = t.reshape(-1)
    if flat.numel() and flat.stride(0) != 1:  # size-1 dims hide stride 0 or k from contiguous()
        flat = torch.empty(flat.numel(), dtype=flat.dtype).copy_(flat)
    return flat


def pack(t: torch.Tensor) -> WireTensor:
    """A CPU copy-free view of ``t``'s bytes (one copy if ``t`` is not dense)."""
    flat = _dense(t)
    data = flat.view(torch.uint8).numpy() if flat.numel() else np.empty(0, np.uint8)
    return WireTensor(str(t.dtype).removeprefix("torch."), tuple(t.shape), data)


def _dtype(name) -> torch.dtype:
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dtype, torch.dtype):
        raise WireFormatError(f"received an unknown dtype {name!r}")
    return dtype


def _aligned(data: np.ndarray) -> np.ndarray:
    """A writeable, ``_ALIGN``-aligned copy of ``data`` unless it already is both."""
    if data.flags.writeable and data.flags.c_contiguous and data.ctypes.data % _ALIGN == 0:
        return data
    buf = np.empty(data.size + _ALIGN, np.uint8)
    start = (-buf.ctypes.data) % _ALIGN
    out = buf[start:start + data.size]
    out[:] = data.reshape(-1)
    return out


def unpack(w: WireTensor) -> torch.Tensor:
    """The tensor back, on the CPU: a plain tensor (not a view) over the received bytes.

    Raises :class:`WireFormatError` when the bytes do not fit the dtype and shape."""
    if not isinstance(w, WireTensor) and not (isinstance(w, tuple) and len(w) == 3):
        raise WireFormatError(f"received {type(w).__name__}, not a tensor")
    dtype = _dtype(w.dtype)
    try:
        shape = tuple(int(s) for s in w.shape)
    except (TypeError, ValueError):
        raise WireFormatError(f"received a malformed shape {w.shape!r}") from None
    if any(s < 0 for s in shape):
        raise WireFormatError(f"received a negative shape {shape}")
    data = w.data
    if not isinstance(data, np.ndarray) or data.dtype != np.uint8:
        raise WireFormatError(f"received {type(data).__name__} instead of uint8 bytes")
    need = math.prod(shape) * dtype.itemsize
    if data.size != need:
        raise WireFormatError(f"received {data.size} bytes for a {w.dtype} tensor of shape "
                              f"{shape}, which needs {need}")
    if not need:
        return torch.empty(shape, dtype=dtype)
    storage = torch.from_numpy(_aligned(data)).untyped_storage()
    stride = torch.empty(shape, device="meta").stride()
    return torch.empty(0, dtype=dtype).set_(storage, 0, shape, stride)
