"""No op hangs or crashes a rank: every value torch produces reads back, the controller checks
what ranks send, and a rank whose interpreter stops is reported (issue 9's symptoms, each as a
test, on the real 4-rank cluster)."""

import os
import time

import numpy as np
import pytest
import torch

import dtorch
from dtorch import Replicate, Shard
from dtorch.runtime import messages as msg
from dtorch.runtime import session
from dtorch.runtime.wire import WireFormatError, WireTensor, pack, unpack

R = Replicate()

STRIDED = {
    "transposed": lambda: torch.randn(1, 3).t(),
    "expanded": lambda: torch.randn(3, 1).expand(3, 4),
    "scalar expanded": lambda: torch.tensor(2.5).expand(1, 1),
    "column": lambda: torch.randn(5, 5)[:, 1],
    "stepped": lambda: torch.randn(6, 7)[::2, 1::3],
    "conj view": lambda: torch.randn(4, 2, dtype=torch.complex64).conj(),
    "neg view": lambda: torch.randn(3, dtype=torch.complex128).conj().imag,
    "zero elements": lambda: torch.randn(0, 3),
    "offset view": lambda: torch.arange(20.).reshape(4, 5)[1:, 2:],
}


# the wire format (pure) -------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(STRIDED))
def test_every_strided_tensor_packs(name):
    t = STRIDED[name]()
    assert torch.equal(unpack(pack(t)), t.resolve_conj().resolve_neg())


@pytest.mark.parametrize("wire, words", [
    (WireTensor("float32", (3,), np.zeros(8, np.uint8)), "8 bytes .* needs 12"),
    (WireTensor("not_a_dtype", (1,), np.zeros(4, np.uint8)), "unknown dtype"),
    (WireTensor("Tensor", (1,), np.zeros(4, np.uint8)), "unknown dtype"),
    (WireTensor("float32", (-1,), np.zeros(4, np.uint8)), "negative shape"),
    (WireTensor("float32", (1,), np.zeros(1, np.float32)), "instead of uint8"),
    ("garbage", "not a tensor"),
])
def test_malformed_bytes_raise_instead_of_crashing(wire, words):
    with pytest.raises(WireFormatError, match=words):
        unpack(wire)


def test_misaligned_received_bytes_are_copied_before_use():
    """Dask hands frames at any byte offset; complex128 kernels need 16-byte alignment."""
    t = torch.randn(33, 7, dtype=torch.complex128)
    raw = pack(t).data
    buf = np.empty(raw.size + 3, np.uint8)
    shifted = buf[3:] if buf[3:].ctypes.data % 16 else buf[1:1 + raw.size]
    shifted[:raw.size] = raw
    got = unpack(WireTensor("complex128", (33, 7), shifted[:raw.size]))
    out = torch.empty(33, 7, dtype=torch.complex128)
    out[:] = got
    assert torch.equal(out, t)


# values that used to hang a read or crash the controller ---------------------------------
def test_expanded_zero_dim_reads_back(mesh1d):
    s = dtorch.tensor(torch.tensor(2.0), device_mesh=mesh1d, placements=[R])
    o = dtorch.tensor(torch.ones(1, 1), device_mesh=mesh1d, placements=[R])
    assert s.expand_as(o).to_torch().tolist() == [[2.0]]


def test_unbound_columns_of_a_row_sharded_tensor_read_back(mesh1d):
    w = torch.randn(5, 5)
    pieces = dtorch.tensor(w, device_mesh=mesh1d, placements=[Shard(0)]).unbind(1)
    assert len(pieces) == 5
    for got, want in zip(pieces, w.unbind(1)):
        assert torch.equal(got.to_torch(), want)


@pytest.mark.parametrize("split", [lambda z: torch.split(z, 5, 1), lambda z: z.chunk(1, 2),
                                   lambda z: torch.tensor_split(z, 1, 0)])
def test_one_piece_splits_read_back(mesh1d, split):
    z = torch.randn(5, 5, 5)
    (piece,) = split(dtorch.tensor(z, device_mesh=mesh1d, placements=[R]))
    assert torch.equal(piece.to_torch(), split(z)[0])


@pytest.mark.parametrize("name", sorted(STRIDED))
@pytest.mark.parametrize("placement", [Shard(0), R])
def test_distribute_tensor_takes_any_strided_tensor(mesh1d, name, placement):
    src = STRIDED[name]()
    x = dtorch.distribute_tensor(src, mesh1d, [placement])
    assert torch.equal(x.to_torch(), src.resolve_conj().resolve_neg())


