"""Ctrl-C / a Jupyter interrupt is for the controller, never for the ranks.

Two rules keep the cluster consistent when the user interrupts:

- Rank processes ignore SIGINT (the worker plugin in :mod:`.sigint_plugin`). A terminal's Ctrl-C and Jupyter's interrupt go to the whole
  process group, which holds the embedded cluster's workers too; without this every interrupt
  killed every rank. (SIGTERM / SIGKILL still stop them.)
- A batch reaches every rank or none. ``Controller.flush`` hands the same numbered batch to each
  rank in a loop; a KeyboardInterrupt half way would leave some ranks waiting forever for a
  batch the others ran. :func:`interrupts_held` holds a SIGINT that lands in that loop and
  delivers it right after.

Example::

    with interrupts_held():
        for rank in ranks:
            send(rank, batch)
"""

from __future__ import annotations

import signal
import threading
from contextlib import contextmanager

@contextmanager
def interrupts_held():
    """Hold SIGINT for the duration of the block, then deliver it (main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: held.append(frame))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if held and callable(previous):
            previous(signal.SIGINT, held[-1])
        elif held and previous == signal.SIG_DFL:
            raise KeyboardInterrupt
