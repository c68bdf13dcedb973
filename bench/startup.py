"""Time from a cold start to the first value: dtorch.init(4) vs 4 spawned torch processes.

Each sample is a fresh Python subprocess (so Python and torch import costs count), timed from
launching it until it prints that it holds the first value:

- dtorch: ``import dtorch; dtorch.init(n_workers=4)``, then a 4-element Shard(0) DTensor and
  ``to_torch()`` on it.
- reference: ``import torch``, spawn 4 processes with torch.multiprocessing that each
  ``init_process_group("gloo")`` and ``all_reduce`` one element; rank 0 hands the result back
  to the parent through a queue.

Shutting down is not timed (but waited for). Median and interquartile range of 3 runs
(``--quick``: 2), the two taking turns.
Target: dtorch at most 2x the reference.

    .venv/bin/python bench/startup.py [--quick]
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import Row, free_port, main, summarize  # noqa: E402

WORLD = 4
TARGET = 2.0
MARK = "FIRST_VALUE"


def _child_dtorch() -> None:
    import dtorch
    from dtorch import Shard, init_device_mesh
    t_import = time.perf_counter()
    dtorch.init(n_workers=WORLD)
    t_init = time.perf_counter()
    x = dtorch.ones(WORLD, device_mesh=init_device_mesh("cpu", WORLD), placements=[Shard(0)])
    assert x.to_torch().sum().item() == WORLD
    t_value = time.perf_counter()
    print(f"{MARK} import={t_import - T0:.2f}s init={t_init - t_import:.2f}s "
          f"value={t_value - t_init:.2f}s", flush=True)
    dtorch.shutdown()


def _rank(rank: int, port: int, queue) -> None:
    import torch
    import torch.distributed as dist
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=WORLD)
    t = torch.ones(1)
    dist.all_reduce(t)
    if rank == 0:
        queue.put(t.item())
    dist.destroy_process_group()


def _child_torch() -> None:
    import torch.multiprocessing as mp
    t_import = time.perf_counter()
    queue = mp.get_context("spawn").SimpleQueue()
    ctx = mp.start_processes(_rank, args=(free_port(), queue), nprocs=WORLD, join=False,
                             start_method="spawn")
    assert queue.get() == WORLD
    print(f"{MARK} import={t_import - T0:.2f}s spawn+init+all_reduce="
          f"{time.perf_counter() - t_import:.2f}s", flush=True)
    while not ctx.join():
        pass


def _sample(kind: str) -> tuple[float, str]:
    """Seconds from launching a fresh interpreter to its first value, and its own breakdown."""
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--child", kind],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    elapsed, detail = None, ""
    try:
        for line in proc.stdout:
            if line.startswith(MARK):
                elapsed, detail = time.perf_counter() - t0, line[len(MARK):].strip()
                break
        proc.stdout.read()  # let it shut down; not timed
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    if elapsed is None:
        raise RuntimeError(f"the {kind} child exited with {proc.returncode} before a value")
    return elapsed, detail


def run(quick: bool = False) -> list[Row]:
    repeats = 2 if quick else 3
    times = {"dtorch": [], "torch": []}
    for i in range(repeats):
        for kind in ("dtorch", "torch"):  # alternate so drift hits both alike
            elapsed, detail = _sample(kind)
            times[kind].append(elapsed)
            print(f"[startup] run {i + 1}/{repeats} {kind:6s} {elapsed:6.2f} s  ({detail})",
                  flush=True)
    return [Row.timed(f"startup to first value ({WORLD} ranks)", summarize(times["dtorch"]),
                      summarize(times["torch"]), TARGET)]


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        T0 = time.perf_counter()
        {"dtorch": _child_dtorch, "torch": _child_torch}[sys.argv[2]]()
    else:
        main(run, __doc__)
