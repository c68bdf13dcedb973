"""The controller's persistent, ordered channel to each rank: two TCP connections per rank.

A Dask actor call costs ~1.4 ms for 4 ranks on a quiet machine (msgpack, the event loops,
a pooled connection per call); a flush, a read or a liveness check then paid that each time.
The channel is a plain socket: the controller writes a rank's batches to it in order and one
reader thread takes every rank's answers as they arrive (a read of a small value is one round
trip, ~0.3 ms for 4 ranks). Dask still places the ranks, runs their process groups' startup
and closes them; the channel only carries the stream.

A connection first presents the world's token (made by the controller, given to each rank by
Dask when it was placed): a process that cannot talk to Dask cannot drive a rank through its
channel either. On a cluster whose Dask comms are TLS the connections are TLS too, with the
cluster's certificates (mutual: each end checks the other's), so the channel is as private as
Dask's own messages. Each connection carries one direction only (``CONTROLLER``: batches to
the rank; ``ANSWERS``: answers back; ``RELAY``: a relay's batches): an SSL connection must not
be read and written by two threads at once. Frames are pickle protocol 5, large buffers
(staged shards, fetched tensors) out of band, so they are not copied into the pickle.
Example::

    >>> import socket
    >>> a, b = socket.socketpair()
    >>> send(a, threading.Lock(), Answer(7, ("ok", [])))
    >>> FrameReader().read_from(b)
    [Answer(req=7, answer=('ok', []))]

In a world larger than ``DTORCH_FANOUT`` ranks the batches travel through relays
(``fanout.py``): a rank then also accepts its relay's connection, which carries its batches;
answers still go straight to the controller.
"""

from __future__ import annotations

import hmac
import pickle
import selectors
import socket
import ssl
import struct
import threading
from concurrent.futures import Future
from typing import Any, NamedTuple

from ..errors import DTorchError

TOKEN_BYTES = 32
# what a connection carries: batches from the controller, answers to it, a relay's batches
CONTROLLER, ANSWERS, RELAY = b"C", b"A", b"R"
_HEADER = struct.Struct("!QI")  # the pickle's bytes, the number of out-of-band buffers
_LENGTH = struct.Struct("!Q")
_CHUNK = 1 << 18  # bytes asked for per receive
_DIRECT = 1 << 16  # a part at least this large is received into its own buffer


class ChannelClosed(DTorchError, ConnectionError):
    """A rank's channel closed: its worker process is gone or the rank was closed."""


# messages: controller -> rank ---------------------------------------------------------------
class Batch(NamedTuple):
    """Batch ``seq`` of this rank's stream (batches.RankBatch's bytes); with ``ack``, the rank
    answers request ``ack`` once it holds the batch (a caller bounding its staged memory)."""

    seq: int
    payload: tuple
    staged: dict | None
    quick: bool
    ack: int | None = None


class Links(NamedTuple):
    """Where the heads of a relay's sub-blocks listen: ``{rank: (host, port)}``
    (``fanout.py``); the relay connects to them before it forwards anything."""

    addresses: dict


class Health(NamedTuple):
    """Ask the rank's channel thread (not the interpreter) whether the interpreter serves."""

    req: int


# messages: rank -> controller ---------------------------------------------------------------
class Answer(NamedTuple):
    """The answer to request ``req`` (a Fetch, Sync, Eager, Checkpoint, Health or an ack)."""

    req: int
    answer: Any


def encode(obj) -> list:
    """``obj`` as the parts of one frame: header, buffer lengths and pickle, then buffers."""
    buffers: list = []
    try:
        data = pickle.dumps(obj, protocol=5, buffer_callback=buffers.append)
        raws = [b.raw() for b in buffers]
    except BufferError:  # a non-contiguous buffer: everything in band
        data, raws = pickle.dumps(obj, protocol=5), []
    head = _HEADER.pack(len(data), len(raws)) + b"".join(_LENGTH.pack(r.nbytes) for r in raws)
    return [head + data, *raws]


def send(sock: socket.socket, lock: threading.Lock, obj) -> None:
    """Write one frame; ``lock`` keeps frames from different threads whole."""
    parts = encode(obj)
    with lock:
        for part in parts:
            sock.sendall(part)


