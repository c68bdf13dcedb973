"""A rank's pool of large CPU buffers, reused instead of freshly allocated.

A redistribute is out of place: every collective needs a fresh output (and all_to_all a send
buffer). Fresh memory page-faults on first touch, which cost as much as the collective itself
for 16 MB buffers on a VM. Freed shards and collective temporaries go back to this pool, and
the next buffer of the same byte size comes from it, already mapped: a caching allocator, as
PyTorch has for CUDA. Only buffers nobody else can see are taken back. Example::

    >>> pool = BufferPool(min_bytes=0)
    >>> t = pool.empty((4, 4), torch.float32)
    >>> pool.give_back(t); del t
    True
    >>> pool.empty((16,), torch.float32).shape, pool.reused
    (torch.Size([16]), 1)
"""

from __future__ import annotations

import sys
from collections import OrderedDict

import torch

_use_count = getattr(torch._C, "_storage_Use_Count", None)


class BufferPool:
    """Untyped storages by byte size, most recently freed last; bounded in total bytes."""

    def __init__(self, min_bytes: int = 1 << 20, max_bytes: int = 1 << 30):
        self.min_bytes, self.max_bytes = min_bytes, max_bytes
        self._free: OrderedDict[int, list] = OrderedDict()
        self.held = 0
        self.reused = 0

    def empty(self, shape, dtype: torch.dtype, device=None) -> torch.Tensor:
        """An uninitialized contiguous tensor, from the pool when a buffer fits exactly."""
        shape = tuple(shape)
        nbytes = dtype.itemsize
        for s in shape:
            nbytes *= s
        storages = self._free.get(nbytes) if device is None or torch.device(device).type == "cpu" \
            else None
        if not storages:
            return torch.empty(shape, dtype=dtype, device=device)
        storage = storages.pop()
        if not storages:
            del self._free[nbytes]
        self.held -= nbytes
        self.reused += 1
        stride = torch.empty(shape, device="meta").stride()
        return torch.empty(0, dtype=dtype).set_(storage, 0, shape, stride)

    def give_back(self, t: torch.Tensor, _callers_refs: int = 1) -> bool:
        """Take ``t``'s memory back if no other tensor or view can reach it.

        The caller drops its own reference right after (``_callers_refs`` counts those).
        """
        if (_use_count is None or not isinstance(t, torch.Tensor) or t.device.type != "cpu"
                or t._base is not None or t.requires_grad):
            return False
        storage = t.untyped_storage()
        nbytes = storage.nbytes()
        if nbytes < self.min_bytes or nbytes > self.max_bytes:
            return False
        # references: the caller's, this function's argument, getrefcount's own argument
        if sys.getrefcount(t) > _callers_refs + 2 or _use_count(storage._cdata) > 2:
            return False
        self._free.setdefault(nbytes, []).append(storage)
        self._free.move_to_end(nbytes)
        self.held += nbytes
        while self.held > self.max_bytes:
            size, storages = next(iter(self._free.items()))
            storages.pop(0)
            self.held -= size
            if not storages:
                del self._free[size]
        return True


_rank_pool: list = [None]  # this process's rank pool, once an Interpreter is made here


def use_as_rank_pool(pool: BufferPool) -> None:
    """Make ``pool`` the one ``rank_empty`` takes from (the rank's Interpreter does)."""
    _rank_pool[0] = pool


def rank_empty(shape, dtype: torch.dtype, device=None) -> torch.Tensor:
    """For a rank-side kernel's large output: a buffer from the rank's pool (already mapped:
    a fresh 8 MB buffer page-faults for longer than copying into it), else ``torch.empty``.

    >>> rank_empty((2, 3), torch.float32).shape
    torch.Size([2, 3])
    """
    pool = _rank_pool[0]
    if pool is None:
        return torch.empty(shape, dtype=dtype, device=device)
    return pool.empty(shape, dtype, device)


def pooled_cat(tensors, dim: int = 0) -> torch.Tensor:
    """``torch.cat`` into a buffer from the rank's pool (``rank_empty``); autograd's own cat
    where a part requires grad.

    >>> pooled_cat([torch.ones(2), torch.zeros(1)]).tolist()
    [1.0, 1.0, 0.0]
    """
    tensors = list(tensors)
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return torch.cat(tensors, dim)
    shape = list(tensors[0].shape)
    shape[dim] = sum(t.shape[dim] for t in tensors)
    return torch.cat(tensors, dim, out=rank_empty(shape, tensors[0].dtype, tensors[0].device))

