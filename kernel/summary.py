"""The per-cell collective summary: one text line and a small HTML table.

Rows group a cell's CommRecords by (kind, mesh dim), in order of first appearance. The text
form is what ``text/plain`` frontends and saved notebooks show. Example::

    >>> from dtorch.comm_debug import CommRecord
    >>> g = ((0, 1, 2, 3),)
    >>> summary_text([CommRecord("all_gather", 0, None, g, 256)])
    'dtorch: all_gather x1 (dim 0, 256 B/rank)'
    >>> recs = [CommRecord("all_reduce", 1, "tp", ((0, 1), (2, 3)), 64, "sum")] * 2
    >>> summary_text(recs + [CommRecord("all_to_all", 0, "dp", ((0, 2), (1, 3)), 2048)])
    'dtorch: 3 collectives: all_reduce x2 (dim tp, 128 B/rank); all_to_all x1 (dim dp, 2.0 KiB/rank)'
    >>> summary_text([CommRecord("all_reduce", 0, "dp", g, 64, "sum", "backward", "fc.weight")])
    'dtorch: all_reduce (backward) x1 (dim dp, 64 B/rank; for fc.weight)'
    >>> summary_text([])
    ''

Plain torch tensors the cell sent as constants (see ``dtorch.ops.constants``; not collectives)
get a part of their own::

    >>> summary_text([], constants=(2, 1536))
    'dtorch: constants sent x2 (from the controller, 1.5 KiB/rank)'
"""

from __future__ import annotations

from typing import NamedTuple

from dtorch.cost import fmt_bytes  # noqa: F401 - the kernel's tables use it

WIDGET_MIME = "application/vnd.jupyter.widget-view+json"
TITLE = "dtorch: collectives issued by this cell"


class CellTiming(NamedTuple):
    """A cell's communication time: ``predicted`` ``{(row label, dim): seconds}`` from the cost
    model (``dtorch.predict`` of its records; empty when it could not predict), ``measured``
    ``{"kind dim": seconds}`` the slowest rank spent in them (empty when not measured)."""

    predicted: dict
    measured: dict

    @classmethod
    def of(cls, records, prediction, measured: dict) -> "CellTiming":
        """From the cell's records, their :class:`dtorch.cost.Prediction` (or None) and the
        ranks' measured seconds."""
        from dtorch.comm_debug import dim_name, kind_label
        predicted: dict = {}
        if prediction is not None:
            for rec, cost in zip(records, prediction.steps):
                key = (kind_label(rec), dim_name(rec))
                predicted[key] = predicted.get(key, 0.0) + cost.seconds
        return cls(predicted, dict(measured))

    def row_text(self, label: str, dim: str, first_of_key: bool) -> str:
        """``, predicted 1.2 ms, measured 1.5 ms`` for one summary row (what is known).

        >>> t = CellTiming({("all_gather", "0"): 1.2e-3}, {"all_gather 0": 1.5e-3})
        >>> t.row_text("all_gather", "0", True)
        ', predicted 1.2 ms, measured 1.5 ms'
        """
        from dtorch.cost import fmt_seconds
        out = ""
        if (label, dim) in self.predicted:
            out += f", predicted {fmt_seconds(self.predicted[(label, dim)])}"
        key = f"{label.split(' (')[0]} {dim}"
        if first_of_key and key in self.measured:
            out += f", measured {fmt_seconds(self.measured[key])}"
        return out

    def totals(self) -> tuple[float | None, float | None]:
        pred = sum(self.predicted.values()) if self.predicted else None
        return pred, (sum(self.measured.values()) if self.measured else None)

    def total_text(self) -> str:
        """``comm predicted 3.1 ms, measured 4.0 ms`` for the whole cell."""
        from dtorch.cost import fmt_seconds
        pred, meas = self.totals()
        parts = ([f"predicted {fmt_seconds(pred)}"] if pred is not None else []) + \
            ([f"measured {fmt_seconds(meas)}"] if meas is not None else [])
        return "comm " + ", ".join(parts) if parts else ""


def dim_text(rec) -> str:
    """``dim tp`` for a named mesh dim, ``dim 0`` otherwise (``-`` when none)."""
    from dtorch.comm_debug import dim_name
    name = dim_name(rec)
    return name if name == "-" else f"dim {name}"