class FrameReader:
    """Decodes frames from a socket as bytes arrive, each part read into its final buffer."""

    def __init__(self):
        self._expect_header()

    def _expect_header(self) -> None:
        self._target = bytearray(_HEADER.size)
        self._filled = 0
        self._stage = "header"

    def read_from(self, sock: socket.socket) -> list:
        """Receive once (blocking or not), and on TLS until nothing decrypted is left waiting
        (a selector sees only the raw socket), and return the messages that completed;
        raises ChannelClosed at the end of the stream."""
        out = self._read_once(sock)
        pending = getattr(sock, "pending", None)
        while pending is not None and pending():
            out += self._read_once(sock)
        return out

    def _read_once(self, sock: socket.socket) -> list:
        """One receive. A large part is received straight into its buffer; small ones come
        in chunks, several frames per receive."""
        direct = len(self._target) - self._filled >= _DIRECT
        try:
            if direct:
                n = sock.recv_into(memoryview(self._target)[self._filled:])
                chunk = b""
            else:
                chunk = sock.recv(_CHUNK)
                n = len(chunk)
        except (BlockingIOError, ssl.SSLWantReadError):  # nothing whole yet (non-blocking)
            return []
        except OSError as exc:
            raise ChannelClosed(f"the channel broke: {exc}") from exc
        if n == 0:
            raise ChannelClosed("the other end closed the channel")
        if direct:
            self._filled += n
        out, pos = [], 0
        while True:
            if self._filled == len(self._target):
                done = self._advance()
                if done is not None:
                    out.append(done[0])
                continue
            if pos >= len(chunk):
                return out
            take = min(len(self._target) - self._filled, len(chunk) - pos)
            self._target[self._filled:self._filled + take] = chunk[pos:pos + take]
            self._filled += take
            pos += take

    def _advance(self):
        """The current part is complete: move on; returns ``(message,)`` at a frame's end."""
        if self._stage == "header":
            self._size, count = _HEADER.unpack(self._target)
            self._buffers: list = []
            self._stage, self._target = "lengths", bytearray(_LENGTH.size * count)
        elif self._stage == "lengths":
            self._lengths = [_LENGTH.unpack_from(self._target, i * _LENGTH.size)[0]
                             for i in range(len(self._target) // _LENGTH.size)]
            self._stage, self._target = "pickle", bytearray(self._size)
        else:
            if self._stage == "pickle":
                self._data = self._target
            else:
                self._buffers.append(self._target)
            if len(self._buffers) == len(self._lengths):
                message = pickle.loads(self._data, buffers=self._buffers)
                self._expect_header()
                return (message,)
            self._stage, self._target = "buffer", bytearray(self._lengths[len(self._buffers)])
        self._filled = 0
        return None


def accept_peer(server: socket.socket, token: bytes,
                ssl_context=None) -> tuple[socket.socket, bytes] | None:
    """The next connection that presents ``token``, and the role it names after it
    (``CONTROLLER``, ``ANSWERS`` or ``RELAY``); others are closed unread, as is one that does
    not complete a TLS handshake with a certificate ``ssl_context`` trusts. None once the
    listening socket is closed."""
    while True:
        try:
            conn, _ = server.accept()
        except OSError:
            return None
        conn.settimeout(10.0)
        try:
            if ssl_context is not None:
                conn = ssl_context.wrap_socket(conn, server_side=True)
            presented = _receive_exactly(conn, TOKEN_BYTES + 1)
        except OSError:  # ssl.SSLError included: no certificate, or one we do not trust
            presented = b""
        if len(presented) == TOKEN_BYTES + 1 and \
                hmac.compare_digest(presented[:TOKEN_BYTES], token) and \
                presented[TOKEN_BYTES:] in (CONTROLLER, ANSWERS, RELAY):
            conn.settimeout(None)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            keep_alive(conn)
            return conn, presented[TOKEN_BYTES:]
        conn.close()


KEEPALIVE_S = (10, 5, 3)  # idle seconds, probe interval, probes: a silent peer in ~25 s


def keep_alive(conn: socket.socket) -> None:
    """Probe an idle connection so that a peer gone without closing it (a laptop lid shut, a
    network cut) reads as closed within ~25 s instead of never (Linux's options; elsewhere
    the system's defaults)."""
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    idle, interval, count = KEEPALIVE_S
    for name, value in (("TCP_KEEPIDLE", idle), ("TCP_KEEPINTVL", interval),
                        ("TCP_KEEPCNT", count)):
        if hasattr(socket, name):
            conn.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)


def _receive_exactly(conn: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        chunk = conn.recv(n - len(out))
        if not chunk:
            break
        out += chunk
    return out


def connect(address: tuple, token: bytes, role: bytes, timeout_s: float = 30.0,
            ssl_context=None):
    """A connection to a rank's channel listener that presents ``token`` and ``role`` (over
    TLS with ``ssl_context``: the cluster's certificates)."""
    sock = socket.create_connection(tuple(address), timeout=timeout_s)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    keep_alive(sock)
    try:
        if ssl_context is not None:
            sock = ssl_context.wrap_socket(sock, server_side=False)
        sock.sendall(token + role)
    except BaseException:
        sock.close()
        raise
    sock.settimeout(None)
    return sock


class Channels:
    """The controller's end: a connection per rank, one reader thread for all of them.

    ``expect(rank, req)`` gives a Future for that request's answer; register it before the
    request is sent. A closed connection fails the rank's waiting futures with
    :class:`ChannelClosed` at once."""

    def __init__(self, addresses: list[tuple[str, int]], token: bytes, timeout_s: float = 30.0,
                 send_timeout_s: float | None = None, ssl_context=None):
        self._stop = False
        self._reader_lost: ChannelClosed | None = None
        self._socks: list[socket.socket] = []  # batches to each rank (written only)
        self._answer_socks: list[socket.socket] = []  # its answers (read only)
        self._locks = [threading.Lock() for _ in addresses]
        self._futures: dict[tuple[int, int], Future] = {}
        self._early: dict[tuple[int, int], Any] = {}  # answers nobody expected yet
        self._closed: dict[int, ChannelClosed] = {}
        self._guard = threading.Lock()
        self.sent = [0] * len(addresses)  # messages written to each rank (tests count hops)
        self.received = [0] * len(addresses)  # answers read from each rank
        try:
            for address in addresses:  # answers first: a rank takes connections in order
                answers = connect(address, token, ANSWERS, timeout_s, ssl_context)
                answers.setblocking(False)  # a rank paused inside a TLS record blocks no one
                self._answer_socks.append(answers)
                sock = connect(address, token, CONTROLLER, timeout_s, ssl_context)
                sock.settimeout(send_timeout_s)  # a rank that stops reading: an error, not a hang
                self._socks.append(sock)
        except BaseException:
            self.close()
            raise
        self._selector = selectors.DefaultSelector()
        self._readers = {}
        for rank, sock in enumerate(self._answer_socks):
            self._selector.register(sock, selectors.EVENT_READ, rank)
            self._readers[rank] = FrameReader()
        self._wake_r, self._wake_w = socket.socketpair()  # close() wakes the reader
        self._selector.register(self._wake_r, selectors.EVENT_READ, None)
        self._thread = threading.Thread(target=self._read_all, daemon=True,
                                        name="dtorch-channels")
        self._thread.start()

    def send(self, rank: int, message) -> None:
        """Write ``message`` to ``rank``; ChannelClosed if its connection is gone or does not
        take the bytes within ``send_timeout_s``. A write cut short (an interrupt inside it)
        closes the connection: the rank would misread what follows."""
        lost = self._closed.get(rank) or self._reader_lost
        if lost is not None:
            raise lost
        try:
            send(self._socks[rank], self._locks[rank], message)
            self.sent[rank] += 1
        except OSError as exc:
            raise self._mark_closed(rank, f"sending to rank {rank} failed: {exc}") from exc
        except BaseException:
            self._mark_closed(rank, f"a write to rank {rank} was interrupted half-way")
            self._socks[rank].close()
            raise

    def expect(self, rank: int, req: int) -> Future:
        """A Future for request ``req``'s answer from ``rank``."""
        fut: Future = Future()
        with self._guard:
            key = (rank, req)
            if key in self._early:
                fut.set_result(self._early.pop(key))
            elif rank in self._closed or self._reader_lost is not None:
                fut.set_exception(self._closed.get(rank) or self._reader_lost)
            else:
                self._futures[key] = fut
        return fut

    def _read_all(self) -> None:
        try:
            while not self._stop:
                for key, _ in self._selector.select():
                    rank = key.data
                    if rank is None:
                        return
                    try:
                        messages = self._readers[rank].read_from(key.fileobj)
                    except ChannelClosed as exc:
                        self._selector.unregister(key.fileobj)
                        self._mark_closed(rank, f"rank {rank}'s channel closed: {exc}")
                        continue
                    for message in messages:
                        self._deliver(rank, message)
        except BaseException as exc:  # noqa: BLE001 - nobody would read answers any more
            self._fail_everything(ChannelClosed(
                f"the controller's channel reader stopped: {type(exc).__name__}: {exc}"))

    def _fail_everything(self, err: ChannelClosed) -> None:
        """Fail every waiting answer and refuse every later request."""
        with self._guard:
            self._reader_lost = err
            futures = list(self._futures.values())
            self._futures.clear()
        for fut in futures:
            fut.set_exception(err)

    def _deliver(self, rank: int, message: Answer) -> None:
        self.received[rank] += 1
        with self._guard:
            fut = self._futures.pop((rank, message.req), None)
            if fut is None:
                self._early[(rank, message.req)] = message.answer
        if fut is not None:
            fut.set_result(message.answer)

    def _mark_closed(self, rank: int, why: str) -> ChannelClosed:
        err = ChannelClosed(why)
        with self._guard:
            self._closed.setdefault(rank, err)
            waiting = [k for k in self._futures if k[0] == rank]
            futures = [self._futures.pop(k) for k in waiting]
        for fut in futures:
            fut.set_exception(err)
        return err

    def close(self) -> None:
        """Close every connection and stop the reader thread (again: nothing happens)."""
        if self._stop:
            return
        self._stop = True
        if hasattr(self, "_wake_w"):
            self._wake_w.send(b"x")
            self._thread.join(timeout=5)
            self._selector.close()
            self._wake_r.close()
            self._wake_w.close()
        for sock in self._socks + self._answer_socks:
            try:
                sock.close()
            except OSError:
                pass
