"""Fault injection (issue 23): a worker killed (SIGKILL) at a random point of a mixed workload,
again and again, seeded. After each kill: a clear error naming what was lost, no hang (every
step returns or raises within its bound), ``restart()`` recovers and the workload then gives
torch's values, and no worker process is left over (the nannies replace the dead ones; the
count stays the cluster's). The figures are printed (``-s``) and quoted in the README.

Also here: SIGINT to the controller while ranks wait inside a long collective. The
controller's own death and the scheduler's are in ``test_runtime_external``
(``test_a_dead_controller_releases_its_workers_and_a_second_is_refused_meanwhile``,
``test_scheduler_loss_is_a_clear_error_and_restart_recovers_once_it_is_back``): they need a
cluster started with the ``dask`` commands.
"""

import os
import random
import time

import psutil
import pytest
import torch

import dtorch
import dtorch.nn as nn
from dtorch import Partial, Replicate, Shard, init_device_mesh
from dtorch.runtime import session
from dtorch.runtime.testing import die, wait_until_gone

SEED = int(os.environ.get("DTORCH_FAULT_SEED", "2312"))
CYCLES = int(os.environ.get("DTORCH_FAULT_CYCLES", "16"))
LOST = (dtorch.WorkerLostError, dtorch.ClusterError, dtorch.FreedTensorError)


def workload(mesh):
    """The mixed workload as named steps, each a function of a dict of state; the last
    checks the values against plain torch."""
    torch.manual_seed(0)
    full = torch.randn(16, 8)
    weight = torch.randn(8, 8)

    def make(s):
        s["x"] = dtorch.tensor(full, device_mesh=mesh, placements=[Shard(0)])

    def ops(s):
        y = s["x"]
        for _ in range(20):
            y = y * 1.01 + 0.1
        s["y"] = y

    def redistribute(s):
        s["r"] = s["y"].redistribute(placements=[Replicate()])
        s["p"] = dtorch.from_local([full / 4] * 4, mesh, [Partial()]).redistribute(
            placements=[Shard(1)])

    def read(s):
        s["read"] = s["r"].to_torch()

    def module(s):
        lin = nn.Linear(8, 8, bias=False, device_mesh=mesh)
        lin.load_state_dict({"weight": weight})
        s["lin"] = lin(s["r"]).to_torch()

    def check(s):
        want = full.clone()
        for _ in range(20):
            want = want * 1.01 + 0.1
        torch.testing.assert_close(s["read"], want)
        torch.testing.assert_close(s["p"].to_torch(), full)
        torch.testing.assert_close(s["lin"], want @ weight.T, rtol=1e-5, atol=1e-5)

    return [("make", make), ("ops", ops), ("redistribute", redistribute), ("read", read),
            ("module", module), ("check", check)]


def processes() -> int:
    """Live (not zombie) processes this test process started: the embedded cluster's nannies
    and workers, and anything they left behind."""
    return sum(p.status() != psutil.STATUS_ZOMBIE
               for p in psutil.Process().children(recursive=True) if p.is_running())


@pytest.mark.timeout(300)
def test_random_worker_kills_are_reported_and_recovered(live):
    rng = random.Random(SEED)
    figures = {"cycles": 0, "faults": 0, "reported": 0, "recovered": 0, "hangs": 0,
               "leftover_processes": 0, "at": {}, "mid_step": 0}
    started = time.monotonic()
    baseline = processes()
    for _ in range(CYCLES):
        c = session.get_controller()
        mesh = init_device_mesh("cpu", 4)
        steps = workload(mesh)
        kill_at = rng.randrange(1, len(steps))  # after at least the tensor exists
        victim = rng.randrange(4)
        landed = rng.random() < 0.5  # wait for the death, or let it land mid-step
        state, error = {}, None
        for i, (name, step) in enumerate(steps):
            if i == kill_at:
                address = c.ranks[victim].address
                pid = c.client.run(os.getpid, workers=[address])[address]
                c.client.run(die, workers=[address], wait=False)
                if landed:
                    wait_until_gone(pid)
                figures["faults"] += 1
                figures["mid_step"] += not landed
                figures["at"][name] = figures["at"].get(name, 0) + 1
            t0 = time.monotonic()
            try:
                step(state)
                if i >= kill_at:
                    dtorch.synchronize(timeout=90)
            except LOST as exc:
                error = exc
                break
            except TimeoutError:
                figures["hangs"] += 1
                raise
            finally:
                assert time.monotonic() - t0 < 120, f"{name} took {time.monotonic() - t0:.0f} s"
        if error is None:  # the kill came after the last step that talks to the ranks
            wait_until_gone(pid)
            with pytest.raises(LOST):
                dtorch.synchronize(timeout=90)
                state["x"].to_torch()
        else:  # the first error after the kill names the lost rank
            assert isinstance(error, dtorch.WorkerLostError), repr(error)
            assert f"rank {victim}" in str(error), str(error)
        figures["reported"] += 1
        state.clear()
        dtorch.restart()
        fresh = {}
        for _, step in workload(init_device_mesh("cpu", 4)):
            step(fresh)
        figures["recovered"] += 1
        figures["cycles"] += 1
        now = processes()
        figures["leftover_processes"] += max(0, now - baseline)
        assert now == baseline, (now, baseline)
    figures["seconds"] = round(time.monotonic() - started, 1)
    print("\nfault suite:", figures)
    assert figures["cycles"] == figures["faults"] == figures["reported"] == \
        figures["recovered"] == CYCLES
    assert figures["hangs"] == 0 and figures["leftover_processes"] == 0


@pytest.mark.timeout(180)
def test_sigint_inside_a_long_collective_returns_and_the_cluster_goes_on(live, tmp_path):
    """Rank 3 is held in a long op, so ranks 0-2 wait inside the all_gather after it; the
    controller, waiting for the result, gets SIGINT (Ctrl-C, a Jupyter interrupt): it raises
    KeyboardInterrupt at once, the ranks are not interrupted, and once rank 3 goes on the
    collective completes and the same tensors read torch's values, no restart needed.
    Mutation: holding SIGINT for the whole wait (``interrupts_held`` around ``wait``)."""
    import signal
    import threading

    from dtorch.runtime import messages as m
    from dtorch.runtime import testing
    mesh = init_device_mesh("cpu", 4)
    full = torch.arange(64.).reshape(16, 4)
    x = dtorch.tensor(full, device_mesh=mesh, placements=[Shard(0)])
    dtorch.synchronize()
    c = session.get_controller()
    folder = str(tmp_path)
    c.issue(m.Call((), testing.hold_rank, (folder,), {}, (3,)))
    r = x.redistribute(placements=[Replicate()])  # ranks 0-2 enter it; rank 3 is held before

    def interrupt():
        testing.wait_until_held(folder, 1)
        time.sleep(0.5)  # ranks 0-2 are waiting inside the all_gather by now
        os.kill(os.getpid(), signal.SIGINT)
    thread = threading.Thread(target=interrupt)
    thread.start()
    t0 = time.monotonic()
    try:
        with pytest.raises(KeyboardInterrupt):
            r.to_torch()
        interrupted_after = time.monotonic() - t0
        assert [s["running"] for s in dtorch.rank_stats()][3] == "Call(hold_rank)"
    finally:
        thread.join()
        testing.release_ranks(folder)
    assert torch.equal(r.to_torch(), full)  # the collective finished: nothing lost
    assert not c.closed and session.get_controller() is c
    print(f"\nSIGINT inside a collective: control back after {interrupted_after:.1f} s")
