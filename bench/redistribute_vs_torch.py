"""redistribute() vs raw torch.distributed doing the same collective on the same bytes.

For each collective a placement change implies on a 4-rank 1-D mesh,
all_gather (Shard(0)->Replicate), all_to_all (Shard(0)->Shard(1)), all_reduce
(Partial->Replicate) and reduce_scatter (Partial->Shard(0)), on a float32 global tensor of
1 MB, 16 MB and 64 MB (``--quick``: 1 MB and 16 MB):

- reference: 4 processes spawned with torch.multiprocessing, gloo on 127.0.0.1, the same
  collective on preallocated buffers of the same bytes per rank (all_gather_single,
  all_to_all_single, all_reduce, reduce_scatter_single: the calls dtorch's workers make),
  timed inside the ranks between barriers; the slowest rank counts. The note column also compares dtorch with torch
  allocating a fresh output per op (all_reduce: on a clone), which an out-of-place result
  like redistribute's needs.
- dtorch: timed on the controller: issue N ``x.redistribute(...)`` then ``dtorch.synchronize()``,
  divided by N, after one warm-up (so the batch hop and the final round trip are included,
  spread over N).

Both report the median over repeats; ranks use the same torch thread count. Target: dtorch at
most 1.15x the reference for tensors of 16 MB and up (1 MB rows are information only).

    .venv/bin/python bench/redistribute_vs_torch.py [--quick]
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import Row, free_port, main, median, rank_threads  # noqa: E402

WORLD = 4
MB = 1 << 20
KINDS = ("all_gather", "all_to_all", "all_reduce", "reduce_scatter")
TARGET = 1.15


def _shape(nbytes: int) -> tuple[int, int]:
    """A square-ish float32 matrix of ``nbytes`` whose sides divide by WORLD (even shards)."""
    n = nbytes // 4
    rows = 1 << ((n.bit_length() - 1) // 2)
    return rows, n // rows


def cases(quick: bool) -> list[tuple[str, int, int]]:
    """(collective, global bytes, ops per timed repeat)."""
    sizes = {1 * MB: 20, 16 * MB: 4} if quick else {1 * MB: 40, 16 * MB: 6, 64 * MB: 3}
    return [(kind, size, n) for size, n in sizes.items() for kind in KINDS]


# reference: raw torch.distributed -------------------------------------------------------------
def _rank_main(rank: int, port: int, todo, repeats: int, queue) -> None:
    import torch
    import torch.distributed as dist
    from datetime import timedelta
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(rank_threads(WORLD))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=WORLD, timeout=timedelta(seconds=300))
    # the same entry points dtorch.runtime.collectives uses
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    results = {}
    for kind, nbytes, n in todo:
        elems = nbytes // 4
        # (preallocated buffers, a fresh output per op as an out-of-place result needs)
        if kind == "all_gather":
            inp, out = torch.ones(elems // WORLD), torch.empty(elems)
            ops = (lambda: gather(out, inp),
                   lambda: gather(torch.empty(elems), inp))
        elif kind == "all_to_all":
            inp, out = torch.ones(elems // WORLD), torch.empty(elems // WORLD)
            ops = (lambda: dist.all_to_all_single(out, inp),
                   lambda: dist.all_to_all_single(torch.empty(elems // WORLD), inp))
        elif kind == "all_reduce":
            inp = torch.ones(elems)
            ops = (lambda: dist.all_reduce(inp),
                   lambda: dist.all_reduce(inp.clone()))
        else:
            inp, out = torch.ones(elems), torch.empty(elems // WORLD)
            ops = (lambda: scatter(out, inp),
                   lambda: scatter(torch.empty(elems // WORLD), inp))
        times = [[], []]
        for op in ops:
            op()  # warm-up
        for _ in range(repeats):
            for op, acc in zip(ops, times):
                dist.barrier()
                t0 = time.perf_counter()
                for _ in range(n):
                    op()
                dist.barrier()
                acc.append((time.perf_counter() - t0) / n)
        slowest = torch.tensor(times, dtype=torch.float64)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        results[(kind, nbytes)] = tuple(median(row) for row in slowest.tolist())
        del ops, inp
    if rank == 0:
        queue.put(results)
    dist.barrier()
    dist.destroy_process_group()


def reference(todo, repeats: int) -> dict:
    """``{(kind, bytes): (seconds per collective on preallocated buffers, seconds with a fresh
    output each time)}`` measured in 4 fresh torch processes."""
    import torch.multiprocessing as mp
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    mp.start_processes(_rank_main, args=(free_port(), todo, repeats, queue), nprocs=WORLD,
                       join=True, start_method="spawn")
    return queue.get()


# dtorch -----------------------------------------------------------------------------------------
def measure_dtorch(todo, repeats: int) -> dict:
    """``{(kind, bytes): seconds per redistribute}`` timed on the controller."""
    import dtorch
    from dtorch import Partial, Replicate, Shard, init_device_mesh
    moves = {"all_gather": ([Shard(0)], [Replicate()]), "all_to_all": ([Shard(0)], [Shard(1)]),
             "all_reduce": ([Partial()], [Replicate()]),
             "reduce_scatter": ([Partial()], [Shard(0)])}
    dtorch.init(n_workers=WORLD)
    results = {}
    try:
        mesh = init_device_mesh("cpu", WORLD)
        for kind, nbytes, n in todo:
            src, dst = moves[kind]
            x = dtorch.ones(*_shape(nbytes), device_mesh=mesh, placements=src)
            x.redistribute(placements=dst)  # warm-up (the result is freed at once)
            times = []
            for _ in range(repeats):
                dtorch.synchronize()
                t0 = time.perf_counter()
                for _ in range(n):
                    x.redistribute(placements=dst)
                dtorch.synchronize()
                times.append((time.perf_counter() - t0) / n)
            results[(kind, nbytes)] = median(times)
            del x
        dtorch.synchronize()
    finally:
        dtorch.shutdown()
    return results


def run(quick: bool = False) -> list[Row]:
    todo = cases(quick)
    repeats = 3 if quick else 5
    print(f"[redistribute] reference: raw torch.distributed, {len(todo)} cases ...", flush=True)
    ref = reference(todo, repeats)
    print("[redistribute] dtorch ...", flush=True)
    got = measure_dtorch(todo, repeats)
    rows = []
    for kind, nbytes, n in todo:
        pre, fresh = ref[(kind, nbytes)]
        ours = got[(kind, nbytes)]
        note = f"{ours / fresh:.2f}x torch allocating its output"
        if nbytes < 16 * MB:
            note += "; info only, target is for >= 16 MB"
        rows.append(Row(f"redistribute {kind} {nbytes // MB} MB", ours, pre, TARGET, note))
    return rows


if __name__ == "__main__":
    main(run, __doc__)
