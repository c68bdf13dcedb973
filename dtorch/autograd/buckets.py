"""Bucketed gradient reduction (DDP's buckets): the Partial gradients of parameters that
reduce the same way are packed into flat buffers of about ``cap`` bytes, and each buffer is
reduced with one collective instead of one per parameter.

A parameter joins when it is registered (``register``: what ``DistributedDataParallel``
does) and its gradient only needs its Partial mesh dims reduced to Replicate, with the same
local shape on every rank (so each rank's flat buffer has the same length). Buckets are cut
in the order gradients become final in the walk (the reverse of the forward: the last
layers' first), per (mesh, placements, dtype). A bucket is a pack on the ranks, one planned
and counted all_reduce of the flat buffer, posted without waiting (``StartReduce``) as soon as
the bucket is full, so the rest of the backward runs while it moves, a ``FinishReduce`` at
the end of the walk, and an unpack into each gradient (tensors over the reduced buffer).
Gradients Partial on several mesh dims take the planned redistribute instead (one all_reduce
per dim, in the stream). CommDebugMode names the bucket's parameters. Example::

    register(model.parameters(), cap_bytes=25 * 2**20)
    loss.backward()          # one all_reduce per 25 MB of gradients, not one per parameter

The engine feeds a ``Bucketer`` each gradient as it becomes final and flushes it at the end.
"""

from __future__ import annotations

import math
import weakref
from typing import NamedTuple

import torch

from .. import comm_debug, layout
from ..placement import Partial, Replicate, Shard
from ..redistribute import plan_redistribute
from ..runtime import messages as m
from ..runtime.buffers import pooled_cat
from ..spec import make_spec

_CAPS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # AutogradMeta -> bytes
OVERLAP = True  # False: each bucket's all_reduce in the stream (bench/train_llama.py compares)


def register(params, cap_bytes: int) -> None:
    """Reduce these parameters' gradients in buckets of about ``cap_bytes``."""
    for p in params:
        if p._ag is not None:
            _CAPS[p._ag] = cap_bytes


def cap_of(meta) -> int | None:
    """The bucket size a parameter's gradient reduces in (None: on its own)."""
    return _CAPS.get(meta)


def bucket_key(meta, target, grads) -> tuple | None:
    """What a leaf's gradient shares with those it may be packed with, or None when it
    reduces alone (not registered, mixed placements, anything but Partial -> Replicate, or
    local shapes that differ between ranks)."""
    cap = _CAPS.get(meta)
    if cap is None or len({g.placements for g in grads}) != 1:
        return None
    g = grads[0]
    src, target = g.placements, tuple(target)
    if src == target or not all(a == b or (isinstance(a, Partial) and b == Replicate())
                                for a, b in zip(src, target)):
        return None
    if len(set(layout.local_shapes(g.shape, g.device_mesh, src).values())) != 1:
        return None
    return (g.device_mesh, src, target, g.dtype, cap)


def any_registered() -> bool:
    return len(_CAPS) > 0


class Bucketer:
    """Open buckets per key; a bucket's reduction starts as soon as it holds ``cap`` bytes
    (the key's last field), the rest start in ``flush``, which then waits for them all.
    Items: ``(meta, key, summed gradient, name)``.

    >>> Bucketer().flush()
    {}
    """

    def __init__(self):
        self.open: dict = {}  # key -> ([items], bytes)
        self.started: list = []  # StartedBucket, in the order their reductions started
        self.reduced: dict = {}  # id(meta) -> reduced gradient
        self._held: set = set()  # id(meta) of every item added

    def holds(self, meta) -> bool:
        return id(meta) in self._held

    def add(self, item) -> None:
        self._held.add(id(item[0]))
        key = item[1]
        items, size = self.open.pop(key, ([], 0))
        items.append(item)
        size += local_bytes(item[2])
        if size >= key[-1]:
            self.started.append(start_bucket(items, key))
        else:
            self.open[key] = (items, size)

    def flush(self) -> dict:
        """Start every open bucket, wait for every started one; every reduced gradient so
        far, by ``id(meta)``."""
        for key, (items, _) in self.open.items():
            self.started.append(start_bucket(items, key))
        self.open.clear()
        try:
            for bucket in self.started:
                self.reduced.update(finish_bucket(bucket))
        finally:
            self.started.clear()
        return self.reduced

    def abandon(self) -> None:
        """A backward that failed: the reductions already posted are finished on the ranks
        (their buffers go back once the handles drop), nothing more starts.

        >>> Bucketer().abandon()
        """
        self.open.clear()
        started, self.started = self.started, []
        for bucket in started:
            if bucket.in_flight:
                bucket.flat._live().issue(m.FinishReduce(bucket.flat._tid, bucket.key[0].ranks))


