"""Joining a cluster started with the `dask scheduler` / `dask worker` commands.

The controller runs in a fresh Python process (this test session already owns an embedded
cluster), exactly as a user would run a script against their own scheduler.
"""

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dtorch.runtime.testing import rank_leftovers

BIN = Path(sys.executable).parent

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
    scheduler_file = tmp_path / "scheduler.json"
    procs = [subprocess.Popen([str(BIN / "dask"), "scheduler", "--host", "127.0.0.1",
                               "--port", "0", "--no-dashboard",
                               "--scheduler-file", str(scheduler_file)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)]
    try:
        deadline = time.monotonic() + 60
        while not scheduler_file.exists():
            assert time.monotonic() < deadline, "dask scheduler did not start"
            time.sleep(0.2)
        procs.append(subprocess.Popen(
            [str(BIN / "dask"), "worker", "--scheduler-file", str(scheduler_file),
             "--nworkers", "2", "--nthreads", "1", "--no-dashboard", "--host", "127.0.0.1"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        time.sleep(1)
        yield json.loads(scheduler_file.read_text())["address"]
    finally:
        for p in reversed(procs):
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()


@pytest.mark.timeout(240)
def test_join_external_dask_cluster(external_cluster):
    deadline = time.monotonic() + 90
    from distributed import Client
    with Client(external_cluster, timeout=30) as client:
        while len(client.scheduler_info()["workers"]) < 2:
            assert time.monotonic() < deadline, "dask workers did not join"
            time.sleep(0.2)
    out = subprocess.run([sys.executable, "-c", SCRIPT, external_cluster], capture_output=True,
                         text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result == {"ranks": 2, "embedded": False, "ok": True, "counts": {"all_gather": 1}}
    # the workers outlive that world: they keep none of its shards, nothing stays frozen
    with Client(external_cluster, timeout=30) as client:
        leftovers = client.run(rank_leftovers)
    assert list(leftovers.values()) == [{"frozen": 0, "tensors": 0}] * 2, leftovers
