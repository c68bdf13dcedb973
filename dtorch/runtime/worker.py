"""The rank runtime: a Dask actor hosting one rank's interpreter thread.

Dask places the actor on its worker and starts it; the stream itself comes over the rank's
channel (``channel.py``), one connection from the controller that carries the batches in order
and takes back the answers. A channel thread receives (so a batch can always arrive while the
interpreter is busy in a collective) and the interpreter thread executes the batches strictly
in sequence order. Example (controller)::

    actor = client.submit(RankActor, rank, world, addr, port, "gloo", actor=True,
                          workers=[worker_address], channel_token=token).result()
    host, port = actor.channel_address().result()    # then channel.Channels connects
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from datetime import timedelta

from . import messages as m
from .batches import unpickle_segments
from .intern import loads
from .interpreter import Interpreter, RemoteFailure
from .network import bind_to_interface, take_listener, worker_ip
from .rank_channel import ServesChannel, stop_listening
from .replay import Run

_STOP = object()
_held: dict = {}  # this worker process's rank, while a world is up: who holds it, since when
_held_lock = threading.Lock()


def holder_of(dask_worker=None) -> dict | None:
    """Run on a worker (``client.run(holder_of)``): the controller whose rank this worker
    process runs now (``{"holder": "pid 123 on host", "rank": 0, "since": epoch seconds}``),
    or None when it is free. A hold whose actor Dask no longer keeps (its client went away)
    is stale: free.

    >>> holder_of() is None
    True
    """
    with _held_lock:
        if not _held:
            return None
        if dask_worker is not None and not _actor_kept(dask_worker, _held.get("owner")):
            return None
        return {k: v for k, v in _held.items() if k != "owner"}


def dask_actors(dask_worker) -> list:
    """The actor instances Dask keeps on ``dask_worker`` (its state's, or older Dask's)."""
    actors = getattr(getattr(dask_worker, "state", None), "actors", None)
    if actors is None:
        actors = getattr(dask_worker, "actors", {}) or {}
    return list(actors.values())


def _actor_kept(dask_worker, actor) -> bool:
    return any(a is actor for a in dask_actors(dask_worker))


def _hold(actor, holder: str, rank: int) -> None:
    """Record that ``holder`` drives this worker; refuse if another controller still does
    (two controllers starting at once both passed ``cluster.check_workers_free``)."""
    from distributed import get_worker
    with _held_lock:
        if _held and _held["holder"] != holder and _actor_kept(get_worker(), _held["owner"]):
            raise RuntimeError(f"this worker already runs rank {_held['rank']} of another dtorch "
                               f"controller ({_held['holder']})")
        _held.clear()
        _held.update(holder=holder, rank=rank, since=time.time(), owner=actor)


def _unhold(actor) -> None:
    """Forget the hold if ``actor`` made it (a late release never clears a newer world's)."""
    with _held_lock:
        if _held.get("owner") is actor:
            _held.clear()


def leave_world(group) -> None:
    """Destroy the default process group if it is still ``group`` (this actor's world). On a
    joined cluster a restarted actor in the same worker process may have made a new world
    meanwhile: an old rank thread that comes out of a stuck collective late leaves that one
    alone.

    >>> leave_world(None)  # never joined: nothing to do
    """
    import torch.distributed as dist
    if group is not None and dist.is_initialized() and dist.group.WORLD is group:
        dist.destroy_process_group()


class RankActor(ServesChannel):
    """One rank: joins the torch.distributed world, then runs batches in sequence order."""

    store_address: tuple = ("", 0)  # rank 0's rendezvous store (declared: Dask's Actor proxy
    #                                 reads only attributes its class has)

    def __init__(self, rank: int, world: int, master_addr: str, master_port: int,
                 backend: str = "gloo", timeout_s: float = 60.0, seed: int = 0,
                 num_threads: int | None = None, device: str = "cpu",
                 store_key: str | None = None, channel_token: bytes = b"",
                 fanout: int = 0, holder: str = ""):
        from distributed import get_worker
        self.rank, self.world = rank, world
        _hold(self, holder or "an unnamed controller", rank)
        self._released = False
        self.ip = worker_ip(get_worker().address)  # torch.distributed binds to this address
        self.store_address = (master_addr, master_port)  # rank 0's rendezvous store
        self.timeout_s = timeout_s
        self._inbox: dict[int, tuple] = {}
        self._next_seq = 0
        self._interned: dict = {}  # meshes, rank tuples and steps the controller sent by id
        self._cv = threading.Condition()
        self._init_error: RemoteFailure | None = None
        self._fatal: RemoteFailure | None = None  # the interpreter cannot go on (health())
        self._closing = False
        self._ready = threading.Event()
        self._busy = True  # the interpreter thread is starting or running a batch
        self.inline_batches = 0  # quick batches run on the channel thread
        self._groups: dict[tuple[int, ...], object] = {}
        self._world_group = None  # this actor's default process group, once joined
        self.device = device
        self.interp = Interpreter(rank, self._group_of, self._make_groups, seed, device)
        self.interp.post_later = self._post  # save_async answers from its writer thread
        self.interp.timeout_s = timeout_s
        # rank 0's store socket, opened on this worker's address by check_world_connects
        store_socket = take_listener(store_key) if store_key else None
        args = (master_addr, master_port, backend, timeout_s, num_threads, store_socket)
        self._thread = threading.Thread(target=self._run, args=args, daemon=True,
                                        name=f"dtorch-rank-{rank}")
        self._thread.start()
        self._start_channel(self.ip, channel_token, fanout)

    async def ready(self) -> RemoteFailure | None:
        """Wait until the process group is up; returns the init error, if any."""
        await asyncio.get_running_loop().run_in_executor(None, self._ready.wait)
        return self._init_error

    async def health(self) -> dict:
        """``_health()`` as an actor call (the controller asks over the channel instead)."""
        return self._health()

    def _health(self) -> dict:
        """Whether the interpreter thread is serving: ``alive``, the instruction it is in and
        for how many seconds (``current``, ``busy_s``), and a ``fatal`` failure that stopped
        it (the controller raises it, naming this rank)."""
        current = self.interp.running()
        fatal = self._fatal
        if fatal is None and not self._thread.is_alive() and not self._closing:
            fatal = RemoteFailure(self.rank, "interpreter", "the rank's interpreter thread "
                                  "stopped", "")
        return {"alive": self._thread.is_alive(), "fatal": fatal,
                "current": current[0] if current else None,
                "busy_s": current[1] if current else 0.0}

    async def stats(self) -> dict:
        out = self.interp.stats()
        out["pending_batches"] = len(self._inbox)
        out["next_seq"] = self._next_seq
        out["inline_batches"] = self.inline_batches
        out["relayed"] = self.relayed
        out["interpreter_cpu_s"] = _thread_cpu_s(self._thread)
        out["process_cpu_s"] = time.process_time()  # every thread of the worker process
        current = self.interp.running()
        out["running"] = current[0] if current else None  # the instruction it is in, if any
        try:
            import psutil
            out["rss"] = psutil.Process().memory_info().rss
        except ImportError:  # pragma: no cover - psutil comes with distributed
            out["rss"] = None
        return out

    async def close(self, final_seq: int | None = None) -> None:
        """Stop once batches up to ``final_seq`` (the controller's count; None: whatever has
        arrived) have run: the last flush travels on the channel, this call through Dask, so
        the stop waits for it. Then drop this rank's state (``_release``)."""
        self._closing = True
        with self._cv:
            self._inbox[-1] = (_STOP, final_seq)
            self._cv.notify()
        stop_listening(self._listener)  # a channel never connected: its thread ends
        await asyncio.get_running_loop().run_in_executor(None, self._thread.join, 30)
        if not self._thread.is_alive():  # a thread stuck in a collective keeps its state
            self._release()

    def _controller_lost(self) -> None:
        """The controller's channel closed without a close(): its process died or lost the
        network (keepalive probes find a silent peer in ~25 s). Run what arrived, leave the
        world and release the rank, so that a new controller can use this worker."""
        self._closing = True
        with self._cv:
            self._inbox[-1] = (_STOP, None)
            self._cv.notify()
        self.abort_answers()  # a send stuck on a silent controller must not keep the thread

        def release_when_stopped():
            self._thread.join(self.timeout_s + 30)  # a collective whose peers left times out
            if not self._thread.is_alive():
                self._release()
        threading.Thread(target=release_when_stopped, daemon=True,
                         name=f"dtorch-rank-{self.rank}-release").start()

    def _release(self) -> None:
        """Free what this rank held and let the collector see it again: the actor and its
        interpreter were frozen with the startup heap (``_freeze_heap``) and live in cycles,
        so a worker that outlives its world (a cluster you run yourself) would keep every
        shard otherwise."""
        import gc
        if self._released:
            return
        self._released = True
        interp = self.interp
        interp.store.clear()
        interp.graphs.clear()
        interp.prepared.clear()
        interp.pool = None
        interp.post_later = None
        self.close_links()
        _unhold(self)
        gc.unfreeze()

    # interpreter thread ----------------------------------------------------------------------
    def _next_batch(self):
        with self._cv:
            self._busy = False
            while self._next_seq not in self._inbox and not self._stopping():
                self._cv.wait()
            if self._next_seq not in self._inbox:
                return _STOP
            item = self._inbox.pop(self._next_seq)
            self._next_seq += 1
            self._busy = True
            return item

    def _stopping(self) -> bool:
        """A close arrived and every batch it waits for has run (called holding ``_cv``)."""
        stop = self._inbox.get(-1)
        return stop is not None and (stop[1] is None or self._next_seq >= stop[1])

    def _run(self, master_addr, master_port, backend, timeout_s, num_threads,
             store_socket) -> None:
        import torch
        if num_threads:
            torch.set_num_threads(num_threads)
        try:
            if self.device.startswith("cuda"):
                torch.cuda.set_device(torch.device(self.device))
            self._join_world(master_addr, master_port, backend, timeout_s, store_socket)
        except Exception as exc:  # noqa: BLE001 - reported to the controller
            failure = self.interp._fail("init_process_group", exc).failure
            across_hosts = master_addr != self.ip
            self._init_error = failure._replace(message=(
                f"{failure.message} (this rank at {self.ip}, gloo interface "
                f"{os.environ.get('GLOO_SOCKET_IFNAME') or 'chosen by torch'}; rendezvous "
                f"store at {master_addr}:{master_port})" + (
                    ". Likely cause: a firewall between the hosts, or an interface that does "
                    "not carry the Dask worker's address" if across_hosts else "")))
        _freeze_heap()
        self._ready.set()
        try:
            while True:
                item = self._next_batch()
                if item is _STOP:
                    break
                self._run_batch(*item)
        except BaseException as exc:  # SystemExit from an op, or a bug: say so, then stop
            self._fatal = self.interp._fail("interpreter", exc).failure._replace(
                message=f"the rank's interpreter thread stopped: {type(exc).__name__}: {exc}")
            raise
        leave_world(self._world_group)
        if self._closing:  # a stop that close() stopped waiting for: release now
            self._release()

    def _join_world(self, master_addr, master_port, backend, timeout_s, store_socket) -> None:
        """init_process_group on this worker's own interface; rank 0's store serves on
        ``store_socket`` (bound to its Dask address, not to every interface)."""
        import torch.distributed as dist
        if dist.is_initialized():  # a world an earlier actor here could not close (lost peer)
            dist.destroy_process_group()
        bind_to_interface(self.ip, backend)
        timeout = timedelta(seconds=timeout_s)
        fd = store_socket.detach() if store_socket is not None else None  # the store's now
        store = dist.TCPStore(master_addr, master_port, self.world, self.rank == 0, timeout,
                              master_listen_fd=fd)
        dist.init_process_group(backend, store=store, rank=self.rank, world_size=self.world,
                                timeout=timeout)
        self._world_group = dist.group.WORLD

    def _run_batch(self, payload: bytes, staged: bytes | None) -> None:
        try:
            items = unpickle_segments(payload, self._interned)  # staged: a dict as sent
        except Exception as exc:  # noqa: BLE001 - the stream is broken from here on
            self._fatal = self.interp._fail("unpickling a batch", exc).failure
            return
        for item in items:
            if type(item) is not Run:
                self._run_one(item, staged)
            elif self._init_error is not None:  # no world: each instruction says so
                for instr in loads(self._interned[item.program].data, self._interned,
                                   item.ids):
                    self._run_one(instr, staged)
            else:
                try:
                    answers = self.interp.replay(item, staged, self._interned)
                except Exception as exc:  # noqa: BLE001 - a bug in replay: which of its
                    # instructions ran is unknown, so the stream cannot go on (health())
                    self._fatal = self.interp._fail("replaying a run", exc).failure
                    return
                for answer in answers:
                    self._post(*answer)

    def _run_one(self, instr, staged) -> None:
        if self._init_error is not None:
            answer = _failure_answer(instr, self._init_error)
        else:
            try:
                answer = self.interp.execute(instr, staged)
            except Exception as exc:  # noqa: BLE001 - a bug in the error path itself
                answer = _failure_answer(instr, self.interp._fail("interpreter",
                                                                      exc).failure)
        if answer is not None:
            self._post(*answer)

    def _group_of(self, ranks: tuple[int, ...]):
        return self._groups[tuple(sorted(ranks))]

    def _make_groups(self, groups, backend: str) -> None:
        """Create process groups in the given order (every rank calls this identically)."""
        import torch.distributed as dist
        for ranks in groups:
            key = tuple(sorted(ranks))
            if key not in self._groups:
                self._groups[key] = dist.new_group(list(key), backend=backend,
                                                   timeout=timedelta(seconds=self.timeout_s))


def _thread_cpu_s(thread: threading.Thread) -> float | None:
    """The CPU seconds ``thread`` has used (None where the platform cannot say)."""
    try:
        return time.clock_gettime(time.pthread_getcpuclockid(thread.ident))
    except (AttributeError, OSError, TypeError):
        return None


def _freeze_heap() -> None:
    """Move every object alive now (the worker's modules, Dask's and torch's state) out of
    the garbage collector's reach: a full collection then walks only what the rank made
    since, not ~200k startup objects (one took 230 ms of a 500 ms op chain, stalling every
    thread of the rank). What is frozen is never collected; it is what the process keeps.

    >>> import gc; _freeze_heap(); gc.get_freeze_count() > 0
    True
    >>> gc.unfreeze()  # what RankActor.close does
    """
    import gc
    gc.collect()
    gc.freeze()


def _failure_answer(instr, failure: RemoteFailure):
    """An instruction that could not run: a request (Fetch, Eager, Sync) still answers, with
    the failure, so nobody waits for it."""
    if isinstance(instr, m.Sync):
        return instr.req, ("ok", [failure])
    if getattr(instr, "req", None) is not None:
        return instr.req, ("err", failure)
    return None
