"""``%dtorch explain``: what issued the last cell's collectives and what each cost.

Rows group the cell's records by what issued them (``CommRecord.origin``: a user's
``redistribute [S(0)] -> [R]``, an op such as ``torch.cdist`` whose plan runs collectives, the
backward pass), with their collectives, bytes per rank and predicted time; then the time the
slowest rank measured per kind and mesh dim. Example::

    >>> from dtorch.comm_debug import CommRecord
    >>> from dtorch.cost import LinkFit, LinkModel, predict
    >>> recs = [CommRecord("all_gather", 0, None, ((0, 1, 2, 3),), 1024, origin="redistribute [S(0)] -> [R]")]
    >>> p = predict(recs, LinkModel((LinkFit("all_gather", 4, 1, 1e-4, 1e-9),)))
    >>> print("\\n".join(explain_lines(recs, p, {"all_gather 0": 2e-4})))
    dtorch explain: 1 collective in the last cell
      redistribute [S(0)] -> [R]: all_gather x1 on 0, 1.0 KiB/rank, predicted 103 us
    measured on the ranks (slowest rank): all_gather on 0 200 us
"""

from __future__ import annotations


def _origin_of(rec) -> str:
    who = getattr(rec, "origin", None)
    if who:
        return who
    return "backward" if getattr(rec, "phase", "forward") != "forward" else "(unnamed)"


def explain_lines(records, prediction, measured: dict) -> list[str]:
    """The lines ``%dtorch explain`` prints for one cell's records."""
    from dtorch.comm_debug import dim_name, kind_label
    from dtorch.cost import fmt_bytes, fmt_seconds
    records = list(records)
    if not records:
        return ["dtorch explain: the last cell issued no collectives"]
    costs = prediction.steps if prediction is not None else [None] * len(records)
    rows: dict = {}
    for rec, cost in zip(records, costs):
        key = (_origin_of(rec), kind_label(rec), dim_name(rec))
        row = rows.setdefault(key, [0, 0, 0.0])
        row[0] += 1
        row[1] += rec.bytes_per_rank
        row[2] += cost.seconds if cost is not None else float("nan")
    n = len(records)
    lines = [f"dtorch explain: {n} collective{'s' if n != 1 else ''} in the last cell"]
    for (who, kind, dim), (count, nbytes, seconds) in rows.items():
        lines.append(f"  {who}: {kind} x{count} on {dim}, {fmt_bytes(nbytes)}/rank, "
                     f"predicted {fmt_seconds(seconds)}")
    if measured:
        parts = [f"{k.rsplit(' ', 1)[0]} on {k.rsplit(' ', 1)[1]} {fmt_seconds(v)}"
                 for k, v in measured.items()]
        lines.append("measured on the ranks (slowest rank): " + "; ".join(parts))
    else:
        lines.append("measured on the ranks: not read (counts were off, or the cell failed)")
    return lines
