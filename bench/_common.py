"""Helpers shared by the bench scripts: a result row, medians, a free port, table printing,
the reference torch.distributed ranks and taking turns with dtorch.

Not a benchmark itself; ``bench/run_all.py`` and each ``bench/<name>.py`` import it.
"""

from __future__ import annotations

import datetime
import gc
import os
import platform
import socket
import statistics
import sys
from typing import NamedTuple


class Timing(NamedTuple):
    """The median of repeated measurements and their spread (the interquartile range)."""

    median: float
    q1: float
    q3: float
    n: int

    @property
    def iqr(self) -> float:
        return self.q3 - self.q1


def summarize(xs) -> Timing:
    """``Timing`` of a list of measurements: median, first and third quartile.

    >>> summarize([1.0, 2.0, 3.0, 4.0, 100.0]).median
    3.0
    """
    xs = sorted(xs)
    if len(xs) < 2:
        return Timing(xs[0], xs[0], xs[0], len(xs))
    q1, _, q3 = statistics.quantiles(xs, n=4, method="inclusive")
    return Timing(statistics.median(xs), q1, q3, len(xs))


class Row(NamedTuple):
    """One comparison: dtorch seconds vs reference seconds (medians, with their interquartile
    ranges ``*_iqr`` when repeated); ``target`` is the max ratio wanted, None for a row that is
    information only (say, one that times dtorch's controller alone). ``unit`` "B" marks a row
    of bytes instead of seconds, "msgs" one of messages."""

    name: str
    dtorch_s: float
    ref_s: float
    target: float | None
    note: str = ""
    unit: str = "s"
    dtorch_iqr: float = 0.0
    ref_iqr: float = 0.0
    both_ways: bool = False  # the target bounds the ratio from below too (1/target..target)

    @classmethod
    def timed(cls, name: str, ours: Timing, ref: Timing, target: float | None,
              note: str = "") -> "Row":
        """A row from two ``Timing``s (medians and spreads)."""
        return cls(name, ours.median, ref.median, target, note, "s", ours.iqr, ref.iqr)

    def shown(self, value: float) -> str:
        if self.unit in ("B", "msgs"):
            return f"{value:9.0f} {self.unit} "
        return fmt_s(value)

    @property
    def ratio(self) -> float:
        return self.dtorch_s / self.ref_s if self.ref_s > 0 else float("inf")

    @property
    def meets(self) -> str:
        if self.target is None:
            return "info"
        low = 1 / self.target if self.both_ways else 0.0
        return "yes" if low <= self.ratio <= self.target else "no"

    @property
    def spread(self) -> str:
        """The interquartile ranges as a share of each median: ``"±3% / ±8%"``."""
        if not (self.dtorch_iqr or self.ref_iqr):
            return ""
        pct = lambda iqr, med: f"±{50 * iqr / med:.0f}%" if med > 0 else "-"  # noqa: E731
        return f"{pct(self.dtorch_iqr, self.dtorch_s)} / {pct(self.ref_iqr, self.ref_s)}"

    @property
    def target_shown(self) -> str:
        if self.target is None:
            return "-"
        return f"{1 / self.target:.2f}-{self.target:.2f}x" if self.both_ways else \
            f"<= {self.target:.2f}x"


def main(run, doc: str) -> None:
    """Command line of one bench script: ``[--quick] [--json PATH]``; prints the table."""
    import argparse
    import json
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small sizes, few repeats (~1 min)")
    ap.add_argument("--json", metavar="PATH", help="also write the rows as JSON (run_all.py)")
    args = ap.parse_args()
    rows = run(args.quick)
    if args.json:
        with open(args.json, "w") as f:
            json.dump([r._asdict() for r in rows], f)
    print(table(rows), flush=True)


def timed_calls(fn, repeats: int) -> list[float]:
    """Seconds of each of ``repeats`` calls of ``fn``, after one untimed warm-up call."""
    import time
    fn()
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def median(xs) -> float:
    return statistics.median(xs)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def barrier_timed(fn, n: int) -> float:
    """Seconds per call of ``fn``, run ``n`` times between two barriers (inside a rank)."""
    import time
    import torch.distributed as dist
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    dist.barrier()
    return (time.perf_counter() - t0) / n


