"""Where a rank's torch.distributed traffic goes, and a check that every rank can reach it.

Left alone, gloo binds to the address the host name resolves to: 127.0.0.1 on a default
Debian or Ubuntu install, which peers on other hosts cannot reach. So each rank binds gloo
(and NCCL) to the interface that carries its Dask worker's own address, and rank 0's
rendezvous store listens on that address; ``GLOO_SOCKET_IFNAME`` / ``NCCL_SOCKET_IFNAME``
set by the user still win. Before any process group starts, every rank opens one TCP
connection to rank 0's store socket and to a listener on every other host, so a world that
cannot connect fails in seconds with the rank, the address and the port it could not reach.
Example::

    >>> interface_of("127.0.0.1")
    'lo'
    >>> worker_ip("tcp://10.251.0.2:40001")
    '10.251.0.2'
"""

from __future__ import annotations

import asyncio
import ipaddress
import os
import socket

from ..errors import ClusterError

# The environment variables that pick torch.distributed's interface, per backend (an NCCL
# world still builds gloo groups for CPU work).
IFNAME_VARIABLES = {"gloo": ("GLOO_SOCKET_IFNAME",),
                    "nccl": ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")}
_set_here: dict[str, str] = {}   # the values this process set (any other value is the user's)
_listeners: dict[str, socket.socket] = {}  # open listening sockets, by the world's key


def worker_ip(address: str) -> str:
    """The IP address of a Dask address (``tcp://host:port``), its host name resolved."""
    from distributed.comm import get_address_host
    host = get_address_host(address)
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        return socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)[0][4][0]


def is_loopback(ip: str) -> bool:
    return ipaddress.ip_address(ip).is_loopback


def interface_of(ip: str) -> str | None:
    """The name of the network interface that carries ``ip`` on this host, if any."""
    import psutil
    for name, addresses in psutil.net_if_addrs().items():
        if any(a.address.split("%")[0] == ip for a in addresses
               if a.family in (socket.AF_INET, socket.AF_INET6)):
            return name
    return None


def bind_to_interface(ip: str, backend: str) -> str | None:
    """Point gloo (and, for nccl, NCCL) at the interface carrying ``ip``, unless the user set
    the variable; returns the gloo interface in effect (None: torch's own choice)."""
    iface = interface_of(ip)
    for var in IFNAME_VARIABLES.get(backend, IFNAME_VARIABLES["gloo"]):
        current = os.environ.get(var)
        if current is not None and _set_here.get(var) != current:
            continue  # the user's choice
        if iface is None:
            os.environ.pop(var, None)
            _set_here.pop(var, None)
        else:
            os.environ[var] = _set_here[var] = iface
    return os.environ.get("GLOO_SOCKET_IFNAME")


def addresses_of(iface: str) -> list[str]:
    """The IP addresses interface ``iface`` carries on this host ([] if there is none)."""
    import psutil
    return [a.address.split("%")[0] for a in psutil.net_if_addrs().get(iface, [])
            if a.family in (socket.AF_INET, socket.AF_INET6)]


# run on the workers (Client.run) ------------------------------------------------------------
def gloo_binding(dask_worker=None) -> tuple[str, str | None, list[str]]:
    """Where gloo will bind on this worker, and who chose: ``("GLOO_SOCKET_IFNAME", name,
    its addresses)`` when the user set it, ``("dask", name, ...)`` for the interface carrying
    the Dask address, else ``("hostname", host name, [what it resolves to])``."""
    user = os.environ.get("GLOO_SOCKET_IFNAME")
    if user is not None and _set_here.get("GLOO_SOCKET_IFNAME") != user:
        return "GLOO_SOCKET_IFNAME", user, [a for i in user.split(",") for a in addresses_of(i)]
    iface = interface_of(worker_ip(dask_worker.address))
    if iface is not None:
        return "dask", iface, addresses_of(iface)
    name = socket.gethostname()
    try:
        return "hostname", name, [socket.gethostbyname(name)]
    except OSError:
        return "hostname", name, []


def listen_on(ip: str) -> socket.socket:
    """A listening socket on ``ip`` at a free port (IPv4 or IPv6)."""
    return socket.create_server((ip, 0), family=socket.AF_INET6 if ":" in ip else
                                socket.AF_INET, backlog=128)


def open_listener(key: str, dask_worker=None) -> tuple[str, int]:
    """Listen on this worker's own address at a free port, kept under ``key``; (ip, port)."""
    ip = worker_ip(dask_worker.address)
    sock = _listeners[key] = listen_on(ip)
    return ip, sock.getsockname()[1]


def take_listener(key: str) -> socket.socket | None:
    """The socket ``open_listener`` kept under ``key`` (now the caller's), or None."""
    return _listeners.pop(key, None)


def close_listener(key: str) -> None:
    sock = _listeners.pop(key, None)
    if sock is not None:
        sock.close()


async def unreachable(targets: list[tuple[str, str, int]], timeout_s: float) -> list[tuple]:
    """The targets ``(what, ip, port)`` this worker cannot open a TCP connection to, each with
    why (``(what, ip, port, reason)``); all tried at once, each for ``timeout_s`` at most."""
    async def attempt(what: str, ip: str, port: int):
        try:
            _, writer = await asyncio.wait_for(asyncio.open_connection(ip, port), timeout_s)
        except asyncio.TimeoutError:
            return what, ip, port, f"no answer within {timeout_s:g} s"
        except OSError as exc:
            return what, ip, port, exc.strerror or str(exc)
        writer.close()
        return None
    return [r for r in await asyncio.gather(*(attempt(*t) for t in targets)) if r]


