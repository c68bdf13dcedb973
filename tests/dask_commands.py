"""A Dask cluster started with the ``dask scheduler`` / ``dask worker`` commands, as a user
starts one, for the tests that join an external cluster (plain or TLS)."""

import json
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

BIN = Path(sys.executable).parent


@contextmanager
def dask_commands(folder: Path, n_workers: int = 2, scheduler_args=(), worker_args=(),
                  procs_out: list | None = None, port: int = 0):
    """Yield the scheduler's address once its file exists (workers may still be joining);
    terminate everything afterwards (kill what does not stop within 20 s). ``procs_out``
    receives the processes (the scheduler first)."""
    folder.mkdir(parents=True, exist_ok=True)
    scheduler_file = folder / "scheduler.json"
    scheduler_file.unlink(missing_ok=True)
    procs = procs_out if procs_out is not None else []
    procs += [subprocess.Popen([str(BIN / "dask"), "scheduler", "--host", "127.0.0.1",
                               "--port", str(port), "--no-dashboard", "--scheduler-file",
                               str(scheduler_file), *scheduler_args],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)]
    try:
        deadline = time.monotonic() + 60
        while not scheduler_file.exists():
            assert time.monotonic() < deadline, "dask scheduler did not start"
            time.sleep(0.2)
        address = json.loads(scheduler_file.read_text())["address"]
        procs.append(subprocess.Popen(
            [str(BIN / "dask"), "worker", address, "--nworkers", str(n_workers),
             "--nthreads", "1", "--no-dashboard", "--host", "127.0.0.1", *worker_args],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        yield address
    finally:
        for p in reversed(procs):
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
