"""Wires the kernel's pieces into an IPython shell (``%load_ext dtorch_kernel`` does this too).

- a :class:`~dtorch_kernel.cell_report.CellReport` on ``pre_run_cell`` / ``post_run_cell``;
- the ``%dtorch`` magics;
- a session start hook: the start-up progress display, then, once the ranks are up, rank
  processes that ignore SIGINT and forward their output (done at once for a cluster that is
  already running).
"""

from __future__ import annotations

import sys

from dtorch.runtime import session

from .cell_report import CellReport
from .magics import DTorchMagics
from .progress import StartupProgress


class KernelState:
    """Everything one shell got from :func:`load_ipython_extension`."""

    def __init__(self, shell):
        from .worker_output import OutputForwarder
        self.shell = shell
        self.forwarder = OutputForwarder()
        self.progress = StartupProgress()
        self.report = CellReport(shell, self.forwarder)
        self.magics = DTorchMagics(shell, self.report)

    def start_hook(self, event: str, info: dict) -> None:
        self.progress(event, info)
        if event == "ready":
            self.attach(info["controller"])

    def attach(self, controller) -> None:
        """Ranks forward their output to the cell (they already ignore SIGINT: the runtime
        protects every embedded cluster's workers)."""
        for step in (self.forwarder.attach,):
            try:
                step(controller)
            except Exception as exc:  # noqa: BLE001 - the cluster works without them
                print(f"dtorch: could not set up the workers ({step.__name__}): "
                      f"{type(exc).__name__}: {exc}", file=sys.stderr)

    def load(self) -> None:
        self.report.register()
        self.shell.register_magics(self.magics)
        session.start_hooks.append(self.start_hook)
        if session.is_running():
            self.attach(session._controller)

    def unload(self) -> None:
        self.report.unregister()
        if self.start_hook in session.start_hooks:
            session.start_hooks.remove(self.start_hook)


def load_ipython_extension(shell) -> KernelState:
    state = getattr(shell, "_dtorch_state", None)
    if state is None:
        state = KernelState(shell)
        state.load()
        shell._dtorch_state = state
    return state


def last_cell_records(shell=None) -> list | None:
    """The CommRecords of the last cell that finished in ``shell`` (default: the running
    IPython shell), or None where the dtorch kernel (or ``%load_ext dtorch_kernel``) is not
    running. Called from a cell, that is the previous cell."""
    if shell is None:
        from IPython import get_ipython
        shell = get_ipython()
    state = getattr(shell, "_dtorch_state", None)
    return None if state is None else list(state.report.last_records)


def unload_ipython_extension(shell) -> None:
    state = getattr(shell, "_dtorch_state", None)
    if state is not None:
        state.unload()
        shell._dtorch_state = None
