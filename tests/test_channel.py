"""The controller's channel to each rank: frames, the token, one hop per read."""

import gc
import os
import socket
import threading
import time

import numpy as np
import pytest
import torch

import dtorch
from dtorch import Replicate, Shard
from dtorch.runtime import messages as m
from dtorch.runtime.channel import (TOKEN_BYTES, Answer, Batch, ChannelClosed, FrameReader,
                                    CONTROLLER, accept_peer, encode, send)
from dtorch.runtime.session import get_controller
from dtorch.runtime.wire import WireTensor, pack, unpack

pytestmark = pytest.mark.timeout(120)


def _read_all(sock, count):
    reader, out = FrameReader(), []
    while len(out) < count:
        out.extend(reader.read_from(sock))
    return out


MESSAGES = [
    Answer(1, ("ok", [])),
    Answer(2, ("ok", pack(torch.arange(300_000, dtype=torch.float32)))),  # out of band
    Answer(3, ("ok", pack(torch.empty(0)))),  # a zero-length buffer
    Batch(0, (None, (b"x" * 10,)), {5: pack(torch.ones(3, 3, dtype=torch.bfloat16))}, False, 9),
    Answer(4, np.arange(10)[::2]),  # a non-contiguous buffer: pickled in band
]


@pytest.mark.parametrize("chunk", [1, 7, 1 << 16])
def test_frames_arrive_whole_however_the_bytes_are_split(chunk):
    a, b = socket.socketpair()
    data = b"".join(bytes(part) for msg in MESSAGES for part in encode(msg))

    def trickle():
        for i in range(0, len(data), chunk):
            a.sendall(data[i:i + chunk])

    writer = threading.Thread(target=trickle)
    writer.start()
    got = _read_all(b, len(MESSAGES))
    writer.join()
    assert [type(g) for g in got] == [type(w) for w in MESSAGES]
    assert got[0] == MESSAGES[0]
    assert torch.equal(unpack(got[1].answer[1]), torch.arange(300_000, dtype=torch.float32))
    assert unpack(got[2].answer[1]).shape == (0,)
    assert torch.equal(unpack(got[3].staged[5]), torch.ones(3, 3, dtype=torch.bfloat16))
    assert got[3].ack == 9 and got[3].payload == (None, (b"x" * 10,))
    assert np.array_equal(got[4].answer, np.arange(10)[::2])
    a.close()
    with pytest.raises(ChannelClosed):
        _read_all(b, 1)


def test_large_buffers_travel_out_of_band():
    big = pack(torch.zeros(1 << 18))  # 1 MB
    parts = encode(Answer(1, ("ok", big)))
    assert len(parts) == 2 and memoryview(parts[1]).nbytes == 1 << 20
    assert len(parts[0]) < 1024  # the pickle holds no copy of the bytes


def test_only_a_connection_presenting_the_token_is_accepted():
    server = socket.create_server(("127.0.0.1", 0))
    token = os.urandom(TOKEN_BYTES)
    accepted = []
    thread = threading.Thread(target=lambda: accepted.append(accept_peer(server, token)))
    thread.start()
    stranger = socket.create_connection(server.getsockname(), timeout=10)
    stranger.sendall(b"\0" * TOKEN_BYTES + CONTROLLER)
    send(stranger, threading.Lock(), Batch(0, (None, ()), None, False))
    try:  # closed unread (a reset, as its frame was never read)
        assert stranger.recv(1) == b""
    except ConnectionResetError:
        pass
    owner = socket.create_connection(server.getsockname())
    owner.sendall(token + CONTROLLER)
    thread.join(timeout=10)
    assert accepted and accepted[0] is not None and accepted[0][1] == CONTROLLER
    send(owner, threading.Lock(), Answer(1, "hello"))
    assert _read_all(accepted[0][0], 1) == [Answer(1, "hello")]
    for s in (stranger, owner, accepted[0][0], server):
        s.close()


def _mark(path):
    open(path, "w").close()


def test_a_rank_s_channel_refuses_everyone_once_its_controller_is_connected(mesh1d, tmp_path):
    c = get_controller()
    for info in c.ranks:
        with pytest.raises(OSError):
            socket.create_connection(info.channel, timeout=5).sendall(info.token + CONTROLLER)
    x = dtorch.tensor(torch.arange(4.0), device_mesh=mesh1d, placements=[Shard(0)])
    assert torch.equal((x + 1).to_torch(), torch.arange(4.0) + 1)


@pytest.mark.parametrize("read", ["synchronize", "item", "to_torch"])
def test_a_read_is_one_message_to_each_rank_asked_and_one_answer_back(mesh1d, read):
    c = get_controller()
    c.poll_s = 60.0  # no liveness question while the read waits (the fixture restores it)
    r = dtorch.tensor(torch.tensor(2.0), device_mesh=mesh1d, placements=[Replicate()])
    x = dtorch.tensor(torch.arange(16.0).reshape(4, 4), device_mesh=mesh1d,
                      placements=[Shard(0)])
    gc.collect()  # handles of earlier tests freed now, not with the read
    dtorch.synchronize()
    sent, received = list(c.channels.sent), list(c.channels.received)
    if read == "synchronize":
        dtorch.synchronize()
        asked = range(4)
    elif read == "item":
        assert r.item() == 2.0
        asked = [0]
    else:
        assert torch.equal(x.to_torch(), torch.arange(16.0).reshape(4, 4))
        asked = range(4)
    new_sent = [a - b for a, b in zip(c.channels.sent, sent)]
    new_received = [a - b for a, b in zip(c.channels.received, received)]
    c.poll_s = 0.5
    assert new_sent == [1 if rank in asked else 0 for rank in range(4)]
    assert new_received == new_sent


def test_a_rank_whose_channel_closes_fails_the_waiting_read_at_once(other_cluster):
    """The channel's end is the liveness signal: a read waiting on a rank whose worker exits
    raises WorkerLostError without waiting for the poll interval's scheduler checks."""
    other_cluster(n_workers=2)
    c = get_controller()
    c.poll_s = 60.0  # only the channel can notice within this test's timeout
    mesh = dtorch.init_device_mesh("cpu", 2)
    x = dtorch.tensor(torch.arange(4.0), device_mesh=mesh, placements=[Shard(0)])
    dtorch.synchronize()
    c.issue(m.Call((), os._exit, (3,), {}, (1,)))
    started = time.monotonic()
    with pytest.raises(dtorch.WorkerLostError, match="rank 1"):
        x.to_torch()
    assert time.monotonic() - started < 20  # long before the first 60 s liveness poll
