"""Reading one block of a tensor from a ``.safetensors`` file, touching only the block's
bytes.

safetensors' own ``safe_open`` maps the whole file and asks the kernel to read it ahead
(measured here: opening a 9.5 MB file read 8 MB from disk before a single slice was taken),
so every rank would read every file whole. The format is small and documented (an 8-byte
little-endian header length, a JSON header of ``dtype``, ``shape`` and ``data_offsets`` per
tensor, then the data, row-major): this module reads the header, then each contiguous run of
the block straight into the output tensor with ``os.preadv``. Writing stays safetensors'.
Example::

    >>> import tempfile, os, torch
    >>> from safetensors.torch import save_file
    >>> f = os.path.join(tempfile.mkdtemp(), "t.safetensors")
    >>> save_file({"w": torch.arange(12.).view(3, 4)}, f)
    >>> read_block(f, read_header(f)["w"], (slice(0, 3), slice(1, 3))).tolist()
    [[1.0, 2.0], [5.0, 6.0], [9.0, 10.0]]
"""

from __future__ import annotations

import itertools
import json
import math
import os
import struct
import sys
from typing import NamedTuple

import torch

DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
          "BF16": torch.bfloat16, "I64": torch.int64, "I32": torch.int32, "I16": torch.int16,
          "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
          "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


class TensorInfo(NamedTuple):
    """Where a tensor's data lies in its file (``start``: the absolute offset)."""

    dtype: torch.dtype
    shape: tuple
    start: int


MAX_HEADER = 100 * 2**20  # safetensors' own limit


def read_header(file: str) -> dict[str, TensorInfo]:
    """Every tensor of ``file`` by name (the header only: no tensor data is read)."""
    if sys.byteorder != "little":
        raise RuntimeError("safetensors data is little-endian; this host is not")
    size = os.path.getsize(file)
    fd = os.open(file, os.O_RDONLY)
    try:  # no read-ahead into the tensors' data either
        _no_read_ahead(fd)
        (n,) = struct.unpack("<Q", _pread(fd, 8, 0))
        if n > min(MAX_HEADER, size - 8):
            raise ValueError(f"{file} is not a safetensors file (a header of {n} bytes)")
        header = json.loads(_pread(fd, n, 8))
    finally:
        os.close(fd)
    out = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        if entry["dtype"] not in DTYPES:
            raise TypeError(f"{file}: tensor {name} has dtype {entry['dtype']}, which dtorch "
                            f"does not read (one of {sorted(DTYPES)})")
        dtype, shape = DTYPES[entry["dtype"]], tuple(entry["shape"])
        start, end = entry["data_offsets"]
        if end - start != math.prod(shape) * dtype.itemsize or 8 + n + end > size:
            raise ValueError(f"{file}: tensor {name}'s bytes [{start}, {end}) do not hold "
                             f"its shape {shape} of {entry['dtype']}: the file is damaged")
        out[name] = TensorInfo(dtype, shape, 8 + n + start)
    return out


def _no_read_ahead(fd: int) -> None:
    if hasattr(os, "posix_fadvise"):  # not on macOS: there the kernel reads ahead
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)


def read_block(file: str, info: TensorInfo, slices: tuple) -> torch.Tensor:
    """The block ``slices`` (one ``slice(start, stop)`` per dim) of the tensor ``info``
    describes: the block's contiguous runs are read into the result, nothing else."""
    shape = info.shape
    if len(slices) != len(shape) or any(not 0 <= s.start <= s.stop <= n
                                        for s, n in zip(slices, shape)):
        raise IndexError(f"block {slices} is not inside a tensor of shape {shape}")
    lo = [s.start for s in slices]
    size = [s.stop - s.start for s in slices]
    out = torch.empty(size, dtype=info.dtype)
    if out.numel() == 0:
        return out
    # the dims after ``k`` are whole: each run is ``size[k]`` rows of them, contiguous
    k = max([d for d in range(len(shape)) if size[d] != shape[d]], default=0)
    inner = math.prod(shape[k + 1:])
    item = out.element_size()
    run = size[k] * inner * item if shape else item
    strides = [math.prod(shape[d + 1:]) for d in range(len(shape))]
    buffer = memoryview(out.view(-1).view(torch.uint8).numpy())  # the result's own bytes
    fd = os.open(file, os.O_RDONLY)
    try:  # no read-ahead: the runs are exactly what this rank needs (the neighbours' blocks
        _no_read_ahead(fd)  # follow, and are theirs to read)
        for i, index in enumerate(itertools.product(*(range(lo[d], lo[d] + size[d])
                                                      for d in range(k)))):
            element = sum(j * strides[d] for d, j in enumerate(index)) + \
                (lo[k] * strides[k] if shape else 0)
            _read_exactly(fd, buffer[i * run:(i + 1) * run], info.start + element * item)
    finally:
        os.close(fd)
    return out


def _pread(fd: int, n: int, offset: int) -> bytes:
    out = bytearray(n)
    _read_exactly(fd, memoryview(out), offset)
    return bytes(out)


def _read_exactly(fd: int, into: memoryview, offset: int) -> None:
    while len(into):
        got = os.preadv(fd, [into], offset)
        if got == 0:
            raise EOFError(f"the file ends before offset {offset + len(into)}: truncated?")
        into, offset = into[got:], offset + got
