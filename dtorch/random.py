"""dtorch's counter-based random stream: dropout masks that do not depend on placements.

Each element's random number is a stateless integer hash of (seed, counter, the element's
*global* index): ``seed`` is the last ``dtorch.manual_seed``, ``counter`` the number of masks
drawn since (the controller advances it by one per dropout call, in program order). So a mask
is the same whatever the mesh and placements, and each rank hashes only the indices of its own
block (cost O(local)). The hash (two keyed rounds of the 32-bit ``lowbias32`` mixer) runs in
exact int64 torch ops, with no integer overflow, so it is the same on every device.

The functions below are plain torch on one device: they reproduce what the ranks compute, so
a program can be checked against them. Example::

    >>> import torch
    >>> keep = dropout_mask((2, 3), 0.5, seed=0, counter=0)
    >>> keep.dtype, keep.shape
    (torch.bool, torch.Size([2, 3]))
    >>> x = torch.ones(2, 3)
    >>> torch.equal(dropout(x, 0.5, seed=0, counter=0), x * keep / 0.5)
    True
    >>> block = dropout_mask((2, 3), 0.5, seed=0, counter=0, offset=(1, 1), block=(1, 2))
    >>> torch.equal(block, keep[1:, 1:])
    True
"""

from __future__ import annotations

import math
import warnings
from typing import NamedTuple, Sequence

import torch

_M32 = 0xFFFFFFFF
_M64 = (1 << 64) - 1


class StreamState(NamedTuple):
    """Where the stream stands: the seed, and the counter the next mask will use."""

    seed: int
    counter: int


_state = StreamState(0, 0)


def reset(seed: int) -> None:
    """Start the stream again at ``seed`` (``dtorch.manual_seed`` calls this)."""
    global _state
    _state = StreamState(int(seed) & _M64, 0)


def state() -> StreamState:
    """``StreamState(seed, counter)``: the counter the next dropout mask will use (after
    ``dtorch.manual_seed(7)``: ``StreamState(seed=7, counter=0)``).

    >>> state()._fields
    ('seed', 'counter')
    """
    return _state


def take() -> StreamState:
    """The position for one new mask; the stream moves on by one (controller side)."""
    global _state
    now = _state
    _state = StreamState(now.seed, now.counter + 1)
    return now


# the hash --------------------------------------------------------------------------------------
def _splitmix64(z: int) -> int:
    """splitmix64's finalizer on a Python int (exact, mod 2**64)."""
    z = (z + 0x9E3779B97F4A7C15) & _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


