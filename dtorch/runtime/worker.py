"""The rank runtime: a Dask actor hosting one rank's interpreter thread.

Dask delivers actor calls concurrently and possibly out of order, so batches carry sequence
numbers and the interpreter thread executes them strictly in order. The actor's methods are
``async`` (they run on the worker's event loop and never wait for the interpreter), so a batch
can always be delivered while the interpreter is busy in a collective. Example (controller)::

    actor = client.submit(RankActor, rank, world, addr, port, "gloo", actor=True,
                          workers=[worker_address]).result()
    actor.submit(0, (definitions, segments), None)   # see batches.py
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from datetime import timedelta

from . import messages as m
from .batches import unpickle_segments
from .interpreter import Interpreter, RemoteFailure
from .network import bind_to_interface, take_listener, worker_ip

_STOP = object()


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


class RankActor:
    """One rank: joins the torch.distributed world, then runs batches in sequence order."""

    store_address: tuple = ("", 0)  # rank 0's rendezvous store (declared: Dask's Actor proxy
    #                                 reads only attributes its class has)

    def __init__(self, rank: int, world: int, master_addr: str, master_port: int,
                 backend: str = "gloo", timeout_s: float = 60.0, seed: int = 0,
                 num_threads: int | None = None, device: str = "cpu",
                 store_key: str | None = None):
        from distributed import get_worker
        self.rank, self.world = rank, world
        self.ip = worker_ip(get_worker().address)  # torch.distributed binds to this address
        self.store_address = (master_addr, master_port)  # rank 0's rendezvous store
        self.timeout_s = timeout_s
        self._inbox: dict[int, tuple] = {}
        self._next_seq = 0
        self._interned: dict = {}  # meshes, rank tuples and steps the controller sent by id
        self._cv = threading.Condition()
        self._lock = threading.Lock()
        self._answers: dict[int, object] = {}
        self._waiters: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Future]] = {}
        self._init_error: RemoteFailure | None = None
        self._fatal: RemoteFailure | None = None  # the interpreter cannot go on (health())
        self._closing = False
        self._ready = threading.Event()
        self._busy = True  # the interpreter thread is starting or running a batch
        self.inline_batches = 0  # quick batches run on the event loop
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

    # called by the controller (event loop; never blocks) ---------------------------------------
    async def submit(self, seq: int, payload: tuple, staged: dict | None = None,
                     answer: int | None = None, quick: bool = False):
        """Queue batch ``seq``; with ``answer``, also wait for and return that request's
        answer (a Fetch or Sync inside this batch). A ``quick`` batch (only reads and frees)
        that is next in line while the interpreter is idle runs right here instead."""
        with self._cv:
            if quick and seq == self._next_seq and not self._busy and not self._inbox:
                self._next_seq += 1
                self.inline_batches += 1
                self._run_batch(payload, staged)
            else:
                self._inbox[seq] = (payload, staged)
                self._cv.notify()
        if answer is not None:
            return await self.answer(answer)

    async def answer(self, req: int):
        """The answer to request ``req`` (a Fetch or a Sync), once the interpreter reaches it."""
        with self._lock:
            if req in self._answers:
                return self._answers.pop(req)
            loop = asyncio.get_running_loop()
            fut = loop.create_future()
            self._waiters[req] = (loop, fut)
        return await fut

    async def ready(self) -> RemoteFailure | None:
        """Wait until the process group is up; returns the init error, if any."""
        await asyncio.get_running_loop().run_in_executor(None, self._ready.wait)
        return self._init_error

    async def health(self) -> dict:
        """Whether the interpreter thread is serving: ``alive``, the instruction it is in and
        for how many seconds (``current``, ``busy_s``), and a ``fatal`` failure that stopped
        it (the controller raises it, naming this rank)."""
        current = self.interp.current
        fatal = self._fatal
        if fatal is None and not self._thread.is_alive() and not self._closing:
            fatal = RemoteFailure(self.rank, "interpreter", "the rank's interpreter thread "
                                  "stopped", "")
        return {"alive": self._thread.is_alive(), "fatal": fatal,
                "current": current[0] if current else None,
                "busy_s": time.monotonic() - current[1] if current else 0.0}

    async def stats(self) -> dict:
        out = self.interp.stats()
        out["pending_batches"] = len(self._inbox)
        out["next_seq"] = self._next_seq
        out["inline_batches"] = self.inline_batches
        current = self.interp.current
        out["running"] = current[0] if current else None  # the instruction it is in, if any
        try:
            import psutil
            out["rss"] = psutil.Process().memory_info().rss
        except ImportError:  # pragma: no cover - psutil comes with distributed
            out["rss"] = None
        return out

    async def close(self) -> None:
        self._closing = True
        with self._cv:
            self._inbox[-1] = _STOP
            self._cv.notify()
        await asyncio.get_running_loop().run_in_executor(None, self._thread.join, 30)

    # interpreter thread ----------------------------------------------------------------------
    def _post(self, req: int, answer) -> None:
        with self._lock:
            waiter = self._waiters.pop(req, None)
            if waiter is None:
                self._answers[req] = answer
        if waiter is not None:
            loop, fut = waiter
            loop.call_soon_threadsafe(lambda: fut.done() or fut.set_result(answer))

    def _next_batch(self):
        with self._cv:
            self._busy = False
            while self._next_seq not in self._inbox and -1 not in self._inbox:
                self._cv.wait()
            if -1 in self._inbox and self._next_seq not in self._inbox:
                return _STOP
            item = self._inbox.pop(self._next_seq)
            self._next_seq += 1
            self._busy = True
            return item

    def _run(self, master_addr, master_port, backend, timeout_s, num_threads,
             store_socket) -> None:
        import torch
        import torch.distributed as dist
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
            instructions = unpickle_segments(payload, self._interned)  # staged: a dict as sent
        except Exception as exc:  # noqa: BLE001 - the stream is broken from here on
            self._fatal = self.interp._fail("unpickling a batch", exc).failure
            return
        for instr in instructions:
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


def _failure_answer(instr, failure: RemoteFailure):
    """An instruction that could not run: a request (Fetch, Eager, Sync) still answers, with
    the failure, so nobody waits for it."""
    if isinstance(instr, m.Sync):
        return instr.req, ("ok", [failure])
    if getattr(instr, "req", None) is not None:
        return instr.req, ("err", failure)
    return None
