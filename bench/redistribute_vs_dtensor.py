"""redistribute() vs PyTorch's DTensor ``redistribute`` under SPMD, raw torch, and the collective.

Every transition of the placement table (DESIGN.md section 2) on a 1-D mesh of 4 CPU ranks
(gloo on 127.0.0.1), float32, a square-ish 2-D global tensor of 1 KB, 1 MB, 16 MB and 64 MB
(``--quick``: 1 KB, 1 MB, 16 MB, fewer repeats):

    Shard(0) -> Replicate   all_gather        Partial -> Replicate   all_reduce
    Shard(0) -> Shard(1)    all_to_all        Partial -> Shard(0)    reduce_scatter
    Replicate -> Shard(0)   local slice       Replicate -> Partial   none (zeros off rank 0)

Three references, all in the same 4 spawned torch processes (``torch.multiprocessing``, gloo),
timed inside the ranks between barriers, the slowest rank counting:

- **PyTorch DTensor** (target: dtorch at most 1.0x for every row from 1 MB up):
  ``DTensor.from_local(local, mesh, [src], shape=..., stride=...)`` then
  ``x.redistribute(mesh, [dst])``, waiting on the result (``AsyncCollectiveTensor.wait()``),
  the same shapes and placements. (On CPU, torch 2.13's DTensor does Shard(0)->Shard(1) as an
  all_gather plus a chunk copy: gloo has no all_to_all in its eyes. Its public
  ``redistribute`` refuses Replicate->Partial, "for internal use only": that row times the
  path DTensor's own ops take, ``redistribute_local_tensor`` (the local tensor divided by the
  world size) wrapped by ``DTensor.from_local``.)
- **raw torch doing the whole move on preallocated buffers** (target: at most 1.15x from 16 MB):
  the collective plus the local copy the move itself needs, into buffers allocated once:
  all_gather_single; pack the column blocks + all_to_all_single; copy the input + all_reduce (a
  redistribute is out of place); reduce_scatter_single; copy this rank's row block out
  (Replicate->Shard(0)); fill zeros on ranks 1.. (Replicate->Partial).
- **the bare collective** on preallocated buffers, the floor (none for the last two rows).

dtorch is timed on the controller: issue N ``x.redistribute(placements=[dst])`` then
``dtorch.synchronize()``, divided by N, after a warm-up (the batch hop and the final round trip
are included, spread over N).

The dtorch cluster starts first; its rank processes' allocator, huge-page and thread settings
(``_common.dtorch_rank_settings``: glibc's malloc variables, ``THP_MEM_ALLOC_ENABLE``, the
OpenMP/BLAS thread variables, the machine's THP mode, torch threads per rank) are read from
inside them, and the reference processes are spawned with exactly those, then report their own
(printed; the run stops if they differ). Both stay up for the whole run and take turns, one
timed repeat each per case (references, then dtorch), so both see the same machine. Medians.

    .venv/bin/python bench/redistribute_vs_dtensor.py [--quick]
    .venv/bin/python bench/redistribute_vs_dtensor.py --where [--quick]   # where dtorch's time goes
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import (Row, barrier_timed, dtorch_cluster, dtorch_rank_settings, fmt_bytes,
                     fmt_s, main, matrix_shape, median, redistribute_turns, time_redistribute)  # noqa: E402
from _reference import ReferenceRanks, serve_timings  # noqa: E402

WORLD = int(os.environ.get("BENCH_WORLD", 4))
KB, MB = 1 << 10, 1 << 20
# (label, source, target, the collective the move implies or None); placements by name
MOVES = (("S(0)->R", "S0", "R", "all_gather"), ("S(0)->S(1)", "S0", "S1", "all_to_all"),
         ("P->R", "P", "R", "all_reduce"), ("P->S(0)", "P", "S0", "reduce_scatter"),
         ("R->S(0)", "R", "S0", None), ("R->P", "R", "P", None))
VS_DTENSOR, VS_RAW = 1.0, 1.15  # targets
DTENSOR_FROM, RAW_FROM = 1 * MB, 16 * MB  # ... for tensors of at least this many bytes


def cases(quick: bool) -> list[tuple[tuple, int, int]]:
    """(move, global bytes, ops per timed repeat: about 0.05-0.3 s each)."""
    sizes = ({1 * KB: 40, 1 * MB: 10, 16 * MB: 3} if quick else
             {1 * KB: 100, 1 * MB: 30, 16 * MB: 8, 64 * MB: 3})
    # the local moves take a few ms: more of them per repeat, so that the one synchronize round
    # trip per repeat weighs about as much as it does for the collectives
    return [(move, size, n if move[3] else 4 * n) for size, n in sizes.items() for move in MOVES]


def _local_shape(placement: str, rows: int, cols: int) -> tuple[int, int]:
    return {"S0": (rows // WORLD, cols), "S1": (rows, cols // WORLD)}.get(placement, (rows, cols))


# references: PyTorch DTensor, raw torch, bare collective (inside the spawned ranks) ---------------
def _dtensor_op(move: tuple, nbytes: int, mesh):
    """PyTorch DTensor's redistribute of this move; it finishes its work before it returns."""
    import torch
    from torch.distributed._functional_collectives import AsyncCollectiveTensor
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
    _, src, dst, _ = move
    rows, cols = matrix_shape(nbytes)
    place = {"S0": Shard(0), "S1": Shard(1), "R": Replicate(), "P": Partial()}
    x = DTensor.from_local(torch.ones(_local_shape(src, rows, cols)), mesh, [place[src]],
                           run_check=False, shape=(rows, cols), stride=(cols, 1))
    target = [place[dst]]
    if dst == "P":  # DTensor.redistribute refuses "to Partial" ("for internal use only"):
        from torch.distributed.tensor._dtensor_spec import DTensorSpec  # take the path its ops use
        from torch.distributed.tensor._redistribute import redistribute_local_tensor
        spec = DTensorSpec(mesh, tuple(target), tensor_meta=x._spec.tensor_meta)

        def dtensor():
            DTensor.from_local(redistribute_local_tensor(x._local_tensor, x._spec, spec), mesh,
                               target, run_check=False, shape=(rows, cols), stride=(cols, 1))
        return dtensor

    def dtensor():
        y = x.redistribute(mesh, target).to_local()
        if isinstance(y, AsyncCollectiveTensor):
            y.wait()
    return dtensor


