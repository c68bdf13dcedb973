"""Op overhead: dtorch's single controller vs PyTorch DTensor under SPMD, same shapes.

Two workloads on 4 CPU ranks (gloo on 127.0.0.1):

- a chain of 500 small elementwise ops on a ``[256, 64]`` float32 tensor, ``Shard(0)``
  (``x = x * 1.0001 + 0.001``, 250 times);
- a 2-layer tensor-parallel MLP forward: ``x [32, 64]`` Replicate, ``w1 [256, 64]`` Shard(0)
  (column parallel), ``w2 [64, 256]`` Shard(1) (row parallel), ``relu`` between, and the
  Partial result redistributed to Replicate (one all_reduce).

Rows with a target compare whole jobs, with the same synchronisation on both sides: from a
synchronized start until every rank has finished.

- reference: PyTorch's ``torch.distributed.tensor.DTensor`` in 4 spawned processes (SPMD),
  timed inside the ranks between two barriers; the slowest rank counts.
- dtorch: issue the ops on the controller, then ``dtorch.synchronize()`` (every rank ran
  everything), from a synchronized start, timed on the controller.

Autograd rows (information only): the same chain with its input requiring grad (the
controller records one node per op; the ranks keep each op's local graph), and the backward
through those 500 nodes (``chain(x).sum().backward()``, no collective on either side), each
beside PyTorch DTensor doing the same and, controller only, beside plain torch.

Derived-rule rows (controller only, information): 500 calls of ``torch.special.erfcx`` (its
rule derived from torch's pointwise tag on the first call, :mod:`dtorch.ops.derived`) beside
500 calls of ``torch.erf`` (a hand-written rule), on the same ``Shard(0)`` tensor, repeated
calls and first calls (the plan cache cleared before each).

Rows labelled *controller only* time what dtorch's controller thread spends (issuing the ops
and shipping the batch, pickling included), which is what a notebook cell waits for before it
can go on; they have no target, and their reference is the same ops in plain torch in one
process (what the op itself costs), not a whole distributed job.

The dtorch cluster starts first; the reference ranks are spawned with its rank processes'
allocator, huge-page and thread settings and must report the same (``_reference.ReferenceRanks``).
Both stay up and take turns, one timed repeat each; medians and interquartile ranges.
Targets (issue 21): the chain end to end <= 0.5x PyTorch DTensor, and a rank's CPU per op of
the chain (its interpreter thread, read from ``rank_stats()``) <= 2x the op in plain torch in
one process (the MLP row is information only). Replay row (information): 20 TP MLP forwards
then ``synchronize()``, the repeated run replayed from a prepared program vs sent and
dispatched whole (``dtorch.runtime.batches.REPLAY = False``), taking turns; and the chain, a
rank's CPU per op, replayed vs not. Fusion row (information): the chain (other constants, so a
new program) with ``DTORCH_FUSE=1`` on the ranks, its stretch compiled into one function, vs
the chain replayed unfused, taking turns after the compiling instance (its time reported).

    .venv/bin/python bench/op_overhead.py [--quick]
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import (Row, Timing, barrier_timed, dtorch_cluster, dtorch_rank_settings, main,
                     summarize, take_turns, timed_calls)  # noqa: E402
from _reference import ReferenceRanks, serve_timings  # noqa: E402

WORLD = 4
CHAIN_OPS = 500
CHAIN_SHAPE = (256, 64)
BATCH, DIM, HIDDEN = 32, 64, 256
MLP_N = 10  # MLP forwards per timed repeat
REPLAYED_N = 20  # MLP forwards per flush in the replay rows


def chain(x):
    """500 elementwise ops: the same Python on a torch DTensor and on a dtorch DTensor."""
    for _ in range(CHAIN_OPS // 2):
        x = x * 1.0001 + 0.001
    return x


def mlp(x, w1, w2, replicate):
    import torch.nn.functional as F
    return replicate(F.linear(F.relu(F.linear(x, w1)), w2))


def values():
    """The chain input and the MLP's input and weights, the same on both sides."""
    import torch
    g = torch.Generator().manual_seed(0)
    return (torch.randn(CHAIN_SHAPE, generator=g), torch.randn(BATCH, DIM, generator=g),
            torch.randn(HIDDEN, DIM, generator=g), torch.randn(DIM, HIDDEN, generator=g))


