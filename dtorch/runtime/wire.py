"""How tensors travel between the controller and the ranks: raw bytes plus dtype and shape.

Dask ships numpy arrays without copies, but its torch serializer goes through ``numpy()``,
which fails for bfloat16 (and a failed answer never arrives). Sending every tensor as a uint8
numpy view of its bytes works for every dtype and stays zero-copy. Example::

    >>> import torch
    >>> t = torch.arange(6, dtype=torch.bfloat16).reshape(2, 3)
    >>> torch.equal(unpack(pack(t)), t)
    True
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch


class WireTensor(NamedTuple):
    """A tensor's bytes (uint8 numpy array), dtype name and shape."""

    dtype: str
    shape: tuple[int, ...]
    data: np.ndarray


def pack(t: torch.Tensor) -> WireTensor:
    """A CPU copy-free view of ``t``'s bytes (one copy if ``t`` is not contiguous)."""
    t = t.detach().cpu().contiguous()
    flat = t.reshape(-1)
    data = flat.view(torch.uint8).numpy() if flat.numel() else np.empty(0, np.uint8)
    return WireTensor(str(t.dtype).removeprefix("torch."), tuple(t.shape), data)


def unpack(w: WireTensor) -> torch.Tensor:
    """The tensor back, on the CPU: a plain tensor (not a view) over the received bytes."""
    dtype = getattr(torch, w.dtype)
    if not w.data.size:
        return torch.empty(w.shape, dtype=dtype)
    data = w.data if w.data.flags.writeable else w.data.copy()
    storage = torch.from_numpy(np.ascontiguousarray(data)).untyped_storage()
    stride = torch.empty(w.shape, device="meta").stride()
    return torch.empty(0, dtype=dtype).set_(storage, 0, w.shape, stride)
