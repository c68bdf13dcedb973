"""The reference ranks the dtorch benches compare with: plain torch.distributed processes
spawned with dtorch's rank settings (allocator, huge pages, threads), which must report
the same settings back, serving timed cases or steps on command.

Not a benchmark itself; the bench scripts import it (``ReferenceRanks``, ``serve_timings``).
"""

from __future__ import annotations

import gc
import os

from _common import barrier_timed, free_port, rank_settings, rank_threads, spawn_env


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
