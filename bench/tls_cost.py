"""What TLS costs: the embedded cluster with its default mutual TLS beside ``security=False``.

On 4 local ranks, in one run: the cluster is started with TLS, measured, shut down, started
without, measured, and that twice (rounds alternate the order), each timing repeated within a
round; medians over both rounds. Rows (TLS in the dtorch column, plain TCP as the reference):

- the chain of 500 elementwise ops on a ``[256, 64]`` ``Shard(0)`` tensor, then
  ``synchronize()`` (what the batches' bytes cost on the channels);
- an empty ``synchronize()`` (one round trip on every rank's channel);
- ``to_torch()`` of 1 MB and 16 MB ``Shard(0)`` (the answers' bytes, decrypted by the
  controller);
- ``redistribute`` S(0) -> R of 1 MB and 16 MB (the ranks' collectives run on gloo, outside
  TLS: the row shows that the data path between ranks is untouched).

Information only (no target): what a shared host's safety costs.

    .venv/bin/python bench/tls_cost.py [--quick]
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import Row, main, matrix_shape, summarize, timed_calls  # noqa: E402

WORLD = 4


def measure(security: bool, repeats: int) -> dict[str, list[float]]:
    import dtorch
    from dtorch import Replicate, Shard, init_device_mesh
    dtorch.init(n_workers=WORLD, security=security)
    try:
        mesh = init_device_mesh("cpu", WORLD)
        x = dtorch.randn(256, 64, device_mesh=mesh, placements=[Shard(0)])
        tensors = {mb: dtorch.randn(*matrix_shape(mb * 2**20), device_mesh=mesh,
                                    placements=[Shard(0)]) for mb in (1, 16)}
        dtorch.synchronize()

        def chain():
            y = x
            for _ in range(250):
                y = y * 1.0001 + 0.001
            dtorch.synchronize()

        def moved(t):
            return lambda: (t.redistribute(mesh, [Replicate()]), dtorch.synchronize())

        cases = {"chain of 500 ops": chain, "empty synchronize()": dtorch.synchronize}
        for mb, t in tensors.items():
            cases[f"to_torch() of {mb} MB"] = t.to_torch
            cases[f"redistribute S(0)->R {mb} MB"] = moved(t)
        return {name: timed_calls(fn, repeats) for name, fn in cases.items()}
    finally:
        dtorch.shutdown()


def run(quick: bool = False) -> list[Row]:
    repeats = 5 if quick else 20
    print("[tls_cost] the embedded cluster with TLS and with security=False, taking turns ...",
          flush=True)
    got: dict[bool, dict[str, list[float]]] = {True: {}, False: {}}
    for order in ((True, False), (False, True)):
        for security in order:
            for name, times in measure(security, repeats).items():
                got[security].setdefault(name, []).extend(times)
    return [Row.timed(f"{name}: TLS vs plain TCP", summarize(got[True][name]),
                      summarize(got[False][name]), None) for name in got[True]]


if __name__ == "__main__":
    main(run, __doc__)
