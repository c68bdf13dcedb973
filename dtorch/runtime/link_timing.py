"""Timing collectives on the ranks for the cost model (``dtorch.measure_links``). Worker side.

A kind is timed as the ranks run it for a redistribute: a planned ``Step`` through
``collectives.run_step`` (padding, the poison flag, the copies out of gloo's buffers and all),
on a mesh whose last dim's groups are the ones asked for, with one shard of the asked size on
each rank. ``send_recv`` sends along the given ``(source, destination)`` pairs at once. Each
size runs ``repeats + 1`` times (the first warms the buffers and the process group up and is
dropped; each result goes back to the rank's buffer pool, as a freed result does, so the next
run reuses its memory as a steady stream of redistributes would), each after a barrier of the whole world, so the ranks start together and the time is
the collective's own. They count in no ledger: not in the rank's step counts, not in its
``dist_calls`` (``collectives.uncounted``) and not in its ``comm_seconds`` (the context keeps
none), so no cell's collectives or measured time include them. Example (on
a rank)::

    time_collective(MeasureLinks(req, "all_reduce", ((0, 1), (2, 3)), (65536,), 3), interp)
    # {65536: [0.00021, 0.00019, 0.0002]}
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from ..mesh import DeviceMesh
from ..placement import Partial, Replicate, Shard
from ..redistribute import plan_redistribute
from .collectives import StepContext, run_step, uncounted

TRANSITIONS = {"all_gather": (Shard(0), Replicate()), "all_to_all": (Shard(0), Shard(1)),
               "all_reduce": (Partial(), Replicate()), "reduce_scatter": (Partial(), Shard(0))}


def time_collective(instr, interp) -> dict:
    """``{size: [seconds per repeat]}`` for this rank (every rank joins every barrier)."""
    out = {}
    with uncounted():
        for size in instr.sizes:
            run = _runner(instr.kind, instr.groups, interp, int(size))
            times = []
            for _ in range(instr.repeats + 1):
                dist.barrier()
                start = time.perf_counter()
                result = run() if run is not None else None
                times.append(time.perf_counter() - start)
                if result is not None:  # back to the pool, as a freed redistribute result is
                    interp.pool.give_back(result)
                    del result
            if run is not None:
                out[int(size)] = times[1:]
    return out


def _runner(kind: str, groups, interp, nbytes: int):
    """A closure running one ``kind`` step with ``nbytes`` per rank, or None (not a member)."""
    if kind == "send_recv":
        pairs = tuple(tuple(g) for g in groups if interp.rank in g)
        return _pairs_runner(pairs, interp.rank, nbytes, interp.device) if pairs else None
    if kind not in TRANSITIONS:
        raise ValueError(f"cannot time {kind!r}; timed kinds: {sorted(TRANSITIONS)}, send_recv")
    if not any(interp.rank in g for g in groups):
        return None
    mesh = DeviceMesh(interp.device.type, [list(g) for g in groups])  # groups = its last dim
    p = mesh.shape[1]
    rows, cols = _local_shape(nbytes, p)
    src, dst = TRANSITIONS[kind]
    shape = (rows * p, cols) if kind in ("all_gather", "all_to_all") else (rows, cols)
    step, = plan_redistribute(mesh, shape, [Replicate(), src], [Replicate(), dst])
    local = torch.ones((rows, cols), dtype=torch.float32, device=interp.device)
    ctx = StepContext(interp.rank, shape, torch.float32, mesh, mesh, interp.group_of,
                      interp.device, interp.pool)
    return lambda: run_step(step, local, ctx)[0]


def _local_shape(nbytes: int, p: int) -> tuple[int, int]:
    """A square-ish float32 shard of ``nbytes`` (power-of-two sides, rows divisible by ``p``),
    the shape a redistribute of a matrix moves.

    >>> _local_shape(4 * 2**20, 4), _local_shape(1024, 4)
    ((1024, 1024), (16, 16))
    """
    n = max(p * p, nbytes // 4)
    cols = 1 << ((n.bit_length() - 1) // 2)
    rows = max(p, n // cols // p * p)
    return rows, cols


def _pairs_runner(pairs, rank: int, nbytes: int, device):
    """Send ``nbytes`` along every pair where this rank is the source, receive where it is the
    destination, all at once (as a mesh move does)."""
    numel = max(1, nbytes // 4)
    bufs = {pair: torch.ones(numel, dtype=torch.float32, device=device) for pair in pairs}

    def run():
        ops = [dist.P2POp(dist.isend if src == rank else dist.irecv, bufs[(src, dst)],
                          dst if src == rank else src) for src, dst in pairs]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    return run
