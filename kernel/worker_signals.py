"""Rank processes ignore SIGINT, so interrupting a cell does not kill the cluster.

Jupyter interrupts a kernel by sending SIGINT to the kernel's whole process group
(jupyter_client's local provisioner uses ``os.killpg``), and a terminal's Ctrl-C does the same
to its foreground group. The embedded cluster's worker processes are children of the kernel,
in that group: without this plugin every interrupt killed every rank (WorkerLostError on the
next cell). An interrupt is meant for the controller only; the ranks finish the stream they
were given, in order, and the controller decides what to wait for next. SIGTERM and SIGKILL
still stop the workers as before (kernel shutdown, ``dtorch.shutdown()``).

Registered by the kernel on every cluster it sees start::

    protect_from_interrupts(controller)
"""

from __future__ import annotations

import signal
import threading

from distributed.diagnostics.plugin import WorkerPlugin

PLUGIN_NAME = "dtorch-ignore-sigint"


class IgnoreInterrupts(WorkerPlugin):
    """Worker plugin: SIGINT is ignored in the worker process (set from its main thread, where
    the worker's event loop runs)."""

    idempotent = True
    name = PLUGIN_NAME

    def setup(self, worker) -> None:
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGINT, signal.SIG_IGN)


def sigint_handlers(client) -> dict:
    """``{worker address: repr of its SIGINT handler}`` (for tests and status)."""
    return client.run(lambda: repr(signal.getsignal(signal.SIGINT)))


def protect_from_interrupts(controller) -> None:
    """Make every worker of ``controller``'s cluster ignore SIGINT."""
    if controller.client is not None:
        controller.client.register_plugin(IgnoreInterrupts(), name=PLUGIN_NAME)
