"""Run one planned redistribute Step on this rank with torch.distributed.

The planner (``dtorch.redistribute``) decided what happens; this file only does it, padding
uneven shards to one size before each collective and cutting the padding off after. Every
member of a group computes the same padded sizes from the same pure layout math, so they all
agree without talking. Example (on a worker)::

    local = run_step(step, local, ctx)
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch
import torch.distributed as dist

from ..layout import chunk_sizes, local_shape
from ..mesh import DeviceMesh

# torch 2.13 renamed the flat-buffer collectives; keep working on older releases too.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

_calls = [0]  # torch.distributed collectives this process issued through the steps below


def _count(fn):
    """``fn`` that also counts its calls (``rank_stats()['dist_calls']``: tests check one
    placement change is one collective)."""
    def call(*args, **kwargs):
        _calls[0] += 1
        return fn(*args, **kwargs)
    return call


class _counted:  # noqa: N801 - a namespace of the counted collectives
    all_gather_flat = staticmethod(_count(_all_gather_flat))
    reduce_scatter_flat = staticmethod(_count(_reduce_scatter_flat))
    all_reduce = staticmethod(_count(dist.all_reduce))
    all_to_all_single = staticmethod(_count(dist.all_to_all_single))
    batch_isend_irecv = staticmethod(_count(dist.batch_isend_irecv))


def collective_calls() -> int:
    """torch.distributed collectives this process has issued through dtorch's steps."""
    return _calls[0]

_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.SUM,
               "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


class StepContext(NamedTuple):
    """What a step needs besides the tensor: who I am and how to find a process group."""

    rank: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    mesh: DeviceMesh
    dst_mesh: DeviceMesh | None
    group_of: Callable[[tuple[int, ...]], object]
    device: torch.device = torch.device("cpu")
    pool: object = None  # a BufferPool: outputs and send buffers reuse freed memory


def _empty(ctx: StepContext, shape, dtype) -> torch.Tensor:
    if ctx.pool is None or ctx.device.type != "cpu":
        return torch.empty(tuple(shape), dtype=dtype, device=ctx.device)
    return ctx.pool.empty(shape, dtype)


def _copy_of(ctx: StepContext, t: torch.Tensor) -> torch.Tensor:
    """A private contiguous copy of ``t`` (in the wire dtype), from the pool when possible."""
    t = _wire(t)
    return _empty(ctx, t.shape, t.dtype).copy_(t)


def _recycle(ctx: StepContext, t: torch.Tensor) -> None:
    """Hand a temporary back to the pool (the caller drops its reference right after)."""
    if ctx.pool is not None:
        ctx.pool.give_back(t, _callers_refs=2)


def _my_group(step, rank: int) -> tuple[int, ...]:
    for g in step.groups:
        if rank in g:
            return g
    raise RuntimeError(f"rank {rank} is in no group of step {step.kind} on mesh dim "
                       f"{step.mesh_dim}")


def _slots(group: tuple[int, ...]) -> list[int]:
    """torch.distributed orders a group by global rank; entry j is the mesh coordinate (index
    in ``group``) of the member in collective slot j."""
    return [group.index(r) for r in sorted(group)]


