"""Run one planned redistribute Step on this rank with torch.distributed.

The planner (``dtorch.redistribute``) decided what happens; this file only does it, padding
uneven shards to one size before each collective and cutting the padding off after. Every
member of a group computes the same padded sizes from the same pure layout math, so they all
agree without talking. Example (on a worker)::

    local = run_step(step, local, ctx)
"""

from __future__ import annotations

import time
from collections import Counter
from contextlib import contextmanager
from typing import Callable, NamedTuple

import torch
import torch.distributed as dist

from ..comm_debug import dim_name
from ..layout import chunk_sizes, local_shape
from ..mesh import DeviceMesh
from .poison_flag import (first_flagged, flag_codes, flag_element, flagged_row,
                          reduced_flag, wire_for_reduction)

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


class counted:  # noqa: N801 - a namespace: the collectives, counted (used by composite.py too)
    all_gather_flat = staticmethod(_count(_all_gather_flat))
    reduce_scatter_flat = staticmethod(_count(_reduce_scatter_flat))
    all_reduce = staticmethod(_count(dist.all_reduce))
    all_to_all_single = staticmethod(_count(dist.all_to_all_single))
    allgather_coalesced = staticmethod(_count(
        lambda pg, outputs, inputs: pg.allgather_coalesced(outputs, inputs).wait()))
    batch_isend_irecv = staticmethod(_count(dist.batch_isend_irecv))


def collective_calls() -> int:
    """torch.distributed collectives this process has issued through dtorch's steps."""
    return _calls[0]


def comm_key(step) -> str:
    """How measured times are keyed: ``"all_gather dp"`` (``dim_name``: the mesh dim's name,
    else its index, ``-`` for none), the same key the controller's records give.

    >>> from dtorch.comm_debug import CommRecord
    >>> comm_key(CommRecord("all_reduce", 1, None, ((0, 1),), 8))
    'all_reduce 1'
    """
    return f"{step.kind} {dim_name(step)}"


def add_comm_time(seconds: Counter | None, step, started: float) -> None:
    """Add the seconds since ``started`` (``time.perf_counter()``) to ``step``'s key of
    ``seconds`` (a rank's ``Interpreter.comm_seconds``; None: not kept)."""
    if seconds is not None:
        seconds[comm_key(step)] += time.perf_counter() - started


@contextmanager
def uncounted():
    """Collectives run inside do not count in ``dist_calls`` (the cost model's timing runs,
    ``link_timing.py``, which keep no ``comm_seconds`` either)."""
    calls = _calls[0]
    try:
        yield
    finally:
        _calls[0] = calls

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
    comm_seconds: Counter | None = None  # "kind dim" -> seconds inside collectives (kept)


def _empty(ctx: StepContext, shape, dtype) -> torch.Tensor:
    if ctx.pool is None or ctx.device.type != "cpu":
        return torch.empty(tuple(shape), dtype=dtype, device=ctx.device)
    return ctx.pool.empty(shape, dtype)


def _copy_of(ctx: StepContext, t: torch.Tensor) -> torch.Tensor:
    """A private contiguous copy of ``t`` (in the wire dtype), from the pool when possible."""
    t = _wire(t)
    return _empty(ctx, t.shape, t.dtype).copy_(t)


def _owning(view: torch.Tensor) -> torch.Tensor:
    """``view`` as a tensor of its own over the same memory (not a view: once freed, the
    rank's pool can take that memory back, as it does for every other result)."""
    return torch.empty(0, dtype=view.dtype, device=view.device).set_(
        view.untyped_storage(), view.storage_offset(), view.shape, view.stride())


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


def slots_of(group: tuple[int, ...]) -> list[int]:
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


# dtypes gloo (and NCCL) cannot move or reduce, carried as one that can hold every value:
# a sum wraps the same way once cast back (int16 sums modulo 2**16 as torch's do)
_WIRE_DTYPES = {torch.bool: torch.uint8, torch.int16: torch.int32, torch.uint16: torch.int32,
                torch.uint32: torch.int64}


