"""redistribute() vs raw torch.distributed doing the same collective on the same bytes.

For each collective a placement change implies on a 1-D mesh of 4 ranks (``BENCH_WORLD`` to
change), all_gather (Shard(0)->Replicate), all_to_all (Shard(0)->Shard(1)), all_reduce
(Partial->Replicate) and reduce_scatter (Partial->Shard(0)), on a float32 global tensor of
1 MB, 16 MB and 64 MB (``--quick``: 1 MB and 16 MB):

- reference: WORLD plain processes spawned with torch.multiprocessing, gloo on 127.0.0.1, the
  same collective on preallocated buffers of the same bytes per rank (all_gather_single,
  all_to_all_single, all_reduce, reduce_scatter_single: the calls dtorch's workers make),
  timed inside the ranks between barriers; the slowest rank counts. The note column also
  compares dtorch with torch allocating a fresh output per op (all_reduce: on a clone), which
  an out-of-place result like redistribute's needs, and, for all_to_all and all_reduce, with
  a raw torch program doing the whole placement change on preallocated buffers: the
  collective plus the local copy the move itself needs (packing the column blocks of
  Shard(0)->Shard(1); copying the input that an out-of-place all_reduce must keep).
- dtorch: timed on the controller: issue N ``x.redistribute(...)`` then
  ``dtorch.synchronize()``, divided by N, after one warm-up (so the batch hop and the final
  round trip are included, spread over N).

Both stay up for the whole run and take turns, one timed repeat each (reference, then
dtorch), so both see the same machine: on a shared VM the load drifts within seconds. Each
reports the median of its repeats; ranks use the same torch thread count. Target: dtorch at
most 1.15x the reference for tensors of 16 MB and up (1 MB rows are information only).

    .venv/bin/python bench/redistribute_vs_torch.py [--quick]
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import Row, barrier_timed, free_port, main, median, rank_threads  # noqa: E402

WORLD = int(os.environ.get("BENCH_WORLD", 4))
MB = 1 << 20
KINDS = ("all_gather", "all_to_all", "all_reduce", "reduce_scatter")
TARGET = 1.15


def _shape(nbytes: int) -> tuple[int, int]:
    """A square-ish float32 matrix of ``nbytes`` whose sides divide by WORLD (even shards)."""
    n = nbytes // 4
    rows = 1 << ((n.bit_length() - 1) // 2)
    return rows, n // rows


def cases(quick: bool) -> list[tuple[str, int, int]]:
    """(collective, global bytes, ops per timed repeat: about 0.1-0.3 s each)."""
    sizes = {1 * MB: 20, 16 * MB: 6} if quick else {1 * MB: 40, 16 * MB: 10, 64 * MB: 4}
    return [(kind, size, n) for size, n in sizes.items() for kind in KINDS]


# reference: raw torch.distributed -------------------------------------------------------------
def _reference_ops(kind: str, nbytes: int):
    """Three ways raw torch does it: (the bare collective on preallocated buffers, the same
    allocating a fresh output each time, the whole placement change on preallocated buffers:
    the collective plus the local copy the move needs, as a hand-written program would)."""
    import torch
    import torch.distributed as dist
    # the same entry points dtorch.runtime.collectives uses
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    elems = nbytes // 4
    if kind == "all_gather":  # Shard(0) -> Replicate: the gathered buffer is the result
        inp, out = torch.ones(elems // WORLD), torch.empty(elems)
        bare = lambda: gather(out, inp)  # noqa: E731
        return bare, lambda: gather(torch.empty(elems), inp), bare
    if kind == "all_to_all":  # Shard(0) -> Shard(1): column blocks must be packed to send
        rows, cols = _shape(nbytes)
        local = torch.ones(rows // WORLD, cols)
        inp, out = torch.ones(elems // WORLD), torch.empty(elems // WORLD)
        packed = local.view(rows // WORLD, WORLD, cols // WORLD).transpose(0, 1)

        def move():
            inp.view(packed.shape).copy_(packed)
            dist.all_to_all_single(out, inp)
        return (lambda: dist.all_to_all_single(out, inp),
                lambda: dist.all_to_all_single(torch.empty(elems // WORLD), inp), move)
    if kind == "all_reduce":  # Partial -> Replicate, out of place: the input stays as it was
        inp, buf = torch.ones(elems), torch.empty(elems)

        def move():
            buf.copy_(inp)
            dist.all_reduce(buf)
        return lambda: dist.all_reduce(inp), lambda: dist.all_reduce(inp.clone()), move
    inp, out = torch.ones(elems), torch.empty(elems // WORLD)  # Partial -> Shard(0)
    bare = lambda: scatter(out, inp)  # noqa: E731
    return bare, lambda: scatter(torch.empty(elems // WORLD), inp), bare


def _rank_main(rank: int, port: int, commands, results) -> None:
    """One reference rank: times ``(kind, bytes, n)`` commands until it reads None."""
    import torch
    import torch.distributed as dist
    from datetime import timedelta
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(rank_threads(WORLD))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=WORLD, timeout=timedelta(seconds=300))
    ops, current = None, None
    while (cmd := commands[rank].get()) is not None:
        kind, nbytes, n = cmd
        if current != (kind, nbytes):
            ops, current = _reference_ops(kind, nbytes), (kind, nbytes)
            for op in ops:
                op()  # warm-up
        took = []
        for op in ops:  # where the whole move is the bare collective, it is timed once
            took.append(took[0] if op is ops[0] and took else barrier_timed(op, n))
        slowest = torch.tensor(took, dtype=torch.float64)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        if rank == 0:
            results.put(tuple(slowest.tolist()))
    dist.barrier()
    dist.destroy_process_group()


class ReferenceRanks:
    """WORLD plain torch processes that time one collective on command."""

    def __init__(self):
        import torch.multiprocessing as mp
        ctx = mp.get_context("spawn")
        self.commands = [ctx.SimpleQueue() for _ in range(WORLD)]
        self.results = ctx.SimpleQueue()
        self.procs = mp.start_processes(_rank_main, nprocs=WORLD, join=False,
                                        args=(free_port(), self.commands, self.results),
                                        start_method="spawn")

    def time(self, kind: str, nbytes: int, n: int) -> tuple[float, float, float]:
        """Seconds per op for each of ``_reference_ops``."""
        for q in self.commands:
            q.put((kind, nbytes, n))
        return self.results.get()

    def close(self) -> None:
        for q in self.commands:
            q.put(None)
        while not self.procs.join():
            pass


# dtorch -----------------------------------------------------------------------------------------
def _moves() -> dict:
    """The placement change (source, target) that implies each collective."""
    from dtorch import Partial, Replicate, Shard
    return {"all_gather": (Shard(0), Replicate()), "all_to_all": (Shard(0), Shard(1)),
            "all_reduce": (Partial(), Replicate()), "reduce_scatter": (Partial(), Shard(0))}


def time_dtorch(x, dst, n: int) -> float:
    """Seconds per redistribute: n of them, then a synchronize."""
    import dtorch
    dtorch.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        x.redistribute(placements=[dst])
    dtorch.synchronize()
    return (time.perf_counter() - t0) / n


def measure(todo, repeats: int) -> dict:
    """``{(kind, bytes): (dtorch s, bare collective s, fresh output s, whole move s)}``."""
    import dtorch
    from dtorch import init_device_mesh
    ref = ReferenceRanks()
    dtorch.init(n_workers=WORLD)
    out = {}
    try:
        mesh = init_device_mesh("cpu", WORLD)
        for kind, nbytes, n in todo:
            src, dst = _moves()[kind]
            x = dtorch.ones(*_shape(nbytes), device_mesh=mesh, placements=[src])
            x.redistribute(placements=[dst])  # warm-up (the result is freed at once)
            ours, refs = [], []
            for _ in range(repeats):
                refs.append(ref.time(kind, nbytes, n))
                ours.append(time_dtorch(x, dst, n))
            out[(kind, nbytes)] = (median(ours), *(median(r) for r in zip(*refs)))
            print(f"[redistribute] {kind} {nbytes // MB} MB: dtorch {median(ours) * 1e3:.2f} ms,"
                  f" torch {out[(kind, nbytes)][1] * 1e3:.2f} ms", flush=True)
            del x
        dtorch.synchronize()
    finally:
        dtorch.shutdown()
        ref.close()
    return out


def run(quick: bool = False) -> list[Row]:
    todo = cases(quick)
    print(f"[redistribute] {len(todo)} cases on {WORLD} ranks, dtorch and raw torch.distributed "
          f"taking turns ...", flush=True)
    got = measure(todo, 3 if quick else 7)
    rows = []
    for kind, nbytes, n in todo:
        ours, pre, fresh, whole = got[(kind, nbytes)]
        note = f"{ours / fresh:.2f}x torch allocating its output"
        if kind in ("all_to_all", "all_reduce"):
            note += f"; {ours / whole:.2f}x torch doing the whole move"
        if nbytes < 16 * MB:
            note += "; info only, target is for >= 16 MB"
        rows.append(Row(f"redistribute {kind} {nbytes // MB} MB", ours, pre, TARGET, note))
    return rows


if __name__ == "__main__":
    main(run, __doc__)