def _pad(t: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    missing = size - t.shape[dim]
    if missing <= 0:
        return t
    pad_shape = list(t.shape)
    pad_shape[dim] = missing
    return torch.cat([t, t.new_zeros(pad_shape)], dim)


def _wire(t: torch.Tensor) -> torch.Tensor:
    """gloo has no bool reductions: carry bools as uint8."""
    return t.to(torch.uint8) if t.dtype == torch.bool else t


def _is_gloo(pg) -> bool:
    try:
        return dist.get_backend(pg) == "gloo"
    except Exception:  # noqa: BLE001 - not a registered group (tests with fakes): generic path
        return False


def _sizes(ctx: StepContext, placements, group, dim: int) -> list[int]:
    return [local_shape(ctx.shape, ctx.mesh, placements, ctx.mesh.get_coordinate(r))[dim]
            for r in group]


def _all_gather(step, local, ctx, group, pg, poisoned=False):
    """Gather the (padded) shards; each rank's chunk carries its poison flag as one extra
    element when the chunk is small, else a flag all_reduce runs beside the gather (the
    in-chunk flag would cost a copy of a large chunk and of the result: see EMBED_MAX)."""
    d = step.src.dim
    sizes = _sizes(ctx, step.before, group, d)
    buf = _wire(_pad(local, d, max(sizes))).contiguous()
    n = len(group)
    slot_of = {c: j for j, c in enumerate(_slots(group))}
    if buf.numel() * buf.element_size() < EMBED_MAX and _flag_fits(buf.dtype):
        chunk = buf.numel() + 1
        send = _empty(ctx, (chunk,), buf.dtype)
        send[:-1].copy_(buf.reshape(-1))
        send[-1] = 1 if poisoned else 0
        flat = _empty(ctx, (n * chunk,), buf.dtype)
        _counted.all_gather_flat(flat, send, group=pg)
        rows = flat.view(n, chunk)
        peer = _first_flagged(rows[:, -1], group, _slots(group))
        out = rows[:, :-1].reshape((n,) + tuple(buf.shape))
        result = torch.cat([out[slot_of[c]].narrow(d, 0, s) for c, s in enumerate(sizes)], d)
        del out, rows
        _recycle(ctx, flat)
        _recycle(ctx, send)
        return result.to(local.dtype), peer
    with _flag_beside(ctx, pg, poisoned) as flag:
        flat = _empty(ctx, (n * buf.shape[0],) + tuple(buf.shape[1:]), buf.dtype)
        if buf.numel():
            _counted.all_gather_flat(flat, buf, group=pg)
    if d == 0 and len(set(sizes)) == 1 and list(slot_of) == sorted(slot_of):
        return flat.to(local.dtype), flag.peer
    out = flat.view((n,) + tuple(buf.shape))
    result = torch.cat([out[slot_of[c]].narrow(d, 0, s) for c, s in enumerate(sizes)], d)
    del out
    _recycle(ctx, flat)
    return result.to(local.dtype), flag.peer


def _all_to_all(step, local, ctx, group, pg, poisoned=False):
    """Exchange the pieces. Small pieces carry the sender's poison flag as one extra element
    (they are packed into a send buffer anyway); large ones keep the zero-copy layouts of
    :func:`_all_to_all_plain` with a flag all_reduce beside (see EMBED_MAX)."""
    d_src, d_dst = step.src.dim, step.dst.dim
    n, me = len(group), group.index(ctx.rank)
    src_sizes = _sizes(ctx, step.before, group, d_src)
    pieces = chunk_sizes(local.shape[d_dst], n)
    x = _wire(_pad(local, d_src, max(src_sizes)))
    if x.numel() * x.element_size() >= EMBED_MAX * n or not _flag_fits(x.dtype):
        with _flag_beside(ctx, pg, poisoned) as flag:
            result = _all_to_all_plain(step, local, ctx, group, pg)
        return result, flag.peer
    return _exchange(x, local, ctx, group, pg, d_src, d_dst, src_sizes, pieces, me, n, poisoned)


def _all_to_all_plain(step, local, ctx, group, pg):
    """The exchange with its zero-copy fast paths (large pieces; the flag runs beside)."""
    d_src, d_dst = step.src.dim, step.dst.dim
    n, me = len(group), group.index(ctx.rank)
    src_sizes = _sizes(ctx, step.before, group, d_src)
    pieces = chunk_sizes(local.shape[d_dst], n)
    x = _wire(_pad(local, d_src, max(src_sizes)))
    offsets = [sum(pieces[:j]) for j in range(n)]
    slots = _slots(group)
    in_order = slots == list(range(n))
    piece_shape = list(x.shape)
    piece_shape[d_dst] = max(pieces)
    temp = None
    if d_dst == 0 and in_order and len(set(pieces)) == 1:
        # the pieces already lie one after the other: a view, not a copy
        inp = x.contiguous().view([n] + piece_shape)
    else:
        temp = _empty(ctx, [n * piece_shape[0]] + piece_shape[1:], x.dtype)
        inp = temp.view([n] + piece_shape)
        for j, c in enumerate(slots):
            if pieces[c] < max(pieces):
                inp[j].zero_()
            inp[j].narrow(d_dst, 0, pieces[c]).copy_(x.narrow(d_dst, offsets[c], pieces[c]))
    received = _empty(ctx, [n * piece_shape[0]] + piece_shape[1:], x.dtype)
    out = received.view([n] + piece_shape)
    if inp.numel():
        _counted.all_to_all_single(out, inp, group=pg)
    del inp
    if temp is not None:
        _recycle(ctx, temp)
        del temp
    if d_src == 0 and in_order and len(set(src_sizes)) == 1 and pieces[me] == max(pieces):
        # nothing to cut off and the blocks arrive in order along dim 0: the buffer is the result
        del out
        return received.to(local.dtype)
    slot_of = {c: j for j, c in enumerate(slots)}
    parts = [out[slot_of[c]].narrow(d_src, 0, src_sizes[c]).narrow(d_dst, 0, pieces[me])
             for c in range(n)]
    result = torch.cat(parts, d_src).to(local.dtype)
    del parts, out
    _recycle(ctx, received)
    return result


def _exchange(x, local, ctx, group, pg, d_src, d_dst, src_sizes, pieces, me, n, poisoned):
    """all_to_all of ``x``'s pieces along ``d_dst``, each piece ending with the sender's flag
    element; returns the result and the first poisoned peer (or None)."""
    offsets = [sum(pieces[:j]) for j in range(n)]
    slots = _slots(group)
    piece_shape = list(x.shape)
    piece_shape[d_dst] = max(pieces)
    size = 1
    for s_ in piece_shape:
        size *= s_
    temp = _empty(ctx, (n, size + 1), x.dtype)
    for j, c in enumerate(slots):
        dst = temp[j, :size].view(piece_shape)
        if pieces[c] < max(pieces):
            dst.zero_()
        dst.narrow(d_dst, 0, pieces[c]).copy_(x.narrow(d_dst, offsets[c], pieces[c]))
    temp[:, -1] = 1 if poisoned else 0
    received = _empty(ctx, (n, size + 1), x.dtype)
    if temp.numel():
        _counted.all_to_all_single(received, temp, group=pg)
    _recycle(ctx, temp)
    del temp
    peer = _first_flagged(received[:, -1], group, slots)
    slot_of = {c: j for j, c in enumerate(slots)}
    parts = [received[slot_of[c], :size].view(piece_shape).narrow(d_src, 0, src_sizes[c])
             .narrow(d_dst, 0, pieces[me]) for c in range(n)]
    result = torch.cat(parts, d_src).to(local.dtype)
    del parts
    _recycle(ctx, received)
    return result, peer


def _all_reduce(step, local, ctx, group, pg, poisoned=False):
    """Reduce a copy of the shard with the poison flag as one extra element, reduced along
    (the copy is needed anyway: the reduction is in place)."""
    t, flagged = _reduced(step, local, ctx, pg, poisoned)
    t = t.to(local.dtype)
    return (_average(t, len(group)) if step.src.reduce_op == "avg" else t), flagged


def _reduced(step, local, ctx, pg, poisoned):
    """``(reduced copy of local, whether any member was poisoned)`` in one all_reduce."""
    op = step.src.reduce_op
    x = _wire(local)
    if not _flag_fits(x.dtype):
        with _flag_beside(ctx, pg, poisoned) as flag:
            t = _copy_of(ctx, local)
            if t.numel():
                _counted.all_reduce(t, op=_REDUCE_OPS[op], group=pg)
        return t, flag.peer
    buf = _empty(ctx, (x.numel() + 1,), x.dtype)
    buf[:-1].view(x.shape).copy_(x)
    normal, bad = _FLAG_CODES[op]
    buf[-1] = bad if poisoned else normal
    _counted.all_reduce(buf, op=_REDUCE_OPS[op], group=pg)
    flagged = buf[-1].item() != normal
    return buf[:-1].view(x.shape), (-1 if flagged else None)


def _reduce_scatter(step, local, ctx, group, pg, poisoned=False):
    d = step.dst.dim
    n, me = len(group), group.index(ctx.rank)
    pieces = chunk_sizes(local.shape[d], n)
    if _is_gloo(pg):
        # gloo's reduce_scatter (torch 2.x) is itself clone + all_reduce + copy of one chunk;
        # doing that here skips the stacked, padded copy of the whole input it would be given,
        # and the poison flag rides in the all_reduce
        full, flagged = _reduced(step, local, ctx, pg, poisoned)
        mine = full.narrow(d, sum(pieces[:me]), pieces[me])
        t = _empty(ctx, mine.shape, mine.dtype).copy_(mine).to(local.dtype)
        del mine, full
        return (_average(t, n) if step.src.reduce_op == "avg" else t), flagged
    with _flag_beside(ctx, pg, poisoned) as flag:
        t = _reduce_scatter_nccl(step, local, ctx, group, pg, d, n, me, pieces)
    return t, flag.peer


def _reduce_scatter_nccl(step, local, ctx, group, pg, d, n, me, pieces):
    x = _wire(local)
    offsets = [sum(pieces[:j]) for j in range(n)]
    inp = torch.stack([_pad(x.narrow(d, offsets[c], pieces[c]), d, max(pieces))
                       for c in _slots(group)]).contiguous()
    out = inp.new_empty(inp.shape[1:])
    inp = inp.reshape((-1,) + tuple(inp.shape[2:]))  # gloo wants n outputs stacked on dim 0
    if inp.numel():
        _counted.reduce_scatter_flat(out, inp, op=_REDUCE_OPS[step.src.reduce_op], group=pg)
    t = out.narrow(d, 0, pieces[me]).to(local.dtype)
    return _average(t, n) if step.src.reduce_op == "avg" else t


def _average(t: torch.Tensor, n: int) -> torch.Tensor:
    if t.is_floating_point() or t.is_complex():
        return t / n
    return torch.div(t, n, rounding_mode="floor")


def _slice(step, local, ctx, group, pg):
    d = step.dst.dim
    n, me = len(group), group.index(ctx.rank)
    pieces = chunk_sizes(local.shape[d], n)
    mine = local.narrow(d, sum(pieces[:me]), pieces[me])
    return _empty(ctx, mine.shape, mine.dtype).copy_(mine)


def _to_partial(step, local, ctx, group, pg):
    if step.dst.reduce_op == "sum" and group.index(ctx.rank) != 0:
        return _empty(ctx, local.shape, local.dtype).zero_()  # pooled: no fresh page faults
    return local


def send_recv(step, local, ctx, poisoned: bool = False):
    """Move shards between two meshes of the same shape, rank by coordinate.

    A one-byte flag travels with each shard, so a poisoned source poisons its destination.
    Returns ``(new local or None, whether the received shard was poisoned)``.
    """
    ops, received, flag_in = [], None, None
    for src, dst in step.groups:
        if src == ctx.rank:
            flag = torch.tensor([int(poisoned)], dtype=torch.uint8, device=ctx.device)
            ops.append(dist.P2POp(dist.isend, flag, dst))
            if local.numel():
                ops.append(dist.P2POp(dist.isend, _wire(local).contiguous(), dst))
        if dst == ctx.rank:
            flag_in = torch.zeros(1, dtype=torch.uint8, device=ctx.device)
            ops.append(dist.P2POp(dist.irecv, flag_in, src))
            coord = ctx.dst_mesh.get_coordinate(dst)
            shape = local_shape(ctx.shape, ctx.dst_mesh, step.after, coord)
            wire_dtype = torch.uint8 if ctx.dtype == torch.bool else ctx.dtype
            received = torch.empty(shape, dtype=wire_dtype, device=ctx.device)
            if received.numel():
                ops.append(dist.P2POp(dist.irecv, received, src))
    if ops:
        for work in _counted.batch_isend_irecv(ops):
            work.wait()
    if received is not None:
        return received.to(ctx.dtype), bool(flag_in.item())
    keeps = ctx.dst_mesh.get_coordinate(ctx.rank) is not None
    return (local if keeps else None), poisoned and keeps


_RUNNERS = {"all_gather": _all_gather, "all_to_all": _all_to_all, "all_reduce": _all_reduce,
            "reduce_scatter": _reduce_scatter, "slice": _slice, "to_partial": _to_partial}


def run_step(step, local: torch.Tensor, ctx: StepContext,
             poisoned: bool = False) -> tuple[torch.Tensor, int | None]:
    """Apply one mesh-dim step (not ``send_recv``).

    Returns this rank's new local tensor and a rank of the group that came in poisoned (-1
    when a reduction says only that one did; None if none did). The poison flag rides inside
    the collective's own payload (one extra element per chunk, reduced or gathered with the
    data), so one step is one collective and a failure on one rank poisons its peers' outputs
    instead of handing them zeros.
    """
    group = _my_group(step, ctx.rank)
    if not step.is_collective:
        return _RUNNERS[step.kind](step, local, ctx, group, None), None
    pg = ctx.group_of(group)
    return _RUNNERS[step.kind](step, local, ctx, group, pg, poisoned)


# the poison flag ------------------------------------------------------------------------------
EMBED_MAX = 1 << 16  # all_gather / all_to_all chunks up to this many bytes carry the flag
# inside; larger ones keep their zero-copy layouts (the flag beside them is overlapped: the
# bench measured 0.04 ms of waiting for it, less than the copies an in-chunk flag costs)
# (normal, poisoned) flag values per reduction, so the reduced flag says whether any was poisoned
_FLAG_CODES = {"sum": (0, 1), "avg": (0, 1), "max": (0, 1), "min": (1, 0)}


def _flag_fits(dtype) -> bool:
    """An 8-bit wire type could wrap a summed flag: those use the flag beside instead."""
    return dtype.itemsize > 1


def _first_flagged(flags: torch.Tensor, group, slots) -> int | None:
    """The rank of the first collective slot whose flag element is set, or None."""
    hit = torch.nonzero(flags).flatten()
    return group[slots[int(hit[0])]] if hit.numel() else None


class _FlagBeside:
    """A one-element MAX all_reduce of the flags, overlapped with a collective (for payloads
    that cannot carry the flag cheaply); ``peer`` is set once the block ends."""

    def __init__(self, ctx, pg, poisoned):
        self.flag = torch.tensor([ctx.rank + 1 if poisoned else 0], dtype=torch.int32,
                                 device=ctx.device)
        self.pg, self.peer = pg, None

    def __enter__(self):
        self.work = _counted.all_reduce(self.flag, op=dist.ReduceOp.MAX, group=self.pg,
                                    async_op=True)
        return self

    def __exit__(self, *exc):
        self.work.wait()
        value = int(self.flag.item())
        self.peer = value - 1 if value else None
        return False


_flag_beside = _FlagBeside


def is_comm_failure(exc: BaseException) -> bool:
    """A collective that timed out or lost a peer: the ranks may be out of step now."""
    text = str(exc).lower()
    return any(w in text for w in ("timed out", "timeout", "connection closed",
                                   "connection reset", "broken pipe"))
