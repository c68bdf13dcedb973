"""Starting or joining the Dask cluster and placing one rank actor on each worker.

One Dask worker is one rank. Ranks are given to workers in sorted address order, rank 0's
host runs the torch.distributed rendezvous. Example::

    client, cluster = start_local_cluster(4)
    ranks = place_rank_actors(client, "gloo", timeout_s=60, seed=0)
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import sys
import time
from contextlib import contextmanager

from ..errors import ClusterError
from .channel import TOKEN_BYTES
from .rank_info import RankInfo  # noqa: F401 - re-exported
from .sigint_plugin import protect_workers


def free_port() -> int:
    """A TCP port free on this machine now."""
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _progress(message: str) -> None:
    print(f"dtorch: {message}", file=sys.stderr, flush=True)


@contextmanager
def main_module_hidden():
    """Start worker processes without re-running the user's script in them.

    multiprocessing's spawn re-imports ``__main__`` from its file in every child, so a script
    without an ``if __name__ == "__main__":`` guard would run again in each worker. Workers
    never need the user's script, so hide it while they start (Jupyter has none anyway).
    """
    main = sys.modules.get("__main__")
    saved = {k: main.__dict__[k] for k in ("__file__", "__spec__") if main and k in main.__dict__}
    try:
        if main is not None:
            main.__dict__.pop("__file__", None)
            main.__dict__["__spec__"] = None
        yield
    finally:
        if main is not None:
            main.__dict__.update(saved)


# How each local rank's worker process ended, by its Dask address (filled by RankNanny, which
# runs in the controller's process for a local cluster): WorkerLostError says why a rank died.
_EXIT_CODES: dict[str, int] = {}


def exit_reason(address: str, wait_s: float = 0.0) -> str | None:
    """Why the local worker at ``address`` ended, in words, or None when unknown (a remote
    cluster's Nanny is not in this process; the worker still runs). ``wait_s`` gives the
    Nanny that long to reap a process that just died.

    >>> _EXIT_CODES["tcp://127.0.0.1:1"] = -9
    >>> exit_reason("tcp://127.0.0.1:1")
    'its process was killed by SIGKILL (signal 9: out of memory, or killed by hand)'
    >>> exit_reason("tcp://127.0.0.1:2") is None
    True
    """
    import signal
    deadline = time.monotonic() + wait_s
    while address not in _EXIT_CODES and time.monotonic() < deadline:
        time.sleep(0.02)
    code = _EXIT_CODES.get(address)
    if code is None:
        return None
    if code >= 0:
        return (f"its process exited with code {code}" + (
            " (the worker closed itself: it lost the scheduler, or was closed by hand)"
            if code == 0 else ""))
    try:
        name = signal.Signals(-code).name
    except ValueError:
        name = f"signal {-code}"
    hint = {"SIGKILL": "out of memory, or killed by hand",
            "SIGABRT": "a C++ abort in torch or gloo: see the worker's stderr",
            "SIGSEGV": "a crash in native code: see the worker's stderr"}.get(name)
    return f"its process was killed by {name} (signal {-code}{': ' + hint if hint else ''})"


def _rank_nanny_class():
    from distributed import Nanny
    from distributed.core import Status

    class RankNanny(Nanny):
        """A Nanny that does not bring a dead rank back: its shards and its place in the
        torch.distributed world are gone, so dtorch reports the loss and restart() starts a
        fresh world instead. It records how the worker ended (``exit_reason``)."""

        async def _on_worker_exit(self, exitcode):
            if self.worker_address and exitcode is not None:
                _EXIT_CODES[self.worker_address] = exitcode
            if self.status in (Status.running, Status.starting):
                try:
                    await self._unregister()
                except OSError:
                    pass
                await self.close(reason="dtorch-rank-exited")

    return RankNanny


# glibc settings for the rank processes. Dask's default MALLOC_TRIM_THRESHOLD_=65536 turns off
# glibc's adaptive mmap threshold, so every buffer over 128 KB is a fresh mmap that page-faults:
# gloo's per-call temporaries made collectives 2-3x slower. glibc's defaults do better (tried:
# MALLOC_MMAP_MAX_=0 with no trimming was slower again at 16 MB). A value set in the
# environment wins.
_WORKER_MALLOC = {"MALLOC_TRIM_THRESHOLD_": None}

# Dask's periodic housekeeping, slowed down for rank processes. A rank spends its time in
# collectives; on a small machine every wake-up of the sampling profiler (every 10 ms), the
# event-loop tick (20 ms), the system monitor (500 ms) and the Nanny's memory check (100 ms)
# takes a core from gloo: measured 10-15% on 16 MB collectives with 4 ranks on 2 cores.
# dtorch does not use the profiles; memory limits are still enforced, once a second.
_QUIET_WORKERS = {"distributed.worker.profile.enabled": False,
                  "distributed.admin.tick.interval": "1s",
                  "distributed.admin.system-monitor.interval": "2s",
                  "distributed.worker.memory.monitor-interval": "1s"}


_ALIASES = {"world_size": "n_workers", "num_workers": "n_workers", "nprocs": "n_workers",
            "nproc_per_node": "n_workers", "device": "device_type", "backend": "device_type"}


def check_dask_kwargs(dask_kwargs: dict, remote: bool) -> None:
    """Raise ``TypeError`` on the controller for a keyword ``dtorch.init`` would pass on to
    Dask but Dask does not take (a local cluster: LocalCluster's, the Nanny's and the
    Worker's; an ``address``: the Client's), before anything starts.

    >>> try:
    ...     check_dask_kwargs({"world_size": 4}, remote=False)
    ... except TypeError as e:
    ...     print(str(e).split(";")[0])
    dtorch.init() got an unexpected keyword argument 'world_size' (did you mean n_workers=?)
    """
    import difflib
    import inspect
    from distributed import Client, LocalCluster, Nanny, Worker
    accepted = {"n_workers", "address", "device_type", "dry_run"}
    if remote:
        inits = [Client.__init__]
    else:  # LocalCluster's own; the rest reach the workers (Server's too, through the MRO)
        worker_class = dask_kwargs.get("worker_class")
        classes = (Nanny, Worker) + ((worker_class,) if isinstance(worker_class, type) else ())
        inits = [LocalCluster.__init__] + [c.__init__ for cls in classes for c in cls.__mro__
                                           if "__init__" in vars(c) and c is not object]
    for init in inits:
        accepted |= {n for n, p in inspect.signature(init).parameters.items()
                     if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL) and n != "self"}
    for key in dask_kwargs:
        if key in accepted:
            continue
        guess = _ALIASES.get(key) or next(iter(difflib.get_close_matches(key, accepted, 1)), None)
        hint = f" (did you mean {guess}=?)" if guess else ""
        raise TypeError(f"dtorch.init() got an unexpected keyword argument {key!r}{hint}; "
                        f"besides n_workers, address, device_type and dry_run it takes the "
                        f"keywords of Dask's {'Client' if remote else 'LocalCluster and Worker'}")


def local_security(security=None):
    """The embedded cluster's Dask security: mutual TLS with certificates made now and kept
    in memory (``None`` or ``True``, the default), none (``False``: plain TCP, any local
    process can connect), or the ``distributed.security.Security`` given."""
    from distributed.security import Security
    if security is None or security is True:
        try:
            return Security.temporary()
        except ImportError as exc:
            raise ClusterError("the embedded cluster uses TLS by default and needs the "
                               "`cryptography` package for its certificates: pip install "
                               "cryptography, or dtorch.init(security=False) for plain TCP "
                               "(any process on this host can then connect)") from exc
    if security is False:
        return None
    if not isinstance(security, Security):
        raise ClusterError(f"security must be True, False or a distributed.security.Security; "
                           f"got {type(security).__name__}")
    return security


def start_local_cluster(n_workers: int, **dask_kwargs):
    """A LocalCluster of ``n_workers`` processes with one thread each, on 127.0.0.1, whose
    scheduler, workers and client authenticate each other with TLS (``local_security``)."""
    import dask
    from distributed import Client, LocalCluster
    security = local_security(dask_kwargs.pop("security", None))
    options = dict(n_workers=n_workers, threads_per_worker=1, processes=True,
                   host="127.0.0.1", dashboard_address="127.0.0.1:0",
                   silence_logs=logging.WARNING, worker_class=_rank_nanny_class())
    if security is not None:
        options["security"] = security
    options.update(dask_kwargs)
    # Dask's MALLOC_TRIM_THRESHOLD_ for workers makes glibc map every large buffer afresh:
    # gloo's per-call temporaries then page-fault and collectives run 2-3x slower.
    spawn_env = {**_WORKER_MALLOC, **{k: os.environ[k] for k in _WORKER_MALLOC
                                      if k in os.environ}}
    settings = {f"distributed.nanny.pre-spawn-environ.{k}": v for k, v in spawn_env.items()}
    settings["distributed.nanny.environ.THP_MEM_ALLOC_ENABLE"] = \
        os.environ.get("THP_MEM_ALLOC_ENABLE", "1")
    settings.update({k: v for k, v in _QUIET_WORKERS.items() if not _user_set(k)})
    before = {k: os.environ.get(k) for k in spawn_env}
    with main_module_hidden(), dask.config.set(settings):
        cluster = LocalCluster(**options)
    for k, v in before.items():  # the Nanny writes its spawn environment into this process too
        if v is None:
            os.environ.pop(k, None)
    client = Client(cluster, set_as_default=False, direct_to_workers=True,
                    security=cluster.security)
    for address in client.scheduler_info(n_workers=-1)["workers"]:
        _EXIT_CODES.pop(address, None)  # an address an earlier cluster's worker had
    protect_workers(client)  # Ctrl-C in the controller's terminal must not kill the ranks
    return client, cluster


def _user_set(key: str) -> bool:
    """Whether the user configured ``key`` away from Dask's default (then it is kept)."""
    import dask
    from distributed import config as _  # noqa: F401 - loads distributed's defaults
    defaults = {}
    for d in dask.config.defaults:
        dask.config.update(defaults, d)
    return dask.config.get(key, None) != dask.config.get(key, None, config=defaults)


def connect(address: str, **dask_kwargs):
    """A client of an existing Dask scheduler (``dask scheduler`` / dask-jobqueue / ...)."""
    from distributed import Client
    if address.startswith("tls://") and not _has_certificates(dask_kwargs.get("security")):
        raise ClusterError(f"{address} speaks TLS: pass its certificates, e.g. dtorch.init("
                           f"address={address!r}, security=distributed.security.Security("
                           f"tls_ca_file='ca.pem', tls_client_cert='cert.pem', "
                           f"tls_client_key='key.pem', require_encryption=True))")
    if dask_kwargs.get("security") in (None, False):  # Dask's configured default: plain TCP
        dask_kwargs.pop("security", None)            # unless its config names certificates
    try:
        dask_kwargs.setdefault("direct_to_workers", True)
        return Client(address, set_as_default=False, timeout=dask_kwargs.pop("timeout", 30),
                      **dask_kwargs)
    except OSError as exc:
        raise ClusterError(f"cannot reach a Dask scheduler at {address!r}: {exc}. Start one with "
                           f"`dask scheduler` and workers with `dask worker {address}`") from exc


def _has_certificates(security) -> bool:
    """Whether a client with ``security`` (None: Dask's configuration) has TLS certificates."""
    from distributed.security import Security
    if not isinstance(security, Security):
        security = Security()  # what Dask's configuration names, if anything
    return bool(security.get_tls_config_for_role("client").get("ca_file"))


def worker_addresses(client, expected: int | None = None, wait_s: float = 60.0) -> list[str]:
    """Sorted worker addresses; waits up to ``wait_s`` for ``expected`` workers."""
    deadline = time.monotonic() + wait_s
    while True:
        workers = sorted(client.scheduler_info(n_workers=-1)["workers"])
        if expected is None and workers or expected is not None and len(workers) >= expected:
            return workers
        if time.monotonic() > deadline:
            raise ClusterError(f"the Dask cluster has {len(workers)} workers after {wait_s:.0f}s; "
                               f"expected {expected or 'at least one'}")
        time.sleep(0.1)


def _host(address: str) -> str:
    return address.split("://")[-1].rsplit(":", 1)[0]


def place_rank_actors(client, backend: str, timeout_s: float, seed: int,
                      workers: list[str] | None = None, num_threads: int | None = None,
                      fanout: int = 0) -> list[RankInfo]:
    """Create one RankActor per worker and wait until the torch.distributed world is up.

    Every rank first connects once to rank 0's store socket and to every other host
    (network.check_world_connects), so a world that cannot connect fails in seconds."""
    from .network import check_world_connects, probe_timeout
    from .worker import RankActor
    workers = workers or worker_addresses(client)
    world = len(workers)
    holder = controller_name()
    check_workers_free(client, workers, holder)
    key = f"dtorch-store-{time.time_ns()}"
    token = secrets.token_bytes(TOKEN_BYTES)
    master, port = check_world_connects(client, workers, key, probe_timeout(timeout_s))
    devices = _devices(workers, backend)
    try:
        futures = [client.submit(RankActor, rank, world, master, port, backend, timeout_s,
                                 seed, num_threads, devices[rank], key if rank == 0 else None,
                                 channel_token=token, fanout=fanout, holder=holder,
                                 actor=True, workers=[addr], allow_other_workers=False,
                                 pure=False, key=f"dtorch-rank-{rank}-{time.time_ns()}")
                   for rank, addr in enumerate(workers)]
        actors = [f.result(timeout=120) for f in futures]
    except BaseException:  # rank 0's actor never took its store socket: close it
        _close_store_socket(client, workers[0], key)
        raise
    ranks = [RankInfo(r, a, _host(a), actor, fut, devices[r], token=token)
             for r, (a, actor, fut) in enumerate(zip(workers, actors, futures))]
    with client.as_current():  # binds each actor handle to this (non-default) client
        readies = [ri.actor.ready() for ri in ranks]
        channels = [ri.actor.channel_address() for ri in ranks]
    _raise_unless_ready(readies, timeout_s + 30)
    return [ri._replace(channel=tuple(c.result(timeout=30))) for ri, c in zip(ranks, channels)]


def controller_name() -> str:
    """How workers name this controller to another one: ``pid 123 on host``."""
    return f"pid {os.getpid()} on {socket.gethostname()}"


def check_workers_free(client, workers: list[str], holder: str) -> None:
    """ClusterError, before anything starts, when another controller's ranks run on any of
    ``workers`` (this controller's own earlier world may be ending there: that is fine)."""
    from .worker import holder_of
    held = {w: h for w, h in client.run(holder_of, workers=workers).items()
            if h is not None and h["holder"] != holder}
    if not held:
        return
    who = sorted({h["holder"] for h in held.values()})
    since = min(h["since"] for h in held.values())
    raise ClusterError(
        f"{len(held)} of the {len(workers)} workers already run ranks of another dtorch "
        f"controller ({', '.join(who)}, since {time.strftime('%H:%M:%S', time.localtime(since))}"
        f"): {', '.join(sorted(held))}. One controller drives a set of workers at a time: give "
        f"this one its own workers (another `dask worker` set, or dtorch.init() without an "
        f"address for an embedded cluster), or end the other (dtorch.shutdown() there, or "
        f"restart its kernel). A controller that died releases its workers within ~30 s, or "
        f"DTORCH_COLLECTIVE_TIMEOUT + 30 s when a rank was inside a collective; if they stay "
        f"held, restart the workers (Client(address).restart(), or restart `dask worker`)")


def _close_store_socket(client, worker: str, key: str) -> None:
    """Close the store socket ``check_world_connects`` left in ``worker`` (a no-op once rank
    0's actor took it); a failure here must not hide the one being raised."""
    try:  # not waited on: an unresponsive worker must not hang the error path
        client.run(_close_listener, key, workers=[worker], wait=False)
    except Exception:  # noqa: BLE001 - the worker may be gone: its socket went with it
        pass


async def _close_listener(key: str) -> None:
    """``network.close_listener`` as a coroutine (Dask runs only those without waiting)."""
    from .network import close_listener
    close_listener(key)


def _raise_unless_ready(readies: list, wait_s: float) -> None:
    """ClusterError naming the ranks whose process group failed or did not start in time."""
    deadline = time.monotonic() + wait_s
    failures, silent = [], []
    for rank, ready in enumerate(readies):
        try:
            failure = ready.result(timeout=max(0.1, deadline - time.monotonic()))
        except TimeoutError:
            silent.append(rank)
            continue
        if failure:
            failures.append(failure)
    if failures or silent:
        lines = [f"rank {f.rank}: {f.message}" for f in failures]
        if silent:
            lines.append(f"ranks {silent}: still starting after {wait_s:.0f} s "
                         "(DTORCH_COLLECTIVE_TIMEOUT + 30 s)")
        raise ClusterError("torch.distributed could not start on every rank:\n" +
                           "\n".join(lines))


def _devices(workers: list[str], backend: str) -> list[str]:
    """``cpu`` for gloo; for nccl, the i-th worker on a host drives that host's GPU i."""
    if backend != "nccl":
        return ["cpu"] * len(workers)
    seen: dict[str, int] = {}
    out = []
    for addr in workers:
        host = _host(addr)
        out.append(f"cuda:{seen.get(host, 0)}")
        seen[host] = seen.get(host, 0) + 1
    return out


def local_threads(n_workers: int) -> int:
    """Torch threads per rank so local ranks do not oversubscribe the machine's cores."""
    return max(1, (os.cpu_count() or 1) // max(1, n_workers))
