"""The backend's own reduce_scatter (the NCCL path; gloo's ranks reduce_scatter through one
all_reduce instead) carries the poison flag inside each piece: run here on 4 plain gloo
processes, against torch, with a poisoned member and with uneven pieces."""

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dtorch import Partial, Shard, init_device_mesh
from dtorch.layout import chunk_sizes
from dtorch.redistribute import plan_redistribute
from dtorch.runtime.cluster import free_port
from dtorch.runtime.collectives import StepContext, collective_calls, reduce_scatter_native

CASES = [("sum", (8, 6), 0), ("avg", (8, 6), 1), ("max", (7, 5), 0), ("min", (6, 9), 1),
         ("sum", (3, 10), 0)]  # (reduce op, global shape, scattered dim); (3, 10) is uneven


def _rank(rank: int, port: int, poisoned_rank: int, out) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=4)
    mesh = init_device_mesh("cpu", 4)
    pg = dist.new_group([0, 1, 2, 3])
    got = []
    for op, shape, d in CASES:
        (step,) = plan_redistribute(mesh, shape, [Partial(op)], [Shard(d)], 4)
        ctx = StepContext(rank, shape, torch.float32, mesh, None, lambda g: pg)
        local = torch.arange(float(torch.Size(shape).numel())).view(shape) * (rank + 1)
        before = collective_calls()
        mine, flagged = reduce_scatter_native(step, local, ctx, (0, 1, 2, 3), pg,
                                              poisoned=rank == poisoned_rank)
        got.append((mine.numpy(), flagged, collective_calls() - before))
    out.put((rank, got))  # numpy arrays: a tensor would be fetched from this process later
    dist.destroy_process_group()


@pytest.mark.parametrize("poisoned_rank", [None, 2], ids=["clean", "rank-2-poisoned"])
def test_native_reduce_scatter_matches_torch_and_carries_the_flag(poisoned_rank):
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, poisoned_rank, out)) for r in range(4)]
    for p in procs:
        p.start()
    try:
        results = dict(out.get(timeout=120) for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.terminate()
    for i, (op, shape, d) in enumerate(CASES):
        locals_ = [torch.arange(float(torch.Size(shape).numel())).view(shape) * (r + 1)
                   for r in range(4)]
        stacked = torch.stack(locals_)
        full = {"sum": stacked.sum(0), "avg": stacked.mean(0), "max": stacked.amax(0),
                "min": stacked.amin(0)}[op]
        sizes = chunk_sizes(shape[d], 4)  # torch.chunk's pieces, as DTensor's Shard
        for r in range(4):
            mine, flagged, calls = results[r][i]
            assert calls == 1
            assert torch.equal(torch.from_numpy(mine), full.narrow(d, sum(sizes[:r]), sizes[r]))
            assert flagged == (None if poisoned_rank is None else -1)
