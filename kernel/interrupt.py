"""Interrupts that never split a batch between ranks.

Jupyter interrupts a kernel with SIGINT, which Python turns into a KeyboardInterrupt at the
next bytecode, wherever the main thread is. Almost everywhere in dtorch that is harmless: a
wait for answers (``Controller.wait``) just stops waiting, the ranks go on executing the
stream in order, and the next request queues behind it. The one place it is not harmless is
``Controller.flush``, which hands the same numbered batch to every rank in a loop: stopped
half way, some ranks would get batch N and others never, and the next batch would wait
forever on those. :class:`InterruptGuard` holds a SIGINT that lands inside ``flush`` until the
batch has gone to every rank (the controller's lock is released), then delivers it.

It is installed around each cell (only while the default SIGINT handler is active, i.e. while
the kernel runs a synchronous cell in the main thread)::

    guard = InterruptGuard()
    guard.install()
    try:
        run_the_cell()
    finally:
        guard.uninstall()
"""

from __future__ import annotations

import _thread
import signal
import threading

REDELIVER_WAIT_S = 30.0  # a flush never holds its lock this long; deliver anyway after it


def _flush_code():
    from dtorch.runtime.controller import Controller
    return Controller.flush.__code__


def flush_frame(frame):
    """The frame of a ``Controller.flush`` call on ``frame``'s stack, or None."""
    code = _flush_code()
    while frame is not None:
        if frame.f_code is code:
            return frame
        frame = frame.f_back
    return None


class InterruptGuard:
    """A SIGINT handler: KeyboardInterrupt as usual, held while a batch is being sent."""

    def __init__(self):
        self._lock = threading.Lock()
        self._active = False
        self.deferred = 0  # interrupts held so far (for tests and %dtorch status)
        self.undelivered = False  # one was held and the cell ended before it was delivered

    def install(self) -> bool:
        """Install the handler if SIGINT currently raises KeyboardInterrupt (main thread)."""
        if threading.current_thread() is not threading.main_thread():
            return False
        if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
            return False
        with self._lock:
            self._active = True
            self.undelivered = False
        signal.signal(signal.SIGINT, self.handler)
        return True

    def uninstall(self) -> bool:
        """Put the default handler back. Returns True when an interrupt held during the cell
        was never delivered (the caller reports the cell as interrupted)."""
        with self._lock:
            was_active, self._active = self._active, False
            undelivered = self.undelivered
            self.undelivered = False
        if was_active and threading.current_thread() is threading.main_thread() and \
                signal.getsignal(signal.SIGINT) == self.handler:
            signal.signal(signal.SIGINT, signal.default_int_handler)
        return undelivered

    def handler(self, signum, frame):
        inside = flush_frame(frame)
        if inside is None:
            raise KeyboardInterrupt
        controller = inside.f_locals.get("self")
        lock = getattr(controller, "_lock", None)
        with self._lock:
            self.deferred += 1
            self.undelivered = True
        threading.Thread(target=self._redeliver, args=(lock,), daemon=True,
                         name="dtorch-interrupt").start()

    def _redeliver(self, lock) -> None:
        """Wait until the flush released the controller's lock, then interrupt again."""
        if lock is not None and lock.acquire(timeout=REDELIVER_WAIT_S):
            lock.release()
        with self._lock:
            if not (self._active and self.undelivered):
                return
            self.undelivered = False
            # A real signal to the main thread (not _thread.interrupt_main, which a blocking
            # call such as time.sleep would not notice until it returned).
            try:
                signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
            except (AttributeError, OSError):  # no pthread_kill on this platform
                _thread.interrupt_main(signal.SIGINT)
