"""redistribute() across two hosts vs the same inside one host (network namespaces).

Two "hosts" are network namespaces on a private bridge (tests/netns_hosts.py: 10.251.0.2 and
.3, the scheduler at .1), each running ``dask worker --nthreads 1 --nworkers 2``; dtorch joins
them (ranks 0, 1 on host 0; 2, 3 on host 1). Each row times one placement change on a 2-rank
mesh whose ranks are on two hosts ([0, 2]) against the same change on a 2-rank mesh inside one
host ([0, 1]), in the same world, same shapes and placements, float32:

    Shard(0) -> Replicate  all_gather     Partial -> Replicate  all_reduce
    Shard(0) -> Shard(1)   all_to_all     a move to another rank's mesh ([0] -> [2] vs [0] -> [1])

The bridge is not a real network (veth pairs in one kernel): read the ratio (what crossing a
host boundary costs over the loopback path on this machine), not absolute speed. Timed on the
controller: N redistributes then ``dtorch.synchronize()``, divided by N, after a warm-up;
across and within take turns, one repeat each; medians and interquartile ranges, no target
(the bridge adds a kernel hop, not a wire). Needs root and ``ip`` (prints why and
gives no rows otherwise).

    .venv/bin/python bench/redistribute_multinode.py [--quick] [--json PATH]
"""

from __future__ import annotations

import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))
from _common import Row, fmt_bytes, main, summarize  # noqa: E402

KB, MB = 1 << 10, 1 << 20
# (label, source placement, target placement) on a 2-rank mesh; "move" changes the mesh
MOVES = (("S(0)->R", "S0", "R"), ("S(0)->S(1)", "S0", "S1"), ("P->R", "P", "R"),
         ("move", "S0", "S0"))


def _placement(name: str):
    from dtorch import Partial, Replicate, Shard
    return {"S0": Shard(0), "S1": Shard(1), "R": Replicate(), "P": Partial()}[name]


def _meshes(move: str, across: bool):
    """(source mesh, target mesh) of one row's side."""
    from dtorch import DeviceMesh
    if move == "move":
        return DeviceMesh("cpu", [0]), DeviceMesh("cpu", [2 if across else 1])
    mesh = DeviceMesh("cpu", [0, 2] if across else [0, 1])
    return mesh, mesh


def _time(move: tuple, nbytes: int, across: bool, n: int) -> float:
    """Seconds per redistribute, N issued then one synchronize."""
    import torch
    import dtorch
    label, src, dst = move
    side = 64 if nbytes < 64 * 16 * 4 else int((nbytes // 4) ** 0.5) // 4 * 4
    rows, cols = max(4, nbytes // 4 // side), side
    here, there = _meshes(label, across)
    x = dtorch.distribute_tensor(torch.randn(rows, cols), here, [_placement(src)])
    target = [_placement(dst)]
    x.redistribute(there, target)
    dtorch.synchronize()
    t0 = time.perf_counter()
    outs = [x.redistribute(there, target) for _ in range(n)]
    dtorch.synchronize()
    elapsed = (time.perf_counter() - t0) / n
    del outs
    return elapsed


def cases(quick: bool) -> list[tuple[tuple, int, int]]:
    """(move, bytes, redistributes per repeat)."""
    sizes = [(64 * KB, 20), (1 * MB, 10)] if quick else [(1 * KB, 50), (1 * MB, 20),
                                                         (16 * MB, 5)]
    return [(move, nbytes, n) for move in MOVES for nbytes, n in sizes]


def run(quick: bool = False) -> list[Row]:
    from netns_hosts import NamespaceHosts, unavailable_reason
    import dtorch
    reason = unavailable_reason()
    if reason:
        print(f"redistribute_multinode: skipped, {reason}", file=sys.stderr)
        return []
    repeats = 3 if quick else 7
    rows = []
    with NamespaceHosts(hosts=2, workers_per_host=2) as hosts:
        dtorch.init(address=hosts.scheduler_address, n_workers=4)
        try:
            for move, nbytes, n in cases(quick):
                times = {True: [], False: []}
                for _ in range(repeats):
                    for across in (False, True):
                        times[across].append(_time(move, nbytes, across, n))
                rows.append(Row.timed(f"{move[0]} {fmt_bytes(nbytes)} across/within hosts",
                                      summarize(times[True]), summarize(times[False]), None,
                                      "info: 2-rank meshes [0, 2] vs [0, 1]" if move[0] != "move"
                                      else "info: [0] -> [2] vs [0] -> [1]"))
        finally:
            dtorch.shutdown()
    return rows


if __name__ == "__main__":
    main(run, __doc__)
