"""Joining a cluster started with the `dask scheduler` / `dask worker` commands.

The controller runs in a fresh Python process (this test session already owns an embedded
cluster), exactly as a user would run a script against their own scheduler.
"""

import json
import subprocess
import sys
import time

import pytest
from distributed import Client

from dask_commands import dask_commands
from dtorch.runtime.testing import rank_leftovers, rank_residue


SCRIPT = r"""
import json, sys, torch, dtorch
from dtorch import Shard, Replicate, init_device_mesh
dtorch.init(address=sys.argv[1])
info = dtorch.cluster_info()
mesh = init_device_mesh("cpu", info["ranks"])
x = dtorch.tensor(torch.arange(12.).reshape(6, 2), device_mesh=mesh, placements=[Shard(0)])
with dtorch.CommDebugMode() as mode:
    y = x.redistribute(placements=[Replicate()])
ok = torch.equal(y.to_local(info["ranks"] - 1), torch.arange(12.).reshape(6, 2))
print(json.dumps({"ranks": info["ranks"], "embedded": info["embedded"], "ok": ok,
                  "counts": mode.get_comm_counts()}))
dtorch.shutdown()
"""


@pytest.fixture
def external_cluster(tmp_path):
    with dask_commands(tmp_path) as address:
        time.sleep(1)
        yield address


def wait_for_workers(address: str, n: int = 2) -> None:
    deadline = time.monotonic() + 90
    with Client(address, timeout=30) as client:
        while len(client.scheduler_info()["workers"]) < n:
            assert time.monotonic() < deadline, "dask workers did not join"
            time.sleep(0.2)


@pytest.mark.timeout(240)
def test_join_external_dask_cluster(external_cluster):
    wait_for_workers(external_cluster)
    out = subprocess.run([sys.executable, "-c", SCRIPT, external_cluster], capture_output=True,
                         text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result == {"ranks": 2, "embedded": False, "ok": True, "counts": {"all_gather": 1}}
    # the workers outlive that world: they keep none of its shards, nothing stays frozen
    with Client(external_cluster, timeout=30) as client:
        leftovers = client.run(rank_leftovers)
    assert list(leftovers.values()) == [{"frozen": 0, "tensors": 0}] * 2, leftovers


HOLDER = r"""
import os, sys, torch, dtorch
from dtorch import Shard, init_device_mesh
dtorch.init(address=sys.argv[1])
mesh = init_device_mesh("cpu", 2)
x = dtorch.randn(5120, 2560, device_mesh=mesh, placements=[Shard(0)])  # 26 MB per rank
dtorch.synchronize()
print("READY", os.getpid(), flush=True)
sys.stdin.read()  # until the test kills this process
"""


@pytest.mark.timeout(300)
def test_a_dead_controller_releases_its_workers_and_a_second_is_refused_meanwhile(
        external_cluster):
    """Issue 23: a controller killed with SIGKILL left each worker's rank thread and shards in
    place, and the next controller failed on every rank with "trying to initialize the default
    process group twice!". Now a second controller is refused at once, naming the holder;
    once the holder dies, its workers are free within ~30 s and a fresh controller runs.
    Mutation: no ``_controller_lost()`` in ``ServesChannel._serve`` (the workers stay held)."""
    wait_for_workers(external_cluster)
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, external_cluster],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    try:
        line = holder.stdout.readline()
        assert line.startswith("READY"), holder.stderr.read()[-3000:]
        pid = line.split()[1]
        second = subprocess.run([sys.executable, "-c", SCRIPT, external_cluster],
                                capture_output=True, text=True, timeout=180)
        assert second.returncode != 0
        assert "already run ranks of another dtorch controller (pid " + pid in second.stderr, \
            second.stderr[-3000:]
        with Client(external_cluster, timeout=30) as client:  # the holder's world is intact
            assert [r["holder"] is not None for r in client.run(rank_residue).values()] == \
                [True, True]
        holder.kill()
        holder.wait(timeout=30)
        deadline = time.monotonic() + 45  # the documented bound is ~30 s
        with Client(external_cluster, timeout=30) as client:
            while True:
                residue = list(client.run(rank_residue).values())
                if residue == [{"holder": None, "frozen": 0, "tensors": 0, "actors": 0}] * 2:
                    break
                assert time.monotonic() < deadline, residue
                time.sleep(0.5)
    finally:
        holder.kill()
    fresh = subprocess.run([sys.executable, "-c", SCRIPT, external_cluster],
                           capture_output=True, text=True, timeout=180)
    assert fresh.returncode == 0, fresh.stderr[-3000:]
    assert json.loads(fresh.stdout.strip().splitlines()[-1])["ok"] is True


