"""Failure paths: remote errors, bad input caught on the controller, a dead worker, restart."""

import gc
import os
import signal
import sys
import threading

import pytest
import torch

import dtorch
from dtorch import DeviceMesh, Partial, Replicate, Shard, init_device_mesh
from dtorch.runtime import session, testing
from dtorch.runtime.controller import Controller
from dtorch.runtime.interrupts import interrupts_held
from dtorch.runtime.sigint_plugin import sigint_handlers


def complex_max_partial(mesh):
    """A real op gloo cannot run: MAX over complex numbers fails inside every rank."""
    parts = [torch.ones(2, dtype=torch.complex64)] * mesh.size()
    return dtorch.from_local(parts, mesh, [Partial("max")]).redistribute(placements=[Replicate()])


def test_remote_error_reaches_value_read_with_rank_and_traceback(mesh1d):
    bad = complex_max_partial(mesh1d)
    with pytest.raises(dtorch.RemoteError) as info:
        bad.to_torch()
    text = str(info.value)
    assert "rank " in text and "remote traceback" in text and "redistribute" in text
    with pytest.raises(dtorch.RemoteError):  # reading it again raises again
        bad.to_local(2)
    with pytest.raises(dtorch.RemoteError):  # and synchronize reports what the ranks hit
        dtorch.synchronize()
    dtorch.synchronize()  # reported once: the cluster is clean and usable again
    ok = dtorch.tensor(torch.arange(4.), device_mesh=mesh1d, placements=[Shard(0)])
    assert torch.equal(ok.redistribute(placements=[Replicate()]).to_torch(), torch.arange(4.))


def test_poisoned_inputs_poison_outputs_but_peers_finish(mesh1d):
    bad = complex_max_partial(mesh1d)
    later = bad.redistribute(placements=[Shard(0)])  # ranks run the slice on poisoned input
    again = later.redistribute(placements=[Replicate()])  # a collective on poisoned shards
    with pytest.raises(dtorch.RemoteError, match="MAX|max|complex"):
        again.to_torch()
    with pytest.raises(dtorch.RemoteError):
        dtorch.synchronize()
    good = dtorch.ones(4, device_mesh=mesh1d, placements=[Shard(0)])
    assert good.redistribute(placements=[Replicate()]).to_torch().tolist() == [1.0] * 4


def _nothing(mesh4, mesh22):
    return None


# (what the bad call needs, built and sent first; the bad call; the error; words it must say)
BAD_INPUTS = {
    "mesh-too-big": (_nothing, lambda _: dtorch.zeros(4, device_mesh=DeviceMesh(
        "cpu", [0, 1, 2, 3, 4, 5])), dtorch.ClusterError, "cluster has 4 ranks"),
    "placement-count": (_nothing, lambda _: dtorch.zeros(4, device_mesh=init_device_mesh(
        "cpu", 4), placements=[Shard(0), Shard(0)]), dtorch.PlacementValueError,
        "one placement per mesh dim"),
    "shard-dim": (_nothing, lambda _: dtorch.zeros(4, 4, device_mesh=init_device_mesh("cpu", 4),
                                                   placements=[Shard(2)]),
                  dtorch.PlacementValueError, "out of range"),
    "reduce-op": (_nothing, lambda _: dtorch.tensor(torch.ones(3), device_mesh=init_device_mesh(
        "cpu", 4), placements=[Partial("mean")]), dtorch.PlacementValueError,
        "sum, avg, max, min"),
    "device-type": (_nothing, lambda _: dtorch.zeros(4, device_mesh=DeviceMesh("cuda", [0, 1])),
                    dtorch.ClusterError, "device_type='cpu'"),
    "mesh-dim-name": (lambda m4, m22: dtorch.zeros(2, 2, device_mesh=m22),
                      lambda x: x.check_placement("tp", Replicate()), dtorch.MeshError,
                      "no dim named 'tp'"),
    "mesh-shape": (lambda m4, m22: dtorch.zeros(6, device_mesh=m4, placements=[Shard(0)]),
                   lambda x: x.redistribute(device_mesh=init_device_mesh("cpu", (2, 2))),
                   dtorch.PlacementValueError, "same shape"),
    "op-placements": (lambda m4, m22: dtorch.zeros(4, 4, device_mesh=m4, placements=[Shard(1)]),
                      lambda x: x.softmax(1), dtorch.PlacementError, "redistribute"),
}


