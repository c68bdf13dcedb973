"""TensorFuture: a value on its way back from the ranks.

``x.to_torch_async()`` returns one at once; ``get()`` waits and returns the torch.Tensor, and
``await fut`` works in Jupyter's top-level await. Example::

    fut = x.to_torch_async()
    fut.add_done_callback(lambda f: print(f.get().shape))
    value = await fut
"""

from __future__ import annotations

import asyncio
import threading


class TensorFuture:
    """Answers from some ranks plus how to assemble them into one tensor."""

    def __init__(self, controller, answers: dict, assemble, cleanup=None):
        self._controller = controller
        self._answers = answers
        self._assemble = assemble
        self._cleanup = cleanup
        self._lock = threading.Lock()
        self._done = False
        self._value = None
        self._error: BaseException | None = None
        self._concurrent = None

    def is_ready(self) -> bool:
        """True once every rank has answered (``get()`` will not wait)."""
        return self._done or all(f.done() for f in self._answers.values())

    def get(self, timeout: float | None = None):
        """The value as a torch.Tensor; raises the remote error if its computation failed."""
        with self._lock:
            if not self._done:
                try:
                    answers = self._controller.wait(self._answers, timeout)
                    self._value = self._assemble(answers)
                except TimeoutError:
                    raise  # not done: a later get() waits again
                except Exception as exc:  # noqa: BLE001 - kept and re-raised on every get
                    self._error = exc
                # a KeyboardInterrupt propagates without marking the future done
                self._done = True
                if self._cleanup is not None:
                    self._cleanup()
        if self._error is not None:
            raise self._error
        return self._value

    result = get

    def wait(self, timeout: float | None = None) -> "TensorFuture":
        """Block until the value is ready (or ``timeout`` seconds pass: TimeoutError)."""
        try:
            self.get(timeout)
        except TimeoutError:
            raise
        except Exception:  # noqa: BLE001 - wait() only waits; get() raises the error
            pass
        return self

    def _as_concurrent(self):
        with self._lock:
            if self._concurrent is None:
                self._concurrent = self._controller.submit_background(self.wait)
        return self._concurrent

    def add_done_callback(self, fn) -> None:
        """Call ``fn(self)`` from a background thread once the value is ready."""
        self._as_concurrent().add_done_callback(lambda _: fn(self))

    def __await__(self):
        return self._await().__await__()

    async def _await(self):
        await asyncio.wrap_future(self._as_concurrent())
        return self.get()

    def __repr__(self) -> str:
        state = "ready" if self.is_ready() else "pending"
        return f"<TensorFuture {state}>"