def wire_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a collective carries ``dtype`` in.

    >>> wire_dtype(torch.bool), wire_dtype(torch.int16), wire_dtype(torch.float32)
    (torch.uint8, torch.int32, torch.float32)
    """
    return _WIRE_DTYPES.get(dtype, dtype)


def _wire(t: torch.Tensor) -> torch.Tensor:
    """``t`` in its wire dtype (bools as uint8: gloo has no bool reductions; int16 as int32)."""
    wire = wire_dtype(t.dtype)
    return t if wire == t.dtype else t.to(wire)


def _is_gloo(pg) -> bool:
    try:
        return dist.get_backend(pg) == "gloo"
    except Exception:  # noqa: BLE001 - not a registered group (tests with fakes): generic path
        return False


def _sizes(ctx: StepContext, placements, group, dim: int) -> list[int]:
    return [local_shape(ctx.shape, ctx.mesh, placements, ctx.mesh.get_coordinate(r))[dim]
            for r in group]


def _all_gather(step, local, ctx, group, pg, poisoned=False):
    """Gather the (padded) shards; each rank's poison flag travels in the same collective. On
    gloo, even shards are one coalesced all_gather of ``[shard, flag]`` that writes every
    block straight into the result (gloo copies out of its own buffer anyway); otherwise the
    flag follows each rank's chunk (see ``flagged_row``)."""
    d = step.src.dim
    sizes = _sizes(ctx, step.before, group, d)
    x = _wire(_pad(local, d, max(sizes)))
    slots = slots_of(group)
    if (len(set(sizes)) == 1 and x.numel() and not x.is_complex() and x.device.type == "cpu"
            and _is_gloo(pg) and hasattr(pg, "allgather_coalesced")):
        result, flags = _gather_coalesced(ctx, x.contiguous(), d, slots, pg, poisoned)
    else:
        result, flags = _gather_flat(ctx, x, d, sizes, slots, pg, poisoned)
    return result.to(local.dtype), first_flagged(flags, group, slots)


def _gather_coalesced(ctx, x, d, slots, pg, poisoned):
    """``(gathered tensor, flag per slot)``: slot j's shard lands in coordinate slots[j]'s block."""
    n, s = len(slots), x.shape[d]
    shape = list(x.shape)
    shape[d] = n * s
    result = _empty(ctx, shape, x.dtype)
    flags = torch.empty(n, dtype=x.dtype, device=ctx.device)
    outputs = [[result.narrow(d, c * s, s), flags[j:j + 1]] for j, c in enumerate(slots)]
    counted.allgather_coalesced(pg, outputs, [x, flag_element(x.dtype, poisoned, ctx.device)])
    return result, flags


def _gather_flat(ctx, x, d, sizes, slots, pg, poisoned):
    """``(gathered tensor, flag per slot)`` through one flat all_gather of ``shard + flag``
    chunks (``flagged_row`` elements each); the padding of uneven shards is cut off."""
    n, size = len(slots), x.numel()
    chunk = flagged_row(size, x.dtype)
    send = _empty(ctx, (chunk,), x.dtype)
    send[:size].view(x.shape).copy_(x)
    send[size:].fill_(int(poisoned))
    flat = _empty(ctx, (n * chunk,), x.dtype)
    counted.all_gather_flat(flat, send, group=pg)
    rows = flat.view(n, chunk)
    flags = rows[:, size].clone()
    blocks = rows[:, :size].view((n,) + tuple(x.shape))
    slot_of = {c: j for j, c in enumerate(slots)}
    result = _cat(ctx, [blocks[slot_of[c]].narrow(d, 0, s) for c, s in enumerate(sizes)], d)
    del rows, blocks
    _recycle(ctx, flat)
    _recycle(ctx, send)
    return result, flags


