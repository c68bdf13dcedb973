"""Helpers shared by the bench scripts: a result row, medians, a free port, table printing,
taking turns with dtorch (the reference ranks: ``_reference.py``).

Not a benchmark itself; ``bench/run_all.py`` and each ``bench/<name>.py`` import it.
"""

from __future__ import annotations

import datetime
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
