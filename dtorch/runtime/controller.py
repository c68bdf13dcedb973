"""The controller: turns DTensor calls into an ordered, batched instruction stream.

Nothing here waits for workers unless a value is asked for. Instructions are appended to a
pending list and shipped when a value is requested, when the list reaches ``max_pending``, at
the end of a notebook cell, or on ``synchronize()``: each rank gets one batch holding only the
instructions it runs (``batches.py``), plus its own staged shards. Example::

    c = Controller(client, cluster, ranks, "cpu")
    tid = c.new_tid()
    c.issue(Create(tid, "zeros", (), {}, (4,), torch.float32, mesh, (Replicate(),), (0,), False))
    c.flush()
"""

from __future__ import annotations

import itertools
import os
from collections import deque
import threading
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_for

from ..errors import ClusterError, InterpreterStuckError, RemoteError, WorkerLostError
from . import messages as m
from .batches import rank_batches
from .channel import Batch, ChannelClosed, Channels, Health, Links
from .fanout import block_of, parent_of, plan_flush, sub_blocks
from .intern import InternTable
from .interrupts import interrupts_held
from .wire import pack

_generations = itertools.count(1)



def remote_error(failure, context: str = "") -> RemoteError:
    """A controller-side exception for a failure on a rank, with the remote traceback."""
    text = f"rank {failure.rank} failed in {failure.op}: {failure.message}"
    if context:
        text += f" ({context})"
    if failure.traceback:
        text += "\n--- remote traceback ---\n" + failure.traceback.rstrip()
    err = RemoteError(text)
    err.rank, err.failure = failure.rank, failure
    return err


# What gloo says on the ranks left when a peer's process died mid-collective.
PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")


def _quiet_logs() -> None:
    """On a worker about to be shut down: its heartbeats may fail while it exits."""
    import logging
    logging.getLogger("distributed").setLevel(logging.CRITICAL)


def client_tls(client):
    """The controller's TLS context for the ranks' channels when the Dask client talks TLS
    (its certificates; the ranks check them as the scheduler does), else None."""
    security = getattr(client, "security", None)
    if security is None or not client.scheduler.address.startswith("tls://"):
        return None
    return security.get_connection_args("client").get("ssl_context")


def _outcome(fut: Future) -> tuple[bool, object]:
    """``(True, result)`` or ``(False, exception)`` of a done future."""
    exc = fut.exception()
    return (False, exc) if exc is not None else (True, fut.result())


