"""Hosts made of Linux network namespaces on a private bridge, running `dask worker`.

The bridge (10.251.0.1/24) stays in this namespace, where the `dask scheduler` and the
controller (the test process) run; each host is a namespace with one veth on the bridge and
its own address, running ``dask worker --nthreads 1`` with no interface hint in its
environment. Needs root and ``ip``. ``close()`` removes everything; leftovers of a killed run
(namespaces, the bridge, the processes in PIDFILE) are removed when the next one starts.
Traffic goes only to these addresses. Example::

    with NamespaceHosts(hosts=2, workers_per_host=2) as hosts:
        dtorch.init(address=hosts.scheduler_address, n_workers=4)
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PREFIX = "dtmn"  # every namespace and link made here starts with it
BRIDGE = f"{PREFIX}-br"
SUBNET = "10.251.0"
PIDFILE = Path(tempfile.gettempdir()) / f"{PREFIX}-pids.json"
HINTS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "TP_SOCKET_IFNAME",
         "DASK_DISTRIBUTED__WORKER__INTERFACE")
BIN = Path(sys.executable).parent


def unavailable_reason() -> str | None:
    """Why namespace hosts cannot be built here (None: they can)."""
    if sys.platform != "linux":
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is not installed"
    probe = f"{PREFIX}-probe"
    for make, undo in ((("netns", "add", probe), ("netns", "del", probe)),
                       (("link", "add", probe, "type", "bridge"), ("link", "del", probe))):
        made = _ip(*make, check=False)
        _ip(*undo, check=False)
        if made.returncode != 0:
            return f"`ip {' '.join(make)}` fails here: {made.stderr.strip()}"
    return None


def _ip(*args: str, netns: str | None = None, check: bool = True):
    cmd = ["ip", "netns", "exec", netns, "ip", *args] if netns else ["ip", *args]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    if check and out.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed: {out.stderr.strip()}")
    return out


class NamespaceHosts:
    """``hosts`` namespaces ``dtmn-h0``, ``dtmn-h1``, ... at 10.251.0.2, .3, ..., each running
    ``workers_per_host`` Dask workers, and a scheduler at 10.251.0.1."""

    def __init__(self, hosts: int = 2, workers_per_host: int = 2):
        self.names = [f"{PREFIX}-h{i}" for i in range(hosts)]
        self.ips = [f"{SUBNET}.{i + 2}" for i in range(hosts)]
        self.workers_per_host = workers_per_host
        self.scheduler_ip = f"{SUBNET}.1"
        self.scheduler_address: str | None = None
        self.logs = Path(tempfile.mkdtemp(prefix=f"{PREFIX}-logs-"))
        self._procs: list[subprocess.Popen] = []
        self._cuts: list[tuple[str, str]] = []

    def __enter__(self) -> "NamespaceHosts":
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def start(self) -> None:
        remove_leftovers()
        self._network()
        self._scheduler()
        for name in self.names:
            self._workers(name)

    def interface(self, host: int) -> str:
        """The name of host ``host``'s interface on the bridge (inside its namespace)."""
        return f"{self.names[host]}-in"

    def _network(self) -> None:
        _ip("link", "add", BRIDGE, "type", "bridge")
        _ip("addr", "add", f"{self.scheduler_ip}/24", "dev", BRIDGE)
        _ip("link", "set", BRIDGE, "up")
        for i, (name, ip) in enumerate(zip(self.names, self.ips)):
            _ip("netns", "add", name)
            outside, inside = f"{name}-br", self.interface(i)
            _ip("link", "add", outside, "type", "veth", "peer", "name", inside)
            _ip("link", "set", inside, "netns", name)
            _ip("link", "set", outside, "master", BRIDGE, "up")
            _ip("addr", "add", f"{ip}/24", "dev", inside, netns=name)
            _ip("link", "set", inside, "up", netns=name)
            _ip("link", "set", "lo", "up", netns=name)

    def _spawn(self, cmd: list[str], log_name: str) -> subprocess.Popen:
        env = {k: v for k, v in os.environ.items() if k not in HINTS}
        log = open(self.logs / log_name, "wb")
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
        log.close()
        self._procs.append(proc)
        PIDFILE.write_text(json.dumps([p.pid for p in self._procs]))
        return proc

    def _scheduler(self) -> None:
        file = self.logs / "scheduler.json"
        proc = self._spawn([str(BIN / "dask"), "scheduler", "--host", self.scheduler_ip,
                            "--port", "0", "--no-dashboard", "--scheduler-file", str(file)],
                           "scheduler.log")
        deadline = time.monotonic() + 60
        while not file.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("dask scheduler did not start:\n" + self.log("scheduler"))
            time.sleep(0.2)
        self.scheduler_address = json.loads(file.read_text())["address"]

    def _workers(self, name: str) -> None:
        self._spawn(["ip", "netns", "exec", name, str(BIN / "dask"), "worker",
                     self.scheduler_address, "--nworkers", str(self.workers_per_host),
                     "--nthreads", "1", "--no-dashboard"], f"{name}.log")

    def log(self, name: str) -> str:
        """The last lines a process wrote (``scheduler`` or a host's namespace name)."""
        path = self.logs / f"{name}.log"
        return path.read_text(errors="replace")[-4000:] if path.exists() else ""

    def wait_for_workers(self, client, n: int, gone: tuple = (), wait_s: float = 90) -> list:
        """The scheduler's worker addresses once it has ``n`` and none of ``gone``."""
        deadline = time.monotonic() + wait_s
        while True:
            workers = sorted(client.scheduler_info(n_workers=-1)["workers"])
            if len(workers) == n and not set(gone) & set(workers):
                return workers
            if time.monotonic() > deadline:
                raise RuntimeError(f"{len(workers)} of {n} workers after {wait_s} s:\n" +
                                   "\n".join(self.log(h) for h in self.names))
            time.sleep(0.2)

    def cut(self, quiet_host: int, cut_off: int) -> None:
        """Host ``quiet_host`` silently drops everything it would send to host ``cut_off``
        (a blackhole route, standing in for a firewall that drops packets): the cut-off
        host's connections to it get no answer. The scheduler still reaches both."""
        args = ("route", "add", "blackhole", f"{self.ips[cut_off]}/32")
        _ip(*args, netns=self.names[quiet_host])
        self._cuts.append((self.names[quiet_host], self.ips[cut_off]))

    def mend(self) -> None:
        """Undo every ``cut``."""
        while self._cuts:
            name, ip = self._cuts.pop()
            _ip("route", "del", "blackhole", f"{ip}/32", netns=name, check=False)

    def close(self) -> None:
        """Stop the processes, then remove the namespaces and the bridge."""
        for proc in reversed(self._procs):
            _signal_group(proc.pid, signal.SIGTERM)
        for proc in self._procs:
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                _signal_group(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
        self._procs.clear()
        remove_leftovers()


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)  # each was started in a session (and process group) of its own
    except (ProcessLookupError, PermissionError):
        pass


def remove_leftovers() -> None:
    """Remove what an earlier (maybe killed) run left: processes listed in PIDFILE that are
    still dask processes, processes inside our namespaces, the namespaces, the bridge."""
    if PIDFILE.exists():
        for pid in json.loads(PIDFILE.read_text() or "[]"):
            if _is_dask_process(pid):
                _signal_group(pid, signal.SIGKILL)
        PIDFILE.unlink()
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True,
                            timeout=30).stdout.split()
    for name in (n for n in listed if n.startswith(f"{PREFIX}-")):
        pids = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True,
                              timeout=30).stdout.split()
        for pid in pids:
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass
        _wait_gone([int(p) for p in pids], wait_s=10)
        _ip("netns", "del", name, check=False)
    _ip("link", "del", BRIDGE, check=False)


def _is_dask_process(pid: int) -> bool:
    try:
        return b"dask" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def _wait_gone(pids: list[int], wait_s: float) -> None:
    deadline = time.monotonic() + wait_s
    while any(Path(f"/proc/{p}").exists() for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