def rank_threads(world: int) -> int:
    """Torch threads per rank: the same formula dtorch uses (dtorch.runtime.cluster.local_threads)."""
    return max(1, (os.cpu_count() or 1) // max(1, world))


def fmt_s(s: float) -> str:
    if s < 1e-3:
        return f"{s * 1e6:8.1f} us"
    if s < 1:
        return f"{s * 1e3:8.2f} ms"
    return f"{s:8.3f} s "


def table(rows: list[Row]) -> str:
    """Plain-text table: name, dtorch, reference, ratio, spread, target, whether it is met."""
    w = max([len(r.name) for r in rows] + [10])
    lines = [f"{'benchmark':<{w}}  {'dtorch':>11}  {'reference':>11}  {'ratio':>6}  "
             f"{'IQR d / ref':>13}  {'target':>8}  meets"]
    for r in rows:
        lines.append(f"{r.name:<{w}}  {r.shown(r.dtorch_s)}  {r.shown(r.ref_s)}  {r.ratio:6.2f}  "
                     f"{r.spread:>13}  {r.target_shown:>8}  {r.meets.upper() if r.meets == 'no' else r.meets}"
                     + (f"  ({r.note})" if r.note else ""))
    return "\n".join(lines)


def markdown(rows: list[Row]) -> str:
    lines = ["| benchmark | dtorch | reference | ratio | IQR dtorch / ref | target | meets | note |",
             "| --- | ---: | ---: | ---: | ---: | ---: | --- | --- |"]
    for r in rows:
        lines.append(f"| {r.name} | {r.shown(r.dtorch_s).strip()} | {r.shown(r.ref_s).strip()} | "
                     f"{r.ratio:.2f}x | {r.spread} | {r.target_shown} | {r.meets} | {r.note} |")
    return "\n".join(lines)


def machine() -> str:
    """One line describing where the numbers were taken."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        load = "load avg %.2f %.2f %.2f" % os.getloadavg()
    except OSError:
        load = "load avg n/a"
    import torch
    return (f"{platform.node()}: {os.cpu_count()} CPUs ({cpu}), {platform.system()} "
            f"{platform.release()}, Python {platform.python_version()}, torch {torch.__version__}"
            f", {load} at start")


def now() -> str:
    return datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")


def command() -> str:
    return " ".join([os.path.relpath(sys.executable)] + sys.argv)


# rank-process settings (allocator, huge pages, threads) -----------------------------------------
# The environment variables that decide how a rank process allocates memory and how many
# threads its libraries start: glibc's malloc tunables, torch's huge-page switch, the BLAS/OpenMP
# thread counts Dask's Nanny sets, and a preloaded allocator (jemalloc/tcmalloc) if any.
RANK_ENV_PREFIXES = ("MALLOC_", "GLIBC_TUNABLES", "THP_MEM_ALLOC_ENABLE", "OMP_NUM_THREADS",
                     "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "LD_PRELOAD")


def rank_settings() -> dict:
    """This process's allocator / huge-page / thread environment (keys of RANK_ENV_PREFIXES
    that are set) plus the machine's transparent-huge-page mode, as ``{name: value}``."""
    env = {k: v for k, v in os.environ.items() if k.startswith(RANK_ENV_PREFIXES)}
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            env["(sys) transparent_hugepage"] = f.read().strip()
    except OSError:
        pass
    return dict(sorted(env.items()))


def dtorch_rank_settings() -> dict:
    """``rank_settings()`` as seen inside each running dtorch rank process (one dict if they all
    agree), plus the torch thread count dtorch gives each local rank."""
    from dtorch.runtime import session
    from dtorch.runtime.cluster import local_threads
    c = session.get_controller()
    got = list(c.client.run(rank_settings).values())
    if any(g != got[0] for g in got):
        raise RuntimeError(f"dtorch's rank processes differ: {got}")
    return {**got[0], "(torch) threads per rank": str(local_threads(len(c.ranks)))}


class spawn_env:
    """``with spawn_env(settings): <spawn processes>``: this process's environment carries the
    RANK_ENV_PREFIXES variables of ``settings`` (others of those unset) while the children
    start, so they begin with the same allocator and huge-page settings; restored after."""

    def __init__(self, settings: dict):
        self.want = {k: v for k, v in settings.items() if k.startswith(RANK_ENV_PREFIXES)}

    def __enter__(self):
        self.before = {k: v for k, v in os.environ.items() if k.startswith(RANK_ENV_PREFIXES)}
        for k in self.before:
            os.environ.pop(k)
        os.environ.update(self.want)
        return self

    def __exit__(self, *exc):
        for k in self.want:
            os.environ.pop(k, None)
        os.environ.update(self.before)
        return False


