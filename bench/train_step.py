"""One training step (forward, backward, AdamW) against PyTorch's own SPMD training on the
same ranks, model and data: data parallel vs DDP, the TP MLP vs ``parallelize_module``,
``Shard(0)`` weights vs FSDP2's ``fully_shard``.

The model is the MLP ``Linear(D, HIDDEN) -> ReLU -> Linear(HIDDEN, D)`` (512-2048-512; in
full mode also the compute-heavier 2048-8192-2048), float32, ``torch.manual_seed(0)`` init on
both sides, 64 rows per rank on 4 CPU ranks, loss ``out.square().mean()``, ``AdamW(lr=1e-3,
foreach=True)``, ``zero_grad`` then forward, backward and step.

- ``dp``: dtorch ``DistributedDataParallel(model, device_mesh=mesh)`` (25 MB buckets) on the
  256-row batch split ``Shard(0)``; PyTorch ``torch.nn.parallel.DistributedDataParallel``
  (gloo), each rank its 64 rows. A second dtorch row reduces each gradient on its own
  (``bucket_cap_mb`` below the smallest) to show what the buckets save.
- ``tp``: ``parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})``
  on both sides, the same 64 rows on every rank (Replicate; tensor parallelism splits the
  weights, not the batch).
- ``fsdp``: ``fully_shard`` of each Linear and of the root on both sides, the 256 rows split
  ``Shard(0)`` (PyTorch: each rank its 64 rows).

The reference is 4 spawned plain torch processes with dtorch's rank settings, ``STEPS`` steps
between two barriers (the slowest rank counts); dtorch issues ``STEPS`` steps, then
``synchronize()``. The gradients of a first backward and the parameters after the warm-up
are compared between the two sides (the same values). Both sides take turns. Target: dtorch at most 1.0x (PyTorch measured here for the small MLP:
DDP 64 ms, fully_shard 108 ms, TP 27 ms per step).

    .venv/bin/python bench/train_step.py [--quick]
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import (Row, dtorch_cluster, dtorch_rank_settings, dtorch_steps_turn, main,
                     take_turns)  # noqa: E402
from _reference import ReferenceRanks, serve_steps  # noqa: E402

WORLD = 4
ROWS_PER_RANK = 64
STEPS = 10
WARMUP = 2
TARGET = 1.0
LR = 1e-3
MODES = ("dp", "tp", "fsdp")


def sizes(quick: bool) -> list[tuple[int, int]]:
    return [(512, 2048)] if quick else [(512, 2048), (2048, 8192)]


def make_model(d: int, hidden: int):
    import torch
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(d, hidden), torch.nn.ReLU(),
                               torch.nn.Linear(hidden, d))


def batch(d: int):
    import torch
    return torch.randn(ROWS_PER_RANK * WORLD, d, generator=torch.Generator().manual_seed(1))


def rows_of(mode: str, x, rank: int):
    """What a rank trains on: its 64 rows (dp, fsdp), the first 64 on every rank (tp)."""
    if mode == "tp":
        return x[:ROWS_PER_RANK]
    return x[rank * ROWS_PER_RANK:(rank + 1) * ROWS_PER_RANK]


# reference: PyTorch SPMD -------------------------------------------------------------------------
def _torch_setup(mode: str, d: int, hidden: int):
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    model = make_model(d, hidden)
    if mode == "dp":
        model = torch.nn.parallel.DistributedDataParallel(model)
    elif mode == "tp":
        from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                       parallelize_module)
        parallelize_module(model, init_device_mesh("cpu", (WORLD,)),
                           {"0": ColwiseParallel(), "2": RowwiseParallel()})
    else:
        from torch.distributed.fsdp import fully_shard
        for layer in (model[0], model[2]):
            fully_shard(layer)
        fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=LR, foreach=True)


def _full(p):
    from torch.distributed.tensor import DTensor
    return (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()


def first_gradients(model, x, whole) -> list:
    """The gradients of one forward and backward (then cleared): compared between the two
    sides, since Adam's update hides a wrong gradient scale."""
    model(x).square().mean().backward()
    grads = [whole(p.grad) for p in model.parameters()]
    for p in model.parameters():
        p.grad = None
    return grads


def _rank_setup(mode: str, d: int, hidden: int):
    """``(step, check)`` on a reference rank: the check is the first gradients and the
    parameters after the warm-up."""
    import torch.distributed as dist
    model, opt = _torch_setup(mode, d, hidden)
    x = rows_of(mode, batch(d), dist.get_rank())

    def step():
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()

    grads = first_gradients(model, x, _full)
    for _ in range(WARMUP):
        step()
    return step, (grads, [_full(p) for p in model.parameters()])


