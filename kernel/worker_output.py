"""Worker stdout/stderr in the notebook.

A Dask worker plugin replaces ``sys.stdout`` and ``sys.stderr`` in every rank's process with a
stream that sends whole lines, prefixed ``[rank r]``, as Dask events (``worker.log_event``)
to the controller's client; the kernel writes them to its own stdout/stderr, so they show in
the cell that is running. Prints from rank code, ``warnings`` and tracebacks printed on a rank
all arrive this way. Dask's own worker logging is not forwarded (it goes to the worker
process's inherited stderr, as before); records of the ``dtorch`` logger are
(``client.forward_logging``).

Events travel worker -> scheduler -> client, so at the end of a cell the kernel asks every
worker to send a marker behind what it already sent (:meth:`OutputForwarder.drain`) and waits
for the markers: output printed by the cell's work lands in that cell, not the next one.

Client side::

    fwd = OutputForwarder()
    fwd.attach(controller)      # subscribe, register the plugin on every worker
    ...
    fwd.drain(controller)       # after the cell's work finished
"""

from __future__ import annotations

import io
import logging
import sys
import threading
import uuid

from distributed.diagnostics.plugin import WorkerPlugin

OUTPUT_TOPIC = "dtorch-output"
MARK_TOPIC = "dtorch-output-mark"
PLUGIN_NAME = "dtorch-forward-output"


# --------------------------------------------------------------------------------------------
# worker side
# --------------------------------------------------------------------------------------------
class RemoteStream(io.TextIOBase):
    """A text stream that sends complete lines to the client as ``OUTPUT_TOPIC`` events."""

    def __init__(self, worker, fd: int, label: str, original):
        super().__init__()
        self.worker, self.fd, self.label, self.original = worker, fd, label, original
        self._buf = ""
        self._lock = threading.Lock()
        self._sending = threading.local()

    @property
    def encoding(self):
        return getattr(self.original, "encoding", "utf-8")

    def writable(self) -> bool:
        return True

    def isatty(self) -> bool:
        return False

    def fileno(self) -> int:
        return self.original.fileno()

    def write(self, s) -> int:
        if not isinstance(s, str):
            raise TypeError(f"write() argument must be str, not {type(s).__name__}")
        with self._lock:
            self._buf += s
            cut = self._buf.rfind("\n") + 1
            text, self._buf = self._buf[:cut], self._buf[cut:]
        if text:
            self._send(text)
        return len(s)

    def flush(self) -> None:
        with self._lock:
            text, self._buf = self._buf, ""
        if text:
            self._send(text)

    def _send(self, text: str) -> None:
        if getattr(self._sending, "on", False):  # a failure below printed something: drop it
            return
        self._sending.on = True
        try:
            lines = text.splitlines(keepends=True)
            self.worker.log_event(OUTPUT_TOPIC, {
                "text": "".join(self.label + line for line in lines), "fd": self.fd})
        except Exception:  # noqa: BLE001 - the worker is closing: print locally instead
            try:
                self.original.write(text)
            except Exception:  # noqa: BLE001
                pass
        finally:
            self._sending.on = False


class ForwardOutput(WorkerPlugin):
    """The worker plugin (pickled by reference: workers import it from ``dtorch_kernel``).
    ``ranks`` maps worker address to rank."""

    idempotent = False
    name = PLUGIN_NAME

    def __init__(self, ranks: dict[str, int]):
        self.ranks = dict(ranks)
        self._saved = None

    def setup(self, worker) -> None:
        rank = self.ranks.get(worker.address)
        label = f"[rank {rank}] " if rank is not None else f"[worker {worker.name}] "
        self._saved = (sys.stdout, sys.stderr)
        sys.stdout = RemoteStream(worker, 1, label, sys.stdout)
        sys.stderr = RemoteStream(worker, 2, label, sys.stderr)

    def teardown(self, worker) -> None:
        if self._saved is None:
            return
        for stream in (sys.stdout, sys.stderr):
            if isinstance(stream, RemoteStream):
                stream.flush()
        if isinstance(sys.stdout, RemoteStream):
            sys.stdout = self._saved[0]
        if isinstance(sys.stderr, RemoteStream):
            sys.stderr = self._saved[1]
        self._saved = None


def _mark(token: str, dask_worker=None) -> None:
    """Run on each worker (client.run): flush the streams, then send a marker event."""
    for stream in (sys.stdout, sys.stderr):
        if isinstance(stream, RemoteStream):
            stream.flush()
    dask_worker.log_event(MARK_TOPIC, {"token": token, "worker": dask_worker.address})


# --------------------------------------------------------------------------------------------
# client side
# --------------------------------------------------------------------------------------------
class OutputForwarder:
    """Subscribes the controller's Dask client to worker output and writes it locally."""

    def __init__(self, stdout=None, stderr=None):
        self._stdout, self._stderr = stdout, stderr
        self.parent = None  # the request (ipykernel message) output belongs to now
        self._client = None
        self._lock = threading.Lock()
        self._marks: dict[str, tuple[set, int, threading.Event]] = {}

    @property
    def attached(self) -> bool:
        return self._client is not None and getattr(self._client, "status", None) == "running"

    def attach(self, controller) -> None:
        """Forward the output of ``controller``'s ranks (called when a cluster is ready)."""
        client = controller.client
        if client is None or client is self._client:
            return
        client.subscribe_topic(OUTPUT_TOPIC, self._on_output)
        client.subscribe_topic(MARK_TOPIC, self._on_mark)
        client.register_plugin(ForwardOutput({i.address: i.rank for i in controller.ranks}),
                               name=PLUGIN_NAME)
        try:
            client.forward_logging("dtorch", level=logging.INFO)
        except Exception:  # noqa: BLE001 - logging forwarding is a nicety
            pass
        self._client = client

    def _on_output(self, event) -> None:
        _, msg = event
        if not isinstance(msg, dict):
            return
        if msg.get("fd") == 2:
            stream = self._stderr or sys.stderr
        else:
            stream = self._stdout or sys.stdout
        text = str(msg.get("text", ""))
        # This runs on the Dask client's event loop thread, whose context still names the
        # request that started the cluster (ipykernel keeps the parent in context variables),
        # so the text would be filed under that cell. Name the cell running now instead
        # (set by the kernel before each cell, from the main thread).
        parent = self.parent
        if parent and hasattr(stream, "set_thread_parent"):
            token = stream.set_thread_parent(parent)
            try:
                stream.write(text)
                stream.flush()
            finally:
                stream.reset_thread_parent(token)
        else:
            stream.write(text)
            stream.flush()

    def _on_mark(self, event) -> None:
        _, msg = event
        with self._lock:
            entry = self._marks.get(msg.get("token")) if isinstance(msg, dict) else None
            if entry is None:
                return
            seen, expected, done = entry
            seen.add(msg.get("worker"))
            if len(seen) >= expected:
                done.set()

    def drain(self, controller, timeout: float = 5.0) -> bool:
        """Wait until output the ranks printed so far has been written here. Returns False
        when a marker did not come back within ``timeout`` seconds (output may then show in a
        later cell)."""
        client = controller.client
        if client is None or client is not self._client:
            return False
        workers = [i.address for i in controller.ranks]
        token = uuid.uuid4().hex
        done = threading.Event()
        with self._lock:
            self._marks[token] = (set(), len(workers), done)
        try:
            client.run(_mark, token, workers=workers, wait=True)
            return done.wait(timeout)
        finally:
            with self._lock:
                self._marks.pop(token, None)
