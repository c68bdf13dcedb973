"""The cost model's predictions beside what the redistributes took on the ranks.

On the embedded 4-rank cluster: ``dtorch.measure_links(force=True)`` fits the alpha-beta line
of each collective kind on sizes up to 4 MiB per rank (its time is printed), then for seed
002's transitions on a 1-D mesh of 4 and Partial -> Shard(0) (reduce_scatter), at 1 MB, 16 MB
and 64 MB of float32 (a square tensor), ``dtorch.time_comms`` runs the redistribute repeatedly
and reads the ranks' time inside its collective (the slowest rank; ``comm_s``), beside
``x.predict_redistribute(...)``.

Rows: measured (dtorch column) vs predicted (reference column). Target: within a factor of 1.5
either way from 16 MB; the 1 MB rows are information (latency-bound: one call's jitter on 2
cores is as large as its time). Replicate -> Shard(0) runs no collective (predicted 0) and
is shown beside the cheapest collective for contrast.

    .venv/bin/python bench/prediction.py [--quick]
"""

from __future__ import annotations

import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import Row, fmt_bytes, main, matrix_shape, summarize  # noqa: E402

WORLD = 4
TARGET = 1.5
SIZES = (2**20, 16 * 2**20, 64 * 2**20)


def cases():
    from dtorch import Partial, Replicate, Shard
    return [("Shard(0) -> Replicate", [Shard(0)], [Replicate()]),
            ("Shard(0) -> Shard(1)", [Shard(0)], [Shard(1)]),
            ("Partial -> Replicate", [Partial()], [Replicate()]),
            ("Partial -> Shard(0)", [Partial()], [Shard(0)])]


def source(shape, mesh, placements):
    """A DTensor with ``placements`` (a Partial one made from a Replicate, locally)."""
    import dtorch
    from dtorch import Partial, Replicate
    if placements[0] == Partial():
        r = dtorch.randn(*shape, device_mesh=mesh, placements=[Replicate()])
        return r.redistribute(mesh, [Partial()])
    return dtorch.randn(*shape, device_mesh=mesh, placements=placements)


def measured(x, mesh, dst, repeats: int):
    """Per repeat, the slowest rank's seconds inside the redistribute's collective."""
    import dtorch
    dtorch.time_comms(lambda: x.redistribute(mesh, dst))  # warm: buffers, plan
    out = []
    for _ in range(repeats):
        t = dtorch.time_comms(lambda: x.redistribute(mesh, dst))
        out.append(t.comm_s)
        del t
    return out


def run(quick: bool = False) -> list[Row]:
    import dtorch
    from dtorch import init_device_mesh
    from dtorch.cost import fmt_seconds
    repeats = 3 if quick else 9
    sizes = SIZES[:2] if quick else SIZES
    os.environ["DTORCH_CACHE_DIR"] = tempfile.mkdtemp(prefix="dtorch-bench-links-")
    print("[prediction] fitting the links, then predicted vs measured redistributes ...",
          flush=True)
    dtorch.init(n_workers=WORLD)
    rows = []
    try:
        mesh = init_device_mesh("cpu", WORLD)
        started = time.perf_counter()
        model = dtorch.measure_links(force=True, meshes=[mesh])
        print(f"[prediction] measure_links: {time.perf_counter() - started:.2f} s, "
              f"{len(model.fits)} fits", flush=True)
        for f in model.fits:
            print(f"  {f.kind:15s} groups of {f.group_size} x{f.groups}: alpha "
                  f"{fmt_seconds(f.alpha_s)}, {f.bandwidth_gb_s:.2f} GB/s", flush=True)
        for nbytes in sizes:
            shape = matrix_shape(nbytes)
            for name, src, dst in cases():
                x = source(shape, mesh, src)
                predicted = x.predict_redistribute(placements=dst).total_s
                got = summarize(measured(x, mesh, dst, repeats))
                target = TARGET if nbytes >= 16 * 2**20 else None
                rows.append(Row(f"{name}, {fmt_bytes(nbytes)}: measured vs predicted",
                                got.median, predicted, target, "", "s", got.iqr, 0.0,
                                both_ways=True))
                del x
    finally:
        dtorch.shutdown()
    return rows


if __name__ == "__main__":
    main(run, __doc__)
