"""The optimizer step alone: ``dtorch.optim.AdamW`` vs plain torch's foreach ``AdamW`` on the
same local shards.

The parameters are those of the TP MLP ``Linear(D, HIDDEN) -> ReLU -> Linear(HIDDEN, D)``
(D = 512, HIDDEN = 2048, float32) after ``parallelize_module`` with ColwiseParallel /
RowwiseParallel on 4 CPU ranks: each rank holds a ``HIDDEN/4 x D`` and a ``D x HIDDEN/4``
weight block, a ``HIDDEN/4`` bias block and the row-parallel bias (``Partial``: one rank
holds it, the others zeros). Every gradient is set to a constant in the parameters'
placements, so no collective runs on either side.

- dtorch: ``dtorch.optim.AdamW(params, lr=1e-3, weight_decay=0.01, foreach=True)``;
  ``STEPS`` steps issued, then ``synchronize()``: per step, issue on the controller, the
  batch to the ranks and the rank's own step (one instruction per rank per step).
- reference: 4 spawned plain torch processes (dtorch's rank settings, ``_reference.ReferenceRanks``),
  each with tensors of its rank's local shard shapes, ``torch.optim.AdamW`` with the same
  arguments, ``STEPS`` steps between two barriers (the slowest rank counts).

Both sides take turns; after the warm-up the parameters of rank 0 are compared (the same
values). Target: dtorch at most 1.2x. The controller's share is printed (issue time per step).

    .venv/bin/python bench/optim_step.py [--quick]
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import (Row, barrier_timed, dtorch_cluster, dtorch_rank_settings, main,
                     take_turns)  # noqa: E402
from _reference import ReferenceRanks, serve_timings  # noqa: E402

WORLD = 4
D, HIDDEN = 512, 2048
STEPS = 20
WARMUP = 3
TARGET = 1.2
HYPER = dict(lr=1e-3, weight_decay=0.01, foreach=True)


def local_shapes() -> list:
    """A rank's local parameter shapes: up.weight, up.bias, down.weight, down.bias."""
    return [(HIDDEN // WORLD, D), (HIDDEN // WORLD,), (D, HIDDEN // WORLD), (D,)]


def grad_value(i: int) -> float:
    return 0.01 * (i + 1)


# reference: plain torch AdamW on one rank's shards -----------------------------------------------
def _rank_main(rank: int, commands, results) -> None:
    import torch
    params = [torch.zeros(s, requires_grad=True) for s in local_shapes()]
    for i, p in enumerate(params):  # the row-parallel bias: one rank holds it
        p.grad = torch.full_like(p, grad_value(i) if (i != 3 or rank == 0) else 0.0)
    opt = torch.optim.AdamW(params, **HYPER)
    for _ in range(WARMUP):
        opt.step()
    if rank == 0:
        results.put([p.detach().clone() for p in params])

    from torch.optim.adam import adam
    states = [opt.state[p] for p in params]
    group = opt.param_groups[0]

    def functional():  # where the time goes: torch's functional step alone, no Optimizer
        with torch.no_grad():
            adam(params, [p.grad for p in params], [s["exp_avg"] for s in states],
                 [s["exp_avg_sq"] for s in states], [], [s["step"] for s in states],
                 foreach=True, amsgrad=False, beta1=group["betas"][0], beta2=group["betas"][1],
                 lr=group["lr"], weight_decay=group["weight_decay"], eps=group["eps"],
                 maximize=False, decoupled_weight_decay=True)

    def timed(cmd):
        n, = cmd
        return [barrier_timed(opt.step, n), barrier_timed(functional, n)]
    serve_timings(rank, commands, results, timed)


class StepRanks(ReferenceRanks):
    def __init__(self, settings: dict):
        super().__init__(_rank_main, WORLD, settings, "optim_step")
        self.after_warmup = self.get()

    def time(self, n: int) -> dict:
        """Seconds per step: torch.optim.AdamW's (``ref``), its functional step alone
        (``ref_fn``)."""
        return dict(zip(("ref", "ref_fn"), self.ask(n)))


# dtorch ------------------------------------------------------------------------------------------
def dtorch_params(mesh) -> list:
    import torch

    import dtorch
    from dtorch import ColwiseParallel, RowwiseParallel
    model = torch.nn.Sequential(torch.nn.Linear(D, HIDDEN), torch.nn.ReLU(),
                                torch.nn.Linear(HIDDEN, D))
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    dtorch.parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    params = list(model.parameters())
    for i, p in enumerate(params):
        p.grad = dtorch.full(tuple(p.shape), grad_value(i), device_mesh=mesh,
                             placements=p.placements)
    return params


def measure(repeats: int) -> dict:
    import torch

    import dtorch
    from dtorch import init_device_mesh
    from dtorch.runtime import session
    with dtorch_cluster(WORLD), StepRanks(dtorch_rank_settings()) as ref:
        c = session.get_controller()
        mesh = init_device_mesh("cpu", WORLD, mesh_dim_names=("tp",))
        params = dtorch_params(mesh)
        opt = dtorch.optim.AdamW(params, **HYPER)
        for _ in range(WARMUP):
            opt.step()
        for p, want in zip(params, ref.after_warmup):  # rank 0's shards: the same values
            assert torch.allclose(p.to_local(0), want, atol=1e-7), (p.to_local(0) - want).abs().max()

        def steps(n):
            dtorch.synchronize()
            t0 = time.perf_counter()
            for _ in range(n):
                opt.step()
            c.flush()
            t1 = time.perf_counter()
            dtorch.synchronize()
            return (time.perf_counter() - t0) / n, (t1 - t0) / n

        def dtorch_turn():
            e2e, ctrl = steps(STEPS)
            return {"e2e": e2e, "ctrl": ctrl}

        before = sum(s["instructions"] for s in dtorch.rank_stats())
        steps(STEPS)
        instr = (sum(s["instructions"] for s in dtorch.rank_stats()) - before) / WORLD / STEPS
        timings = take_turns(repeats, lambda: ref.time(STEPS), dtorch_turn)
        r = {k: v.median for k, v in timings.items()}
        print(f"[optim_step] dtorch {r['e2e'] * 1e3:.2f} ms/step (controller "
              f"{r['ctrl'] * 1e6:.0f} us), torch AdamW on the local shards {r['ref'] * 1e3:.2f} "
              f"ms (its functional step alone {r['ref_fn'] * 1e3:.2f} ms); {instr:.1f} "
              f"instructions per step on each rank", flush=True)
        timings["instr"] = instr
    return timings


def run(quick: bool = False) -> list[Row]:
    print(f"[optim_step] AdamW step on the TP MLP {D}-{HIDDEN}-{D}'s shards, {WORLD} ranks: "
          f"dtorch.optim vs torch.optim (foreach) on the same local shards ...", flush=True)
    t = measure(3 if quick else 9)
    note = (f"{STEPS} steps per repeat; controller {t['ctrl'].median * 1e6:.0f} us/step; "
            f"torch's functional step alone {t['ref_fn'].median * 1e3:.2f} ms in the reference "
            f"ranks (slower there than dtorch's whole step: not dtorch's doing, unexplained); "
            f"{t['instr']:.1f} instructions per step on each rank; no collective")
    return [Row.timed("AdamW step (foreach), TP MLP shards", t["e2e"], t["ref"], TARGET, note)]


if __name__ == "__main__":
    main(run, __doc__)
