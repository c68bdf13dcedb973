"""The rank side of ``fully_shard``: packing a module's parameter shards into one flat buffer
(one all_gather moves them all), unpacking the gathered buffer into whole parameters, the same
for gradients the other way (one reduce_scatter), and freeing / refilling the storage of the
whole parameters that the local autograd graphs saved.

Every ``Shard(0)`` parameter of ``rows`` rows has ``torch.chunk`` blocks of at most
``step = ceil(rows / n)`` rows on the ``n`` ranks; padded to ``step`` rows, every rank's
blocks flatten to the same ``width`` elements, so the flat buffer is evenly sharded and the
gathered one is ``n`` rows of ``width``. Example::

    >>> layout = flat_layout([(3, 2), (3,)], 2)     # a 3x2 weight and its bias on 2 ranks
    >>> layout.width, layout.steps                    # 2 padded rows of 2, plus 2 of 1
    (6, (2, 2))
    >>> w, b = torch.arange(6.).view(3, 2), torch.tensor([7., 8., 9.])
    >>> flat = torch.cat([pack_shards(w[:2], b[:2], layout=layout),
    ...                   pack_shards(w[2:], b[2:], layout=layout)])
    >>> [t.tolist() for t in unpack_whole(flat, layout=layout)]
    [[[0.0, 1.0], [2.0, 3.0], [4.0, 5.0]], [7.0, 8.0, 9.0]]
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from ..layout import chunk_sizes
from ..runtime.buffers import pooled_cat
from ..runtime.collectives import _pad


class FlatLayout(NamedTuple):
    """Where each parameter sits in a rank's flat block of ``width`` elements."""

    n: int                      # ranks the parameters are sharded over
    rows: tuple[int, ...]       # each parameter's dim-0 size
    steps: tuple[int, ...]      # its padded rows per rank (ceil(rows / n))
    rests: tuple[tuple, ...]    # its other dims
    offsets: tuple[int, ...]    # where its block starts in a rank's flat block
    width: int                  # a rank's flat block

    def size(self, i: int) -> int:
        return self.steps[i] * math.prod(self.rests[i])


def flat_layout(shapes, n: int) -> FlatLayout:
    """The layout of parameters of ``shapes`` (each at least 1-D) sharded ``Shard(0)`` on
    ``n`` ranks."""
    rows = tuple(int(s[0]) for s in shapes)
    steps = tuple(-(-r // n) for r in rows)
    rests = tuple(tuple(int(d) for d in s[1:]) for s in shapes)
    offsets, at = [], 0
    for step, rest in zip(steps, rests):
        offsets.append(at)
        at += step * math.prod(rest)
    return FlatLayout(n, rows, steps, rests, tuple(offsets), at)


def pack_shards(*shards: torch.Tensor, layout: FlatLayout) -> torch.Tensor:
    """This rank's flat block: each shard padded to its ``step`` rows, flattened, in order
    (into a buffer from the rank's pool: a fresh one page-faults)."""
    return pooled_cat(_pad(s, 0, step).reshape(-1) for s, step in zip(shards, layout.steps))


def unpack_whole(flat: torch.Tensor, layout: FlatLayout) -> tuple:
    """The whole parameters from the gathered flat buffer (``n`` blocks, rank order): each a
    tensor of its own (the storage ``free_storage`` may drop and ``refill`` fill again)."""
    blocks = flat.view(layout.n, layout.width)
    out = []
    for i, (rows, step, rest, at) in enumerate(zip(layout.rows, layout.steps, layout.rests,
                                                  layout.offsets)):
        piece = blocks[:, at:at + layout.size(i)].reshape((layout.n * step,) + rest)
        out.append(piece[:rows].clone())
    return tuple(out)


def pack_whole(*grads: torch.Tensor, layout: FlatLayout) -> torch.Tensor:
    """Whole gradients as the gathered layout (``n`` blocks of ``width``), flattened: what a
    reduce_scatter turns into each rank's flat block of the summed gradients."""
    parts = [_pad(g, 0, layout.n * step).reshape(layout.n, -1)
             for g, step in zip(grads, layout.steps)]
    return pooled_cat(parts, dim=1).reshape(-1)


def unpack_shards(flat: torch.Tensor, coordinate, layout: FlatLayout) -> tuple:
    """This rank's gradient shards (``torch.chunk`` blocks, padding cut) from its flat block."""
    me = coordinate[0]
    out = []
    for i, (rows, step, rest, at) in enumerate(zip(layout.rows, layout.steps, layout.rests,
                                                  layout.offsets)):
        mine = chunk_sizes(rows, layout.n)[me]
        out.append(flat[at:at + layout.size(i)].view((step,) + rest)[:mine].clone())
    return tuple(out)


def free_storage(*tensors: torch.Tensor, n_whole: int) -> None:
    """Drop the memory of the first ``n_whole`` tensors (and of every view and saved copy
    sharing it), except where one of the others (the module's outputs) shares it: an output
    that is a view of a weight keeps it."""
    kept = {t.untyped_storage().data_ptr() for t in tensors[n_whole:]}
    for t in tensors[:n_whole]:
        storage = t.untyped_storage()
        if storage.data_ptr() not in kept:
            storage.resize_(0)


def refill(*pairs: torch.Tensor) -> None:
    """``refill(old_1, ..., old_k, new_1, ..., new_k)``: give each freed ``old`` its memory back
    holding ``new``'s values, its version counter unchanged (the graphs that saved it see the
    tensor they saved)."""
    k = len(pairs) // 2
    for old, new in zip(pairs[:k], pairs[k:]):
        if old.untyped_storage().nbytes():  # kept (an output shares it)
            continue
        with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(old):
            old.untyped_storage().resize_(new.numel() * new.element_size())
            old.copy_(new)

