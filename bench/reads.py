"""Reads and waits: what a small read costs, beside the round trips it is built on.

On the embedded 4-rank cluster, each timed alone (nothing else pending), repeated:

- ``dtorch.synchronize()`` with nothing issued (every rank answers);
- ``(r + 1).item()`` of a 0-dim Replicate value (one op, read from one rank);
- ``x.to_torch()`` of a 4x4 float32 Shard(0) tensor (every rank's shard) and of 1 MB;
- ``p.item()`` of a 0-dim Partial value (its all_reduce, then the read), beside the rest;

and, in the same run, the floors they stand on:

- a bare Dask actor round trip to every rank (``health()`` on each rank's actor, awaited
  together on the client's event loop, what a read paid before the channels);
- a raw loopback TCP socket round trip (one byte there and back, between two threads of this
  process): the transport itself.

Target: the small reads that need no collective (synchronize, item, the 4x4 to_torch) at
most 1.5 ms on 4 local ranks. The rows' reference column is the raw socket round trip
(information: how far above the transport a read is).

    .venv/bin/python bench/reads.py [--quick]
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import Row, main, summarize, timed_calls  # noqa: E402

WORLD = 4
TARGET_S = 1.5e-3


def socket_round_trip(repeats: int) -> list[float]:
    """Seconds per one-byte round trip over a loopback TCP connection (an echo thread)."""
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]

    def echo():
        conn, _ = server.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        while data := conn.recv(1):
            conn.sendall(data)
        conn.close()

    thread = threading.Thread(target=echo, daemon=True)
    thread.start()
    client = socket.create_connection(("127.0.0.1", port))
    client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        client.sendall(b"x")
        client.recv(1)
        out.append(time.perf_counter() - t0)
    client.close()
    thread.join()
    server.close()
    return out


def run(quick: bool = False) -> list[Row]:
    import torch
    import dtorch
    from distributed.utils import sync
    from dtorch import Partial, Replicate, Shard, init_device_mesh
    from dtorch.runtime.session import get_controller
    repeats = 30 if quick else 200
    print("[reads] small reads on 4 ranks beside a Dask and a socket round trip ...", flush=True)
    dtorch.init(n_workers=WORLD)
    try:
        c = get_controller()
        mesh = init_device_mesh("cpu", WORLD)
        r = dtorch.tensor(torch.tensor(2.0), device_mesh=mesh, placements=[Replicate()])
        p = dtorch.tensor(torch.tensor(2.0), device_mesh=mesh, placements=[Partial()])
        small = dtorch.tensor(torch.randn(4, 4), device_mesh=mesh, placements=[Shard(0)])
        big = dtorch.tensor(torch.randn(WORLD * 256, 256), device_mesh=mesh,
                            placements=[Shard(0)])
        dtorch.synchronize()

        async def every_answer(futures):
            return [await f for f in futures]

        def dask_round_trip():
            sync(c.client.loop, every_answer, [info.actor.health() for info in c.ranks])

        sock = summarize(socket_round_trip(repeats))
        cases = [
            ("bare Dask actor round trip to every rank", dask_round_trip, None),
            ("empty synchronize()", dtorch.synchronize, TARGET_S),
            ("(r + 1).item(), 0-dim Replicate", lambda: (r + 1).item(), TARGET_S),
            ("to_torch() of 4x4 Shard(0)", small.to_torch, TARGET_S),
            ("to_torch() of 1 MB Shard(0)", big.to_torch, None),
            ("p.item(), 0-dim Partial (adds its all_reduce)", lambda: p.item(), None),
        ]
        rows = []
        for name, fn, target in cases:
            t = summarize(timed_calls(fn, repeats))
            verdict = "" if target is None else \
                f"; target <= {target * 1e3:.1f} ms: {'yes' if t.median <= target else 'no'}"
            rows.append(Row.timed(name, t, sock, None,
                                  f"reference: a raw loopback socket round trip{verdict}"))
    finally:
        dtorch.shutdown()
    return rows


if __name__ == "__main__":
    main(run, __doc__)
