"""Op overhead: dtorch's single controller vs PyTorch DTensor under SPMD, same shapes.

Two workloads on 4 CPU ranks (gloo on 127.0.0.1, same torch thread count per rank):

- a chain of 500 small elementwise ops on a ``[256, 64]`` float32 tensor, ``Shard(0)``
  (``x = x * 1.0001 + 0.001``, 250 times);
- a 2-layer tensor-parallel MLP forward: ``x [32, 64]`` Replicate, ``w1 [256, 64]`` Shard(0)
  (column parallel), ``w2 [64, 256]`` Shard(1) (row parallel), ``relu`` between, and the
  Partial result redistributed to Replicate (one all_reduce).

- reference: PyTorch's ``torch.distributed.tensor.DTensor`` in 4 spawned processes (SPMD),
  timed inside the ranks between barriers after a warm-up; the slowest rank counts.
- dtorch: timed on the controller after a warm-up (the signature cache is filled):
  *controller* = issuing the ops plus shipping the batch (pickling included), per op;
  *end to end* = issue + ``dtorch.synchronize()`` (the workers ran everything).

Targets: controller cost per op <= 0.2x PyTorch DTensor's per-op time; end-to-end chain time
<= 1.0x PyTorch DTensor's. The MLP rows are information only. Medians over repeats.

    .venv/bin/python bench/op_overhead.py [--quick]
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import Row, barrier_timed, free_port, main, median, rank_threads  # noqa: E402

WORLD = 4
CHAIN_OPS = 500
CHAIN_SHAPE = (256, 64)
BATCH, DIM, HIDDEN = 32, 64, 256


def chain(x):
    """500 elementwise ops: the same Python on a torch DTensor and on a dtorch DTensor."""
    for _ in range(CHAIN_OPS // 2):
        x = x * 1.0001 + 0.001
    return x


def mlp(x, w1, w2, replicate):
    import torch.nn.functional as F
    return replicate(F.linear(F.relu(F.linear(x, w1)), w2))


# reference: PyTorch DTensor, SPMD ---------------------------------------------------------------
def _rank_main(rank: int, port: int, repeats: int, queue) -> None:
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(rank_threads(WORLD))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=WORLD, timeout=timedelta(seconds=300))
    mesh = init_device_mesh("cpu", (WORLD,))
    torch.manual_seed(0)
    x = distribute_tensor(torch.randn(CHAIN_SHAPE), mesh, [Shard(0)])
    xin = distribute_tensor(torch.randn(BATCH, DIM), mesh, [Replicate()])
    w1 = distribute_tensor(torch.randn(HIDDEN, DIM), mesh, [Shard(0)])
    w2 = distribute_tensor(torch.randn(DIM, HIDDEN), mesh, [Shard(1)])

    def replicate(t):
        return t.redistribute(mesh, [Replicate()]).to_local() + 0  # waits for the all_reduce

    def timed(fn, n):
        fn()  # warm-up
        return median([barrier_timed(fn, n) for _ in range(repeats)])

    results = torch.tensor([timed(lambda: chain(x), 1),
                            timed(lambda: mlp(xin, w1, w2, replicate), 10)],
                           dtype=torch.float64)
    dist.all_reduce(results, op=dist.ReduceOp.MAX)
    if rank == 0:
        queue.put({"chain": results[0].item(), "mlp": results[1].item()})
    dist.barrier()
    dist.destroy_process_group()


def reference(repeats: int) -> dict:
    import torch.multiprocessing as mp
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    mp.start_processes(_rank_main, args=(free_port(), repeats, queue), nprocs=WORLD, join=True,
                       start_method="spawn")
    return queue.get()


# dtorch -------------------------------------------------------------------------------------------
def measure_dtorch(repeats: int) -> dict:
    """Seconds: controller and end-to-end, for the chain and for one MLP forward."""
    import torch

    import dtorch
    from dtorch import Replicate, Shard, init_device_mesh
    from dtorch.runtime import session
    dtorch.init(n_workers=WORLD)
    try:
        c = session.get_controller()
        mesh = init_device_mesh("cpu", WORLD)
        dtorch.manual_seed(0)
        x = dtorch.randn(*CHAIN_SHAPE, device_mesh=mesh, placements=[Shard(0)])
        xin = dtorch.tensor(torch.randn(BATCH, DIM), device_mesh=mesh, placements=[Replicate()])
        w1 = dtorch.tensor(torch.randn(HIDDEN, DIM), device_mesh=mesh, placements=[Shard(0)])
        w2 = dtorch.tensor(torch.randn(DIM, HIDDEN), device_mesh=mesh, placements=[Shard(1)])

        def replicate(t):
            return t.redistribute(placements=[Replicate()])

        def timed(fn, n):
            fn()  # warm-up: fills the signature cache
            dtorch.synchronize()
            ctrl, e2e = [], []
            for _ in range(repeats):
                dtorch.synchronize()
                t0 = time.perf_counter()
                for _ in range(n):
                    out = fn()
                del out
                c.flush()
                t1 = time.perf_counter()
                dtorch.synchronize()
                t2 = time.perf_counter()
                ctrl.append((t1 - t0) / n)
                e2e.append((t2 - t0) / n)
            return median(ctrl), median(e2e)

        chain_ctrl, chain_e2e = timed(lambda: chain(x), 1)
        mlp_ctrl, mlp_e2e = timed(lambda: mlp(xin, w1, w2, replicate), 10)
        check = (chain(x).to_torch(), mlp(xin, w1, w2, replicate).to_torch())
        assert all(torch.isfinite(t).all() for t in check)
    finally:
        dtorch.shutdown()
    return {"chain_ctrl": chain_ctrl, "chain_e2e": chain_e2e, "mlp_ctrl": mlp_ctrl,
            "mlp_e2e": mlp_e2e}


def run(quick: bool = False) -> list[Row]:
    repeats = 3 if quick else 7
    print("[op_overhead] reference: PyTorch DTensor, SPMD on 4 processes ...", flush=True)
    ref = reference(repeats)
    print("[op_overhead] dtorch ...", flush=True)
    got = measure_dtorch(repeats)
    per_op = ref["chain"] / CHAIN_OPS
    return [
        Row("controller cost per op (chain)", got["chain_ctrl"] / CHAIN_OPS, per_op, 0.2,
            "dtorch issue + batch shipping vs PyTorch DTensor per op"),
        Row(f"chain of {CHAIN_OPS} ops, end to end", got["chain_e2e"], ref["chain"], 1.0,
            f"{got['chain_e2e'] / CHAIN_OPS * 1e6:.1f} us/op vs {per_op * 1e6:.1f} us/op"),
        Row("MLP forward: controller", got["mlp_ctrl"], ref["mlp"], 1.0,
            "info: 5 ops + 1 all_reduce issued"),
        Row("MLP forward: end to end", got["mlp_e2e"], ref["mlp"], 1.0, "info"),
    ]


if __name__ == "__main__":
    main(run, __doc__)
