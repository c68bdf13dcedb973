"""CommView: counts and bytes of collectives per kind and mesh dim, and their timeline.

Takes the records of a cell or of a ``CommDebugMode`` block (a list of CommRecords, a
CommLedger, or the mode itself); ``CommView()`` with no argument shows the previous cell's
collectives in the dtorch kernel (:func:`dtorch_kernel.last_cell_records`), and elsewhere an
empty view saying what to pass. An ``ipywidgets.VBox`` of a mesh-dim filter, the table from
:func:`dtorch_widgets.comm_picture.comm_table_html` and a matplotlib timeline shown as a PNG image.
Example::

    >>> from dtorch.comm_debug import CommRecord
    >>> recs = [CommRecord("all_gather", 0, "dp", ((0, 2), (1, 3)), 32),
    ...         CommRecord("all_reduce", 1, "tp", ((0, 1), (2, 3)), 64, "sum")]
    >>> v = CommView(recs)
    >>> v.counts, v.rows
    ({'all_gather': 1, 'all_reduce': 1}, [('all_gather', 'dp', 1, 32, 128), ('all_reduce', 'tp', 1, 64, 256)])
    >>> v.select_dim("tp").counts
    {'all_reduce': 1}
    >>> CommView().note.startswith("CommView() shows the previous cell's")  # no kernel here
    True
"""

from __future__ import annotations

import io
from html import escape

import ipywidgets as W

from . import svg as S
from .display import StaticFallback, type_name
from .comm_picture import comm_html, comm_rows, comm_table_html, kind_color, record_dim

ALL = "all"
LAST_CELL = "Collectives of the previous cell"
NO_CELLS = ("CommView() shows the previous cell's collectives in the dtorch kernel; here there "
            "are no cells. Pass records: with dtorch.CommDebugMode() as mode: ... then "
            "CommView(mode)")


def last_cell() -> tuple[list, str]:
    """``(records, note)``: the previous cell's records in the dtorch kernel, else
    ``([], NO_CELLS)``."""
    from dtorch_kernel import last_cell_records
    records = last_cell_records()
    if records is None:
        return [], NO_CELLS
    return records, "the previous cell ran no collectives"


def checked_records(source) -> list:
    """The CommRecords of ``source`` (a list, a CommLedger or a CommDebugMode); TypeError for
    anything else."""
    records = getattr(source, "records", source)
    if not isinstance(records, (list, tuple)) or not all(
            hasattr(r, "kind") and hasattr(r, "bytes_per_rank") for r in records):
        raise TypeError(f"CommView takes a dtorch.CommDebugMode, a CommLedger or a list of "
                        f"CommRecords (or nothing: the previous cell's); got {type_name(source)}")
    return list(records)


class CommView(StaticFallback, W.VBox):
    """Interactive view of collectives ``records`` (None: the previous cell's); ``title``
    names the cell or block; ``note`` is what an empty view says."""

    def __init__(self, records=None, title=None, **kwargs):
        if records is None:
            self.all_records, self.note = last_cell()
            title = title or LAST_CELL
        else:
            self.all_records, self.note = checked_records(records), None
        self.title = title or "Collectives"
        dims = []
        for rec in self.all_records:
            if record_dim(rec) not in dims:
                dims.append(record_dim(rec))
        self.dim_buttons = W.ToggleButtons(options=[ALL] + dims, value=ALL,
                                           description="mesh dim:", style={"button_width": "auto"})
        self.header = W.HTML()
        self.table = W.HTML()
        self.timeline = W.Image(format="png")
        super().__init__(children=[self.dim_buttons, self.header, self.table, self.timeline],
                         **kwargs)
        self._redraw()
        self.dim_buttons.observe(self._on_change, names="value")

    # state ----------------------------------------------------------------------------------
    @property
    def selected_dim(self) -> str | None:
        """The mesh dim shown (by name, or index as text), or None for all."""
        v = self.dim_buttons.value
        return None if v == ALL else v

    @property
    def records(self) -> list:
        """The records shown: all, or those along the selected mesh dim."""
        d = self.selected_dim
        return [r for r in self.all_records if d is None or record_dim(r) == d]

    @property
    def rows(self) -> list[tuple[str, str, int, int, int]]:
        """``(kind, mesh dim, count, bytes per rank, total bytes)`` per kind and mesh dim."""
        return comm_rows(self.records)

    @property
    def counts(self) -> dict[str, int]:
        """``{kind: count}`` of the records shown (like ``CommDebugMode.get_comm_counts``)."""
        out: dict[str, int] = {}
        for r in self.records:
            out[r.kind] = out.get(r.kind, 0) + 1
        return out

    @property
    def total_bytes(self) -> int:
        """Bytes all ranks put into the collectives shown."""
        return sum(r.total_bytes for r in self.records)

    def select_dim(self, dim: str | None) -> "CommView":
        """Show only the collectives along mesh dim ``dim`` (None: all). Returns self."""
        self.dim_buttons.value = ALL if dim is None else str(dim)
        return self

    # drawing --------------------------------------------------------------------------------
    def timeline_figure(self):
        """A matplotlib Figure: one bar per collective in issue order, height = bytes per
        rank, colour = kind (at most ``svg.MAX_TIMELINE`` bars)."""
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch
        from matplotlib.ticker import MaxNLocator

        recs = self.records
        shown = recs[:S.MAX_TIMELINE]
        fig = Figure(figsize=(6.4, 2.2), dpi=80)
        ax = fig.add_subplot()
        ax.bar(range(len(shown)), [r.bytes_per_rank for r in shown],
               color=[kind_color(r.kind) for r in shown], width=0.8)
        kinds = list(dict.fromkeys(r.kind for r in shown))
        if kinds:
            ax.legend(handles=[Patch(color=kind_color(k), label=k) for k in kinds],
                      fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)
        more = f" (first {len(shown)} of {len(recs)})" if len(recs) > len(shown) else ""
        ax.set_title(f"collectives in issue order{more}", fontsize=9)
        ax.set_xlabel("#", fontsize=8)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # collective numbers, not 0.25
        ax.set_ylabel("bytes per rank", fontsize=8)
        ax.tick_params(labelsize=7)
        fig.tight_layout()
        return fig

    def timeline_png(self) -> bytes:
        """The timeline figure as PNG bytes."""
        buf = io.BytesIO()
        self.timeline_figure().savefig(buf, format="png")
        return buf.getvalue()

    def static_html(self) -> str:
        """Table and timeline of the records shown, as static HTML (also put in the widget's
        mime bundle)."""
        return comm_html(self.records, self.title, note=self.note)

    @property
    def html(self) -> str:
        """The header and table currently shown (the timeline is an image)."""
        return self.header.value + self.table.value

    def _on_change(self, change) -> None:
        self._redraw()

    def _redraw(self) -> None:
        recs = self.records
        self.header.value = (f"<b>{escape(self.title)}</b> · {len(recs)} collective"
                             f"{'s' if len(recs) != 1 else ''}")
        if recs:
            self.table.value = comm_table_html(recs)
            self.timeline.value = self.timeline_png()
            self.timeline.layout.display = None
        else:
            self.table.value = S.note(self.note or "no collectives")
            self.timeline.value = b""
            self.timeline.layout.display = "none"
