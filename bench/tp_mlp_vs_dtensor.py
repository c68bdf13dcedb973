"""TP MLP forward: dtorch.nn vs PyTorch's DTensor with ``parallelize_module`` under SPMD.

The MLP is ``Linear(D, HIDDEN) -> ReLU -> Linear(HIDDEN, D)`` (D = 512, HIDDEN = 2048, float32,
the same torch.manual_seed weights on both sides), tensor parallel on 4 CPU ranks (gloo on
127.0.0.1), at batch 1 and batch 64:

- dtorch: ``dtorch.nn.Sequential(ColumnParallelLinear, ReLU, RowParallelLinearWithReplicateOutput)``
  on a ``("tp",)`` mesh of 4 ranks, ``load_state_dict`` of the torch model; the input Replicate.
- reference: the torch model in each of 4 spawned processes, ``parallelize_module(model,
  mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})`` (its output is all-reduced to
  Replicate, a plain tensor), spawned after the dtorch cluster with its rank processes'
  allocator, huge-page and thread settings, which they must report back the same
  (``_reference.ReferenceRanks``).

Each forward runs once (one all_reduce) and takes the previous output as input
(``y = mlp(y)``, ``CHAIN`` times), so both sides run them one after another and nothing is
left in flight. Timed:

- *end to end* (the target row): the chain, per forward. dtorch: issue + ``synchronize()`` on
  the controller (so the one round trip to the ranks is included, spread over the chain);
  reference: inside the ranks between barriers, the slowest rank.
- *one forward to a value* (information): one forward and reading its value on the
  controller (``to_torch()``); the reference: one forward between barriers.
- *controller* (information): dtorch issuing the chain and shipping the batch, per forward.
- *where the time goes* (printed, and in the notes): in the reference ranks, per op, the
  forward's two local matmuls on one rank's shards, a bare all_reduce of the output and
  dtorch's all_reduce step written in plain torch (copy the shard with the poison flag as one
  extra element, all_reduce, read the flag); on dtorch, a chain of Partial -> Replicate
  redistributes of the output's shape alone, an empty ``synchronize()`` and the instructions
  each rank runs per forward.

dtorch and the reference stay up for the whole run and take turns, one timed repeat each;
medians and interquartile ranges. The first forward's output is compared between the two (same values). Target:
dtorch end to end at most 1.0x the reference.

    .venv/bin/python bench/tp_mlp_vs_dtensor.py [--quick]
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
BATCHES = (1, 64)
CHAIN = 20
TARGET = 1.0


def torch_mlp():
    import torch
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(D, HIDDEN), torch.nn.ReLU(),
                               torch.nn.Linear(HIDDEN, D))


def inputs(batch: int):
    import torch
    return torch.randn(batch, D, generator=torch.Generator().manual_seed(batch))


# reference: PyTorch DTensor, parallelize_module, SPMD -------------------------------------------
def _rank_main(rank: int, commands, results) -> None:
    """One reference rank (in the gloo group): times ``(batch, chain)`` commands until it reads
    None."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)
    mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("tp",))
    model = parallelize_module(torch_mlp(), mesh, {"0": ColwiseParallel(),
                                                   "2": RowwiseParallel()})
    xs = {b: inputs(b) for b in BATCHES}
    with torch.no_grad():
        first = {b: model(xs[b]) + 0 for b in BATCHES}  # + 0: waits for the all_reduce
    if rank == 0:
        results.put({b: first[b].clone() for b in BATCHES})

    def chain(x, n):
        for _ in range(n):
            x = model(x) + 0
        return x

    # the parts of a forward, in plain torch on this rank's shards (where the time goes)
    w1, b1 = torch.randn(HIDDEN // WORLD, D), torch.randn(HIDDEN // WORLD)
    w2 = torch.randn(D, HIDDEN // WORLD)
    parts = {}
    for b in BATCHES:
        out, flagged = torch.zeros(b, D), torch.zeros(b * D + 1)

        def local(x=xs[b]):  # the two local matmuls, no collective
            return F.linear(F.relu(F.linear(x, w1, b1)), w2)

        def dtorch_step(out=out, flagged=flagged):  # dtorch's all_reduce step: the shard
            flagged[:-1].view(out.shape).copy_(out)  # copied with the poison flag as one
            flagged[-1] = 0  # extra element, one all_reduce, the flag read back
            dist.all_reduce(flagged)
            return flagged[-1].item()
        parts[b] = (local, lambda out=out: dist.all_reduce(out), dtorch_step)

    def timed(cmd):
        batch, n = cmd
        return ([barrier_timed(lambda: chain(xs[batch], n), 1) / n,
                 barrier_timed(lambda: chain(xs[batch], 1), 1)] +
                [barrier_timed(fn, n) for fn in parts[batch]])

    with torch.no_grad():
        for b in BATCHES:  # warm-up
            chain(xs[b], 3)
            for fn in parts[b]:
                fn()
        serve_timings(rank, commands, results, timed)


class MlpRanks(ReferenceRanks):
    """4 plain torch processes, spawned with dtorch's rank ``settings``, running the
    parallelized MLP on command."""

    def __init__(self, settings: dict):
        super().__init__(_rank_main, WORLD, settings, "tp_mlp")
        self.first = self.get()  # {batch: output of one forward}

    def time(self, batch: int, n: int) -> dict:
        """Seconds: per forward of a chain of n (``ref_e2e``), of one forward (``ref_one``), and
        per op of the parts: local matmuls (``ref_local``), bare all_reduce (``ref_ar``),
        dtorch's all_reduce step in plain torch (``ref_step``)."""
        return dict(zip(("ref_e2e", "ref_one", "ref_local", "ref_ar", "ref_step"),
                        self.ask(batch, n)))


# dtorch ------------------------------------------------------------------------------------------
def dtorch_mlp(mesh):
    import dtorch.nn as nn
    from dtorch import Graph
    with Graph.default_graph().device_mesh_guard(mesh):
        mlp = nn.Sequential(nn.ColumnParallelLinear(D, HIDDEN), nn.ReLU(),
                            nn.RowParallelLinearWithReplicateOutput(HIDDEN, D))
    mlp.load_state_dict(torch_mlp().state_dict())
    return mlp


def measure(repeats: int) -> dict:
    """``{batch: {name: Timing}}``: dtorch ``e2e``, ``ctrl``, ``one``, ``coll``
    (its all_reduce alone), ``sync`` (an empty round trip); the reference's ``ref_e2e``,
    ``ref_one`` and parts ``ref_local``, ``ref_ar``, ``ref_step``."""
    import torch

    import dtorch
    from dtorch import Partial, Replicate, init_device_mesh
    from dtorch.runtime import session
    out = {}
    # inference on both sides: the reference runs under no_grad, so does dtorch (its
    # parameters require grad and would record the graph otherwise)
    with dtorch_cluster(WORLD), MlpRanks(dtorch_rank_settings()) as ref, torch.no_grad():
        c = session.get_controller()
        mesh = init_device_mesh("cpu", WORLD, mesh_dim_names=("tp",))
        mlp = dtorch_mlp(mesh)
        for batch in BATCHES:
            x = dtorch.distribute_tensor(inputs(batch), mesh, [Replicate()])
            got = mlp(x).to_torch()  # warm-up (fills the signature cache); same values
            assert torch.allclose(got, ref.first[batch], atol=1e-5), \
                (got - ref.first[batch]).abs().max()

            def chain(n):
                dtorch.synchronize()
                t0 = time.perf_counter()
                y = x
                for _ in range(n):
                    y = mlp(y)
                c.flush()
                t1 = time.perf_counter()
                dtorch.synchronize()
                t2 = time.perf_counter()
                del y
                return (t2 - t0) / n, (t1 - t0) / n

            def one():
                dtorch.synchronize()
                t0 = time.perf_counter()
                mlp(x).to_torch()
                return time.perf_counter() - t0

            partial = dtorch.ones(batch, D, device_mesh=mesh, placements=[Partial()])

            def collective(n):  # dtorch's all_reduce alone: n Partial -> Replicate, synchronize
                dtorch.synchronize()
                t0 = time.perf_counter()
                for _ in range(n):
                    partial.redistribute(placements=[Replicate()])
                dtorch.synchronize()
                return (time.perf_counter() - t0) / n

            def sync():  # an empty round trip to the ranks
                t0 = time.perf_counter()
                dtorch.synchronize()
                return time.perf_counter() - t0

            chain(3)
            collective(3)
            before = sum(s["instructions"] for s in dtorch.rank_stats())
            chain(CHAIN)
            instr = (sum(s["instructions"] for s in dtorch.rank_stats()) - before) / WORLD / CHAIN
            def dtorch_turn():
                e2e, ctrl = chain(CHAIN)
                return {"e2e": e2e, "ctrl": ctrl, "one": one(), "coll": collective(CHAIN),
                        "sync": sync()}

            timings = out[batch] = take_turns(repeats, lambda: ref.time(batch, CHAIN),
                                              dtorch_turn)
            r = {k: v.median for k, v in timings.items()}
            print(f"[tp_mlp] batch {batch}: dtorch {r['e2e'] * 1e3:.2f} ms/forward "
                  f"(controller {r['ctrl'] * 1e6:.0f} us), DTensor {r['ref_e2e'] * 1e3:.2f} ms; "
                  f"one forward to a value {r['one'] * 1e3:.2f} vs {r['ref_one'] * 1e3:.2f} ms",
                  flush=True)
            print(f"[tp_mlp] batch {batch}, parts: local matmuls {r['ref_local'] * 1e3:.2f} ms, "
                  f"bare all_reduce {r['ref_ar'] * 1e3:.2f} ms, dtorch's all_reduce step in plain "
                  f"torch {r['ref_step'] * 1e3:.2f} ms, dtorch Partial->Replicate "
                  f"{r['coll'] * 1e3:.2f} ms, empty synchronize {r['sync'] * 1e3:.2f} ms, "
                  f"{instr:.1f} instructions per forward on each rank", flush=True)
            del x, partial
    return out


def run(quick: bool = False) -> list[Row]:
    print(f"[tp_mlp] TP MLP {D} -> {HIDDEN} -> {D} on {WORLD} ranks, dtorch.nn vs PyTorch "
          f"DTensor parallelize_module (SPMD), taking turns ...", flush=True)
    got = measure(3 if quick else 9)
    rows = []
    for batch in BATCHES:
        t = got[batch]
        r = {k: v.median for k, v in t.items()}
        rows.append(Row.timed(f"TP MLP forward batch {batch}, end to end", t["e2e"], t["ref_e2e"],
                              TARGET, f"chain of {CHAIN} forwards, 1 all_reduce each; controller "
                                      f"{r['ctrl'] * 1e6:.0f} us/forward; parts: local matmuls "
                                      f"{r['ref_local'] * 1e3:.2f} ms, all_reduce bare "
                                      f"{r['ref_ar'] * 1e3:.2f} / dtorch {r['coll'] * 1e3:.2f} ms"
                                      f", round trip {r['sync'] * 1e3:.2f} ms"))
        rows.append(Row.timed(f"TP MLP forward batch {batch}, one forward to a value", t["one"],
                              t["ref_one"], None, "info: dtorch's includes reading the value on "
                              "the controller; the reference's ends at a barrier in the ranks"))
    return rows


if __name__ == "__main__":
    main(run, __doc__)
