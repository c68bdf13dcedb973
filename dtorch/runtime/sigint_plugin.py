"""The worker plugin that makes rank processes ignore SIGINT (see :mod:`.interrupts`).

Apart from ``interrupts.py`` so that the controller's side of the rule imports no Dask.
Example::

    protect_workers(client)   # every worker of the cluster, and any that joins later
"""

from __future__ import annotations

import signal
import threading

from distributed.diagnostics.plugin import WorkerPlugin

PLUGIN_NAME = "dtorch-ignore-sigint"


class IgnoreInterrupts(WorkerPlugin):
    """Worker plugin: the worker process ignores SIGINT (set from its main thread)."""

    idempotent = True
    name = PLUGIN_NAME

    def setup(self, worker) -> None:
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGINT, signal.SIG_IGN)


def protect_workers(client) -> None:
    """Make every worker of ``client``'s cluster (and any that joins later) ignore SIGINT."""
    client.register_plugin(IgnoreInterrupts(), name=PLUGIN_NAME)


def sigint_handlers(client) -> dict:
    """``{worker address: repr of its SIGINT handler}`` (for tests and status)."""
    return client.run(lambda: repr(signal.getsignal(signal.SIGINT)))
