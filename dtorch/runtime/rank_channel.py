"""The rank's end of its channel (``channel.py``) and, in large worlds, its relay duty
(``fanout.py``). A mixin of ``RankActor``, which gives ``rank``, ``world``, ``interp``, ``_cv``,
``_inbox``, ``_next_seq``, ``_busy``, ``_fatal``, ``_run_batch`` and ``_health``.

A listener on the worker's interface takes the controller's two connections (its batches
come on one, answers go back on the other) and, for a rank that is not a head the controller
sends to, its relay's; then it stops listening. On a TLS cluster all of them are TLS, with the
worker's own certificates (``tls_context``). Each connection has its own receiving thread; batches are queued by sequence
number, so whichever path brought them, the interpreter runs them in order."""

from __future__ import annotations

import threading

from .channel import (ANSWERS, CONTROLLER, RELAY, Answer, Batch, ChannelClosed, FrameReader,
                      Health, Links, accept_peer, connect, send)
from .fanout import Relay, block_of, parent_of, relay_for, route_of, sub_blocks
from .network import listen_on


def tls_context(server_side: bool):
    """This worker's TLS context when its Dask comms use TLS (its own certificates, the
    cluster's CA: mutual authentication), else None (run on a worker)."""
    from distributed import get_worker
    worker = get_worker()
    if not worker.address.startswith("tls://"):
        return None
    security = worker.security
    args = security.get_listen_args("worker") if server_side else \
        security.get_connection_args("worker")
    return args.get("ssl_context")


class ServesChannel:
    """Accepts the controller's (and a relay's) connection, queues batches, relays."""

    def _start_channel(self, ip: str, token: bytes, fanout: int) -> None:
        self._listener = listen_on(ip)
        self._token = token
        self._tls = tls_context(server_side=True), tls_context(server_side=False)
        self._send_lock = threading.Lock()
        self._channel = None  # the controller's connection, once it presented the token
        self._answers = None  # the connection answers go back on
        self._answers_ready = threading.Event()
        tree = bool(fanout) and self.world > fanout
        self._fanout = fanout
        expected = 3 if tree and parent_of(self.rank, self.world, fanout) is not None else 2
        self._sub_blocks = sub_blocks(block_of(self.rank, self.world, fanout), fanout) \
            if tree else []
        self._children: dict[int, tuple] = {}  # head rank -> (socket, lock), once linked
        self._linked = threading.Event()  # the links arrived (at once: nobody to relay to)
        if not self._sub_blocks:
            self._linked.set()
        self.relayed = 0  # Relay messages this rank forwarded
        self._accepter = threading.Thread(target=self._accept, args=(expected,), daemon=True,
                                          name=f"dtorch-channel-{self.rank}")
        self._accepter.start()

    async def channel_address(self) -> tuple[str, int]:
        """Where the controller (and a relay) connect this rank's channel."""
        return self._listener.getsockname()[:2]

    def _accept(self, expected: int) -> None:
        """Take ``expected`` connections, each served by its own thread; the listener closes
        before the last one is served (so once it answers, later connections are refused)."""
        try:
            for i in range(expected):
                peer = accept_peer(self._listener, self._token, self._tls[0])
                if peer is None:
                    return
                conn, role = peer
                if role == CONTROLLER:
                    self._channel = conn
                if i == expected - 1:
                    stop_listening(self._listener)
                if role == ANSWERS:  # written by _post, never read
                    self._answers = conn
                    self._answers_ready.set()
                    continue
                threading.Thread(target=self._serve, args=(conn,), daemon=True,
                                 name=f"dtorch-channel-{self.rank}-{role.decode()}").start()
        finally:
            stop_listening(self._listener)

    def _serve(self, conn) -> None:
        """Read one connection: queue batches, relay, link, answer health questions. A
        failure here (a relay that cannot forward, a frame that cannot be read) means batches
        were lost: the rank reports it as fatal (``health()``), so reads raise, never hang."""
        reader = FrameReader()
        try:
            while True:
                for message in reader.read_from(conn):
                    kind = type(message)
                    if kind is Batch:
                        self._take(message)
                    elif kind is Relay:
                        self._relay(message)
                    elif kind is Health:
                        self._post(message.req, self._health())
                    elif kind is Links:
                        self._link(message.addresses)
        except ChannelClosed:  # the other end closed it, or went away
            pass
        except BaseException as exc:  # noqa: BLE001 - reported by health(), then stop
            self._fatal = self.interp._fail("receiving batches", exc).failure
        finally:
            conn.close()
            if conn is self._channel and not self._closing:
                self._controller_lost()

    def _take(self, batch: Batch) -> None:
        """Queue batch ``seq``. A ``quick`` batch (only reads and frees) that is next in line
        while the interpreter is idle runs right here instead (a read answers sooner)."""
        with self._cv:
            if batch.quick and batch.seq == self._next_seq and not self._busy \
                    and not self._inbox:
                self._next_seq += 1
                self.inline_batches += 1
                self._run_batch(batch.payload, batch.staged)
            else:
                self._inbox[batch.seq] = (batch.payload, batch.staged)
                self._cv.notify()
        if batch.ack is not None:
            self._post(batch.ack, None)

    def _link(self, addresses: dict) -> None:
        """Connect to the heads of this rank's sub-blocks (a relay)."""
        for rank, address in sorted(addresses.items()):
            if rank not in self._children:
                self._children[rank] = (connect(address, self._token, RELAY,
                                                ssl_context=self._tls[1]), threading.Lock())
        self._linked.set()

    def close_links(self) -> None:
        """Close the connections to the heads this rank relays to, and the answers'."""
        for sock, _ in self._children.values():
            sock.close()
        self._children.clear()
        if self._answers is not None:
            with self._send_lock:
                self._answers.close()

    def abort_answers(self) -> None:
        """Shut the answers' connection down now: a send blocked on a controller that went
        silent (unacknowledged data keeps TCP retrying for many minutes) returns at once."""
        import socket
        if self._answers is not None:
            try:
                self._answers.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def _relay(self, relay: Relay) -> None:
        """Forward each sub-block its routes, then queue this rank's own batch. The links
        come on the controller's connection and a relay's batches on another: wait for them.
        A sub-block that cannot be reached raises (see ``_serve``)."""
        if not self._linked.wait(timeout=60):
            raise ChannelClosed("the controller never said where this relay's ranks listen")
        routes = list(relay.routes)
        for block in self._sub_blocks:
            part = relay_for(block, routes, relay.batches, relay.ack)
            if part.routes:
                sock, lock = self._children[block.start]
                try:
                    send(sock, lock, part)
                except OSError as exc:
                    raise RuntimeError(f"rank {self.rank} could not relay batches to rank "
                                       f"{block.start}: {exc}") from exc
                self.relayed += 1
        mine = route_of(relay, self.rank)
        if mine is not None:
            _, _, seq, index, quick, staged = mine
            self._take(Batch(seq, relay.batches[index], staged, quick, relay.ack))

    def _post(self, req: int, answer) -> None:
        """Send request ``req``'s answer to the controller (any thread)."""
        if not self._answers_ready.wait(timeout=30):  # connected before the batches' one
            return
        try:
            send(self._answers, self._send_lock, Answer(req, answer))
        except OSError:  # the controller is gone: nobody waits for it
            pass


def stop_listening(listener) -> None:
    """Close a listening socket, waking a thread blocked in its ``accept``."""
    import socket
    try:
        listener.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    listener.close()
