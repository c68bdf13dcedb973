"""Static HTML/SVG pictures of collectives: counts and bytes per kind and mesh dim, and a
timeline in issue order. Pure: no widgets. Example::

    >>> from dtorch.comm_debug import CommRecord
    >>> "all_gather" in comm_html([CommRecord("all_gather", 0, "tp", ((0, 1),), 64)])
    True
"""

from __future__ import annotations

from html import escape

from . import svg as S
from .colors import rank_color

def records_of(source) -> list:
    """The CommRecords of a list, a CommLedger or a CommDebugMode."""
    return list(getattr(source, "records", source))


def record_dim(rec) -> str:
    """The mesh dim a record ran along, by name when known, ``-`` for none."""
    from dtorch.comm_debug import dim_name
    return dim_name(rec)


def comm_rows(records) -> list[tuple[str, str, int, int, int]]:
    """``(kind, mesh dim, count, bytes per rank, total bytes)`` per kind and mesh dim, in
    order of first appearance (a backward's collectives are rows of their own).

    >>> from dtorch.comm_debug import CommRecord
    >>> r = CommRecord("all_gather", 0, "dp", ((0, 1),), 16)
    >>> comm_rows([r, r])
    [('all_gather', 'dp', 2, 32, 64)]
    """
    from dtorch.comm_debug import group_records
    return [(r.label, r.dim, r.count, r.bytes_per_rank, r.total_bytes)
            for r in group_records(records)]


def kind_color(kind: str) -> str:
    """One colour per collective kind (a kind's index among dtorch's kinds)."""
    from dtorch.comm_debug import COMM_KINDS
    kind = kind.split(" ")[0]  # "all_reduce (backward)": the kind's colour
    return rank_color(COMM_KINDS.index(kind) if kind in COMM_KINDS else len(COMM_KINDS))


def comm_table_html(records) -> str:
    """The counts-and-bytes table of ``comm_html`` (with a total row)."""
    from dtorch.comm_debug import gradients_text, group_records
    rows = group_records(records)
    grads = any(r.gradients for r in rows)  # the column shows once a backward reduced any
    cells = [[S.chip(kind_color(r.label), r.label), escape(r.dim), str(r.count),
              S.fmt_bytes(r.bytes_per_rank), S.fmt_bytes(r.total_bytes)]
             + ([escape(gradients_text(r.gradients))] if grads else [])
             for r in rows[:S.MAX_TABLE_ROWS]]
    cells.append(["<b>total</b>", "", f"<b>{len(records)}</b>",
                  S.fmt_bytes(sum(r.bytes_per_rank for r in records)),
                  S.fmt_bytes(sum(r.total_bytes for r in records))] + ([""] if grads else []))
    head = ["collective", "mesh dim", "count", "bytes per rank", "bytes (all ranks)"]
    return S.table(head + (["for the gradients of"] if grads else []), cells,
                   total_rows=len(rows) + 1)


def comm_timeline_svg(records) -> str:
    """The collectives in issue order: one square per collective, one lane per mesh dim."""
    shown = records[:S.MAX_TIMELINE]
    lanes: list[str] = []
    for rec in shown:
        if record_dim(rec) not in lanes:
            lanes.append(record_dim(rec))
    per_row = 50
    step, lane_h, left = 9, 14, 60
    nrows = -(-len(shown) // per_row) or 1
    band = len(lanes) * lane_h + 6
    body = []
    for row in range(nrows):
        for li, lane in enumerate(lanes):
            body.append(S.text(left - 4, row * band + li * lane_h + 10, lane, size=9,
                               anchor="end", fill="#555"))
    for i, rec in enumerate(shown):
        row, col = divmod(i, per_row)
        x = left + col * step
        y = row * band + lanes.index(record_dim(rec)) * lane_h + 2
        tip = f"#{i} {rec.kind} on {record_dim(rec)}: {S.fmt_bytes(rec.bytes_per_rank)} per rank"
        body.append(f"<g><title>{escape(tip)}</title>"
                    + S.rect(x, y, step - 2, lane_h - 4, kind_color(rec.kind), stroke="none")
                    + "</g>")
    width = left + min(len(shown), per_row) * step + 4
    return S.svg(width, nrows * band, "".join(body)) + S.not_drawn(len(records) - len(shown),
                                                                   "collectives")


def comm_html(records, title=None, note=None) -> str:
    """Counts and bytes per collective kind and mesh dim, then a timeline in issue order.

    ``records`` is a list of CommRecords, a CommLedger or a CommDebugMode; ``note`` is what
    an empty picture says (default "no collectives").

    >>> from dtorch.comm_debug import CommRecord
    >>> h = comm_html([CommRecord("all_reduce", 1, "tp", ((0, 1), (2, 3)), 64, "sum")])
    >>> "all_reduce" in h and "tp" in h and "64 B" in h
    True
    >>> "no collectives" in comm_html([])
    True
    """
    records = records_of(records)
    head = f"<b>{escape(title or 'Collectives')}</b> · {len(records)} issued"
    if not records:
        return S.box(head, S.note(note or "no collectives"))
    out = S.box(head, comm_table_html(records), comm_timeline_svg(records))
    return S.cap_html(out, S.box(head, S.note("(too large to draw)")))