def instructions_run() -> dict:
    """``{rank: instructions executed}``, from the workers' own counts, once every rank has
    run all that was issued (the ``Sync`` this needs is one instruction on each rank)."""
    dtorch.synchronize()
    return {s["rank"]: s["instructions"] for s in dtorch.rank_stats()}


@pytest.mark.parametrize("name", sorted(BAD_INPUTS))
def test_bad_input_raises_before_anything_is_sent(live, name):
    setup, bad, error, words = BAD_INPUTS[name]
    made = setup(init_device_mesh("cpu", 4), init_device_mesh("cpu", (2, 2), ("a", "b")))
    gc.collect()
    before = instructions_run()
    with pytest.raises(error, match=words):
        bad(made)
    after = instructions_run()
    # the ranks ran exactly the one Sync of instructions_run(): nothing of the bad call
    assert {r: n - before[r] for r, n in after.items()} == {r: 1 for r in before}


def test_freed_and_stale_tensors_raise(live):
    x = dtorch.ones(2)
    moved = dtorch.Tensor(torch.ones(2))
    assert torch.equal(moved.to_torch(), torch.ones(2))
    other = dtorch.tensor(torch.ones(2))
    holder = dtorch.Tensor.__new__(dtorch.Tensor)
    holder._adopt(other)
    with pytest.raises(dtorch.FreedTensorError, match="freed"):
        other.to_torch()
    assert torch.equal(holder.to_torch(), torch.ones(2))
    assert x.to_torch().tolist() == [1.0, 1.0]


def test_dropped_tensors_free_worker_memory(mesh2d):
    c = session.get_controller()
    gc.collect()  # tensors earlier tests dropped are freed with the next batch
    dtorch.synchronize()
    base = c.stats()
    for i in range(2000):
        t = dtorch.randn(64, 64, device_mesh=mesh2d, placements=[Shard(0), Shard(1)])
        u = t.redistribute(placements=[Replicate(), Shard(0)])
        del t, u
    gc.collect()
    dtorch.synchronize()
    after = c.stats()
    assert all(a["tensors"] <= b["tensors"] for a, b in zip(after, base)), (after, base)
    assert all(a["bytes"] <= b["bytes"] for a, b in zip(after, base)), (after, base)
    grown = max(a["rss"] - b["rss"] for a, b in zip(after, base))
    assert grown < 64 * 2**20, f"a worker's memory grew by {grown / 2**20:.1f} MiB"


def test_init_with_other_size_while_tensors_alive_raises(live):
    keep = dtorch.ones(2)
    with pytest.raises(dtorch.ClusterError, match="DTensors alive"):
        dtorch.init(n_workers=2)
    with pytest.raises(dtorch.ClusterError, match="DTensors alive"):
        dtorch.init(device_type="cuda")
    assert dtorch.init() is live
    assert dtorch.init(n_workers=4) is live
    assert dtorch.init(n_workers=4, device_type="cpu") is live
    del keep


@pytest.mark.parametrize("kwargs, guess", [({"world_size": 4}, "n_workers"),
                                           ({"memory_limt": "2GB"}, "memory_limit"),
                                           ({"address": "tcp://127.0.0.1:1", "nanny": 1}, None)])
def test_an_unknown_init_keyword_raises_on_the_controller(live, kwargs, guess):
    """A keyword neither dtorch nor Dask takes raises TypeError naming it (and the likely one)
    before anything starts; the running cluster is left as it was."""
    with pytest.raises(TypeError, match=f"unexpected keyword argument '{list(kwargs)[-1]}'") \
            as info:
        dtorch.init(**kwargs)
    if guess is not None:
        assert f"did you mean {guess}=?" in str(info.value)
    assert dtorch.init() is live and not live.closed
    assert torch.equal(dtorch.ones(2).to_torch(), torch.ones(2))