def matrix_shape(nbytes: int, itemsize: int = 4) -> tuple[int, int]:
    """A square-ish 2-D shape of ``nbytes`` (power-of-two sides, so they divide by 2, 4, 8 ...)."""
    n = nbytes // itemsize
    rows = 1 << ((n.bit_length() - 1) // 2)
    return rows, n // rows


def fmt_bytes(n: int) -> str:
    for unit, size in (("MB", 1 << 20), ("KB", 1 << 10)):
        if n >= size:
            return f"{n // size} {unit}"
    return f"{n} B"


# reference ranks: plain torch.distributed processes the dtorch benches compare with --------------
def join_reference_group(rank: int, port: int, world: int) -> None:
    """In a spawned reference rank: ``rank_threads(world)`` torch threads, then the default
    process group of ``world`` ranks (gloo on 127.0.0.1:``port``, loopback interface)."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(rank_threads(world))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=300))


def gathered_rank_settings(world: int) -> list[dict]:
    """In a reference rank: every rank's ``rank_settings()`` plus its torch thread count (the
    keys ``dtorch_rank_settings`` gives), in rank order, on every rank."""
    import torch
    import torch.distributed as dist
    every = [None] * world
    dist.all_gather_object(every, {**rank_settings(),
                                   "(torch) threads per rank": str(torch.get_num_threads())})
    return every


def check_same_settings(ours: dict, theirs: list[dict], bench: str = "bench") -> None:
    """Prints dtorch's rank settings; raises unless every reference rank's (``theirs``) are
    the same (the one check every bench with reference ranks goes through)."""
    print(f"[{bench}] rank settings, dtorch's ranks and the reference ranks alike:")
    for k, v in ours.items():
        print(f"    {k}={v}")
    if not any(k.startswith("MALLOC_") for k in ours):
        print("    (no MALLOC_* variable: glibc's default, adaptive mmap threshold)")
    for r, s in enumerate(theirs):
        if s != ours:
            raise RuntimeError(f"reference rank {r} runs with {s}, dtorch's ranks with {ours}")


def slowest_rank(seconds) -> tuple[float, ...]:
    """In a reference rank: each of ``seconds`` maxed over all ranks (an all_reduce)."""
    import torch
    import torch.distributed as dist
    took = torch.tensor(list(seconds), dtype=torch.float64)
    dist.all_reduce(took, op=dist.ReduceOp.MAX)
    return tuple(took.tolist())


def serve_timings(rank: int, commands, results, time_case) -> None:
    """A reference rank's command loop: for each command from ``commands[rank]`` until None,
    ``time_case(command)`` gives this rank's seconds (a number or a sequence of them) and
    rank 0 puts the slowest rank's on ``results``; then the rank leaves the process group."""
    import torch.distributed as dist
    while (cmd := commands[rank].get()) is not None:
        took = time_case(cmd)
        single = isinstance(took, (int, float))
        took = slowest_rank([took] if single else took)
        if rank == 0:
            results.put(took[0] if single else took)
    dist.barrier()
    dist.destroy_process_group()


def serve_steps(rank: int, commands, results, setup) -> None:
    """A reference rank's loop for the training benches: a command is ``(*key, n)``;
    ``setup(*key)`` gives ``(step, check)`` and is kept until another key comes (one model
    alive at a time); ``n == 0`` puts ``check`` (rank 0's: what the two sides compare) on
    ``results``, else ``n`` steps are timed between barriers. Pair it with
    ``ReferenceRanks.check``."""
    setups = {}

    def timed(cmd):
        *key, n = cmd
        if tuple(key) not in setups:
            setups.clear()
            gc.collect()
            setups[tuple(key)] = setup(*key)
        step, check = setups[tuple(key)]
        if n == 0:
            if rank == 0:
                results.put(check)
            return 0.0
        return barrier_timed(step, n)

    serve_timings(rank, commands, results, timed)


def _reference_rank(rank: int, port: int, commands, results, rank_main, world: int) -> None:
    """A spawned reference rank: joins the gloo group, reports every rank's settings (rank 0
    puts them on ``results``), then runs ``rank_main(rank, commands, results)``."""
    join_reference_group(rank, port, world)
    every = gathered_rank_settings(world)
    if rank == 0:
        results.put(every)
    rank_main(rank, commands, results)


