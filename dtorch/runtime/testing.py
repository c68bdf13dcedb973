"""Helpers for tests that must order events between the controller and the ranks.

A test that needs "the ranks are busy right now" holds them on an event it controls instead of
sleeping and hoping the timing works out on a loaded machine:

>>> import tempfile
>>> d = tempfile.mkdtemp()
>>> release_ranks(d)
>>> hold_rank(d, timeout=5)             # returns at once: the folder already says "go"
>>> len(started_ranks(d))
1
"""

import os
import time
from pathlib import Path

_POLL_S = 0.01


def hold_rank(folder: str, timeout: float = 120.0) -> None:
    """Run on a rank (``m.Call((), hold_rank, (folder,), {}, ranks)``): write
    ``folder/started.<pid>``, then block until ``folder/release`` exists or ``timeout``
    seconds pass (a forgotten release ends, it never hangs the suite)."""
    Path(folder, f"started.{os.getpid()}").touch()
    deadline = time.monotonic() + timeout
    while not Path(folder, "release").exists() and time.monotonic() < deadline:
        time.sleep(_POLL_S)


def started_ranks(folder: str) -> list[str]:
    """The ``started.<pid>`` marks the held ranks wrote so far."""
    return sorted(p.name for p in Path(folder).glob("started.*"))


def wait_until_held(folder: str, n: int, timeout: float = 60.0) -> None:
    """Block until ``n`` ranks are inside ``hold_rank`` on ``folder``; raise after ``timeout``."""
    deadline = time.monotonic() + timeout
    while len(started_ranks(folder)) < n:
        if time.monotonic() > deadline:
            raise TimeoutError(f"only {started_ranks(folder)} of {n} ranks reached hold_rank "
                               f"in {timeout} s")
        time.sleep(_POLL_S)


def release_ranks(folder: str) -> None:
    """Let every rank held on ``folder`` go on."""
    Path(folder, "release").touch()


def rank_leftovers() -> dict:
    """Run on a worker (``client.run(rank_leftovers)``) after its world closed: objects
    still frozen out of the collector's reach, and the tensors dtorch interpreters in this
    process still hold (both 0 once ``RankActor.close`` released its rank)."""
    import gc

    from .interpreter import Interpreter
    gc.collect()
    stores = [o.store for o in gc.get_objects() if isinstance(o, Interpreter)]
    return {"frozen": gc.get_freeze_count(), "tensors": sum(len(s) for s in stores)}


def rank_residue(dask_worker=None) -> dict:
    """Run on a worker (``client.run(rank_residue)``): what a dtorch world left there: the
    controller still holding it (``holder``, None when free), RankActors Dask still keeps
    (``actors``), and :func:`rank_leftovers`' frozen objects and held tensors."""
    from .worker import RankActor, dask_actors, holder_of
    return {"holder": holder_of(), **rank_leftovers(),
            "actors": sum(isinstance(a, RankActor) for a in dask_actors(dask_worker))}


async def die() -> None:
    """Run on a worker (``client.run(die, workers=[address], wait=False)``): SIGKILL its own
    process, as an out-of-memory kill or a crash would."""
    import signal
    os.kill(os.getpid(), signal.SIGKILL)


def wait_until_gone(pid: int, limit_s: float = 30.0) -> None:
    """Return once process ``pid`` has exited (gone, or a zombie its nanny has not reaped)."""
    import psutil
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return
        except psutil.NoSuchProcess:
            return
        time.sleep(0.02)
    raise AssertionError(f"process {pid} still runs {limit_s:g} s after SIGKILL")
