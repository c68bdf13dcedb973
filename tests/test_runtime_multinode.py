"""Worlds that span hosts: two "hosts" as network namespaces on a private bridge, each running
``dask worker --nthreads 1 --nworkers 2`` with no interface hint, joined by
``dtorch.init(address=...)``. Ranks 0, 1 live on host 0 (10.251.0.2), ranks 2, 3 on host 1
(10.251.0.3). Values are checked against torch on one device, collectives against the
workers' own counts (tests/ledgers.py), and which collectives cross hosts against the
records' rank groups. Skips where namespaces cannot be made (not root, no ``ip``).

The suite's embedded cluster (tests/conftest.py) is shut down for this module and started
again after it, as the ``other_cluster`` fixture does.
"""

import gc
import os
import re
import signal

import pytest
import torch

import dtorch
import dtorch.nn as nn
from dtorch import DeviceMesh, Partial, Replicate, Shard, init_device_mesh
from dtorch.runtime import network, session
from ledgers import counted
from netns_hosts import NamespaceHosts, unavailable_reason

R = Replicate()
pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def netns_hosts():
    """Two namespace hosts with two Dask workers each and a scheduler on the bridge."""
    reason = unavailable_reason()
    if reason:
        pytest.skip(f"multi-node tests need network namespaces: {reason}")
    with NamespaceHosts(hosts=2, workers_per_host=2) as hosts:
        yield hosts


@pytest.fixture(scope="module")
def on_hosts(netns_hosts):
    """dtorch joined to the namespace hosts' scheduler (4 ranks); the suite's embedded
    cluster, if it was running, is back afterwards."""
    gc.collect()
    was_running = session.is_running()
    dtorch.shutdown()
    dtorch.init(address=netns_hosts.scheduler_address, n_workers=4)
    yield netns_hosts
    gc.collect()
    dtorch.shutdown()
    if was_running:
        dtorch.init(n_workers=4)


def host_of(rank: int) -> str:
    return network.worker_ip(dtorch.cluster_info()["workers"][rank])


def hosts_spanned(records) -> set:
    """For each record, how many hosts its rank groups span (a set of ints)."""
    return {len({host_of(r) for r in group}) for rec in records for group in rec.groups}


def counted_records(fn):
    """(out, counts, records) of ``fn()``, the ledgers checked against each other. Work
    still running on some ranks (an earlier ``to_torch`` of a Partial waits only for the
    ranks it reads) is finished first, or the workers' counts before would miss it."""
    dtorch.synchronize()
    with dtorch.CommDebugMode() as mode:
        out, counts = counted(fn)
    return out, counts, mode.get_comm_records()


def counts_of(fn):
    """(out, counts) of ``fn()``, as counted_records."""
    out, counts, _ = counted_records(fn)
    return out, counts


# item 1: where torch.distributed binds ------------------------------------------------------
def test_ranks_bind_to_their_dask_workers_interface(on_hosts):
    info = dtorch.cluster_info()
    assert [host_of(r) for r in range(4)] == [on_hosts.ips[0]] * 2 + [on_hosts.ips[1]] * 2
    client = session.get_controller().client
    bound = client.run(lambda: os.environ.get("GLOO_SOCKET_IFNAME"))
    assert [bound[info["workers"][r]] for r in range(4)] == \
        [on_hosts.interface(0)] * 2 + [on_hosts.interface(1)] * 2
    # dtorch set that; the workers were started with no hint (a gloo world sets no NCCL one)
    hints = client.run(lambda: [os.environ.get(k) for k in ("NCCL_SOCKET_IFNAME",
                                                               "TP_SOCKET_IFNAME")])
    assert all(v == [None, None] for v in hints.values()), hints
    # rank 0's rendezvous store listens on its host's address, not on every interface
    store_ip, store_port = session.get_controller().ranks[0].actor.store_address
    assert store_ip == on_hosts.ips[0]
    listening = client.run(_listening, workers=[info["workers"][0]])[info["workers"][0]]
    assert [ip for ip, port in listening if port == store_port] == [store_ip]


_listening = lambda: [(c.laddr.ip, c.laddr.port)  # noqa: E731 - a lambda travels by value
                      for c in __import__("psutil").Process().net_connections("tcp")
                      if c.status == "LISTEN"]


def test_a_users_interface_variable_wins(monkeypatch):
    monkeypatch.setattr(network, "_set_here", {})  # what dtorch set: restored after the test
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    monkeypatch.delenv("NCCL_SOCKET_IFNAME", raising=False)
    assert network.bind_to_interface("127.0.0.1", "nccl") == "lo"
    assert os.environ["NCCL_SOCKET_IFNAME"] == "lo"
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth7")
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "ib0")
    assert network.bind_to_interface("127.0.0.1", "nccl") == "eth7"
    assert os.environ["NCCL_SOCKET_IFNAME"] == "ib0"
    monkeypatch.delenv("GLOO_SOCKET_IFNAME")
    assert network.bind_to_interface("10.251.0.99", "gloo") is None  # no such interface here
    assert "GLOO_SOCKET_IFNAME" not in os.environ


