"""One data-parallel training step (forward, backward, AdamW): ``dtorch.DistributedDataParallel``
vs PyTorch's own DDP on the same ranks, model and data.

The model is the MLP ``Linear(D, HIDDEN) -> ReLU -> Linear(HIDDEN, D)`` (D = 512,
HIDDEN = 2048, float32; ``torch.manual_seed(0)`` init on both sides), 64 rows per rank on
4 CPU ranks, loss ``out.square().mean()`` over the whole batch, ``AdamW(lr=1e-3,
foreach=True)``.

- dtorch: ``DistributedDataParallel(model, device_mesh=mesh)`` (buckets of 25 MB: its four
  gradients, 8.4 MB, reduce in one all_reduce), the 256-row batch split ``Shard(0)``;
  ``STEPS`` steps issued, then ``synchronize()``. A second dtorch row reduces each gradient
  on its own (``bucket_cap_mb`` below the smallest gradient: four all_reduces) to show what
  the buckets save.
- reference: 4 spawned plain torch processes (dtorch's rank settings), each with the same
  model wrapped in ``torch.nn.parallel.DistributedDataParallel`` (gloo, default buckets)
  and its own 64 rows, ``STEPS`` steps between two barriers (the slowest rank counts).

After the warm-up both sides' parameters are compared (rank 0's, the same values). Both sides
take turns. Target: dtorch at most 1.0x (PyTorch measured here: 64 ms per step).

    .venv/bin/python bench/train_step_ddp.py [--quick]
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import (ReferenceRanks, Row, barrier_timed, dtorch_cluster,  # noqa: E402
                     dtorch_rank_settings, main, serve_timings, take_turns)

WORLD = 4
D, HIDDEN = 512, 2048
ROWS_PER_RANK = 64
STEPS = 10
WARMUP = 2
TARGET = 1.0
LR = 1e-3


def make_model():
    import torch
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(D, HIDDEN), torch.nn.ReLU(),
                               torch.nn.Linear(HIDDEN, D))


def batch():
    import torch
    return torch.randn(ROWS_PER_RANK * WORLD, D, generator=torch.Generator().manual_seed(1))


def _rank_main(rank: int, commands, results) -> None:
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP
    model = DDP(make_model())
    x = batch()[rank * ROWS_PER_RANK:(rank + 1) * ROWS_PER_RANK]
    opt = torch.optim.AdamW(model.parameters(), lr=LR, foreach=True)

    def step():
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()

    for _ in range(WARMUP):
        step()
    if rank == 0:
        results.put([p.detach().clone() for p in model.parameters()])
    serve_timings(rank, commands, results, lambda cmd: barrier_timed(step, cmd[0]))


class DDPRanks(ReferenceRanks):
    def __init__(self, settings: dict):
        super().__init__(_rank_main, WORLD, settings, "train_step_ddp")
        self.after_warmup = self.get()

    def time(self, n: int) -> dict:
        return {"ref": self.ask(n)}


def measure(repeats: int) -> dict:
    import torch

    import dtorch
    from dtorch import init_device_mesh
    with dtorch_cluster(WORLD), DDPRanks(dtorch_rank_settings()) as ref:
        mesh = init_device_mesh("cpu", WORLD)
        x = batch()
        models = {"buckets": dtorch.DistributedDataParallel(make_model(), device_mesh=mesh),
                  "per_param": dtorch.DistributedDataParallel(
                      make_model(), device_mesh=mesh, bucket_cap_mb=1e-6)}
        opts = {k: dtorch.optim.AdamW(m.parameters(), lr=LR, foreach=True)
                for k, m in models.items()}
        xs = dtorch.distribute_tensor(x, mesh, [dtorch.Shard(0)])

        def step(key):
            opts[key].zero_grad()
            models[key](xs).square().mean().backward()
            opts[key].step()

        for key in models:
            for _ in range(WARMUP):
                step(key)
            for p, want in zip(models[key].parameters(), ref.after_warmup):
                got = p.to_torch()
                assert torch.allclose(got, want, atol=1e-5), (key, (got - want).abs().max())
        with dtorch.CommDebugMode() as mode:
            step("buckets")
        counts = mode.get_comm_counts()

        def turn(key):
            def run():
                dtorch.synchronize()
                t0 = time.perf_counter()
                for _ in range(STEPS):
                    step(key)
                dtorch.synchronize()
                return {key: (time.perf_counter() - t0) / STEPS}
            return run

        timings = take_turns(repeats, lambda: ref.time(STEPS), turn("buckets"),
                             turn("per_param"))
        r = {k: v.median for k, v in timings.items()}
        print(f"[train_step_ddp] dtorch DDP {r['buckets'] * 1e3:.1f} ms/step ({counts}), "
              f"one all_reduce per gradient {r['per_param'] * 1e3:.1f} ms, torch DDP "
              f"{r['ref'] * 1e3:.1f} ms", flush=True)
    return timings


def run(quick: bool = False) -> list[Row]:
    print(f"[train_step_ddp] MLP {D}-{HIDDEN}-{D}, {ROWS_PER_RANK} rows per rank, {WORLD} ranks: "
          f"forward + backward + AdamW, dtorch DDP vs torch DDP ...", flush=True)
    t = measure(3 if quick else 7)
    per_param = t["per_param"].median
    note = (f"{STEPS} steps per repeat; buckets: one all_reduce per step; each gradient on its "
            f"own: {per_param * 1e3:.1f} ms/step ({per_param / t['buckets'].median:.2f}x the "
            f"bucketed step)")
    return [Row.timed("DDP training step, MLP 512-2048-512", t["buckets"], t["ref"], TARGET,
                      note)]


if __name__ == "__main__":
    main(run, __doc__)
