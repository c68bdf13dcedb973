"""Run a composite op's plan on one rank: local calls, all_to_all and send_recv steps.

The plan (``messages.CompositePlan``) was made on the controller; this file only does it.
The poison rule holds for every step: once this rank's inputs or one of its steps failed, it
skips its local calls but still takes part in every collective with zeros of the planned shape,
and a flag travels inside each collective (one extra element of every all_to_all piece, a
byte sent in the same batch as each shift), so a failure anywhere poisons every rank's result
and no peer waits. Example (on a worker, from ``Interpreter._call``)::

    outs = run_composite(interp, plan, inputs)
"""

from __future__ import annotations

import math
import time

import torch
import torch.distributed as dist

from . import messages as m
from .collectives import add_comm_time, counted, slots_of
from .poison_flag import first_flagged, flagged_row


class _Run:
    """One composite's state on this rank: the slots, the shifts in flight, the poison."""

    def __init__(self, interp, plan: m.CompositePlan):
        self.interp, self.plan, self.rank = interp, plan, interp.rank
        self.env: dict[int, torch.Tensor] = {}
        self.pending: dict[tuple, tuple] = {}  # Shift outs -> (works, flag, buffers)
        self.poison = None
        self.watch = set(plan.watch)
        self.peak = 0

    # values ----------------------------------------------------------------------------------
    def mine(self, table: tuple):
        """This rank's entry of a per-rank ``table`` of ``(rank, entry)`` pairs."""
        return self._once(table, lambda: dict(table)[self.rank])

    def my_group(self, groups: tuple) -> tuple:
        return self._once(groups, lambda: next(g for g in groups if self.rank in g))

    def _once(self, key: tuple, find):
        """``find()``, once per ``key`` object: plans are interned on the rank, so the same
        tables come back on every call (no O(world) lookup per step)."""
        hit = self.interp.mine.get(id(key))
        if hit is None or hit[0] is not key:
            hit = self.interp.mine[id(key)] = (key, find())
        return hit[1]

    def resolve(self, obj):
        t = type(obj)
        if t is m.Slot:
            return self.env[obj.index]
        if t is m.PerRank:
            return self.mine(obj.table)
        if t is m.Coord:
            return obj.mesh.get_coordinate(self.rank)
        if t in (list, tuple):
            return t(self.resolve(x) for x in obj)
        if t is dict:
            return {k: self.resolve(v) for k, v in obj.items()}
        return obj

    def value_or_zeros(self, slot: int, shape, like_dtype) -> torch.Tensor:
        """What this rank sends from ``slot``: its value, or zeros of the planned shape when
        poisoned (or when the value is missing or of the wrong shape: a bug stays local)."""
        value = self.env.get(slot)
        if self.poison is None and value is not None and tuple(value.shape) == tuple(shape):
            return value
        return torch.zeros(tuple(shape), dtype=like_dtype, device=self.interp.device)

    def fail(self, what: str, exc: BaseException) -> None:
        if self.poison is None:
            self.poison = self.interp._fail(f"{self.plan.name}: {what}", exc)

    def peer_failed(self, peer, kind: str) -> None:
        if self.poison is None:
            from .interpreter import Poison, RemoteFailure
            self.poison = Poison(RemoteFailure(
                self.rank, self.plan.name, f"rank {peer}'s data in this {kind} came from a "
                f"failed op; dtorch.synchronize() raises that failure with its traceback", ""))

    def held(self) -> int:
        """Bytes of the watched slots now held, buffers of shifts in flight included."""
        n = sum(_nbytes(v) for s, v in self.env.items() if s in self.watch)
        for outs, (_, _, bufs) in self.pending.items():
            n += sum(_nbytes(b) for s, b in zip(outs, bufs) if s in self.watch)
        return n

    # steps -----------------------------------------------------------------------------------
    def local(self, step: m.Local) -> None:
        if self.poison is not None:
            return
        try:
            result = step.fn(*self.resolve(step.args), **self.resolve(step.kwargs))
            outs = list(result) if isinstance(result, (tuple, list)) else [result]
            if len(outs) != len(step.outs):
                raise TypeError(f"{getattr(step.fn, '__name__', step.fn)} returned "
                                f"{len(outs)} values; the plan expects {len(step.outs)}")
        except Exception as exc:  # noqa: BLE001 - the failure becomes the outputs' poison
            self.fail(getattr(step.fn, "__name__", "local step"), exc)
            return
        self.env.update(zip(step.outs, outs))

    def exchange(self, step: m.Exchange, dtype) -> None:
        in_shape, send_sizes, recv_shapes, pad_shape = self.mine(step.table)
        group = self.my_group(step.groups)
        pg = self.interp.group_of(group)
        value = self.value_or_zeros(step.src, in_shape, dtype)
        try:
            send = _pack_pieces(value, step.split_dim, send_sizes, pad_shape, group, dtype)
        except Exception as exc:  # noqa: BLE001 - take part anyway, with zeros
            self.fail("packing an all_to_all", exc)
            send = torch.zeros((len(group), flagged_row(math.prod(pad_shape), dtype)),
                               dtype=dtype, device=self.interp.device)
        size = math.prod(pad_shape)
        send[:, size:].fill_(int(self.poison is not None))  # the flag rides in each piece
        recv = torch.empty_like(send)
        started = time.perf_counter()
        counted.all_to_all_single(recv, send, group=pg)
        add_comm_time(self.interp.comm_seconds, step, started)
        peer = first_flagged(recv[:, size], group, slots_of(group))
        if peer is not None:
            self.peer_failed(peer, "all_to_all")
        if self.poison is None:
            pieces = recv[:, :size].view((len(group),) + tuple(pad_shape))
            self.env[step.out] = _unpack_pieces(pieces, step.cat_dim, recv_shapes, group)

    def shift(self, step: m.Shift, dtype) -> None:
        send_to, recv_from, send_shapes, recv_shapes = self.mine(step.table)
        dev = self.interp.device
        sends = [self.value_or_zeros(s, shape, dtype).contiguous()
                 for s, shape in zip(step.srcs, send_shapes)]
        flag_out = torch.tensor([int(self.poison is not None)], dtype=torch.uint8, device=dev)
        flag_in = torch.zeros(1, dtype=torch.uint8, device=dev)
        bufs = [torch.empty(tuple(shape), dtype=dtype, device=dev) for shape in recv_shapes]
        ops = [dist.P2POp(dist.isend, flag_out, send_to)]
        ops += [dist.P2POp(dist.isend, t, send_to) for t in sends if t.numel()]
        ops.append(dist.P2POp(dist.irecv, flag_in, recv_from))
        ops += [dist.P2POp(dist.irecv, b, recv_from) for b in bufs if b.numel()]
        works = counted.batch_isend_irecv(ops)
        self.pending[step.outs] = (works, (flag_in, recv_from, sends), bufs)

    def wait(self, step: m.Wait) -> None:
        works, (flag_in, peer, _sends), bufs = self.pending.pop(step.outs)
        for work in works:
            work.wait()
        if flag_in.item():
            self.peer_failed(peer, "send_recv")
        if self.poison is None:
            self.env.update(zip(step.outs, bufs))

    def drop(self, step: m.Drop) -> None:
        for s in step.slots:
            self.env.pop(s, None)