def rows(records) -> list[tuple[str, str, int, int]]:
    """``(kind, dim text, count, bytes per rank)`` per kind and mesh dim; a backward's
    collectives are rows of their own (``all_reduce (backward)``)."""
    from dtorch.comm_debug import group_records
    return [(r.label, "-" if r.dim == "-" else f"dim {r.dim}", r.count, r.bytes_per_rank)
            for r in group_records(records)]


def constants_text(constants) -> str:
    """``constants sent xN (from the controller, B/rank)`` for ``(sends, bytes per rank)``."""
    sends, nbytes = constants
    return f"constants sent x{sends} (from the controller, {fmt_bytes(nbytes)}/rank)" \
        if sends else ""


def summary_text(records, constants=(0, 0), timing: CellTiming | None = None) -> str:
    """One line naming each collective kind, its count, mesh dim and bytes per rank, and the
    parameters whose gradients a backward's collectives reduced; ``constants``: ``(sends,
    bytes per rank)`` of the plain tensors sent as constants; ``timing``: each row's predicted
    and measured time, and the cell's total when it has several rows.

    >>> from dtorch.comm_debug import CommRecord
    >>> t = CellTiming({("all_gather", "0"): 1.2e-3}, {"all_gather 0": 1.5e-3})
    >>> summary_text([CommRecord("all_gather", 0, None, ((0, 1),), 256)], timing=t)
    'dtorch: all_gather x1 (dim 0, 256 B/rank, predicted 1.2 ms, measured 1.5 ms)'
    """
    from dtorch.comm_debug import gradients_text, group_records
    records = list(records)
    const = constants_text(constants)
    if not records:
        return f"dtorch: {const}" if const else ""
    parts, seen = [], set()
    groups = group_records(records)
    for r in groups:
        dim = "-" if r.dim == "-" else f"dim {r.dim}"
        grads = f"; for {gradients_text(r.gradients)}" if r.gradients else ""
        key = f"{r.label.split(' (')[0]} {r.dim}"
        timed = timing.row_text(r.label, r.dim, key not in seen) if timing else ""
        seen.add(key)
        parts.append(f"{r.label} x{r.count} ({dim}, {fmt_bytes(r.bytes_per_rank)}/rank"
                     f"{timed}{grads})")
    if timing is not None and len(groups) > 1 and timing.total_text():
        parts.append(timing.total_text())
    head = "dtorch: " if len(records) == 1 else f"dtorch: {len(records)} collectives: "
    return head + "; ".join(parts + ([const] if const else []))


def summary_metadata(records, constants=(0, 0), timing: CellTiming | None = None) -> dict:
    """Display metadata that lets tools find the summary and read its counts.

    >>> from dtorch.comm_debug import CommRecord
    >>> summary_metadata([CommRecord("all_gather", 0, None, ((0, 1),), 8)])["dtorch"]["counts"]
    {'all_gather': 1}
    """
    counts: dict[str, int] = {}
    for rec in records:
        counts[rec.kind] = counts.get(rec.kind, 0) + 1
    out = {"cell_collectives": True, "counts": counts,
           "rows": [list(r) for r in rows(records)],
           "constants": {"sends": constants[0], "bytes_per_rank": constants[1]}}
    if timing is not None:
        pred, meas = timing.totals()
        out["timing"] = {"predicted_s": pred, "measured_s": meas,
                         "predicted": [[k[0], k[1], v] for k, v in timing.predicted.items()],
                         "measured": dict(timing.measured)}
    return {"dtorch": out}


def summary_bundle(records, title: str = TITLE, constants=(0, 0),
                   timing: CellTiming | None = None) -> dict:
    """The mime bundle the kernel displays: the static table of ``dtorch_widgets`` as
    ``text/html`` (no widget: a cell summary must stay light) and the line as ``text/plain``."""
    records = list(records)
    data = {}
    try:
        if records:
            from dtorch_widgets import comm_mimebundle
            data = comm_mimebundle(records, title, exclude={WIDGET_MIME})
    except Exception:  # noqa: BLE001 - the text line is enough
        data = {}
    const = constants_text(constants)
    if const:
        data["text/html"] = data.get("text/html", "") + f"<p>dtorch: {const}</p>"
    if timing is not None and timing.total_text():
        from html import escape
        data["text/html"] = data.get("text/html", "") + \
            f"<p>dtorch: {escape(timing.total_text())}</p>"
    data["text/plain"] = summary_text(records, constants, timing)
    return data
