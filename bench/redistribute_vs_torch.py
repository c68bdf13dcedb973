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

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import (ReferenceRanks, Row, barrier_timed, dtorch_cluster,  # noqa: E402
                     join_reference_group, main, matrix_shape, redistribute_turns,
                     serve_timings)

WORLD = int(os.environ.get("BENCH_WORLD", 4))
MB = 1 << 20
KINDS = ("all_gather", "all_to_all", "all_reduce", "reduce_scatter")
TARGET = 1.15


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
        rows, cols = matrix_shape(nbytes)
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
    join_reference_group(rank, port, WORLD)
    ops, current = None, None

    def timed(cmd):
        nonlocal ops, current
        kind, nbytes, n = cmd
        if current != (kind, nbytes):
            ops, current = _reference_ops(kind, nbytes), (kind, nbytes)
            for op in ops:
                op()  # warm-up
        took = []
        for op in ops:  # where the whole move is the bare collective, it is timed once
            took.append(took[0] if op is ops[0] and took else barrier_timed(op, n))
        return took
    serve_timings(rank, commands, results, timed)


class CollectiveRanks(ReferenceRanks):
    """WORLD plain torch processes that time one collective on command."""

    def __init__(self):
        super().__init__(_rank_main, WORLD)

    def time(self, kind: str, nbytes: int, n: int) -> dict:
        """Seconds per op for each of ``_reference_ops``: ``bare``, ``fresh``, ``whole``."""
        return dict(zip(("bare", "fresh", "whole"), self.ask(kind, nbytes, n)))


# dtorch -----------------------------------------------------------------------------------------
def _moves() -> dict:
    """The placement change (source, target) that implies each collective."""
    from dtorch import Partial, Replicate, Shard
    return {"all_gather": (Shard(0), Replicate()), "all_to_all": (Shard(0), Shard(1)),
            "all_reduce": (Partial(), Replicate()), "reduce_scatter": (Partial(), Shard(0))}


def measure(todo, repeats: int) -> dict:
    """``{(kind, bytes): (dtorch s, bare collective s, fresh output s, whole move s)}``."""
    import dtorch
    from dtorch import init_device_mesh
    out = {}
    with CollectiveRanks() as ref, dtorch_cluster(WORLD):
        mesh = init_device_mesh("cpu", WORLD)
        for kind, nbytes, n in todo:
            src, dst = _moves()[kind]
            r = redistribute_turns(repeats, lambda: ref.time(kind, nbytes, n), mesh, nbytes,
                                   src, dst, n)
            out[(kind, nbytes)] = (r["dtorch"], r["bare"], r["fresh"], r["whole"])
            print(f"[redistribute] {kind} {nbytes // MB} MB: dtorch {r['dtorch'] * 1e3:.2f} ms,"
                  f" torch {r['bare'] * 1e3:.2f} ms", flush=True)
        dtorch.synchronize()
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