def _rank_main(rank: int, commands, results) -> None:
    serve_steps(rank, commands, results, _rank_setup)


class TorchRanks(ReferenceRanks):
    def __init__(self, settings: dict):
        super().__init__(_rank_main, WORLD, settings, "train_step")

    def time(self, mode: str, d: int, hidden: int, n: int) -> dict:
        return {f"ref_{mode}": self.ask(mode, d, hidden, n)}


# dtorch --------------------------------------------------------------------------------------------
def dtorch_setup(mode: str, d: int, hidden: int, mesh, per_param: bool = False):
    import dtorch
    from dtorch import ColwiseParallel, Replicate, RowwiseParallel, Shard
    model = make_model(d, hidden)
    if mode == "dp":
        model = dtorch.DistributedDataParallel(model, device_mesh=mesh,
                                               bucket_cap_mb=1e-6 if per_param else None)
        x = dtorch.distribute_tensor(batch(d), mesh, [Shard(0)])
    elif mode == "tp":
        dtorch.parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
        x = dtorch.distribute_tensor(batch(d)[:ROWS_PER_RANK], mesh, [Replicate()])
    else:
        for layer in (model[0], model[2]):
            dtorch.fully_shard(layer, mesh=mesh)
        dtorch.fully_shard(model, mesh=mesh)
        x = dtorch.distribute_tensor(batch(d), mesh, [Shard(0)])
    opt = dtorch.optim.AdamW(model.parameters(), lr=LR, foreach=True)

    def step():
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()

    return model, x, step


def measure(quick: bool, repeats: int) -> dict:
    import torch

    import dtorch
    from dtorch import init_device_mesh
    out = {}
    with dtorch_cluster(WORLD), TorchRanks(dtorch_rank_settings()) as ref:
        mesh = init_device_mesh("cpu", WORLD)
        for d, hidden in sizes(quick):
            timings, counts = {}, {}
            for mode in MODES:  # one mode's models alive at a time, on both sides (the
                turns = []      # 2048-8192-2048 models of every mode at once ran out of memory)
                want = ref.check(mode, d, hidden)  # first gradients, warmed-up params
                variants = [(mode, False)] + ([("dp_per_param", True)] if mode == "dp" else [])
                for name, per_param in variants:
                    model, x, step = dtorch_setup(mode, d, hidden, mesh, per_param)
                    grads = first_gradients(model, x, lambda g: g.to_torch())
                    for _ in range(WARMUP):
                        step()
                    params = [p.to_torch() for p in model.parameters()]
                    for got, w in zip(grads + params, want[0] + want[1], strict=True):
                        assert torch.allclose(got, w, atol=1e-5), (name, (got - w).abs().max())
                    with dtorch.CommDebugMode() as comm:
                        step()
                    counts[name] = comm.get_comm_counts()
                    turns.append(dtorch_steps_turn(name, step, STEPS))
                    del model, x, step, grads, params
                turns.append(lambda mode=mode: ref.time(mode, d, hidden, STEPS))
                timings.update(take_turns(repeats, *turns))
                del turns, want
            out[(d, hidden)] = (timings, counts)
            r = {k: v.median * 1e3 for k, v in timings.items()}
            print(f"[train_step] {d}-{hidden}-{d}: " + "; ".join(
                f"{m} dtorch {r[m]:.1f} ms vs torch {r['ref_' + m]:.1f} ms ({counts[m]})"
                for m in MODES) + f"; dp with one all_reduce per gradient {r['dp_per_param']:.1f}"
                  f" ms", flush=True)
    return out


def run(quick: bool = False) -> list[Row]:
    print(f"[train_step] forward + backward + AdamW on {WORLD} ranks, {ROWS_PER_RANK} rows per "
          f"rank: dtorch vs PyTorch SPMD (DDP, parallelize_module, fully_shard) ...", flush=True)
    rows = []
    labels = {"dp": "DDP", "tp": "parallelize_module", "fsdp": "fully_shard"}
    for (d, hidden), (t, counts) in measure(quick, 3 if quick else 7).items():
        for mode in MODES:
            note = f"{STEPS} steps per repeat; dtorch's collectives per step {counts[mode]}"
            if mode == "dp":
                note += (f"; with one all_reduce per gradient {t['dp_per_param'].median * 1e3:.1f}"
                         f" ms ({counts['dp_per_param']})")
            rows.append(Row.timed(f"training step {mode} vs {labels[mode]}, MLP {d}-{hidden}-{d}",
                                  t[mode], t[f"ref_{mode}"], TARGET, note))
    return rows


if __name__ == "__main__":
    main(run, __doc__)
