"""``%dtorch``: cluster status, restart, shutdown, and the per-cell collective display.

::

    %dtorch status        # ranks, workers, backend, dashboard, live DTensors, per-rank stats
    %dtorch restart       # a fresh world (DTensors made before are gone)
    %dtorch shutdown      # stop the cluster; the next DTensor op starts a new one
    %dtorch counts on     # show each cell's collectives (the default)
    %dtorch counts off
    %dtorch explain       # the last cell's collectives by what issued them: predicted, measured
    %dtorch help

``%dtorch status`` never starts a cluster.
"""

from __future__ import annotations

from html import escape

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_magic, magics_class

from dtorch import config
from dtorch.runtime import session

from .summary import fmt_bytes

USAGE = "usage: %dtorch [status | restart | shutdown | counts [on|off] | explain | help]"


def status_lines(counts_enabled: bool = True, stats: bool = True) -> list[str]:
    """The text of ``%dtorch status`` (``stats`` asks every rank for its store and counts)."""
    counts = f"per-cell collective summary: {'on' if counts_enabled else 'off'}"
    if not session.is_running():
        return [f"dtorch: no cluster running; the first DTensor op starts "
                f"{config.default_workers()} local workers (DTORCH_WORKERS)", counts]
    info = session.cluster_info()
    kind = "embedded LocalCluster" if info["embedded"] else f"Dask scheduler {info['scheduler']}"
    lines = [f"dtorch: {info['ranks']} ranks running ({info['backend']}, {info['device_type']}, "
             f"{kind})",
             f"scheduler: {info['scheduler']}"]
    if info.get("dashboard"):
        lines.append(f"dashboard: {info['dashboard']}")
    lines += [f"live DTensors: {info['live_tensors']}", counts]
    per_rank = {}
    if stats:
        try:
            per_rank = {s["rank"]: s for s in session.get_controller().stats()}
        except Exception as exc:  # noqa: BLE001 - status must still show what it can
            lines.append(f"(ranks did not report stats: {type(exc).__name__}: {exc})")
    for rank, address in sorted(info["workers"].items()):
        s = per_rank.get(rank)
        extra = ""
        if s is not None:
            ran = ", ".join(f"{k} {v}" for k, v in sorted(s.get("counts", {}).items())) or "none"
            extra = (f"  tensors {s.get('tensors', '?')}  {fmt_bytes(s.get('bytes', 0))}  "
                     f"collectives run: {ran}")
        lines.append(f"  rank {rank}: {address}{extra}")
    return lines


def status_bundle(counts_enabled: bool = True, stats: bool = True) -> dict:
    lines = status_lines(counts_enabled, stats)
    html = ('<pre style="font-size:12px;margin:0">' + "\n".join(escape(x) for x in lines)
            + "</pre>")
    return {"text/plain": "\n".join(lines), "text/html": html}


@magics_class
class DTorchMagics(Magics):
    def _explain(self) -> list[str]:
        """``%dtorch explain``'s lines for the last cell that ran collectives."""
        from .explain import explain_lines
        records = self.report.last_records
        prediction = None
        if records and session.is_running():
            from dtorch.runtime import links
            try:
                prediction = links.predict(records)
            except Exception:  # noqa: BLE001 - a dry run: no prediction, the rest stands
                prediction = None
        timing = self.report.last_timing
        return explain_lines(records, prediction, timing.measured if timing else {})

    """The ``%dtorch`` line magic; ``report`` is the kernel's CellReport."""

    def __init__(self, shell, report):
        super().__init__(shell)
        self.report = report

    @line_magic
    def dtorch(self, line: str = ""):
        """%dtorch [status | restart | shutdown | counts [on|off] | explain | help]"""
        args = line.split()
        cmd = args[0].lower() if args else "status"
        if cmd == "status" and len(args) <= 1:
            from IPython.display import display
            display(status_bundle(self.report.counts_enabled), raw=True)
        elif cmd == "restart" and len(args) == 1:
            c = session.restart()
            print(f"dtorch: restarted: {c.world} ranks ready (DTensors made before are gone)")
        elif cmd == "shutdown" and len(args) == 1:
            was = session.is_running()
            session.shutdown()
            print("dtorch: cluster shut down; the next DTensor op starts a new one" if was
                  else "dtorch: no cluster was running")
        elif cmd == "counts" and len(args) <= 2:
            if len(args) == 2:
                if args[1].lower() not in ("on", "off"):
                    raise UsageError(USAGE)
                self.report.counts_enabled = args[1].lower() == "on"
                self.report._comm_base = None  # measured time restarts from the next cell
            state = "on" if self.report.counts_enabled else "off"
            print(f"dtorch: per-cell collective summary {state}")
        elif cmd == "explain" and len(args) == 1:
            print("\n".join(self._explain()))
        elif cmd in ("help", "-h", "--help"):
            print(__doc__.strip())
        else:
            raise UsageError(USAGE)