def _nbytes(t) -> int:
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0


def _pack_pieces(value, dim, sizes, pad_shape, group, dtype) -> torch.Tensor:
    """``[n, flagged_row(numel(pad_shape))]``: row j holds piece c of ``value`` along ``dim``
    (sizes ``sizes``) for the member in slot j, zero-padded to ``pad_shape``; the rest of each
    row is left for the poison flag."""
    out = torch.zeros((len(group), flagged_row(math.prod(pad_shape), dtype)), dtype=dtype,
                      device=value.device)
    starts = [sum(sizes[:c]) for c in range(len(sizes))]
    size = math.prod(pad_shape)
    for j, c in enumerate(slots_of(group)):
        piece = value.narrow(dim, starts[c], sizes[c])
        out[j, :size].view(pad_shape)[tuple(slice(0, s) for s in piece.shape)].copy_(piece)
    return out


def _unpack_pieces(recv, dim, shapes, group) -> torch.Tensor:
    """The pieces received (coordinate c's piece has shape ``shapes[c]``), padding cut off,
    concatenated along ``dim`` in coordinate order."""
    slot_of = {c: j for j, c in enumerate(slots_of(group))}
    parts = [recv[slot_of[c]][tuple(slice(0, s) for s in shape)]
             for c, shape in enumerate(shapes)]
    return torch.cat(parts, dim)


def run_composite(interp, plan: m.CompositePlan, inputs: list) -> list:
    """Interpret ``plan`` on this rank; returns its outputs (``Poison`` values on failure).

    ``inputs`` are the local shards (or a ``Poison``). Collective failures between ranks
    (a timeout, a lost peer) propagate to the caller, which marks the rank broken."""
    from .interpreter import Poison
    dtype = plan.dtype
    run = _Run(interp, plan)
    for i, value in enumerate(inputs):
        if isinstance(value, Poison):
            run.poison = run.poison or value
        else:
            run.env[i] = value
    run.peak = run.held()
    for step in plan.steps:
        kind = type(step)
        if kind is m.Local:
            run.local(step)
        elif kind is m.Exchange:
            run.exchange(step, dtype)
            interp.counts[step.kind] += 1
        elif kind is m.Shift:
            run.shift(step, dtype)
            interp.counts[step.kind] += 1
        elif kind is m.Wait:
            run.wait(step)
        elif kind is m.Drop:
            run.drop(step)
        run.peak = max(run.peak, run.held())
    interp.composite_peak_bytes = run.peak
    if run.poison is not None:
        return [run.poison] * len(plan.outputs)
    return [run.env[s] for s in plan.outputs]