# reference: PyTorch DTensor, SPMD ---------------------------------------------------------------
def _rank_main(rank: int, commands, results) -> None:
    """One reference rank: times ``(workload,)`` commands until it reads None."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    mesh = init_device_mesh("cpu", (WORLD,))
    x0, xin, w1, w2 = values()
    x = distribute_tensor(x0, mesh, [Shard(0)])
    xin = distribute_tensor(xin, mesh, [Replicate()])
    w1 = distribute_tensor(w1, mesh, [Shard(0)])
    w2 = distribute_tensor(w2, mesh, [Shard(1)])

    def replicate(t):
        return t.redistribute(mesh, [Replicate()]).to_local() + 0  # waits for the all_reduce

    xg = x.detach().requires_grad_(True)

    def backward():
        xg.grad = None
        loss = chain(xg).to_local().sum()  # local: no collective, as dtorch's Partial seed
        return barrier_timed(loss.backward, 1)

    work = {"chain": lambda: barrier_timed(lambda: chain(x), 1),
            "mlp": lambda: barrier_timed(lambda: mlp(xin, w1, w2, replicate), MLP_N),
            "chain_grad": lambda: barrier_timed(lambda: chain(xg), 1),
            "backward": backward}
    for fn in work.values():
        fn()  # warm-up
    serve_timings(rank, commands, results, lambda cmd: work[cmd[0]]())


def plain_torch(repeats: int) -> dict:
    """``{"chain", "mlp": Timing}``: the same work in plain torch in one process (the chain on
    one rank's shard, the MLP on the global weights)."""
    x0, xin, w1, w2 = values()
    x = x0[:CHAIN_SHAPE[0] // WORLD]
    xg = x.clone().requires_grad_(True)
    work = {"chain": lambda: chain(x), "mlp": lambda: mlp(xin, w1, w2, lambda t: t),
            "chain_grad": lambda: chain(xg)}
    out = {name: summarize(timed_calls(fn, repeats)) for name, fn in work.items()}
    runs = []
    for _ in range(repeats + 1):
        xg.grad = None
        loss = chain(xg).sum()
        t0 = time.perf_counter()
        loss.backward()
        runs.append(time.perf_counter() - t0)
    out["backward"] = summarize(runs[1:])
    return out


# dtorch -------------------------------------------------------------------------------------------
def unary_chain(fn, x):
    for _ in range(CHAIN_OPS):
        x = fn(x)
    return x


def controller_unary(c, x, repeats: int) -> dict:
    """``{"derived", "hand", "derived_first", "hand_first": Timing}``: controller seconds per
    call of ``special.erfcx`` (derived rule) and ``erf`` (hand-written), cached and first."""
    import torch

    import dtorch
    from dtorch.ops import clear_cache
    fns = {"derived": torch.special.erfcx, "hand": torch.erf}
    runs = {k: [] for k in (*fns, *(f"{k}_first" for k in fns))}
    for name, fn in fns.items():
        unary_chain(fn, x)  # warm
    for _ in range(repeats):
        for name, fn in fns.items():
            dtorch.synchronize()
            t0 = time.perf_counter()
            unary_chain(fn, x)
            c.flush()
            runs[name].append((time.perf_counter() - t0) / CHAIN_OPS)
            dtorch.synchronize()
            clear_cache()
            t0 = time.perf_counter()
            fn(x)
            runs[f"{name}_first"].append(time.perf_counter() - t0)
    dtorch.synchronize()
    return {k: summarize(v) for k, v in runs.items()}


def rank_cpu(c, run_chain, repeats: int) -> dict:
    """``{"rank_cpu", "rank_process_cpu": Timing}``: CPU seconds per op of the chain on a
    rank, its interpreter thread alone and its whole worker process (the channel thread,
    Dask's), read from ``rank_stats()`` before and after a synchronized chain; the median
    over the ranks of each repeat. Also ``instructions_per_op``."""
    import statistics

    import dtorch
    runs = {"rank_cpu": [], "rank_process_cpu": []}
    per_op = []
    for _ in range(repeats):
        before = c.stats()
        run_chain()
        dtorch.synchronize()
        after = c.stats()
        for key, field in (("rank_cpu", "interpreter_cpu_s"),
                           ("rank_process_cpu", "process_cpu_s")):
            runs[key].append(statistics.median(
                (a[field] - b[field]) / CHAIN_OPS for a, b in zip(after, before)))
        per_op.append(statistics.median((a["instructions"] - b["instructions"]) / CHAIN_OPS
                                        for a, b in zip(after, before)))
    out = {k: summarize(v) for k, v in runs.items()}
    out["instructions_per_op"] = statistics.median(per_op)
    return out


def replay_gain(c, work: dict, repeats: int) -> dict:
    """For each ``name: (fn, n)`` in ``work``: ``{name + "_replayed" / "_unreplayed": Timing}``
    of seconds per call of ``n`` calls then ``synchronize()``, and ``name + "_cpu_replayed" /
    "_cpu_unreplayed"`` of a rank's interpreter-thread CPU seconds per call (the median rank),
    with the repeated run replayed (``batches.REPLAY``, the default) or sent whole each time,
    taking turns."""
    import statistics

    import dtorch
    from dtorch.runtime import batches

    def timed(fn, n: int, replay: bool):
        batches.REPLAY = replay
        try:
            dtorch.synchronize()
            before = c.stats()
            t0 = time.perf_counter()
            for _ in range(n):
                out = fn()
            del out
            dtorch.synchronize()
            wall = (time.perf_counter() - t0) / n
            cpu = statistics.median((a["interpreter_cpu_s"] - b["interpreter_cpu_s"]) / n
                                    for a, b in zip(c.stats(), before))
            return wall, cpu
        finally:
            batches.REPLAY = True
    runs: dict = {}
    for name, (fn, n) in work.items():
        for replay in (True, False, True):  # warm: the program defined and prepared
            timed(fn, n, replay)
        for _ in range(repeats):
            for replay, label in ((True, "replayed"), (False, "unreplayed")):
                wall, cpu = timed(fn, n, replay)
                runs.setdefault(f"{name}_{label}", []).append(wall)
                runs.setdefault(f"{name}_cpu_{label}", []).append(cpu)
    return {k: summarize(v) for k, v in runs.items()}


def _set_fuse(value: str) -> None:
    """On a rank's process: ``DTORCH_FUSE`` for the programs it prepares from now on."""
    os.environ["DTORCH_FUSE"] = value


def fused_chain(x):
    """The chain with other constants: its program is new, prepared with fusion on."""
    for _ in range(CHAIN_OPS // 2):
        x = x * 1.00011 + 0.0011
    return x


def fusion_gain(c, x, repeats: int) -> dict:
    """``{"chain_fused", "chain_unfused": Timing, "fuse_compile_s": float}``: the chain end to
    end with its stretches fused (``DTORCH_FUSE=1`` on the ranks: one compiled function per
    stretch) vs the same chain replayed unfused, taking turns, after the fused program's
    first (compiling) instance, whose time is ``fuse_compile_s``."""
    import dtorch

    def timed(fn):
        dtorch.synchronize()
        t0 = time.perf_counter()
        out = fn(x)
        del out
        dtorch.synchronize()
        return time.perf_counter() - t0
    c.client.run(_set_fuse, "1")
    try:
        timed(fused_chain)  # sent whole
        compile_s = timed(fused_chain)  # the program defined, prepared and compiled
        runs: dict = {"chain_fused": [], "chain_unfused": []}
        for _ in range(repeats):
            runs["chain_fused"].append(timed(fused_chain))
            runs["chain_unfused"].append(timed(chain))
    finally:
        c.client.run(_set_fuse, "0")
    out = {k: summarize(v) for k, v in runs.items()}
    out["fuse_compile_s"] = compile_s
    return out


def measure(repeats: int) -> dict:
    """``{name: Timing}``: dtorch's ``chain``/``mlp`` end to end and ``chain_ctrl``/``mlp_ctrl``
    (controller only), the reference's ``ref_chain``/``ref_mlp``."""
    import torch

    import dtorch
    from dtorch import Replicate, Shard, init_device_mesh
    from dtorch.runtime import session
    with dtorch_cluster(WORLD), ReferenceRanks(_rank_main, WORLD, dtorch_rank_settings(),
                                               "op_overhead") as ref:
        c = session.get_controller()
        mesh = init_device_mesh("cpu", WORLD)
        x0, xin, w1, w2 = values()
        x = dtorch.tensor(x0, device_mesh=mesh, placements=[Shard(0)])
        xin = dtorch.tensor(xin, device_mesh=mesh, placements=[Replicate()])
        w1 = dtorch.tensor(w1, device_mesh=mesh, placements=[Shard(0)])
        w2 = dtorch.tensor(w2, device_mesh=mesh, placements=[Shard(1)])

        def replicate(t):
            return t.redistribute(placements=[Replicate()])

        def timed(name, fn, n):
            dtorch.synchronize()
            t0 = time.perf_counter()
            for _ in range(n):
                out = fn()
            del out
            c.flush()
            t1 = time.perf_counter()
            dtorch.synchronize()
            t2 = time.perf_counter()
            return {name: (t2 - t0) / n, name + "_ctrl": (t1 - t0) / n}

        xg = x.detach().requires_grad_(True)

        def timed_backward():
            """Backward through the 500 nodes of ``chain(xg).sum()`` (built untimed)."""
            xg.grad = None
            loss = chain(xg).sum()
            dtorch.synchronize()
            t0 = time.perf_counter()
            loss.backward()
            c.flush()
            t1 = time.perf_counter()
            dtorch.synchronize()
            t2 = time.perf_counter()
            return {"backward": t2 - t0, "backward_ctrl": t1 - t0}

        work = {"chain": (lambda: chain(x), 1),
                "mlp": (lambda: mlp(xin, w1, w2, replicate), MLP_N),
                "chain_grad": (lambda: chain(xg), 1)}
        for name, (fn, n) in work.items():  # warm-up: fills the signature cache
            timed(name, fn, 1)
        timed_backward()
        got = take_turns(repeats, lambda: {"ref_chain": ref.ask("chain")},
                         lambda: timed("chain", *work["chain"]),
                         lambda: {"ref_mlp": ref.ask("mlp")}, lambda: timed("mlp", *work["mlp"]),
                         lambda: {"ref_chain_grad": ref.ask("chain_grad")},
                         lambda: timed("chain_grad", *work["chain_grad"]),
                         lambda: {"ref_backward": ref.ask("backward")}, timed_backward)
        got.update({f"unary_{k}": v for k, v in controller_unary(c, x, repeats).items()})
        got.update(rank_cpu(c, lambda: chain(x), repeats))
        got.update(replay_gain(c, {"mlp": (lambda: mlp(xin, w1, w2, replicate), REPLAYED_N),
                                   "chain": (lambda: chain(x), 1)}, repeats))
        got.update(fusion_gain(c, x, repeats))
        want = torch.special.erfcx(torch.special.erfcx(x0))
        assert torch.allclose(torch.special.erfcx(torch.special.erfcx(x)).to_torch(), want)
        loss = chain(xg).sum()
        xg.grad = None
        loss.backward()
        want = torch.full(CHAIN_SHAPE, 1.0001 ** (CHAIN_OPS // 2))
        assert torch.allclose(xg.grad.to_torch(), want), "the chain's gradient"
        want = torch.nn.functional.linear(torch.relu(torch.nn.functional.linear(
            values()[1], values()[2])), values()[3])
        assert torch.allclose(mlp(xin, w1, w2, replicate).to_torch(), want, atol=1e-4)
    return got


def run(quick: bool = False) -> list[Row]:
    repeats = 3 if quick else 9
    print("[op_overhead] dtorch and PyTorch DTensor (SPMD, 4 processes) taking turns ...",
          flush=True)
    got = measure(repeats)
    plain = plain_torch(repeats)
    per_op = lambda t: Timing(*(v / CHAIN_OPS for v in t[:3]), t.n)  # noqa: E731
    return [
        Row.timed(f"chain of {CHAIN_OPS} ops, end to end", got["chain"], got["ref_chain"], 0.5,
                  f"{got['chain'].median / CHAIN_OPS * 1e6:.1f} us/op vs PyTorch DTensor "
                  f"{got['ref_chain'].median / CHAIN_OPS * 1e6:.1f} us/op"),
        Row.timed("rank CPU per op (chain), interpreter thread", got["rank_cpu"],
                  per_op(plain["chain"]), 2.0,
                  f"reference: the op in plain torch in one process (one rank's shard); "
                  f"{got['instructions_per_op']:.2f} instructions per op (the op and the free "
                  f"of its input); the whole worker process (channel thread, Dask) "
                  f"{got['rank_process_cpu'].median * 1e6:.1f} us/op"),
        Row.timed("MLP forward, end to end", got["mlp"], got["ref_mlp"], None,
                  "info: 5 ops + 1 all_reduce vs PyTorch DTensor"),
        Row.timed(f"TP MLP forward x{REPLAYED_N}, replayed vs sent whole",
                  got["mlp_replayed"], got["mlp_unreplayed"], None,
                  f"info: per forward; the same flush of {REPLAYED_N} forwards then "
                  "synchronize(), its run replayed from a prepared program (the default) vs "
                  "unpickled and dispatched instruction by instruction (batches.REPLAY = "
                  f"False); a rank's CPU per forward {got['mlp_cpu_replayed'].median * 1e6:.0f}"
                  f" vs {got['mlp_cpu_unreplayed'].median * 1e6:.0f} us"),
        Row.timed("rank CPU per op (chain), replayed vs sent whole",
                  per_op(got["chain_cpu_replayed"]), per_op(got["chain_cpu_unreplayed"]), None,
                  "info: the chain's interpreter-thread CPU per op on the median rank, its "
                  f"run replayed vs not; end to end {got['chain_replayed'].median * 1e3:.2f} vs "
                  f"{got['chain_unreplayed'].median * 1e3:.2f} ms"),
        Row.timed("chain of 500 ops fused (DTORCH_FUSE=1) vs replayed unfused",
                  got["chain_fused"], got["chain_unfused"], None,
                  "info: end to end, once compiled; the instance that compiled its stretch "
                  f"took {got['fuse_compile_s']:.1f} s (torch.compile on each rank), which is "
                  "why fusion is off by default"),
        Row.timed("controller only: cost per op (chain)", per_op(got["chain_ctrl"]),
                  per_op(plain["chain"]), None,
                  "dtorch's controller issuing + shipping one op vs the op in plain torch in "
                  "one process (one rank's shard); not a whole-job comparison"),
        Row.timed("controller only: MLP forward", got["mlp_ctrl"], plain["mlp"], None,
                  "dtorch's controller per forward vs the forward in plain torch in one "
                  "process; not a whole-job comparison"),
        Row.timed(f"chain of {CHAIN_OPS} ops recording the graph, end to end",
                  got["chain_grad"], got["ref_chain_grad"], None,
                  f"info: input requires grad; {got['chain_grad'].median / CHAIN_OPS * 1e6:.1f}"
                  f" us/op (forward only: {got['chain'].median / CHAIN_OPS * 1e6:.1f}) vs "
                  f"PyTorch DTensor {got['ref_chain_grad'].median / CHAIN_OPS * 1e6:.1f} us/op"),
        Row.timed("controller only: cost per op recording the graph (chain)",
                  per_op(got["chain_grad_ctrl"]), per_op(plain["chain_grad"]), None,
                  f"forward only: {got['chain_ctrl'].median / CHAIN_OPS * 1e6:.1f} us/op; "
                  "reference: the op recording torch's graph in one process"),
        Row.timed(f"backward through {CHAIN_OPS} nodes, end to end", got["backward"],
                  got["ref_backward"], None,
                  f"info: {got['backward'].median / CHAIN_OPS * 1e6:.1f} us/node vs PyTorch "
                  f"DTensor {got['ref_backward'].median / CHAIN_OPS * 1e6:.1f} us/node"),
        Row.timed("controller only: a call with a derived rule (special.erfcx), cached",
                  got["unary_derived"], got["unary_hand"], None,
                  f"reference: a hand-written rule (torch.erf), same tensor; "
                  f"{got['unary_derived'].median * 1e6:.1f} vs "
                  f"{got['unary_hand'].median * 1e6:.1f} us/call"),
        Row.timed("controller only: first call of a derived rule (plan cache cleared)",
                  got["unary_derived_first"], got["unary_hand_first"], None,
                  "reference: the first call of torch.erf; the derived rule also traces the "
                  "call's aten ops on meta"),
        Row.timed("controller only: cost per backward node (chain)",
                  per_op(got["backward_ctrl"]), per_op(plain["backward"]), None,
                  "dtorch's controller walking the graph and issuing one Backward per node vs "
                  "torch's backward per node in one process"),
    ]


if __name__ == "__main__":
    main(run, __doc__)