def test_dask_keywords_the_workers_take_are_accepted():
    """What LocalCluster, the Nanny, the Worker and Dask's Server take passes the check (no
    cluster started); what only SpecCluster takes would reach the workers and fail there."""
    from dtorch.runtime.cluster import check_dask_kwargs
    for key in ("memory_limit", "env", "resources", "nthreads", "timeout", "serializers",
                "connection_limit", "local_directory", "protocol", "interface", "security"):
        check_dask_kwargs({key: None}, remote=False)
    for key in ("workers", "scheduler", "shutdown_on_close"):
        with pytest.raises(TypeError, match=key):
            check_dask_kwargs({key: None}, remote=False)
    check_dask_kwargs({"timeout": 5, "name": "x"}, remote=True)
    with pytest.raises(TypeError, match="memory_limit"):
        check_dask_kwargs({"memory_limit": "2GB"}, remote=True)  # a Client's: workers exist


def test_interrupts_held_delivers_after_the_block():
    with pytest.raises(KeyboardInterrupt):
        with interrupts_held():
            signal.raise_signal(signal.SIGINT)
            reached = True  # the SIGINT did not stop the block
    assert reached
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


@pytest.mark.skipif(threading.current_thread() is not threading.main_thread(),
                    reason="signals reach the main thread only")
def test_interrupt_while_sending_a_batch_never_splits_it(mesh1d):
    """A real SIGINT raised at the worst moment, after rank 0 got batch N and before rank 1
    did: flush still hands it to every rank, then raises KeyboardInterrupt; no worker dies
    (the ranks ignore SIGINT) and the ranks agree on the next batch."""
    c = session.get_controller()
    assert all("SIG_IGN" in h for h in sigint_handlers(c.client).values())
    x = dtorch.tensor(torch.arange(8.), device_mesh=mesh1d, placements=[Shard(0)])
    dtorch.synchronize()
    fired = []

    def at_rank_1(frame, event, arg):  # a profile hook: observes, replaces nothing
        if (event == "call" and frame.f_code is Controller._write.__code__
                and frame.f_locals.get("rank") == 1 and not fired):
            fired.append(True)
            os.kill(os.getpid(), signal.SIGINT)

    y = x.redistribute(placements=[Replicate()])
    sys.setprofile(at_rank_1)
    try:
        with pytest.raises(KeyboardInterrupt):
            c.flush()
    finally:
        sys.setprofile(None)
    assert fired
    dtorch.synchronize(timeout=30)
    assert [s["next_seq"] for s in c.stats()] == c._seqs  # every rank got the whole flush
    assert torch.equal(y.to_torch(), torch.arange(8.))


def test_dead_worker_is_reported_and_restart_recovers(mesh1d):
    """Runs last in this module: it kills a rank, then restarts the session cluster."""
    x = dtorch.tensor(torch.arange(8.), device_mesh=mesh1d, placements=[Shard(0)])
    dtorch.synchronize()
    c = session.get_controller()
    victim = c.ranks[3].address
    pid = c.client.run(os.getpid, workers=[victim])[victim]
    c.client.run(testing.die, workers=[victim], wait=False)
    testing.wait_until_gone(pid)  # the kill happened before the collective is issued
    with pytest.raises(dtorch.WorkerLostError, match="rank 3 .*killed by SIGKILL"):
        x.redistribute(placements=[Replicate()]).to_torch()  # peers block in all_gather
    with pytest.raises((dtorch.ClusterError, dtorch.FreedTensorError)):
        x.to_torch()
    dtorch.restart()
    assert dtorch.cluster_info()["ranks"] == 4
    with pytest.raises(dtorch.FreedTensorError, match="restarted"):
        x.to_torch()
    y = dtorch.tensor(torch.arange(8.), device_mesh=init_device_mesh("cpu", 4),
                      placements=[Shard(0)])
    assert torch.equal(y.redistribute(placements=[Replicate()]).to_torch(), torch.arange(8.))