class Controller:
    """Owns the cluster connection, the instruction stream and the ids of remote tensors."""

    def __init__(self, client, cluster, ranks, device_type: str, backend: str = "gloo",
                 max_pending: int = 1000, poll_s: float = 0.5, fanout: int = 0):
        self.client, self.cluster, self.ranks = client, cluster, ranks
        self.device_type, self.backend = device_type, backend
        self.world = len(ranks)
        self.generation = next(_generations)
        self.max_pending = max_pending
        self.poll_s = poll_s
        self.op_timeout_s = float(os.environ.get("DTORCH_OP_TIMEOUT", "600"))
        self.live_tensors = 0
        self.closed = False
        self.link_model = None  # the cost model's fits for this cluster (runtime/links.py)
        self._pending: list = []
        self._staged: dict[int, dict] = {}
        self._freed: deque[tuple] = deque()  # (tid, ranks) from __del__, drained by flush
        self._seqs = [0] * self.world  # each rank's own batch sequence
        self.flushes = 0  # flushes that shipped something (the kernel's per-cell check)
        self.issued = 0  # instructions issued so far (tests: a refused call issues none)
        self._interned = InternTable()
        self._known: list[set] = [set()] * self.world  # ids each rank resolves (shared sets)
        self._tids = itertools.count(1)
        self._reqs = itertools.count(1)
        self._groups_made: set[tuple[int, ...]] = set()
        self._meshes_ready: set = set()  # meshes checked and with their groups made
        self._lock = threading.RLock()
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="dtorch-fetch")
        self.fanout = fanout  # a larger world's flushes go through relays (fanout.py)
        self.channels = Channels([info.channel for info in ranks], ranks[0].token,
                                 send_timeout_s=self.op_timeout_s,
                                 ssl_context=client_tls(client)) \
            if client is not None and ranks and ranks[0].channel else None
        if self.channels is not None:
            if self._relayed():
                self._link_relays()
            self._check_channels()

    # ids and the stream ----------------------------------------------------------------------
    def new_tid(self) -> m.Tid:
        return m.Tid(next(self._tids))

    def _new_req(self) -> m.Tid:
        return m.Tid(next(self._reqs))

    def issue(self, instr) -> None:
        """Append one instruction; ships a batch when ``max_pending`` is reached.

        Handles dropped since the last instruction are freed first, in stream order, so a
        rank can reuse their memory for this very instruction.
        """
        with self._lock:  # ops may be issued from a TensorFuture callback thread too
            self._check_open()
            if self._freed:
                self._pending.extend(self._drain_freed())
            self._pending.append(instr)
            self.issued += 1
            if len(self._pending) >= self.max_pending:
                self.flush()

    def _drain_freed(self) -> list:
        """One Free per holder set, for the ranks that hold the tensors (in drop order)."""
        by_ranks: dict = {}  # keyed by identity: a mesh's rank tuple is one object (no hashing)
        while self._freed:
            tid, ranks = self._freed.popleft()
            by_ranks.setdefault(id(ranks), (ranks, []))[1].append(tid)
        return [m.Free(tuple(tids), ranks) for ranks, tids in by_ranks.values()]

    def stage(self, rank: int, tid: int, tensor) -> None:
        """Attach a shard for ``rank`` to the next batch (read by a ``Load``)."""
        self._staged.setdefault(rank, {})[tid] = pack(tensor)

    def release(self, tid: int, ranks=None) -> None:
        """Free a tensor's shards with the next batch (safe from ``__del__``)."""
        self._freed.append((tid, ranks))
        self.live_tensors -= 1

    def release_graph(self, node_id: int, ranks=None) -> None:
        """Drop the local autograd graph of ``node_id`` on its ranks with the next batch (a
        controller node was garbage-collected; safe from ``__del__``)."""
        self._freed.append((node_id, ranks))

    def ensure_mesh(self, mesh) -> None:
        """Check a mesh against the cluster; create its process groups on first use."""
        self._check_open()
        if mesh in self._meshes_ready:
            return
        if mesh.device_type != self.device_type:
            raise ClusterError(f"this cluster runs {self.device_type!r} ranks; the mesh is "
                               f"{mesh.device_type!r}. Build the mesh with device_type="
                               f"{self.device_type!r} or dtorch.init(device_type="
                               f"{mesh.device_type!r})")
        top = max(mesh.ranks)
        if top >= self.world:
            raise ClusterError(f"the mesh names rank {top} but the cluster has {self.world} ranks "
                               f"(0..{self.world - 1}); use ranks below {self.world} or start a "
                               f"bigger cluster with dtorch.init(n_workers={top + 1})")
        self.ensure_groups(g for dim in range(mesh.ndim) for g in mesh.groups(dim))
        self._meshes_ready.add(mesh)

    def ensure_groups(self, groups) -> None:
        """Create the process groups of these rank tuples on first use (with the next batch)."""
        new = []
        for group in groups:
            key = tuple(sorted(group))
            if len(group) > 1 and key not in self._groups_made:
                self._groups_made.add(key)
                new.append(key)
        if new:
            self.issue(m.SetupMesh(tuple(new), self.backend))

    def flush(self, delivered: bool = False) -> dict:
        """Ship everything pending: each rank gets one batch on its channel.

        With ``delivered``, returns ``{rank: Future}``, each done once that rank holds its
        batch (a caller streaming large staged data waits on them to bound its memory).
        """
        with self._lock:
            if self._freed:
                self._pending.extend(self._drain_freed())
            if not self._pending:
                return {}
            self._check_open()
            batches = rank_batches(self._pending, self._interned, self._known)
            staged, self._staged = self._staged, {}
            self._pending = []
            self.flushes += 1
            ack = self._new_req() if delivered else None
            acks = {rank: self._expect(rank, ack) for rank in batches} if delivered else {}
            with interrupts_held():  # the same flush reaches every rank, or none
                for rank, message in self._messages(batches, staged, ack):
                    self._write(rank, message)
            return acks

    def _messages(self, batches: dict, staged: dict, ack) -> list[tuple[int, object]]:
        """What the controller writes for one flush: a Batch to each rank, or in a world
        larger than the fan-out a Relay to each head (``fanout.py``)."""
        seqs = {}
        for rank in batches:
            seqs[rank], self._seqs[rank] = self._seqs[rank], self._seqs[rank] + 1
        if self._relayed():
            return plan_flush(batches, seqs, staged, self.world, self.fanout, ack)
        return [(rank, Batch(seqs[rank], (batch.definitions, batch.segments),
                             staged.get(rank) or None, batch.quick, ack))
                for rank, batch in batches.items()]

    def _check_channels(self, wait_s: float = 30.0) -> None:
        """One round trip on every channel before the first batch: each rank serves it (and
        a relay has linked to its ranks, the links having come first)."""
        reports = self._health(range(self.world), wait_s)
        if reports is None or not all(ok for ok, _ in reports.values()):
            self.channels.close()
            raise ClusterError(f"the ranks' channels did not answer within {wait_s:.0f} s: "
                               f"{reports}")

    def _relayed(self) -> bool:
        """Whether flushes go through relays: a world larger than the fan-out."""
        return bool(self.fanout) and self.world > self.fanout

    def _link_relays(self) -> None:
        """Tell each relay where the heads of its sub-blocks listen (it connects to them)."""
        for rank in range(self.world):
            heads = [b.start for b in sub_blocks(block_of(rank, self.world, self.fanout),
                                                 self.fanout)]
            if heads:
                self._write(rank, Links({h: self.ranks[h].channel for h in heads}))

    def _write(self, rank: int, message) -> None:
        """Write one message to a rank's channel (the dry-run controller only counts)."""
        try:
            self.channels.send(rank, message)
        except ChannelClosed as exc:
            raise self._lost(rank, exc) from exc

    def _expect(self, rank: int, req: int) -> Future:
        return self.channels.expect(rank, req)

    def deliver(self) -> None:
        """Flush and wait until every rank has received the batch (not run it)."""
        self.wait(self.flush(delivered=True))

    # answers ---------------------------------------------------------------------------------
    def request(self, make, ranks) -> dict:
        """Issue ``make(req)`` (a Fetch, Sync, ...), flush, and return ``{rank: Future}`` of
        the answers (each rank pushes its answer on its channel: one round trip)."""
        req = self._new_req()
        with self._lock:
            self._check_open()
            futures = {r: self._expect(r, req) for r in ranks}
            if self._freed:  # handles dropped before the request: freed before it answers
                self._pending.extend(self._drain_freed())
            self._pending.append(make(req))
            self.flush()
        return futures

    def wait(self, futures: dict, timeout: float | None = None) -> dict:
        """Wait for answers; every ``poll_s`` without one, check that the ranks' workers
        and interpreters are alive (a closed channel fails its futures at once)."""
        start = time.monotonic()
        pending = dict(futures)
        while pending:
            left = None if timeout is None else timeout - (time.monotonic() - start)
            if left is not None and left <= 0:
                raise TimeoutError(f"no answer from ranks {sorted(pending)} within {timeout}s")
            done, _ = wait_for(list(pending.values()), self.poll_s if left is None else
                               min(self.poll_s, left), return_when=FIRST_COMPLETED)
            for rank, fut in pending.items():  # a lost rank: say so now, not after the rest
                if fut.done() and fut.exception() is not None:
                    raise self._lost(rank, fut.exception()) from fut.exception()
            pending = {r: f for r, f in pending.items() if not f.done()}
            if not done and pending:
                self.check_alive(list(pending))
                self.check_interpreters(self._with_relays(pending))
        out = {}
        for rank, fut in futures.items():
            ok, value = _outcome(fut)
            if not ok:  # the channel closed: the worker is gone
                raise self._lost(rank, value) from value
            out[rank] = value
        return out

    def _call(self, rank: int, method: str, *args):
        """Call an actor method; a rank whose worker is gone raises WorkerLostError."""
        try:
            return getattr(self.ranks[rank].actor, method)(*args)
        except RuntimeError as exc:  # Dask: "Worker holding Actor was lost"
            raise self._lost(rank, exc) from exc

    def _with_relays(self, ranks) -> list[int]:
        """``ranks`` and, beyond the fan-out, the relays their batches pass through (a relay
        that failed is why a rank waits)."""
        out = set(ranks)
        if self._relayed():
            for rank in ranks:
                parent = parent_of(rank, self.world, self.fanout)
                while parent is not None and parent not in out:
                    out.add(parent)
                    parent = parent_of(parent, self.world, self.fanout)
        return sorted(out)

    def _health(self, ranks, wait_s: float) -> dict | None:
        """``{rank: (ok, report)}`` from each rank's channel thread, or None when some did
        not answer within ``wait_s``."""
        req = self._new_req()
        futures = {}
        with interrupts_held():  # a question cut half-way would break the channel
            for r in ranks:
                futures[r] = self._expect(r, req)
                try:
                    self.channels.send(r, Health(req))
                except ChannelClosed:
                    pass  # its future fails with it
        done, waiting = wait_for(list(futures.values()), wait_s)
        if waiting:
            return None
        return {r: _outcome(f) for r, f in futures.items()}

    def check_alive(self, ranks=None) -> None:
        """Raise WorkerLostError when a rank's Dask worker has left the cluster."""
        try:
            present = set(self.client.scheduler_info(n_workers=-1)["workers"])
        except Exception as exc:  # noqa: BLE001 - the scheduler itself is gone
            self.closed = True
            raise ClusterError(f"lost the Dask scheduler: {exc}; call dtorch.restart()") from exc
        for r in (range(self.world) if ranks is None else ranks):
            if self.ranks[r].address not in present:
                raise self._lost(r)

    def check_interpreters(self, ranks) -> None:
        """Raise when a rank's interpreter stopped (its thread died, its batch stream broke)
        or has been in one instruction for longer than ``op_timeout_s``. The world is out of
        step then: the controller closes, and ``dtorch.restart()`` starts a fresh one."""
        reports = self._health(ranks, max(self.poll_s, 5.0))
        if reports is None:
            return  # a busy rank answers late; the next round asks again
        for rank, (ok, report) in sorted(reports.items()):
            if not ok:
                raise self._lost(rank, report) from report
            if report["fatal"] is not None:
                self.closed = True
                raise remote_error(report["fatal"], "this rank cannot go on; call "
                                                    "dtorch.restart()")
            if report["busy_s"] > self.op_timeout_s:
                self.closed = True
                raise InterpreterStuckError(
                    f"rank {rank} has been running {report['current']} for "
                    f"{report['busy_s']:.0f} s (DTORCH_OP_TIMEOUT={self.op_timeout_s:g}); its "
                    f"peers and reads cannot go on. Call dtorch.restart(), or set "
                    f"DTORCH_OP_TIMEOUT higher for ops that run this long")

    def error_for(self, failure, context: str = "", wait_s: float = 5.0):
        """The exception for a rank's failure: when its collective broke because a peer's
        connection closed, the WorkerLostError of the rank that is gone, else the
        RemoteError. Every rank is asked (``health``, answered by its channel thread); when all
        answer, no worker is lost and nothing waits. Only a rank that does not answer within
        ``wait_s`` sends the question to the scheduler."""
        err = remote_error(failure, context)
        if not any(text in failure.message for text in PEER_LOST):
            return err
        lost = self._lost_rank(wait_s)
        if lost is None:
            return err
        lost.__cause__ = err
        return lost

    def _lost_rank(self, wait_s: float) -> Exception | None:
        """The WorkerLostError of a rank whose worker is gone (or whose interpreter thread
        stopped: its RemoteError), or None when every rank answers as serving."""
        reports = self._health(range(self.world), wait_s)
        if reports is not None:
            for rank, (ok, report) in sorted(reports.items()):
                if not ok:
                    return self._lost(rank, report)
                if report["fatal"] is not None:  # its interpreter stopped: that is the cause
                    self.closed = True
                    return remote_error(report["fatal"], "this rank cannot go on; call "
                                                         "dtorch.restart()")
            return None
        try:
            self.check_alive()
        except WorkerLostError as lost:
            return lost
        return None

    def _lost(self, rank: int, exc: BaseException | None = None) -> WorkerLostError:
        self.closed = True
        address = self.ranks[rank].address
        from .cluster import exit_reason  # Dask: only when a rank is gone
        ended = exit_reason(address, wait_s=2.0 if self.cluster is not None else 0.0)
        why = "".join(f"; {reason}" for reason in (exc, ended, self._scheduler_gone()) if reason)
        return WorkerLostError(f"rank {rank} (Dask worker {address}) died or left the "
                               f"cluster{why}. Its shards are lost; call dtorch.restart() to "
                               f"start a fresh world")

    def _scheduler_gone(self) -> str | None:
        """Why the Dask scheduler cannot be reached (its workers stop with it), or None: a
        connection to its address is refused, or the client says it lost it."""
        import socket
        client = self.client
        if client is None:
            return None
        address = client.scheduler.address
        status = getattr(client, "status", "running")
        if status == "running":
            try:
                host, port = address.split("://")[-1].rsplit(":", 1)
                socket.create_connection((host, int(port)), timeout=1.0).close()
                return None
            except (OSError, ValueError):
                status = "refused"
        return (f"the Dask scheduler at {address} cannot be reached ({status}): its workers "
                f"stopped with it; once the scheduler and its workers are back, "
                f"dtorch.restart() starts a world on them")

    def synchronize(self, timeout: float | None = None) -> None:
        """Wait until every rank ran everything issued; raise the errors they hit meanwhile."""
        answers = self.wait(self.request(m.Sync, range(self.world)), timeout)
        failures = [f for _, (_, errs) in sorted(answers.items()) for f in errs]
        if failures:
            err = self.error_for(failures[0])
            if not isinstance(err, RemoteError):
                raise err
            if len(failures) > 1:
                err.args = (err.args[0] + f"\n({len(failures) - 1} more failures: " + "; ".join(
                    f"rank {f.rank} in {f.op}: {f.message}" for f in failures[1:4]) + ")",)
            err.failures = failures
            raise err

    def submit_background(self, fn):
        return self._pool.submit(fn)

    def stats(self) -> list[dict]:
        """Each rank's ``RankActor.stats()`` now (while it may still be running earlier work:
        ``synchronize()`` first for counts that include everything issued)."""
        self.flush()
        return [self._call(info.rank, "stats").result() for info in self.ranks]

    def _check_open(self) -> None:
        if self.closed:
            raise ClusterError("the dtorch cluster is shut down or lost a worker; call "
                               "dtorch.init() or dtorch.restart()")

    def _close_survivors(self, wait_s: float = 10.0) -> None:
        """Close the rank actors that still answer, waiting ``wait_s`` at most in all."""
        futures = []
        present = set(self.client.scheduler_info(n_workers=-1)["workers"])
        for info in (i for i in self.ranks if i.address in present):
            try:
                futures.append(info.actor.close())
            except Exception:  # noqa: BLE001 - this one is gone
                pass
        deadline = time.monotonic() + wait_s
        for fut in futures:
            try:
                fut.result(timeout=max(0.1, deadline - time.monotonic()))
            except Exception:  # noqa: BLE001 - its world is ended when the next one starts
                pass

    def close(self) -> None:
        """Stop the rank threads; shut the embedded cluster down if we started it."""
        if self.closed and self.client is None:
            return
        try:
            if not self.closed:
                self.flush()
                for fut in [info.actor.close(self._seqs[info.rank]) for info in self.ranks]:
                    fut.result(timeout=30)
                if self.cluster is not None:  # our own workers: a quiet exit, no heartbeat noise
                    self.client.run(_quiet_logs)
            elif self.cluster is None:  # a joined cluster's surviving ranks keep their
                self._close_survivors()  # processes: end their world, or a new one cannot start
        except Exception:  # noqa: BLE001 - a lost worker cannot be closed politely; go on
            pass
        finally:
            self.closed = True
            self._pool.shutdown(wait=False)
            if self.channels is not None:
                self.channels.close()
            client, cluster, self.client = self.client, self.cluster, None
            if client is not None:
                client.close()
            if cluster is not None:
                cluster.close()