SCHEDULER_LOSS = r"""
import json, os, signal, sys, time, torch, dtorch
from pathlib import Path
from dtorch import Shard, Replicate, init_device_mesh
address, scheduler_pid, folder = sys.argv[1], int(sys.argv[2]), Path(sys.argv[3])
dtorch.init(address=address)
x = dtorch.tensor(torch.arange(8.), device_mesh=init_device_mesh("cpu", 2),
                  placements=[Shard(0)])
assert x.redistribute(placements=[Replicate()]).to_torch().sum().item() == 28
os.kill(scheduler_pid, signal.SIGKILL)
error, deadline = None, time.monotonic() + 60
while error is None and time.monotonic() < deadline:  # the channels need no scheduler: ops
    try:                                              # go on until its workers stop with it
        x = x * 1.0
        x.to_torch()
        time.sleep(0.5)
    except (dtorch.WorkerLostError, dtorch.ClusterError) as exc:
        error = f"{type(exc).__name__}: {exc}"
(folder / "lost").touch()
while not (folder / "back").exists():
    time.sleep(0.2)
world = dtorch.restart().world
y = dtorch.tensor(torch.arange(8.), device_mesh=init_device_mesh("cpu", 2),
                  placements=[Shard(0)])
print(json.dumps({"error": error, "ranks": world,
                  "sum": y.redistribute(placements=[Replicate()]).to_torch().sum().item()}))
dtorch.shutdown()
"""


@pytest.mark.timeout(300)
def test_scheduler_loss_is_a_clear_error_and_restart_recovers_once_it_is_back(tmp_path):
    """Issue 23: the scheduler killed under a running controller: the ranks' channels need no
    scheduler, so work goes on until its workers stop with it; then a read raises a
    WorkerLostError naming the scheduler, no hang; a new scheduler and workers on the same
    address, and dtorch.restart() runs there. Mutation: no
    ``_scheduler_gone()`` in ``Controller._lost`` (the message names only the rank)."""
    from dtorch.runtime.cluster import free_port
    port = free_port()
    procs: list = []
    with dask_commands(tmp_path / "first", procs_out=procs, port=port) as address:
        wait_for_workers(address)
        controller = subprocess.Popen([sys.executable, "-c", SCHEDULER_LOSS, address,
                                       str(procs[0].pid), str(tmp_path)],
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 120
        while not (tmp_path / "lost").exists():
            assert controller.poll() is None, controller.stderr.read()[-3000:]
            assert time.monotonic() < deadline, "the read after the scheduler died hung"
            time.sleep(0.2)
    with dask_commands(tmp_path / "second", port=port) as again:
        assert again == address
        wait_for_workers(again)
        (tmp_path / "back").touch()
        out, err = controller.communicate(timeout=180)
    assert controller.returncode == 0, err[-3000:]
    result = json.loads(out.strip().splitlines()[-1])
    assert result["error"] is not None and "WorkerLostError" in result["error"]
    assert f"the Dask scheduler at {address} cannot be reached" in result["error"], \
        result["error"]
    assert result["ranks"] == 2 and result["sum"] == 28.0