def test_failure_on_one_rank_poisons_its_peers_through_a_collective(mesh1d):
    """Only rank 3 fails (index 99 is out of range there); the others still take part in the
    collectives with placeholders, and every rank's result is poisoned, so the value read
    raises instead of returning zeros."""
    import torch.nn.functional as F
    idx = dtorch.tensor(torch.tensor([0, 1, 2, 99]), device_mesh=mesh1d, placements=[Shard(0)])
    emb = dtorch.tensor(torch.randn(10, 3), device_mesh=mesh1d, placements=[Replicate()])
    e = F.embedding(idx, emb)
    with pytest.raises(dtorch.RemoteError, match="rank 3"):
        e.redistribute(placements=[Replicate()]).to_torch()
    with pytest.raises(dtorch.RemoteError):
        e.sum().item()
    with pytest.raises(dtorch.RemoteError, match="rank 3"):
        dtorch.synchronize()
    ok = F.embedding(dtorch.tensor(torch.tensor([0, 1, 2, 3]), device_mesh=mesh1d,
                                   placements=[Shard(0)]), emb)
    assert ok.redistribute(placements=[Replicate()]).to_torch().shape == (4, 3)


def test_a_failure_travels_through_two_collectives_before_anything_is_read(mesh1d):
    """Rank 3 fails; the all_gather on ranks (2, 3) hands rank 2 zeros (poisoned there through
    the collective's flag), and rank 2 moves its result on to rank 0, all in one batch: the
    value read on rank 0 raises."""
    import torch.nn.functional as F
    pair, other = DeviceMesh("cpu", [2, 3]), DeviceMesh("cpu", [0, 1])
    idx = dtorch.tensor(torch.tensor([0, 99]), device_mesh=pair, placements=[Shard(0)])
    emb = dtorch.tensor(torch.randn(10, 3), device_mesh=pair, placements=[Replicate()])
    gathered = F.embedding(idx, emb).redistribute(placements=[Replicate()]) * 2
    moved = gathered.redistribute(device_mesh=other, placements=[Replicate()])
    with pytest.raises(dtorch.RemoteError, match="source rank"):
        moved.to_local(0)
    with pytest.raises(dtorch.RemoteError, match="rank 3"):
        dtorch.synchronize()
    ok = dtorch.tensor(torch.arange(4.), device_mesh=pair, placements=[Shard(0)])
    assert torch.equal(ok.redistribute(placements=[Replicate()])
                       .redistribute(device_mesh=other, placements=[Replicate()]).to_local(0),
                       torch.arange(4.))


def test_an_unrelated_collective_in_the_same_batch_is_not_poisoned(mesh1d):
    """Only values that depend on the failed rank's placeholder are poisoned."""
    import torch.nn.functional as F
    idx = dtorch.tensor(torch.tensor([0, 1, 2, 99]), device_mesh=mesh1d, placements=[Shard(0)])
    emb = dtorch.tensor(torch.randn(10, 3), device_mesh=mesh1d, placements=[Replicate()])
    bad = F.embedding(idx, emb).redistribute(placements=[Replicate()])
    good = dtorch.arange(8., device_mesh=mesh1d, placements=[Shard(0)]).redistribute(
        placements=[Replicate()])
    assert torch.equal(good.to_torch(), torch.arange(8.))
    with pytest.raises(dtorch.RemoteError, match="rank 3"):
        bad.to_torch()
    with pytest.raises(dtorch.RemoteError):
        dtorch.synchronize()


def test_poison_inside_a_list_argument_poisons_the_result(mesh1d):
    """torch.cat takes its tensors in a list: a failed one in there must poison the output."""
    bad = complex_max_partial(mesh1d).redistribute(placements=[Shard(0)])
    good = dtorch.from_local([torch.ones(1, dtype=torch.complex64)] * 4, mesh1d, [Shard(0)],
                             shape=(4,))
    from dtorch.runtime import messages as m
    c = session.get_controller()
    out = c.new_tid()  # the instruction torch.cat([...]) becomes, with its list argument
    c.issue(m.Call((out,), torch.cat, ([m.Ref(bad._tid), m.Ref(good._tid)],), {},
                   mesh1d.ranks))
    answers = c.wait(c.request(lambda req: m.Fetch(req, out, (0,)), [0]))
    assert answers[0][0] == "err"
    with pytest.raises(dtorch.RemoteError):
        dtorch.synchronize()