def test_loopback_workers_beside_other_hosts_are_refused_with_the_cause():
    with pytest.raises(dtorch.ClusterError, match=r"ranks \[1\] have loopback.*resolves to "
                                                  r"loopback.*--host"):
        network.refuse_mixed_loopback(["tcp://10.0.0.2:1", "tcp://127.0.0.1:2"],
                                      ["10.0.0.2", "127.0.0.1"])


def test_a_host_name_resolving_to_loopback_is_named_as_the_cause():
    with pytest.raises(dtorch.ClusterError, match=r"rank 1 \(Dask worker tcp://10.0.0.3:2\): no "
                                                  r"interface carries.*'vm' resolves to "
                                                  r"\['127.0.0.1'\].*--host"):
        network.refuse_loopback_binding(
            ["tcp://10.0.0.2:1", "tcp://10.0.0.3:2"], ["10.0.0.2", "10.0.0.3"],
            [("dask", "eth0", ["10.0.0.2"]), ("hostname", "vm", ["127.0.0.1"])])


class _Ready:
    """Stands in for a rank's ``ready()`` future: an init failure, None, or no answer."""

    def __init__(self, answer):
        self.answer = answer

    def result(self, timeout):
        if self.answer == "silent":
            raise TimeoutError
        return self.answer


def test_a_process_group_that_does_not_start_is_a_cluster_error_not_a_bare_timeout():
    from dtorch.runtime.cluster import _raise_unless_ready
    from dtorch.runtime.interpreter import RemoteFailure
    failed = RemoteFailure(1, "init_process_group", "DistNetworkError: timed out (this rank "
                           "at 10.0.0.3 ...)", "")
    with pytest.raises(dtorch.ClusterError, match=r"(?s)rank 1: DistNetworkError.*ranks \[2\]: "
                                                  r"still starting after 12 s"):
        _raise_unless_ready([_Ready(None), _Ready(failed), _Ready("silent")], 12)
    _raise_unless_ready([_Ready(None)] * 2, 12)


# item 3: the seed walk-through, every placement change, models ------------------------------
def test_seed_walkthrough_across_hosts(on_hosts):
    """Seed 004's example and seed 002's walk-through (examples/demo.py), values and counts."""
    pair = DeviceMesh("cpu", [0, 1])
    dtorch.manual_seed(0)
    x = dtorch.rand((4, 3), device_mesh=pair, placements=[Shard(0)])
    torch.manual_seed(0)
    assert torch.equal(x.to_torch(), torch.rand(4, 3))
    assert x.local_shapes() == {0: (2, 3), 1: (2, 3)}
    big = torch.arange(16.).reshape(4, 4)
    grid = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    d = dtorch.distribute_tensor(big, grid, [Shard(0), Shard(1)])
    assert [d.to_local(r).flatten().tolist() for r in range(4)] == [
        [0., 1., 4., 5.], [2., 3., 6., 7.], [8., 9., 12., 13.], [10., 11., 14., 15.]]
    line = init_device_mesh("cpu", 4)
    xs = dtorch.distribute_tensor(big, line, [Shard(1)])
    ws = dtorch.distribute_tensor(torch.ones(4, 4), line, [Shard(0)])
    out, counts = counts_of(lambda: xs @ ws)
    assert counts == {} and out.placements == (Partial(),)
    full, counts, records = counted_records(lambda: out.redistribute(line, [R]))
    assert counts == {"all_reduce": 1} and hosts_spanned(records) == {2}
    assert torch.equal(full.to_torch(), big @ torch.ones(4, 4))
    with pytest.raises(dtorch.PlacementError):
        torch.softmax(xs, dim=1)
    u = dtorch.randn(4, 11, device_mesh=line, placements=[Shard(1)])
    assert u.local_shapes() == {0: (4, 3), 1: (4, 3), 2: (4, 3), 3: (4, 2)}
    ur, counts = counts_of(lambda: u.redistribute(line, [R]))
    assert counts == {"all_gather": 1} and torch.equal(ur.to_local(3), u.to_torch())