def _raw_ops(move: tuple, nbytes: int, rank: int):
    """(raw torch's whole move on preallocated buffers, the bare collective or None, the
    torch.distributed call dtorch's ranks make for it or None), on the default process group
    of WORLD ranks."""
    import torch
    import torch.distributed as dist
    _, _, dst, coll = move
    rows, cols = matrix_shape(nbytes)
    # torch 2.13 names of the flat collectives
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    elems, k = rows * cols, rows // WORLD
    if coll == "all_gather":
        inp, out = torch.ones(elems // WORLD), torch.empty(elems)
        bare = lambda: gather(out, inp)  # noqa: E731
        return bare, bare, _dtorch_gather(k, cols)
    if coll == "all_to_all":  # the column blocks are packed into one contiguous send buffer
        local = torch.ones(k, cols)
        inp, out = torch.empty(elems // WORLD), torch.empty(elems // WORLD)
        blocks = local.view(k, WORLD, cols // WORLD).transpose(0, 1)

        def whole():
            inp.view(blocks.shape).copy_(blocks)
            dist.all_to_all_single(out, inp)
        return whole, lambda: dist.all_to_all_single(out, inp), _dtorch_all_to_all(k, cols)
    if coll == "all_reduce":  # out of place: the input stays as it was
        inp, buf = torch.ones(elems), torch.empty(elems)

        def whole():
            buf.copy_(inp)
            dist.all_reduce(buf)
        return whole, lambda: dist.all_reduce(buf), _dtorch_all_reduce(elems)
    if coll == "reduce_scatter":
        inp, out = torch.ones(elems), torch.empty(elems // WORLD)
        bare = lambda: scatter(out, inp)  # noqa: E731
        return bare, bare, _dtorch_all_reduce(elems)  # gloo: dtorch reduces, keeps its piece
    full = torch.ones(rows, cols)
    if dst == "S0":  # Replicate -> Shard(0): this rank's row block, as its own tensor
        out = torch.empty(k, cols)
        return lambda: out.copy_(full[rank * k:(rank + 1) * k]), None, None
    buf = torch.empty(rows, cols)  # Replicate -> Partial(sum): rank 0 keeps it, zeros elsewhere
    return ((lambda: None) if rank == 0 else buf.zero_), None, None


# the torch.distributed call each of dtorch's steps makes (dtorch/runtime/collectives.py), the
# poison flag inside, on preallocated buffers: the floor of what dtorch's ranks can take
def _dtorch_gather(k: int, cols: int):
    """Even shards on gloo: one ProcessGroup.allgather_coalesced of [shard, flag], each block
    written straight into the result."""
    import torch
    import torch.distributed as dist
    pg = dist.distributed_c10d._get_default_group()
    shard, flag = torch.ones(k, cols), torch.zeros(1)
    result, flags = torch.empty(WORLD * k, cols), torch.empty(WORLD)
    outputs = [[result[j * k:(j + 1) * k], flags[j:j + 1]] for j in range(WORLD)]
    return lambda: pg.allgather_coalesced(outputs, [shard, flag]).wait()


def _dtorch_all_to_all(k: int, cols: int):
    """One all_to_all_single of WORLD rows, each a piece and its flag (rows of 64 bytes)."""
    import torch
    import torch.distributed as dist
    from dtorch.runtime.poison_flag import flagged_row
    row = flagged_row(k * (cols // WORLD), torch.float32)
    send, received = torch.ones(WORLD, row), torch.empty(WORLD, row)
    return lambda: dist.all_to_all_single(received, send)


def _dtorch_all_reduce(elems: int):
    """One all_reduce of the shard and its flag element (also gloo's reduce_scatter path)."""
    import torch
    import torch.distributed as dist
    buf = torch.ones(elems + 1)
    return lambda: dist.all_reduce(buf)


def _reference_ops(move: tuple, nbytes: int, mesh, rank: int):
    """(DTensor redistribute, raw torch's whole move on preallocated buffers, bare collective
    or None, dtorch's call in plain torch or None). Every op finishes before it returns."""
    return (_dtensor_op(move, nbytes, mesh), *_raw_ops(move, nbytes, rank))


def _rank_main(rank: int, commands, results) -> None:
    """One reference rank (in the gloo group): times ``(move, bytes, n)`` commands until it
    reads None."""
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (WORLD,))
    ops, current = None, None

    def timed(cmd):
        nonlocal ops, current
        move, nbytes, n = cmd
        if current != (move, nbytes):
            ops, current = None, None  # free the previous case's buffers first
            ops, current = _reference_ops(move, nbytes, mesh, rank), (move, nbytes)
            for op in ops:
                if op is not None:
                    op()  # warm-up
        took = []
        for i, op in enumerate(ops):  # an op that is also an earlier one is timed once
            same = [j for j in range(i) if ops[j] is op]
            took.append(-1.0 if op is None else took[same[0]] if same else barrier_timed(op, n))
        return took
    serve_timings(rank, commands, results, timed)


class MoveRanks(ReferenceRanks):
    """WORLD plain torch processes, spawned with dtorch's rank ``settings``, that time one
    case on command."""

    def __init__(self, settings: dict):
        super().__init__(_rank_main, WORLD, settings, "redistribute_vs_dtensor")

    def time(self, move: tuple, nbytes: int, n: int) -> dict:
        """Seconds per op: ``dt`` (DTensor), ``whole`` (raw whole move), ``bare`` (the bare
        collective) and ``calls`` (dtorch's own call in plain torch); the last two absent
        where the move has no collective."""
        dt, whole, bare, calls = self.ask(move, nbytes, n)
        return {"dt": dt, "whole": whole,
                **({"bare": bare, "calls": calls} if bare >= 0 else {})}


# dtorch -------------------------------------------------------------------------------------------
def measure(todo, repeats: int) -> dict:
    """``{(label, bytes): {"dtorch", "dt", "whole"[, "bare", "calls"]: Timing}}``."""
    import dtorch
    from dtorch import Partial, Replicate, Shard, init_device_mesh
    place = {"S0": Shard(0), "S1": Shard(1), "R": Replicate(), "P": Partial()}
    out = {}
    with dtorch_cluster(WORLD):
        with MoveRanks(dtorch_rank_settings()) as ref:
            mesh = init_device_mesh("cpu", WORLD)
            for move, nbytes, n in todo:
                label, src, dst, _ = move
                r = out[(label, nbytes)] = redistribute_turns(
                    repeats, lambda: ref.time(move, nbytes, n), mesh, nbytes, place[src],
                    place[dst], n)
                ms = {k: f"{v.median * 1e3:.2f} ms" for k, v in r.items()}
                print(f"[redistribute_vs_dtensor] {label} {fmt_bytes(nbytes)}: dtorch "
                      f"{ms['dtorch']}, DTensor {ms['dt']}, raw move {ms['whole']}"
                      + (f", bare {ms['bare']}, dtorch's call {ms['calls']}" if "bare" in r
                         else ""), flush=True)
            dtorch.synchronize()
    return out


def run(quick: bool = False) -> list[Row]:
    todo = cases(quick)
    print(f"[redistribute_vs_dtensor] {len(todo)} cases on {WORLD} ranks: dtorch, PyTorch "
          f"DTensor (SPMD) and raw torch taking turns ...", flush=True)
    got = measure(todo, 3 if quick else 7)
    rows = []
    for (label, _, _, coll), nbytes, n in todo:
        r = got[(label, nbytes)]
        ours = r["dtorch"].median
        name = f"redistribute {label} {fmt_bytes(nbytes)}"
        floor = (f"floors: bare {coll} {fmt_s(r['bare'].median).strip()} (dtorch "
                 f"{ours / r['bare'].median:.2f}x, DTensor {r['dt'].median / r['bare'].median:.2f}x), "
                 f"dtorch's own call in plain torch {fmt_s(r['calls'].median).strip()} (dtorch "
                 f"{ours / r['calls'].median:.2f}x)" if "bare" in r else "no collective")
        rows.append(Row.timed(f"{name} vs DTensor", r["dtorch"], r["dt"], VS_DTENSOR, floor + (
            "" if nbytes >= DTENSOR_FROM else "; info only, target from 1 MB")))
        rows.append(Row.timed(f"{name} vs raw move", r["dtorch"], r["whole"], VS_RAW,
                              "raw torch: the whole move on preallocated buffers" + (
                                  "" if nbytes >= RAW_FROM else "; info only, target from 16 MB")))
    return rows


# where the time goes (``--where``): timers inside dtorch's rank processes ----------------------
def _install_timers() -> None:
    """In a rank process: wrap the batch loop, each redistribute step and each torch.distributed
    call dtorch's steps make (the poison flag rides inside it), adding seconds to
    ``collectives._bench_timers``."""
    import collections
    from dtorch.runtime import collectives, interpreter, worker
    if hasattr(collectives, "_bench_timers"):
        return
    timers = collectives._bench_timers = collections.Counter()

    def timed(key, fn):
        def call(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                timers[key] += time.perf_counter() - t0
        return call

    worker.RankActor._run_batch = timed("batch", worker.RankActor._run_batch)
    interpreter.run_step = timed("step", interpreter.run_step)
    for name, fn in vars(collectives.counted).items():
        if isinstance(fn, staticmethod):
            setattr(collectives.counted, name, staticmethod(timed("collective", fn.__func__)))


def _read_timers() -> dict:
    from dtorch.runtime import collectives
    got = dict(collectives._bench_timers)
    collectives._bench_timers.clear()
    return got


def _in_worker(move: tuple, nbytes: int, n: int) -> tuple:
    """In a rank process (Dask's event-loop thread, the interpreter idle): raw torch's whole
    move and the bare collective on preallocated buffers, timed like the reference ranks."""
    import torch.distributed as dist
    ops = _raw_ops(move, nbytes, dist.get_rank())[:2]
    for op in ops:
        if op is not None:
            op()
    return tuple(barrier_timed(op, n) if op is not None else -1.0 for op in ops)


def where(quick: bool) -> None:
    """Per move and size: dtorch's time per op on the controller, split into what the ranks
    spend (batch loop, redistribute step, the collective call with its flag inside) and the rest
    (controller issue, the Dask hop, the synchronize round trip), and raw torch on preallocated
    buffers inside the same rank processes. Slowest rank per number; medians of 5 repeats."""
    import dtorch
    from dtorch import Partial, Replicate, Shard, init_device_mesh
    from dtorch.runtime import session
    place = {"S0": Shard(0), "S1": Shard(1), "R": Replicate(), "P": Partial()}
    with dtorch_cluster(WORLD):
        client = session.get_controller().client
        print("[where] rank settings:", dtorch_rank_settings(), flush=True)
        client.run(_install_timers)
        mesh = init_device_mesh("cpu", WORLD)
        syncs = []
        for _ in range(20):
            t0 = time.perf_counter()
            dtorch.synchronize()
            syncs.append(time.perf_counter() - t0)
        print(f"[where] an empty synchronize(): {median(syncs) * 1e3:.2f} ms", flush=True)
        sizes = (1 * MB, 16 * MB) if quick else (1 * MB, 16 * MB, 64 * MB)
        for nbytes in sizes:
            n = {1 * MB: 30, 16 * MB: 8, 64 * MB: 3}[nbytes]
            for move in MOVES:
                label, src, dst, coll = move
                n_move = n if coll else 4 * n
                x = dtorch.ones(*matrix_shape(nbytes), device_mesh=mesh, placements=[place[src]])
                x.redistribute(placements=[place[dst]])
                ctrl, ranks = [], []
                for _ in range(5):
                    dtorch.synchronize()
                    client.run(_read_timers)
                    ctrl.append(time_redistribute(x, place[dst], n_move))
                    per_rank = client.run(_read_timers).values()
                    keys = {k for d in per_rank for k in d}
                    ranks.append({k: max(d.get(k, 0.0) for d in per_rank) / n_move for k in keys})
                keys = {k for d in ranks for k in d}
                c, t = median(ctrl), {k: median([d.get(k, 0.0) for d in ranks]) for k in keys}
                reps = [[max(v) for v in zip(*client.run(_in_worker, move, nbytes,
                                                          n_move).values())] for _ in range(3)]
                raw = [median(v) for v in zip(*reps)]  # (whole move, bare or -1), slowest rank
                ms = lambda v: f"{v * 1e3:.2f}"  # noqa: E731
                print(f"[where] {label} {fmt_bytes(nbytes)}: controller-timed {ms(c)} ms/op; "
                      f"in the ranks: batch {ms(t.get('batch', 0))}, step {ms(t.get('step', 0))}"
                      f", collective call {ms(t.get('collective', 0))}; outside the ranks' "
                      f"batches {ms(c - t.get('batch', 0))}; raw in "
                      f"the rank process: whole move {ms(raw[0])}"
                      + (f", bare {ms(raw[1])}" if raw[1] >= 0 else ""), flush=True)
                del x


if __name__ == "__main__":
    if "--where" in sys.argv:
        where("--quick" in sys.argv)
    else:
        main(run, __doc__)
