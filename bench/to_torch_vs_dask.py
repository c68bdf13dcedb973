"""to_torch() vs a plain Dask gather of the same shards, on the same workers.

A float32 tensor of 1 MB, 16 MB and 64 MB (``--quick``: 1 MB and 16 MB) sharded Shard(0) over
4 ranks. dtorch: ``x.to_torch()`` (fetch every shard, assemble on the controller). Reference:
the same 4 shards scattered as Dask futures, one to each rank's worker, then
``torch.cat(client.gather(futures))``, using dtorch's own Dask client so both read from the
same worker processes. The two alternate within each repeat; medians and interquartile
ranges of the repeats.
Target: dtorch at most 1.2x the reference.

    .venv/bin/python bench/to_torch_vs_dask.py [--quick]
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import Row, main, summarize  # noqa: E402

WORLD = 4
MB = 1 << 20
TARGET = 1.2


def run(quick: bool = False) -> list[Row]:
    import torch
    import dtorch
    from dtorch import Shard, init_device_mesh
    from dtorch.runtime.session import get_controller
    sizes = {1 * MB: 10, 16 * MB: 5} if quick else {1 * MB: 20, 16 * MB: 9, 64 * MB: 7}
    print("[to_torch] dtorch vs Dask gather ...", flush=True)
    dtorch.init(n_workers=WORLD)
    rows = []
    try:
        c = get_controller()
        client, mesh = c.client, init_device_mesh("cpu", WORLD)
        for nbytes, repeats in sizes.items():
            value = torch.randn(WORLD * 256, nbytes // 4 // (WORLD * 256))
            x = dtorch.tensor(value, device_mesh=mesh, placements=[Shard(0)])
            futures = [client.scatter([shard.clone()], workers=[info.address], hash=False)[0]
                       for info, shard in zip(c.ranks, value.chunk(WORLD))]

            def dask_gather():
                return torch.cat(client.gather(futures))

            assert torch.equal(x.to_torch(), value) and torch.equal(dask_gather(), value)
            ours, ref = [], []
            for _ in range(repeats):
                for fn, acc in ((x.to_torch, ours), (dask_gather, ref)):
                    t0 = time.perf_counter()
                    fn()
                    acc.append(time.perf_counter() - t0)
            rows.append(Row.timed(f"to_torch {nbytes // MB} MB", summarize(ours), summarize(ref),
                                  TARGET))
            del x, futures
    finally:
        dtorch.shutdown()
    return rows


if __name__ == "__main__":
    main(run, __doc__)
