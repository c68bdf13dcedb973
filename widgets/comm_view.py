"""CommView: counts and bytes of collectives per kind and mesh dim, and their timeline.

Takes the records of a cell or of a ``CommDebugMode`` block (a list of CommRecords, a
CommLedger, or the mode itself). An ``ipywidgets.VBox`` of a mesh-dim filter, the table from
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
"""

from __future__ import annotations

import io
from html import escape

import ipywidgets as W

from . import svg as S
from .display import StaticFallback
from .comm_picture import (comm_html, comm_rows, comm_table_html, kind_color, record_dim,
                   records_of)

ALL = "all"


class CommView(StaticFallback, W.VBox):
    """Interactive view of collectives ``records``; ``title`` names the cell or block."""

    def __init__(self, records, title=None, **kwargs):
        self.all_records = records_of(records)
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
        return comm_html(self.records, self.title)

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
            self.table.value = S.note("no collectives")
            self.timeline.value = b""
            self.timeline.layout.display = "none"
