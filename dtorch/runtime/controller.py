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
from concurrent.futures import ThreadPoolExecutor

from ..errors import ClusterError, InterpreterStuckError, RemoteError, WorkerLostError
from . import messages as m
from .batches import rank_batches
from .cluster import exit_reason
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


async def _answers_of(futures: dict) -> dict:
    """``{rank: (True, result) or (False, exception)}`` once every actor future is done, read
    on the event loop: one hop for all of them (``ActorFuture.result()`` is a hop each)."""
    out = {}
    for rank, fut in futures.items():
        try:
            out[rank] = (True, await fut)
        except Exception as exc:  # noqa: BLE001 - Controller.wait raises it as a lost worker
            out[rank] = (False, exc)
    return out


class Controller:
    """Owns the cluster connection, the instruction stream and the ids of remote tensors."""

    def __init__(self, client, cluster, ranks, device_type: str, backend: str = "gloo",
                 max_pending: int = 1000, poll_s: float = 0.5):
        self.client, self.cluster, self.ranks = client, cluster, ranks
        self.device_type, self.backend = device_type, backend
        self.world = len(ranks)
        self.generation = next(_generations)
        self.max_pending = max_pending
        self.poll_s = poll_s
        self.op_timeout_s = float(os.environ.get("DTORCH_OP_TIMEOUT", "600"))
        self.live_tensors = 0
        self.closed = False
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

    # ids and the stream ----------------------------------------------------------------------
    def new_tid(self) -> int:
        return next(self._tids)

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
        new = []
        for dim in range(mesh.ndim):
            for group in mesh.groups(dim):
                key = tuple(sorted(group))
                if len(group) > 1 and key not in self._groups_made:
                    self._groups_made.add(key)
                    new.append(key)
        if new:
            self.issue(m.SetupMesh(tuple(new), self.backend))
        self._meshes_ready.add(mesh)

    def flush(self, answer: int | None = None, answer_ranks=(), delivered: bool = False) -> dict:
        """Ship everything pending as one batch to every rank.

        With ``answer``, the submit calls to ``answer_ranks`` also bring back the answer to
        that request (one round trip instead of two); returns ``{rank: ActorFuture}`` then.
        With ``delivered``, returns every rank's submit future (done once the rank holds the
        batch: a caller streaming large staged data waits on them to bound its memory).
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
            futures = {}
            answer_ranks = set(answer_ranks)
            with interrupts_held():  # the same flush reaches every rank, or none
                for rank, batch in batches.items():
                    wanted = answer if rank in answer_ranks else None
                    seq, self._seqs[rank] = self._seqs[rank], self._seqs[rank] + 1
                    fut = self._send(rank, seq, batch, staged.get(rank) or None, wanted)
                    if wanted is not None or delivered:
                        futures[rank] = fut
            return futures

    def _send(self, rank: int, seq: int, batch, staged, answer):
        """Hand one rank its batch (an actor call; the dry-run controller only counts)."""
        return self._call(rank, "submit", seq, (batch.definitions, batch.segments), staged,
                          answer, batch.quick)

    def deliver(self) -> None:
        """Flush and wait until every rank has received the batch (not run it)."""
        self.wait(self.flush(delivered=True))

    # answers ---------------------------------------------------------------------------------
    def request(self, make, ranks) -> dict:
        """Issue ``make(req)`` (a Fetch or Sync), flush, and return ``{rank: ActorFuture}``."""
        req = next(self._reqs)
        ranks = list(ranks)
        with self._lock:
            self._check_open()
            self._pending.append(make(req))
            futures = self.flush(req, ranks)
        for r in ranks:  # a rank whose answer did not ride on the submit asks separately
            if r not in futures:
                futures[r] = self._call(r, "answer", req)
        return futures

    def _call(self, rank: int, method: str, *args):
        """Call an actor method; a rank whose worker is gone raises WorkerLostError."""
        try:
            return getattr(self.ranks[rank].actor, method)(*args)
        except RuntimeError as exc:  # Dask: "Worker holding Actor was lost"
            raise self._lost(rank, exc) from exc

    def wait(self, futures: dict, timeout: float | None = None) -> dict:
        """Wait for answers, checking every ``poll_s`` that the ranks' workers are alive."""
        from distributed.utils import sync
        start = time.monotonic()
        got: dict = {}
        while len(got) < len(futures):
            pending = {r: f for r, f in futures.items() if r not in got}
            left = None if timeout is None else timeout - (time.monotonic() - start)
            if left is not None and left <= 0:
                raise TimeoutError(f"no answer from ranks {sorted(pending)} within {timeout}s")
            try:
                got.update(sync(self.client.loop, _answers_of, pending, callback_timeout=
                                self.poll_s if left is None else min(self.poll_s, left)))
            except TimeoutError:  # answers already in are read again next round
                waiting = [r for r, f in pending.items() if not f.done()]
                self.check_alive(waiting)
                self.check_interpreters(waiting)
        out = {}
        for rank in futures:
            ok, value = got[rank]
            if not ok:  # the actor call itself failed: the worker is gone
                raise self._lost(rank, value) from value
            out[rank] = value
        return out

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
        from distributed.utils import sync
        futures = {r: self._call(r, "health") for r in ranks}
        try:
            reports = sync(self.client.loop, _answers_of, futures,
                           callback_timeout=max(self.poll_s, 5.0))
        except TimeoutError:
            return  # a busy event loop answers late; the next round asks again
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
        RemoteError. Every rank is asked (``health``, answered on its event loop); when all
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
        from distributed.utils import sync
        futures = {}
        for r in range(self.world):
            try:
                futures[r] = self._call(r, "health")
            except WorkerLostError as lost:  # Dask already knows the actor's worker is gone
                return lost
        try:
            reports = sync(self.client.loop, _answers_of, futures, callback_timeout=wait_s)
        except TimeoutError:
            reports = None
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
        ended = exit_reason(address, wait_s=2.0 if self.cluster is not None else 0.0)
        why = "".join(f"; {reason}" for reason in (exc, ended) if reason)
        return WorkerLostError(f"rank {rank} (Dask worker {address}) died or left the "
                               f"cluster{why}. Its shards are lost; call dtorch.restart() to "
                               f"start a fresh world")

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
                for fut in [info.actor.close() for info in self.ranks]:
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
            client, cluster, self.client = self.client, self.cluster, None
            if client is not None:
                client.close()
            if cluster is not None:
                cluster.close()
