"""What the kernel does around every cell.

Before the cell (IPython's ``pre_run_cell`` event): open a :class:`dtorch.comm_debug.CommLedger`
for it. (A SIGINT never splits a batch between ranks: ``Controller.flush`` holds it until the
batch went to every rank, see :mod:`dtorch.runtime.interrupts`.)

After the cell (``post_run_cell``, which ipykernel triggers before it builds the reply):

1. ship pending instructions (``session.flush``) - never starting a cluster;
2. if the cell shipped work, wait until every rank ran it (``Controller.synchronize``); a
   failure on a rank becomes the cell's error: its traceback is the cell's error output and
   the execute reply has ``status: "error"``, exactly as if the cell had raised it;
3. wait until what the ranks printed meanwhile has arrived (worker output forwarding);
4. when the cell issued collectives or sent constants (plain tensors, see
   :mod:`dtorch.ops.constants`) and counts are on, display one summary of them
   (``text/plain`` line plus a small HTML table), before the error if there is one. Beside
   each kind and mesh dim: the cost model's predicted time (``dtorch.predict`` of the cell's
   records; the first prediction fits the links, a few seconds once per cluster) and the
   time the slowest rank spent in them (``rank_stats()["comm_seconds"]``, one more round
   trip). With counts off nothing is predicted or fetched: no cell waits for it.

A cell that shipped nothing (plain Python) never waits. An interrupted cell (KeyboardInterrupt)
is not waited for either: the ranks finish its work in the background, in order, and the next
cell that ships work waits for it too and reports its errors, saying they came from an
earlier cell. A KeyboardInterrupt during step 2 ends the wait the same way.
"""

from __future__ import annotations

import sys

from dtorch import comm_debug
from dtorch.errors import DTorchError
from dtorch.runtime import session

from .summary import CellTiming, summary_bundle, summary_metadata


def _running():
    return session._controller if session.is_running() else None


def _shipped(controller):
    """How many batches ``controller`` has shipped (None when it does not say)."""
    return getattr(controller, "flushes", None) if controller is not None else None