class ReferenceRanks:
    """``world`` spawned plain torch processes, each in the default gloo group, running
    ``rank_main(rank, commands, results)``: one command queue per rank, one results queue.

    They are spawned with dtorch's rank-process settings (``settings``, from
    ``dtorch_rank_settings()``: start the dtorch cluster first) and report their own, which
    must be the same (``check_same_settings``, raising otherwise): both sides of every
    comparison run with one allocator, huge-page and thread setup. A context manager: leaving
    it closes them.
    """

    def __init__(self, rank_main, world: int, settings: dict, bench: str = "bench"):
        import torch.multiprocessing as mp
        ctx = mp.get_context("spawn")
        self.commands = [ctx.SimpleQueue() for _ in range(world)]
        self.results = ctx.Queue()
        with spawn_env(settings):
            self.procs = mp.start_processes(
                _reference_rank, nprocs=world, join=False, start_method="spawn",
                args=(free_port(), self.commands, self.results, rank_main, world))
        try:
            check_same_settings(settings, self.get(), bench)
        except BaseException:
            self.close()
            raise

    def get(self):
        """The next result; raises if a reference rank died (instead of waiting forever)."""
        import queue
        while True:
            try:
                return self.results.get(timeout=2)
            except queue.Empty:
                self.procs.join(timeout=0)  # raises ProcessRaisedException if one failed

    def check(self, *key):
        """What ``serve_steps``'s setup of ``key`` gave to compare (then its zero timing)."""
        for q in self.commands:
            q.put(key + (0,))
        value = self.get()
        self.get()
        return value

    def ask(self, *command):
        """Sends ``command`` to every rank; returns the result (rank 0's)."""
        for q in self.commands:
            q.put(command)
        return self.get()

    def close(self) -> None:
        """Tells every rank to stop and waits for them."""
        for q in self.commands:
            q.put(None)
        while not self.procs.join():
            pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False


def dtorch_steps_turn(name: str, step, n: int):
    """A ``take_turns`` turn: ``n`` calls of dtorch's ``step`` between two ``synchronize()``
    (the controller issues ahead; the ranks' finish counts): ``{name: seconds per step}``."""
    import time

    import dtorch

    def run():
        dtorch.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            step()
        dtorch.synchronize()
        return {name: (time.perf_counter() - t0) / n}
    return run


def take_turns(repeats: int, *turns) -> dict:
    """``repeats`` rounds of calling each of ``turns`` in order (one timed repeat each, so all
    see the same machine); each returns ``{name: seconds}``. ``{name: Timing}`` (median and
    interquartile range over the rounds)."""
    runs = {}
    for _ in range(repeats):
        for turn in turns:
            for k, v in turn().items():
                runs.setdefault(k, []).append(v)
    return {k: summarize(v) for k, v in runs.items()}


class dtorch_cluster:
    """``with dtorch_cluster(world):`` dtorch started on ``world`` local ranks, shut down after."""

    def __init__(self, world: int):
        self.world = world

    def __enter__(self):
        import dtorch
        dtorch.init(n_workers=self.world)
        return self

    def __exit__(self, *exc):
        import dtorch
        dtorch.shutdown()
        return False


def time_redistribute(x, dst, n: int) -> float:
    """dtorch seconds per ``x.redistribute(placements=[dst])``: n of them, then a synchronize
    (timed on the controller, from a synchronized start)."""
    import time

    import dtorch
    dtorch.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        x.redistribute(placements=[dst])
    dtorch.synchronize()
    return (time.perf_counter() - t0) / n


def redistribute_turns(repeats: int, ref_turn, mesh, nbytes: int, src, dst, n: int) -> dict:
    """One redistribute case: dtorch ones of ``matrix_shape(nbytes)`` placed ``[src]`` on
    ``mesh``, one warm-up redistribute to ``dst`` (its result freed at once), then
    ``take_turns`` of ``ref_turn`` and dtorch's ``time_redistribute`` (key ``dtorch``):
    ``{name: Timing}``."""
    import dtorch
    x = dtorch.ones(*matrix_shape(nbytes), device_mesh=mesh, placements=[src])
    x.redistribute(placements=[dst])
    return take_turns(repeats, ref_turn, lambda: {"dtorch": time_redistribute(x, dst, n)})