def local_bytes(g) -> int:
    """The bytes of one rank's shard of ``g`` (the same on every rank of a bucket)."""
    shape = layout.local_shape(g.shape, g.device_mesh, g.placements,
                               g.device_mesh.get_coordinate(g.device_mesh.ranks[0]))
    return math.prod(shape) * g.dtype.itemsize


class StartedBucket(NamedTuple):
    """A bucket whose reduction was issued: its leaves (``id(meta)``), each gradient's global
    and local shape, the flat buffer being reduced and whether that is an all_reduce still to
    wait for (the summed gradients themselves are not kept: the ranks free them once packed)."""

    leaves: list
    key: tuple
    shapes: list
    local_shapes: list
    flat: object  # DTensor
    in_flight: bool


def start_bucket(items: list, key: tuple) -> StartedBucket:
    """Pack the bucket's gradients on the ranks and start its reduction: one all_reduce
    posted without waiting (``StartReduce``: the rest of the backward runs while it moves),
    or, when the gradients are Partial on several mesh dims, the planned redistribute."""
    from ..local_call import run_local
    mesh, src, target, dtype, _ = key
    grads = [item[2] for item in items]
    coord = mesh.get_coordinate(mesh.ranks[0])
    shapes = [layout.local_shape(g.shape, mesh, src, coord) for g in grads]
    length = sum(math.prod(s) for s in shapes)
    sharded = math.prod(n for p, n in zip(src, mesh.shape) if p.is_shard())
    flat_src = tuple(Shard(0) if p.is_shard() else p for p in src)
    flat_target = tuple(Shard(0) if p.is_shard() else p for p in target)
    flat, = run_local(pack_flat, (grads,), {}, [make_spec((length * sharded,), dtype, mesh,
                                                          flat_src)])
    steps = plan_redistribute(mesh, flat._spec.shape, flat_src, flat_target, dtype.itemsize)
    names = [item[3] or "?" for item in items]
    leaves, global_shapes = [id(item[0]) for item in items], [g.shape for g in grads]
    del grads, items
    with comm_debug.gradient_of(f"bucket of {len(leaves)}: " + ", ".join(names)):
        if OVERLAP and len(steps) == 1 and steps[0].kind == "all_reduce":
            reduced, in_flight = _start_all_reduce(flat, steps[0], flat_target), True
        else:
            reduced, in_flight = flat._move(mesh, flat_target), False
    return StartedBucket(leaves, key, global_shapes, shapes, reduced, in_flight)


def _start_all_reduce(flat, step, target):
    """Issue ``StartReduce`` for ``flat`` (counted now, as the ranks count it when posted);
    the returned handle holds the reduction in flight until ``FinishReduce``."""
    from ..tensor import DTensor
    c, spec = flat._live(), flat._spec
    handle = DTensor._wrap(make_spec(spec.shape, spec.dtype, spec.mesh, target), c.new_tid(), c)
    c.issue(m.StartReduce(handle._tid, flat._tid, spec.shape, spec.dtype, spec.mesh, step,
                          spec.mesh.ranks))  # the handle first: nothing in flight is unowned
    comm_debug.record_steps((step,))
    return handle


def finish_bucket(bucket: StartedBucket) -> dict:
    """Wait for the bucket's reduction on the ranks and unpack it into one gradient per
    item: ``{id(meta): reduced gradient}``."""
    from ..local_call import run_local
    mesh, _, target, dtype, _ = bucket.key
    flat = bucket.flat
    if bucket.in_flight:
        flat._live().issue(m.FinishReduce(flat._tid, mesh.ranks))
    outs = run_local(unpack_flat, (flat,), {"shapes": bucket.local_shapes},
                     [make_spec(shape, dtype, mesh, target) for shape in bucket.shapes])
    return dict(zip(bucket.leaves, outs))


def pack_flat(grads) -> torch.Tensor:
    """Rank side: this rank's gradients, flattened one after another.

    >>> pack_flat([torch.ones(2, 2), torch.zeros(3)]).tolist()
    [1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0]
    """
    return pooled_cat(g.reshape(-1) for g in grads)  # into a buffer from the rank's pool


def unpack_flat(flat: torch.Tensor, shapes) -> tuple:
    """Rank side: the reduced gradients as views of the reduced buffer, in order.

    >>> [t.shape for t in unpack_flat(torch.arange(7.), [(2, 2), (3,)])]
    [torch.Size([2, 2]), torch.Size([3])]
    """
    from ..runtime.collectives import _owning
    sizes = [math.prod(s) for s in shapes]  # tensors of their own over the buffer: once all
    return tuple(_owning(piece.view(s))       # are freed, the rank's pool takes it back
                 for piece, s in zip(flat.split(sizes), shapes))