class CellReport:
    """The ``pre_run_cell`` / ``post_run_cell`` handlers of the dtorch kernel."""

    def __init__(self, shell, forwarder=None):
        self.shell = shell
        self.forwarder = forwarder
        self.counts_enabled = True
        self.last_records: list = []
        self.last_constants = (0, 0)  # (sends, bytes per rank) of the last cell's constants
        self._ledger: comm_debug.CommLedger | None = None
        self._before = (None, None)
        self._owed = False  # an interrupted cell shipped work nobody has waited for yet
        self.last_timing: CellTiming | None = None
        self._comm_base: tuple | None = None  # (controller, {rank: comm seconds}) or unknown

    # registration ---------------------------------------------------------------------------
    def register(self) -> None:
        self.shell.events.register("pre_run_cell", self.pre_run_cell)
        self.shell.events.register("post_run_cell", self.post_run_cell)

    def unregister(self) -> None:
        for event, fn in (("pre_run_cell", self.pre_run_cell),
                          ("post_run_cell", self.post_run_cell)):
            try:
                self.shell.events.unregister(event, fn)
            except ValueError:
                pass
        self._close_ledger()

    # handlers -------------------------------------------------------------------------------
    def pre_run_cell(self, info=None) -> None:
        self._close_ledger()
        self._ledger = comm_debug.CommLedger()
        comm_debug.listen(self._ledger)
        c = _running()
        self._before = (c, _shipped(c))
        if self.counts_enabled and c is not None and (self._comm_base is None or
                                                      self._comm_base[0] is not c):
            self._comm_base = (c, self._comm_seconds(c))
        if self.forwarder is not None:  # worker output arriving from now on is this cell's
            self.forwarder.parent = getattr(self.shell, "parent_header", None)

    def post_run_cell(self, result) -> None:
        ledger = self._close_ledger()
        records = list(ledger.records) if ledger is not None else []
        constants = (ledger.constant_sends, ledger.constant_bytes) if ledger is not None \
            else (0, 0)
        self.last_records, self.last_constants = records, constants
        error = self._finish_work(result)
        self.last_timing = None
        if records and self.counts_enabled and error is None and \
                not isinstance(error_of(result), KeyboardInterrupt):
            self.last_timing = self._timing(records)
        elif records:
            self._comm_base = None  # this cell's time was not read: the next cell starts anew
        if (records or constants[0]) and self.counts_enabled:
            self._display(records, constants, self.last_timing)
        if error is not None:
            self._set_cell_error(result, error)

    # steps ----------------------------------------------------------------------------------
    def _close_ledger(self):
        ledger, self._ledger = self._ledger, None
        if ledger is not None:
            comm_debug.unlisten(ledger)
        return ledger

    def _finish_work(self, result) -> BaseException | None:
        """Flush, wait for the cell's work and drain worker output; the error to report."""
        interrupted = isinstance(error_of(result), KeyboardInterrupt)
        owed = self._owed
        try:
            session.flush()
            c = _running()
            if c is None:
                return None
            before_c, before_seq = self._before
            shipped = c is not before_c or _shipped(c) is None or _shipped(c) != before_seq
            if interrupted:
                self._owed = self._owed or shipped
                return None
            if not shipped:  # nothing new: do not block a plain-Python cell on older work
                return None
            try:
                c.synchronize()
                self._owed = False
            finally:
                self._drain(c)
        except KeyboardInterrupt:
            self._owed = True
            if interrupted:
                return None
            return KeyboardInterrupt("interrupted while waiting for the ranks to finish this "
                                     "cell's work; they finish it in the background and the "
                                     "cluster stays usable")
        except DTorchError as exc:
            self._owed = False
            if owed:
                _add_note(exc, "dtorch: this error comes from work issued by an earlier, "
                               "interrupted cell")
            return exc
        except Exception as exc:  # noqa: BLE001 - never lose an error silently
            return exc
        return None

    def _timing(self, records) -> CellTiming | None:
        """The cell's predicted and measured communication time (after its work ran)."""
        c = _running()
        if c is None:
            return None
        from dtorch.runtime import links
        try:
            prediction = links.predict(records)
        except Exception:  # noqa: BLE001 - a dry run, a broken world: show what is known
            prediction = None
        now = self._comm_seconds(c)
        if self._comm_base is not None and self._comm_base[0] is c:
            base = self._comm_base[1]
        else:  # a world started in this cell counts from zero; otherwise unknown
            base = {} if self._before[0] is not c else None
        measured = {}
        if now is not None and base is not None:
            measured = links.comm_delta(base, now)[1]
        self._comm_base = (c, now) if now is not None else None
        return CellTiming.of(records, prediction, measured)

    @staticmethod
    def _comm_seconds(c):
        """Each rank's cumulative ``comm_seconds`` (None when they could not be read)."""
        from dtorch.runtime import links
        try:
            return links.comm_seconds_by_rank(c)
        except Exception:  # noqa: BLE001 - a dry run or a lost rank: no measured time
            return None

    def _drain(self, controller) -> None:
        if self.forwarder is None:
            return
        try:
            self.forwarder.drain(controller)
        except Exception:  # noqa: BLE001 - output forwarding is best effort
            pass

    def _display(self, records, constants=(0, 0), timing=None) -> None:
        from IPython.display import display
        try:
            display(summary_bundle(records, constants=constants, timing=timing), raw=True,
                    metadata=summary_metadata(records, constants, timing))
        except Exception:  # noqa: BLE001
            pass

    def _set_cell_error(self, result, error: BaseException) -> None:
        """Show ``error`` as this cell's error and make the execute reply an error."""
        earlier = error_of(result)
        if earlier is not None:  # the cell failed already: add, do not replace
            if not _same_failure(earlier, error):
                print(f"dtorch: the ranks also reported: {type(error).__name__}: {error}",
                      file=sys.stderr)
            return
        # No local traceback: the message carries the remote one; kernel frames are noise.
        self.shell.showtraceback((type(error), error, None))
        if result is not None:
            result.error_in_exec = error
        self.shell.last_execution_succeeded = False


def error_of(result):
    if result is None:
        return None
    return result.error_before_exec if result.error_before_exec is not None \
        else result.error_in_exec


def _same_failure(a: BaseException, b: BaseException) -> bool:
    """Whether ``b`` (from the end-of-cell wait) reports the failure the cell already raised
    as ``a`` (reading a failed tensor raises it in the cell; the wait reports it again)."""
    fa, fb = getattr(a, "failure", None), getattr(b, "failure", None)
    if fa is not None and fb is not None and (fa.rank, fa.op, fa.message) == \
            (fb.rank, fb.op, fb.message):
        return True
    first = str(b).splitlines()[0] if str(b) else ""
    return bool(first) and first in str(a)


def _add_note(exc: BaseException, note: str) -> None:
    if hasattr(exc, "add_note"):
        exc.add_note(note)
    else:  # Python < 3.11
        exc.args = ((str(exc.args[0]) if exc.args else "") + "\n" + note,) + exc.args[1:]