CHANGES = [  # (from, to, the collective it implies on a mesh dim that crosses hosts)
    (Shard(0), R, {"all_gather": 1}), (Shard(1), R, {"all_gather": 1}),
    (R, Shard(0), {}), (Shard(0), Shard(1), {"all_to_all": 1}),
    (Partial(), R, {"all_reduce": 1}), (Partial(), Shard(0), {"reduce_scatter": 1}),
    (Partial("max"), R, {"all_reduce": 1}), (R, Partial(), {}), (Shard(0), Shard(0), {})]


@pytest.mark.parametrize("src, dst, expected", CHANGES, ids=[f"{a}->{b}" for a, b, _ in CHANGES])
def test_each_placement_change_across_hosts(on_hosts, src, dst, expected):
    """On a 1-D mesh of the four ranks, and along dp of a 2 x 2 mesh (dp across the hosts,
    tp inside each), with uneven shapes; the values against torch."""
    value = torch.randn(5, 7, generator=torch.Generator().manual_seed(3))
    line = init_device_mesh("cpu", 4)
    grid = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    for mesh, before, after in [(line, [src], [dst]), (grid, [src, R], [dst, R])]:
        x = dtorch.distribute_tensor(value, mesh, before)
        y, counts, records = counted_records(lambda: x.redistribute(mesh, after))
        assert counts == expected, (mesh, counts)
        if records:
            assert hosts_spanned(records) == {2}
            assert all(rec.mesh_dim == 0 for rec in records)
        assert torch.allclose(y.to_torch(), value, atol=1e-6)
        assert y.placements == tuple(after)


def test_a_move_between_the_hosts_sub_meshes_is_point_to_point(on_hosts):
    value = torch.arange(35.).reshape(5, 7)
    here, there = DeviceMesh("cpu", [0, 1]), DeviceMesh("cpu", [2, 3])
    for placements in ([Shard(0)], [Shard(1)], [R]):
        x = dtorch.distribute_tensor(value, here, placements)
        y, counts, records = counted_records(lambda: x.redistribute(device_mesh=there))
        assert set(counts) == {"send_recv"} and hosts_spanned(records) == {2}
        assert y.device_mesh == there and torch.equal(y.to_torch(), value)
        assert torch.equal(y.to_local(2), x.to_local(0))


def test_tp_mlp_with_tp_inside_a_host_and_dp_across(on_hosts):
    grid = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(2)
    ref = torch.nn.Sequential(torch.nn.Linear(8, 11), torch.nn.GELU(), torch.nn.Linear(11, 8))
    mlp = nn.Sequential(nn.ColumnParallelLinear(8, 11, device_mesh=grid), nn.GELU(),
                        nn.RowParallelLinearWithReplicateOutput(11, 8, device_mesh=grid))
    mlp.load_state_dict(ref.state_dict())
    x = torch.randn(6, 3, 8)
    y, counts, records = counted_records(lambda: mlp(dtorch.distribute_tensor(x, grid,
                                                                              [Shard(0), R])))
    assert counts == {"all_reduce": 1} and hosts_spanned(records) == {1}  # tp: inside a host
    assert torch.allclose(y.to_torch(), ref(x), atol=1e-5)
    mean, counts, records = counted_records(lambda: y.mean().redistribute(grid, [R, R]))
    assert counts == {"all_reduce": 1} and hosts_spanned(records) == {2}  # dp: across
    assert torch.allclose(mean.to_torch(), ref(x).mean(), atol=1e-5)


def test_a_pipeline_with_one_stage_per_host(on_hosts):
    from test_nn_pipeline import Staged, TorchStaged
    grid = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    torch.manual_seed(7)
    ref, model = TorchStaged(), Staged(grid)
    model.load_state_dict(ref.state_dict())
    assert [{host_of(r) for r in s.mesh.flatten().tolist()} for s in model.stages] == \
        [{on_hosts.ips[0]}, {on_hosts.ips[1]}]
    tokens = torch.randint(0, 17, (4, 6))
    out, counts, records = counted_records(
        lambda: model(dtorch.distribute_tensor(tokens, model.stages[0], [R])))
    assert counts == {"send_recv": 1, "all_gather": 2, "all_reduce": 4}
    assert {hosts_spanned([r]).pop() for r in records if r.kind == "send_recv"} == {2}
    assert hosts_spanned([r for r in records if r.kind != "send_recv"]) == {1}
    assert torch.allclose(out.to_torch(), ref(tokens), atol=1e-5)