def _keys(seed: int, counter: int) -> tuple[int, int]:
    """Two 32-bit keys of one mask, from (seed, counter)."""
    k = _splitmix64(_splitmix64(seed & _M64) ^ (counter & _M64))
    return k & _M32, k >> 32


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """``(x * c) mod 2**32`` for int64 ``x`` in [0, 2**32) and a 32-bit ``c``, with no int64
    overflow: ``x * (c mod 2**31)`` stays below 2**63, and ``x * 2**31 mod 2**32`` is
    ``(x & 1) << 31``."""
    out = x * (c & 0x7FFFFFFF)
    if c >> 31:
        out.add_((x & 1).bitwise_left_shift_(31))
    return out.bitwise_and_(_M32)


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 (C. Wellons): a bijection of 32-bit values with a strong avalanche."""
    x = _mul32(x.bitwise_xor_(x >> 16), 0x7FEB352D)
    x = _mul32(x.bitwise_xor_(x >> 15), 0x846CA68B)
    return x.bitwise_xor_(x >> 16)


def hash_bits(index: torch.Tensor, seed: int, counter: int) -> torch.Tensor:
    """32 random bits per element (int64 values in [0, 2**32)) of non-negative int64
    global ``index``es, for the mask at ``(seed, counter)``."""
    k0, k1 = _keys(seed, counter)
    bits = _mix32(index.bitwise_and(_M32).bitwise_xor_(k0))
    return _mix32(bits.bitwise_xor_(index >> 32).bitwise_xor_(k1))


def global_index(shape: Sequence[int], offset: Sequence[int] | None = None,
                 block: Sequence[int] | None = None, device=None) -> torch.Tensor:
    """The row-major global indices (int64) of the block ``block`` at ``offset`` of a tensor
    of ``shape`` (the whole tensor by default), built from one arange per dim.

    >>> global_index((3, 4), (1, 2), (2, 2)).tolist()
    [[6, 7], [10, 11]]
    """
    shape = tuple(shape)
    offset = tuple(offset) if offset is not None else (0,) * len(shape)
    block = tuple(block) if block is not None else shape
    index = torch.zeros((1,) * len(shape), dtype=torch.int64, device=device)
    stride = 1
    for d in reversed(range(len(shape))):
        along = torch.arange(offset[d], offset[d] + block[d], dtype=torch.int64, device=device)
        index = index + (along * stride).view((-1,) + (1,) * (len(shape) - 1 - d))
        stride *= shape[d]
    return index.reshape(block)


def threshold(p: float) -> int:
    """An element is dropped when its 32 bits are below this (``p * 2**32``)."""
    return int(p * 2 ** 32)


# one-device references -------------------------------------------------------------------------
def dropout_mask(shape: Sequence[int], p: float, *, seed: int, counter: int,
                 offset: Sequence[int] | None = None, block: Sequence[int] | None = None,
                 device=None) -> torch.Tensor:
    """The keep mask (bool, True = kept) dtorch draws for a tensor of ``shape`` with drop
    probability ``p`` at stream position (``seed``, ``counter``); with ``offset`` / ``block``
    only that block of it (what one rank computes).

    >>> dropout_mask((4,), 0.0, seed=1, counter=3).all().item()
    True
    """
    index = global_index(shape, offset, block, device)
    return hash_bits(index, seed, counter) >= threshold(p)


def dropout_noise(keep: torch.Tensor, p: float, dtype: torch.dtype) -> torch.Tensor:
    """torch's dropout noise from a keep mask: ``1 / (1 - p)`` where kept, 0 elsewhere (all
    0 when ``p == 1``), in ``dtype``."""
    noise = keep.to(dtype)
    return noise.zero_() if p == 1 else noise.div_(1 - p)


ALPHA = 1.7580993408473766  # SELU's alpha * scale, as torch's alpha dropout has it


def alpha_dropout_terms(keep, p: float):
    """torch's alpha dropout ``input * noise + shift`` from a 0/1 ``keep`` mask (float):
    ``(noise, shift)``, made with torch's own sequence of ops (``keep`` is used up). Works
    on DTensors too (the ranks run the same ops on their blocks)."""
    a = 1.0 / math.sqrt((ALPHA * ALPHA * p + 1) * (1 - p))
    shift = keep.add(-1).mul_(ALPHA * a).add_(ALPHA * a * p)
    return keep.mul_(a), shift


_ELEMENTWISE = ("dropout", "alpha_dropout")
_BATCHED = {"dropout1d": lambda n: n == 3, "dropout2d": lambda n: True,
            "dropout3d": lambda n: n == 5, "feature_alpha_dropout": lambda n: True}


def feature_shape(kind: str, shape: Sequence[int]) -> tuple[int, ...]:
    """The mask shape of ``F.<kind>`` on an input of ``shape``: the input's for ``dropout``
    and ``alpha_dropout``; for ``dropout1d/2d/3d`` and ``feature_alpha_dropout`` one value
    per (batch, channel), broadcast over the rest, with torch's reading of unbatched inputs
    (``dropout2d`` takes a 3-D input as batched).

    >>> feature_shape("dropout2d", (2, 3, 4, 5)), feature_shape("dropout1d", (3, 4))
    ((2, 3, 1, 1), (3, 1))
    """
    shape = tuple(shape)
    if kind in _ELEMENTWISE:
        return shape
    channel = 1 if _BATCHED[kind](len(shape)) else 0
    return shape[:channel + 1] + (1,) * (len(shape) - channel - 1)


def dropout(input: torch.Tensor, p: float = 0.5, *, seed: int, counter: int,
            kind: str = "dropout") -> torch.Tensor:
    """What ``F.<kind>(x, p, training=True)`` gives on DTensors at stream position
    (``seed``, ``counter``), computed on one device (differentiable): ``input * noise``, or
    ``input * noise + shift`` for the alpha kinds. ``kind`` is ``dropout``, ``dropout1d``,
    ``dropout2d``, ``dropout3d``, ``alpha_dropout`` or ``feature_alpha_dropout``."""
    if not 0 <= p <= 1:
        raise ValueError(f"dropout probability has to be between 0 and 1, but got {p}")
    keep = dropout_mask(feature_shape(kind, input.shape), p, seed=seed, counter=counter,
                        device=input.device)
    if "alpha" not in kind or p == 1:
        return input * dropout_noise(keep, p, input.dtype)
    noise, shift = alpha_dropout_terms(keep.to(input.dtype), p)
    return input * noise + shift


def attention_weights_shape(output_shape, key_shape) -> tuple[int, ...]:
    """The shape ``(*batch, L, S)`` of the attention weights, from the attention output's
    ``(*batch, L, Ev)`` and the key's ``(..., S, E)``."""
    return tuple(output_shape[:-1]) + (key_shape[-2],)


def attention_with_mask(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                        scale=None, enable_gqa=False, *, dropout_mask):
    """Scaled dot-product attention with the dropout mask given (bool, the attention
    weights' shape): torch's math implementation, ``softmax(q k^T * scale + mask) * keep /
    (1 - p) @ v``. The ranks run this; so does the one-device reference."""
    with warnings.catch_warnings():  # torch warns that a given mask is meant for testing
        warnings.simplefilter("ignore", UserWarning)
        out, _ = torch.ops.aten._scaled_dot_product_attention_math(
            query, key, value, attn_mask, dropout_p, is_causal, dropout_mask, scale=scale,
            enable_gqa=enable_gqa)
    return out


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0,
                                 is_causal=False, scale=None, enable_gqa=False, *, seed: int,
                                 counter: int) -> torch.Tensor:
    """What ``F.scaled_dot_product_attention(..., dropout_p=p)`` gives on DTensors at stream
    position (``seed``, ``counter``), on one device: the mask is drawn over the attention
    weights ``(*batch, L, S)``, indexed globally."""
    meta = [t.to("meta") for t in (query, key, value)]
    out = torch.nn.functional.scaled_dot_product_attention(*meta, enable_gqa=enable_gqa)
    shape = attention_weights_shape(out.shape, key.shape)
    keep = dropout_mask(shape, dropout_p, seed=seed, counter=counter, device=query.device)
    return attention_with_mask(query, key, value, attn_mask, dropout_p, is_causal, scale,
                               enable_gqa, dropout_mask=keep)


__all__ = ["StreamState", "state", "reset", "dropout_mask", "dropout_noise", "dropout",
           "alpha_dropout_terms",
           "feature_shape", "scaled_dot_product_attention", "attention_with_mask",
           "hash_bits", "global_index"]
