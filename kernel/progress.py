"""The cluster start-up progress display.

The cluster starts lazily, inside the first cell that needs it, and that takes seconds
(worker processes import torch). :class:`StartupProgress` is a
``dtorch.runtime.session.start_hooks`` hook: on "starting" it displays a line with an
indeterminate progress bar and the elapsed time (updated in place, by display id, every
``tick_s``), and on "ready" / "failed" it replaces it with the outcome::

    dtorch: starting 4 local workers ... 3 s
    dtorch: 4 ranks ready in 4.6 s (gloo, cpu)
"""

from __future__ import annotations

import threading
import time
from html import escape


def _bundle(text: str, busy: bool = False, color: str = "#333") -> dict:
    bar = ('<progress style="width:8em;height:0.9em;vertical-align:middle;'
           'margin-right:0.6em"></progress>' if busy else "")
    html = (f'<div style="font-family:monospace;font-size:12px;color:{color}">{bar}'
            f'{escape(text)}</div>')
    return {"text/plain": text, "text/html": html}


def starting_text(info: dict, elapsed: float) -> str:
    """``dtorch: starting 4 local workers ... 3 s`` (or joining a scheduler).

    >>> starting_text({"n_workers": 2, "address": None, "device_type": "cpu"}, 3.2)
    'dtorch: starting 2 local workers ... 3 s'
    >>> starting_text({"n_workers": None, "address": "tcp://h:8786"}, 0)
    'dtorch: joining the Dask scheduler at tcp://h:8786 ... 0 s'
    """
    if info.get("address"):
        what = f"joining the Dask scheduler at {info['address']}"
    else:
        n = info.get("n_workers")
        if n is None:
            from dtorch import config
            n = config.default_workers() if (info.get("device_type") or "cpu") == "cpu" else "GPU"
        what = f"starting {n} local workers"
    return f"dtorch: {what} ... {elapsed:.0f} s"


def ready_text(controller, seconds: float) -> str:
    """``dtorch: 4 ranks ready in 4.6 s (gloo, cpu)`` plus the dashboard link when there is
    one."""
    text = (f"dtorch: {controller.world} ranks ready in {seconds:.1f} s "
            f"({controller.backend}, {controller.device_type})")
    link = None
    if getattr(controller, "cluster", None) is not None:
        link = getattr(controller.client, "dashboard_link", None)
    return text + (f", dashboard {link}" if link else "")


class StartupProgress:
    """Shows cluster start-up in the running cell (a session start hook)."""

    def __init__(self, tick_s: float = 1.0):
        self.tick_s = tick_s
        self._handle = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __call__(self, event: str, info: dict) -> None:
        if event == "starting":
            self._start(info)
        elif event == "ready":
            self._finish(_bundle(ready_text(info["controller"], info.get("seconds", 0.0))))
        elif event == "failed":
            err = info.get("error")
            what = "interrupted" if isinstance(err, KeyboardInterrupt) else \
                f"failed: {type(err).__name__}: {err}"
            self._finish(_bundle(f"dtorch: cluster start {what}", color="#a33"))

    def _start(self, info: dict) -> None:
        from IPython.display import display
        self._stop_ticker()
        began = time.monotonic()
        self._handle = display(_bundle(starting_text(info, 0), busy=True), raw=True,
                               display_id=True)
        if self._handle is None or self.tick_s <= 0:
            return
        self._stop = threading.Event()

        def tick(handle=self._handle, stop=self._stop):
            while not stop.wait(self.tick_s):
                try:
                    handle.update(_bundle(starting_text(info, time.monotonic() - began),
                                          busy=True), raw=True)
                except Exception:  # noqa: BLE001 - the display is best effort
                    return

        self._thread = threading.Thread(target=tick, daemon=True, name="dtorch-progress")
        self._thread.start()

    def _stop_ticker(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
            self._thread = None

    def _finish(self, bundle: dict) -> None:
        self._stop_ticker()
        handle, self._handle = self._handle, None
        if handle is not None:
            handle.update(bundle, raw=True)
