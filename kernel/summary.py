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

WIDGET_MIME = "application/vnd.jupyter.widget-view+json"
TITLE = "dtorch: collectives issued by this cell"


def fmt_bytes(n: int) -> str:
    """Bytes in B / KiB / MiB / GiB.

    >>> fmt_bytes(16), fmt_bytes(1536)
    ('16 B', '1.5 KiB')
    """
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


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


def summary_text(records, constants=(0, 0)) -> str:
    """One line naming each collective kind, its count, mesh dim and bytes per rank, and the
    parameters whose gradients a backward's collectives reduced; ``constants``: ``(sends,
    bytes per rank)`` of the plain tensors sent as constants."""
    from dtorch.comm_debug import gradients_text, group_records
    records = list(records)
    const = constants_text(constants)
    if not records:
        return f"dtorch: {const}" if const else ""
    parts = []
    for r in group_records(records):
        dim = "-" if r.dim == "-" else f"dim {r.dim}"
        grads = f"; for {gradients_text(r.gradients)}" if r.gradients else ""
        parts.append(f"{r.label} x{r.count} ({dim}, {fmt_bytes(r.bytes_per_rank)}/rank{grads})")
    head = "dtorch: " if len(records) == 1 else f"dtorch: {len(records)} collectives: "
    return head + "; ".join(parts + ([const] if const else []))


def summary_metadata(records, constants=(0, 0)) -> dict:
    """Display metadata that lets tools find the summary and read its counts.

    >>> from dtorch.comm_debug import CommRecord
    >>> summary_metadata([CommRecord("all_gather", 0, None, ((0, 1),), 8)])["dtorch"]["counts"]
    {'all_gather': 1}
    """
    counts: dict[str, int] = {}
    for rec in records:
        counts[rec.kind] = counts.get(rec.kind, 0) + 1
    return {"dtorch": {"cell_collectives": True, "counts": counts,
                       "rows": [list(r) for r in rows(records)],
                       "constants": {"sends": constants[0], "bytes_per_rank": constants[1]}}}


def summary_bundle(records, title: str = TITLE, constants=(0, 0)) -> dict:
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
    data["text/plain"] = summary_text(records, constants)
    return data