# on the controller ---------------------------------------------------------------------------
def probe_timeout(collective_timeout_s: float) -> float:
    """How long one probe connection may take: 5 s, less for a short collective timeout."""
    return max(0.5, min(5.0, collective_timeout_s / 4))


def check_world_connects(client, workers: list[str], key: str, timeout_s: float
                         ) -> tuple[str, int]:
    """Open rank 0's rendezvous store socket (kept in its worker under ``key``) and a probe
    listener on every other host, have every rank connect to each, and raise ClusterError
    naming who cannot reach what (a world on one host is not probed). Before that, a rank
    whose gloo would bind to loopback only (a user's GLOO_SOCKET_IFNAME, a host name that
    resolves to 127.0.0.1) is refused with the cause. Returns the store's (ip, port).

    ``workers`` are in rank order; ``timeout_s`` bounds each connection attempt.
    """
    ips = [worker_ip(w) for w in workers]
    refuse_mixed_loopback(workers, ips)
    first_on_host: dict[str, int] = {}
    for rank, ip in enumerate(ips):
        first_on_host.setdefault(ip, rank)
    hosts = [workers[r] for r in first_on_host.values()]
    if len(hosts) > 1:
        bindings = client.run(gloo_binding, workers=workers)
        refuse_loopback_binding(workers, ips, [bindings[w] for w in workers])
    opened = client.run(open_listener, key, workers=hosts)
    if len(hosts) == 1:  # one host (the embedded cluster): its own address always answers
        return opened[workers[0]]
    try:
        targets = [(_what(rank), *opened[workers[rank]]) for rank in first_on_host.values()]
        reports = client.run(unreachable, targets, timeout_s, workers=workers)
    finally:
        if hosts[1:]:  # (no workers= would mean all of them) rank 0 keeps the store socket
            client.run(close_listener, key, workers=hosts[1:])
    failures = [(rank, *f) for rank, w in enumerate(workers) for f in reports.get(w, [])]
    if failures:
        client.run(close_listener, key, workers=hosts[:1])
        raise ClusterError(unreachable_message(workers, failures, timeout_s))
    return opened[workers[0]]


def _what(rank: int) -> str:
    return ("rank 0's rendezvous store" if rank == 0 else
            f"rank {rank}'s host, a free port as gloo's connections use")


def unreachable_message(workers: list[str], failures: list[tuple], timeout_s: float) -> str:
    """Which rank could not reach which address and port, why, and what to do."""
    lines = [f"  rank {rank} (Dask worker {workers[rank]}) -> {ip}:{port} ({what}): {why}"
             for rank, what, ip, port, why in failures[:12]]
    if len(failures) > 12:
        lines.append(f"  ... and {len(failures) - 12} more")
    silent = any(why.startswith("no answer") for *_, why in failures)
    cause = ("a firewall between the hosts dropping the connections (no answer)" if silent else
             "a firewall refusing the connections, or no route between the hosts")
    return ("torch.distributed cannot start: some ranks cannot open a TCP connection to "
            f"another host (each tried for {timeout_s:g} s before any process group):\n"
            + "\n".join(lines) +
            f"\nLikely cause: {cause}. Every rank must reach rank 0's store port and any TCP "
            "port on every other rank's host at its Dask worker's address. Open them, then "
            "call dtorch.restart().")


def refuse_mixed_loopback(workers: list[str], ips: list[str]) -> None:
    """A world with loopback workers and workers on other hosts cannot connect: say why."""
    loop = [r for r, ip in enumerate(ips) if is_loopback(ip)]
    if loop and len(loop) < len(ips):
        other = [r for r in range(len(ips)) if r not in loop]
        raise ClusterError(
            f"ranks {loop} have loopback Dask addresses ({workers[loop[0]]}) while ranks "
            f"{other} are on other hosts ({workers[other[0]]}), which cannot reach them. "
            "Their host name probably resolves to loopback (the default on Debian and Ubuntu) "
            "or the worker was started with --host localhost: start `dask worker` with "
            "--host <the host's address> or --interface <name>")


def refuse_loopback_binding(workers: list[str], ips: list[str], bindings: list[tuple]) -> None:
    """In a world across hosts, a rank whose gloo would bind to loopback only (or to nothing)
    cannot be reached: raise ClusterError naming the rank, the interface and what chose it."""
    lines = []
    for rank, (chose, name, addresses) in enumerate(bindings):
        if addresses and not all(is_loopback(a) for a in addresses):
            continue
        where = f"rank {rank} (Dask worker {workers[rank]})"
        if chose == "GLOO_SOCKET_IFNAME":
            has = f"only loopback addresses {addresses}" if addresses else "no address here"
            lines.append(f"  {where}: GLOO_SOCKET_IFNAME={name} in its environment names an "
                         f"interface with {has}. Unset it (dtorch then binds to the "
                         f"interface carrying {ips[rank]}) or name that interface")
        else:
            lines.append(f"  {where}: no interface carries its Dask address {ips[rank]}, and "
                         f"its host name {name!r} resolves to {addresses or 'nothing'} (a "
                         f"loopback address, the Debian and Ubuntu default). Start `dask "
                         f"worker` with --host <this host's address> or set "
                         f"GLOO_SOCKET_IFNAME on it")
    if lines:
        raise ClusterError("torch.distributed cannot start: in a world across hosts these ranks "
                           "would listen where their peers cannot reach them:\n" +
                           "\n".join(lines))