def _all_to_all(step, local, ctx, group, pg, poisoned=False):
    """Exchange the pieces along the target dim in one all_to_all: each piece is packed into
    a row of its own with the sender's poison flag after it (a copy of the shard that a
    Shard(0) -> Shard(k) move needs anyway: gloo sends contiguous pieces), and the pieces
    received are joined along the source dim (a copy of the result)."""
    d_src, d_dst = step.src.dim, step.dst.dim
    n, me, slots = len(group), group.index(ctx.rank), slots_of(group)
    src_sizes = _sizes(ctx, step.before, group, d_src)
    pieces = chunk_sizes(local.shape[d_dst], n)
    x = _wire(_pad(local, d_src, max(src_sizes)))
    piece_shape = list(x.shape)
    piece_shape[d_dst] = max(pieces)
    send, size = _pack_pieces(ctx, x, d_dst, pieces, slots, piece_shape, x.dtype,
                              int(poisoned))
    received = _empty(ctx, send.shape, x.dtype)
    counted.all_to_all_single(received, send, group=pg)
    _recycle(ctx, send)
    del send
    flags = received[:, size].clone()
    blocks = received[:, :size].view([n] + piece_shape)
    slot_of = {c: j for j, c in enumerate(slots)}
    parts = [blocks[slot_of[c]].narrow(d_src, 0, src_sizes[c]).narrow(d_dst, 0, pieces[me])
             for c in range(n)]
    result = _cat(ctx, parts, d_src).to(local.dtype)
    del parts, blocks
    _recycle(ctx, received)
    return result, first_flagged(flags, group, slots)


def _pack_pieces(ctx, x, dim, pieces, slots, piece_shape, dtype, flag) -> tuple:
    """``(buffer, size)``: row j of ``buffer`` holds, in its first ``size`` elements, the piece
    of ``x`` along ``dim`` for the member in collective slot j (zero-padded to
    ``piece_shape``), then ``flag`` (see ``flagged_row``)."""
    size = 1
    for s in piece_shape:
        size *= s
    out = _empty(ctx, (len(slots), flagged_row(size, dtype)), dtype)
    out[:, size:].fill_(flag)
    offsets = [sum(pieces[:c]) for c in range(len(pieces))]
    for j, c in enumerate(slots):
        dst = out[j, :size].view(piece_shape)
        if pieces[c] < piece_shape[dim]:
            dst.zero_()
        dst.narrow(dim, 0, pieces[c]).copy_(x.narrow(dim, offsets[c], pieces[c]))
    return out, size


def _cat(ctx, parts: list, dim: int) -> torch.Tensor:
    """``torch.cat(parts, dim)`` into a (pooled) buffer."""
    shape = list(parts[0].shape)
    shape[dim] = sum(p.shape[dim] for p in parts)
    return torch.cat(parts, dim, out=_empty(ctx, shape, parts[0].dtype))


def _all_reduce(step, local, ctx, group, pg, poisoned=False):
    """Reduce a copy of the shard with the poison flag as one extra element, reduced along
    (the copy is needed anyway: the reduction is in place)."""
    t, flagged = _reduced(step, local, ctx, group, pg, poisoned)
    t = _average(t, len(group)) if step.src.reduce_op == "avg" else t
    return t.to(local.dtype), flagged


def _reduced(step, local, ctx, group, pg, poisoned):
    """``(reduced copy of local, -1 if any member was poisoned else None)`` in one all_reduce."""
    buf = _flagged_copy(step, local, ctx, group, poisoned)
    counted.all_reduce(buf, op=_REDUCE_OPS[step.src.reduce_op], group=pg)
    return _unflagged(buf, local.shape, step.src.reduce_op)


def _flagged_copy(step, local, ctx, group, poisoned) -> torch.Tensor:
    """A flat copy of ``local`` with the poison flag as one extra element (the reduction is
    in place, so the copy is needed anyway)."""
    op = step.src.reduce_op
    x = _wire(local)
    buf = _empty(ctx, (x.numel() + 1,), wire_for_reduction(x.dtype, op, len(group)))
    buf[:-1].view(x.shape).copy_(x)
    buf[-1:].fill_(flag_codes(op)[1 if poisoned else 0])
    return buf


def _unflagged(buf: torch.Tensor, shape, op: str) -> tuple:
    return _owning(buf[:-1].view(shape)), (-1 if reduced_flag(buf[-1], op) else None)


class InFlight(NamedTuple):
    """An all_reduce started by ``start_all_reduce``: what ``finish_all_reduce`` needs."""

    work: object
    buf: torch.Tensor
    shape: torch.Size
    dtype: torch.dtype
    op: str
    n: int