def test_llama_on_dp2_tp2_with_dp_across_hosts(on_hosts):
    transformers = pytest.importorskip("transformers")
    from dtorch.models import LlamaForCausalLM
    from test_llama import CONFIG, expected_counts
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG)).eval()
    tokens = torch.randint(0, 101, (2, 12), generator=torch.Generator().manual_seed(1))
    grid = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = LlamaForCausalLM(hf.config, device_mesh=grid)
    model.load_state_dict(hf.state_dict())
    ids = dtorch.distribute_tensor(tokens, grid, [Shard(0), R])
    logits, counts, records = counted_records(lambda: model(ids).logits)
    assert counts == expected_counts(("dp", "tp")) and hosts_spanned(records) == {1}
    with torch.no_grad():
        want = hf(tokens).logits
    assert torch.allclose(logits.to_torch(), want, atol=1e-4)
    total, counts, records = counted_records(lambda: logits.sum().redistribute(grid, [R, R]))
    assert counts == {"all_reduce": 1} and hosts_spanned(records) == {2}
    assert torch.allclose(total.to_torch(), want.sum(), atol=1e-2)


# failures: a killed worker, a world that cannot connect (these run last) ---------------------
def _set_gloo_ifname(address: str, value):
    """Set (or with None, unset) GLOO_SOCKET_IFNAME in the worker processes of that
    scheduler, as a user's environment would."""
    from distributed import Client
    with Client(address, timeout=30) as client:
        def put():
            os.environ.pop("GLOO_SOCKET_IFNAME", None) if value is None else \
                os.environ.__setitem__("GLOO_SOCKET_IFNAME", value)
        client.run(put)


def test_a_users_loopback_interface_across_hosts_is_refused_and_restart_recovers(on_hosts):
    """GLOO_SOCKET_IFNAME=lo set by the user wins over dtorch's choice, and a world across
    hosts then cannot connect: refused at once, naming the rank and the variable."""
    _set_gloo_ifname(on_hosts.scheduler_address, "lo")
    try:
        with pytest.raises(dtorch.ClusterError, match=r"rank 0 \(Dask worker .*\): "
                                                      r"GLOO_SOCKET_IFNAME=lo in its environment "
                                                      r"names an interface with only loopback"):
            dtorch.restart()  # refused before any process group starts
    finally:
        _set_gloo_ifname(on_hosts.scheduler_address, None)
    dtorch.restart()
    y = dtorch.tensor(torch.arange(8.), device_mesh=init_device_mesh("cpu", 4),
                      placements=[Shard(0)])
    assert torch.equal(y.redistribute(placements=[R]).to_torch(), torch.arange(8.))


def test_a_worker_killed_on_one_host_is_reported_and_restart_recovers(on_hosts):
    line = init_device_mesh("cpu", 4)
    x = dtorch.tensor(torch.arange(8.), device_mesh=line, placements=[Shard(0)])
    dtorch.synchronize()
    c = session.get_controller()
    victim = c.ranks[3].address
    pid = c.client.run(os.getpid, workers=[victim])[victim]
    os.kill(pid, signal.SIGKILL)  # its Nanny starts a fresh worker, at a new address
    with pytest.raises(dtorch.WorkerLostError, match=re.escape(f"rank 3 (Dask worker {victim})")):
        x.redistribute(placements=[R]).to_torch()  # reported, not waited on forever
    on_hosts.wait_for_workers(c.client, 4, gone=(victim,))
    dtorch.restart()
    assert host_of(3) == on_hosts.ips[1]
    y = dtorch.tensor(torch.arange(8.), device_mesh=init_device_mesh("cpu", 4),
                      placements=[Shard(0)])
    assert torch.equal(y.redistribute(placements=[R]).to_torch(), torch.arange(8.))


def test_a_world_that_cannot_connect_fails_clearly_and_restart_recovers(on_hosts, monkeypatch):
    """Host 0 drops everything it would send to host 1 (a firewall dropping packets): ranks
    2 and 3 get no answer from rank 0's store; once mended, restart() brings the world up."""
    timeout = 45  # the error must come within the collective timeout (it takes about 5 s)
    monkeypatch.setenv("DTORCH_COLLECTIVE_TIMEOUT", str(timeout))
    on_hosts.cut(quiet_host=0, cut_off=1)
    try:
        with pytest.raises(dtorch.ClusterError) as caught:
            dtorch.restart()
    finally:
        on_hosts.mend()
    message = str(caught.value)
    assert not isinstance(caught.value, TimeoutError)
    ip0, ip1 = on_hosts.ips
    assert f"rank 2 (Dask worker tcp://{ip1}:" in message
    assert any(f"-> {ip0}:" in line and "rank 0's rendezvous store" in line and
               "no answer" in line for line in message.splitlines() if "rank 2" in line)
    assert "firewall" in message and "dtorch.restart()" in message
    dtorch.restart()
    assert dtorch.cluster_info()["ranks"] == 4
    y = dtorch.tensor(torch.arange(8.), device_mesh=init_device_mesh("cpu", 4),
                      placements=[Shard(0)])
    assert torch.equal(y.redistribute(placements=[R]).to_torch(), torch.arange(8.))