@pytest.mark.parametrize("cast", [lambda x: x.to(torch.complex128), lambda x: x.cdouble(),
                                  lambda x: x.to(torch.complex64), lambda x: x.to(torch.bfloat16),
                                  lambda x: x.to(torch.bool), lambda x: x.to(torch.uint8),
                                  lambda x: x.half(), lambda x: x.long()])
def test_casts_to_every_dtype_read_back(mesh1d, cast):
    x = torch.randn(5, 3)
    for placements in ([R], [Shard(0)], [Shard(1)]):
        d = dtorch.tensor(x, device_mesh=mesh1d, placements=placements)
        assert torch.equal(cast(d).to_torch(), cast(x))


def test_multi_output_ops_read_back(mesh1d):
    x = torch.randn(6, 5)
    d = dtorch.tensor(x, device_mesh=mesh1d, placements=[R])
    a = torch.randn(4, 4)
    sym = a @ a.T + 4 * torch.eye(4)
    ds = dtorch.tensor(sym, device_mesh=mesh1d, placements=[R])
    cases = [
        (d.max(1), x.max(1)), (d.sort(0), x.sort(0)), (d.topk(2, 1), x.topk(2, 1)),
        (torch.split(d, 2), torch.split(x, 2)), (d.chunk(3, 1), x.chunk(3, 1)),
        (d.unbind(0), x.unbind(0)), (torch.linalg.qr(d), torch.linalg.qr(x)),
        (torch.linalg.eigh(ds), torch.linalg.eigh(sym)), (d.min(0), x.min(0)),
    ]
    for got, want in cases:
        assert type(got) is type(want) and len(got) == len(want)
        for g, w in zip(got, want):
            assert torch.allclose(g.to_torch(), w, atol=1e-5), (g, w)
    assert d.max(1).values.shape == (6,)


# the controller checks what ranks send ------------------------------------------------------
def test_a_rank_sending_the_wrong_shape_is_an_error_naming_the_rank(mesh1d):
    """A rank whose local value disagrees with the metadata (here: made so on purpose) gives a
    clear error on the read, never a crash; the cluster goes on."""
    c = session.get_controller()
    tid = c.new_tid()
    c.issue(msg.Call((tid,), torch.ones, ((7,),), {}, mesh1d.ranks))  # 7 where 3 are planned
    spec = dtorch.tensor(torch.ones(3), device_mesh=mesh1d, placements=[R])._spec
    wrong = dtorch.DTensor._wrap(spec, tid, c)
    with pytest.raises(WireFormatError, match=r"rank 0 sent a torch.float32 tensor of shape "
                                              r"\(7,\).*says torch.float32 \(3,\)"):
        wrong.to_torch()
    with pytest.raises(WireFormatError, match="rank 2"):
        wrong.to_local(2)
    assert dtorch.ones(3, device_mesh=mesh1d).to_torch().tolist() == [1.0] * 3


def test_an_op_returning_no_tensor_poisons_its_output_and_the_rank_goes_on(mesh1d):
    c = session.get_controller()
    tid = c.new_tid()
    c.issue(msg.Call((tid,), int, (3,), {}, mesh1d.ranks))
    spec = dtorch.tensor(torch.ones(3), device_mesh=mesh1d, placements=[R])._spec
    bad = dtorch.DTensor._wrap(spec, tid, c)
    with pytest.raises(dtorch.RemoteError, match="returned int"):
        bad.to_torch()
    with pytest.raises(dtorch.RemoteError):
        dtorch.synchronize()
    assert (dtorch.ones(2, device_mesh=mesh1d) * 3).to_torch().tolist() == [3.0, 3.0]


def test_an_argument_pickle_cannot_send_fails_that_op_only(mesh1d):
    x = dtorch.tensor(torch.ones(3), device_mesh=mesh1d, placements=[R])
    good = x + 1
    bad = x.clone().apply_(lambda v: v * 2)  # a lambda cannot travel to the ranks
    with pytest.raises(dtorch.RemoteError, match="could not be sent to the ranks"):
        bad.to_torch()
    with pytest.raises(dtorch.RemoteError):
        dtorch.synchronize()
    assert good.to_torch().tolist() == [2.0] * 3