def start_all_reduce(step, local: torch.Tensor, ctx: StepContext,
                     poisoned: bool = False) -> InFlight:
    """Post the all_reduce ``step`` of ``local`` (the flag inside its payload) and return at
    once: the backend moves the data while the rank runs its next instructions."""
    group = _my_group(step, ctx.rank)
    buf = _flagged_copy(step, local, ctx, group, poisoned)
    work = counted.all_reduce(buf, op=_REDUCE_OPS[step.src.reduce_op],
                              group=ctx.group_of(group), async_op=True)
    return InFlight(work, buf, local.shape, local.dtype, step.src.reduce_op, len(group))


def finish_all_reduce(pending: InFlight) -> tuple[torch.Tensor, int | None]:
    """Wait for a started all_reduce: ``(reduced tensor, -1 if a member was poisoned else
    None)``, as ``run_step`` returns them."""
    pending.work.wait()
    t, flagged = _unflagged(pending.buf, pending.shape, pending.op)
    t = _average(t, pending.n) if pending.op == "avg" else t
    return t.to(pending.dtype), flagged


def _reduce_scatter(step, local, ctx, group, pg, poisoned=False):
    d = step.dst.dim
    n, me = len(group), group.index(ctx.rank)
    pieces = chunk_sizes(local.shape[d], n)
    if _is_gloo(pg):
        # gloo's reduce_scatter (torch 2.x) is itself clone + all_reduce + copy of one chunk;
        # doing that here skips the stacked, padded copy of the whole input it would be given,
        # and the poison flag rides in the all_reduce
        full, flagged = _reduced(step, local, ctx, group, pg, poisoned)
        mine = full.narrow(d, sum(pieces[:me]), pieces[me])
        t = _empty(ctx, mine.shape, mine.dtype).copy_(mine)
        del mine, full
        t = _average(t, n) if step.src.reduce_op == "avg" else t
        return t.to(local.dtype), flagged
    return reduce_scatter_native(step, local, ctx, group, pg, poisoned)


def reduce_scatter_native(step, local, ctx, group, pg, poisoned=False):
    """The backend's own reduce_scatter (NCCL): each member's piece is packed with a flag
    element, reduced with the data. Returns ``(my reduced piece, -1 or None)``."""
    d, op = step.dst.dim, step.src.reduce_op
    n, me, slots = len(group), group.index(ctx.rank), slots_of(group)
    pieces = chunk_sizes(local.shape[d], n)
    x = _wire(local)
    piece_shape = list(x.shape)
    piece_shape[d] = max(pieces)
    inp, size = _pack_pieces(ctx, x, d, pieces, slots, piece_shape,
                             wire_for_reduction(x.dtype, op, n), flag_codes(op)[int(poisoned)])
    out = _empty(ctx, (inp.shape[1],), inp.dtype)
    counted.reduce_scatter_flat(out, inp.view(-1), op=_REDUCE_OPS[op], group=pg)
    flagged = -1 if reduced_flag(out[size], op) else None
    t = _owning(out[:size].view(piece_shape).narrow(d, 0, pieces[me]).contiguous())
    t = _average(t, n) if op == "avg" else t
    return t.to(local.dtype), flagged


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
            received = torch.empty(shape, dtype=wire_dtype(ctx.dtype), device=ctx.device)
            if received.numel():
                ops.append(dist.P2POp(dist.irecv, received, src))
    if ops:
        started = time.perf_counter()
        for work in counted.batch_isend_irecv(ops):
            work.wait()
        add_comm_time(ctx.comm_seconds, step, started)
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
    started = time.perf_counter()
    try:
        return _RUNNERS[step.kind](step, local, ctx, group, pg, poisoned)
    finally:
        add_comm_time(ctx.comm_seconds, step, started)


def is_comm_failure(exc: BaseException) -> bool:
    """A collective that timed out or lost a peer: the ranks may be out of step now."""
    text = str(exc).lower()
    return any(w in text for w in ("timed out", "timeout", "connection closed",
                                   "connection reset", "broken pipe"))
