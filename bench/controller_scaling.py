"""Controller cost and bytes per op as the world grows: a 500-op chain on meshes of 4, 64 and
1,024 ranks in dry-run mode (the same controller, planner and rules; batches built, not sent).

Prints, per world size, the controller's time per op (issue + batch building) and the bytes
the busiest rank would receive per op, with ratios to the 4-rank mesh (target: flat within
1.5x). The chain is elementwise ops, a matmul every 4 ops and a redistribute every 50, run
once to warm the plan caches and send the per-rank definitions, then timed.

And what the controller itself writes per flush (``DTORCH_FANOUT``, default 32: beyond that
many ranks a flush goes to the heads of at most 32 blocks, which relay it): messages and
bytes per flush of the chain (staged shards excluded), at 4, 32, 64 and 1,024 ranks, with
ratios to 32 ranks (target: flat within 2x from 32 ranks up).

    .venv/bin/python bench/controller_scaling.py [--quick]
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch  # noqa: E402

import dtorch  # noqa: E402
from dtorch import Replicate, Shard, init_device_mesh  # noqa: E402
from dtorch.runtime.fanout import fanout_setting  # noqa: E402
from _common import Row, main  # noqa: E402

WORLDS = (4, 32, 64, 1024)
FLAT_FROM = 32  # the flush rows' reference world: the default fan-out


def chain(mesh, n_ops: int):
    x = dtorch.ones(mesh.size() * 2, 16, device_mesh=mesh, placements=[Shard(0)])
    w = dtorch.ones(16, 16, device_mesh=mesh, placements=[Replicate()])
    done = 0
    while done < n_ops:
        x = torch.relu(x @ w * 0.5 + 1.0)
        done += 4
        if done % 50 == 0:
            x = x.redistribute(placements=[Replicate()]).redistribute(placements=[Shard(0)])
            done += 2
    return x


def measure(world: int, n_ops: int, repeats: int) -> tuple[float, float, float, float]:
    """(seconds per op on the controller, bytes per op to the busiest rank, messages and
    bytes the controller writes per flush)."""
    c = dtorch.init(n_workers=world, dry_run=True)
    mesh = init_device_mesh("cpu", world)
    chain(mesh, n_ops)
    dtorch.synchronize()
    best = float("inf")
    sent = 0.0
    messages, nbytes, flushes = c.sent_messages, c.sent_bytes, c.flushes
    for _ in range(repeats):
        before = dtorch.rank_stats()
        t0 = time.perf_counter()
        out = chain(mesh, n_ops)
        dtorch.synchronize()
        best = min(best, (time.perf_counter() - t0) / n_ops)
        after = dtorch.rank_stats()
        sent = max(a["bytes"] - b["bytes"] for a, b in zip(after, before)) / n_ops
        del out
    n = c.flushes - flushes
    per_flush = ((c.sent_messages - messages) / n, (c.sent_bytes - nbytes) / n)
    dtorch.shutdown()
    return (best, sent) + per_flush


def run(quick: bool) -> list[Row]:
    n_ops, repeats = (200, 3) if quick else (500, 7)
    results = {w: measure(w, n_ops, repeats) for w in WORLDS}
    base_t, base_b, _, _ = results[WORLDS[0]]
    _, _, flat_m, flat_b = results[FLAT_FROM]
    rows = []
    for w in WORLDS[1:]:
        t, b, msgs, nbytes = results[w]
        rows.append(Row(f"controller time per op, {w} vs {WORLDS[0]} ranks (dry run)", t, base_t,
                        1.5, f"{t * 1e6:.1f} us vs {base_t * 1e6:.1f} us"))
        rows.append(Row(f"bytes a rank receives per op, {w} vs {WORLDS[0]} ranks", b, base_b,
                        1.5, unit="B"))
        if w > FLAT_FROM:
            rows.append(Row(f"controller messages per flush, {w} vs {FLAT_FROM} ranks", msgs,
                            flat_m, 2.0, f"{msgs:.0f} vs {flat_m:.0f} (fan-out "
                            f"{fanout_setting()})", unit="msgs"))
            rows.append(Row(f"controller bytes per flush, {w} vs {FLAT_FROM} ranks", nbytes,
                            flat_b, 2.0, "staged shards excluded", unit="B"))
    for w, (t, b, msgs, nbytes) in results.items():
        print(f"  {w:5d} ranks: {t * 1e6:7.1f} us/op on the controller, {b:6.0f} B/op to the "
              f"busiest rank; the controller writes {msgs:.0f} messages, {nbytes:.0f} B per "
              f"flush", flush=True)
    return rows


if __name__ == "__main__":
    main(run, __doc__)