# a stopped or stuck interpreter is reported, and restart() recovers --------------------------
def _exit_on_rank(rank_to_stop, coord):
    if coord == (rank_to_stop,):
        raise SystemExit("stopping this rank's interpreter on purpose")
    return torch.zeros(1)


@pytest.mark.timeout(120)
def test_a_dead_interpreter_is_reported_and_restart_recovers(mesh1d):
    x = dtorch.ones(4, device_mesh=mesh1d, placements=[Shard(0)])
    c = session.get_controller()
    tid = c.new_tid()
    c.issue(msg.Call((tid,), _exit_on_rank, (2, msg.Coord(mesh1d)), {}, mesh1d.ranks))
    with pytest.raises(dtorch.RemoteError, match=r"rank 2 .*interpreter thread stopped.*"
                                                 r"SystemExit.*restart"):
        x.to_torch()
    with pytest.raises(dtorch.ClusterError, match="restart"):
        x + 1  # the world is out of step: nothing more is sent until restart()
    dtorch.restart()
    mesh = dtorch.init_device_mesh("cpu", 4)
    assert dtorch.arange(4., device_mesh=mesh, placements=[Shard(0)]).to_torch().tolist() == \
        [0.0, 1.0, 2.0, 3.0]


@pytest.mark.timeout(120)
def test_a_stuck_op_is_reported_after_the_op_timeout(monkeypatch):
    monkeypatch.setenv("DTORCH_OP_TIMEOUT", "2")
    dtorch.restart()
    try:
        mesh = dtorch.init_device_mesh("cpu", 4)
        x = dtorch.ones(4, device_mesh=mesh, placements=[R])
        c = session.get_controller()
        c.issue(msg.Call((), time.sleep, (60,), {}, (1,)))  # the error comes before it ends
        with pytest.raises(dtorch.InterpreterStuckError, match=r"rank 1 has been running "
                                                              r"Call\(sleep\).*DTORCH_OP_TIMEOUT"):
            dtorch.synchronize()
    finally:
        monkeypatch.delenv("DTORCH_OP_TIMEOUT")
        dtorch.restart()
    mesh = dtorch.init_device_mesh("cpu", 4)
    assert dtorch.ones(2, device_mesh=mesh).to_torch().tolist() == [1.0, 1.0]
    assert os.environ.get("DTORCH_OP_TIMEOUT") is None


LEAVE_WORLD = """
import socket
import torch.distributed as dist
from dtorch.runtime.worker import leave_world

def join():
    s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
    dist.init_process_group("gloo", store=dist.TCPStore("127.0.0.1", port, 1, True), rank=0,
                            world_size=1)
    return dist.group.WORLD

old = join()
dist.destroy_process_group()  # a restarted actor in this worker process drops the old world
new = join()                  # and joins its own
leave_world(old)              # the old actor's rank thread comes out of its collective late
assert dist.is_initialized() and dist.group.WORLD is new, "the old thread destroyed the new world"
leave_world(new)
assert not dist.is_initialized()
"""


def test_a_late_old_rank_thread_leaves_a_restarted_world_alone():
    """Real gloo process groups in a fresh process: the world a rank thread joined is the
    only one it destroys."""
    import subprocess
    import sys
    subprocess.run([sys.executable, "-c", LEAVE_WORLD], check=True, timeout=120)


def _open_listeners(dask_worker=None) -> list:
    from dtorch.runtime import network
    return sorted(network._listeners)


def test_a_failed_actor_creation_closes_rank_0s_store_socket(live):
    """Actors that fail in their constructor (a seed torch refuses) leave no listening
    socket behind in rank 0's worker; the session's world is untouched."""
    from dtorch.runtime.cluster import place_rank_actors
    c = session.get_controller()
    w0 = c.ranks[0].address
    before = c.client.run(_open_listeners, workers=[w0])[w0]
    with pytest.raises(RuntimeError, match="manual_seed expected a long"):
        place_rank_actors(c.client, "gloo", 30.0, "not a seed", workers=[r.address for r in c.ranks])
    assert c.client.run(_open_listeners, workers=[w0])[w0] == before
    mesh = dtorch.init_device_mesh("cpu", 4)
    assert dtorch.arange(4., device_mesh=mesh, placements=[Shard(0)]).to_torch().tolist() == \
        [0.0, 1.0, 2.0, 3.0]
