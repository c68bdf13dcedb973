"""Counting collectives: ``CommDebugMode`` and the ledger that feeds it.

The controller records one :class:`CommRecord` per collective step it issues (from the same
planned steps the workers execute). Any number of ledgers may listen at once: every open
``CommDebugMode`` block and the Jupyter kernel's per-cell ledger. Example::

    >>> from dtorch import init_device_mesh, Shard, Replicate
    >>> from dtorch.redistribute import plan_redistribute
    >>> m = init_device_mesh("cpu", 4)
    >>> with CommDebugMode() as mode:
    ...     record_steps(plan_redistribute(m, (4, 4), [Shard(0)], [Replicate()]))
    >>> mode.get_comm_counts(), mode.get_total_counts()
    ({'all_gather': 1}, 1)
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterable, NamedTuple

COMM_KINDS = ("all_gather", "all_reduce", "reduce_scatter", "all_to_all", "send_recv",
              "broadcast")


class CommRecord(NamedTuple):
    """One collective as issued: its kind, the mesh dim it ran along, the rank groups and the
    bytes each rank put into it (padded)."""

    kind: str
    mesh_dim: int
    mesh_dim_name: str | None
    groups: tuple[tuple[int, ...], ...]
    bytes_per_rank: int
    reduce_op: str | None = None
    phase: str = "forward"  # "backward" for the collectives a backward pass ran

    @property
    def total_bytes(self) -> int:
        return self.bytes_per_rank * sum(len(g) for g in self.groups)


class CommLedger:
    """An ordered list of records with counts by kind (and by mesh dim)."""

    def __init__(self):
        self.records: list[CommRecord] = []

    def add(self, record: CommRecord) -> None:
        self.records.append(record)

    def clear(self) -> None:
        self.records.clear()

    def get_comm_counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for r in self.records:
            out[r.kind] = out.get(r.kind, 0) + 1
        return out

    def get_total_counts(self) -> int:
        return len(self.records)

    def summary(self) -> list[tuple[str, str | None, int, int]]:
        """Rows ``(kind, mesh dim name, count, bytes per rank)`` grouped by kind and mesh dim."""
        rows: dict[tuple, list[int]] = {}
        for r in self.records:
            key = (r.kind, r.mesh_dim_name if r.mesh_dim_name is not None else
                   (None if r.mesh_dim < 0 else str(r.mesh_dim)))
            row = rows.setdefault(key, [0, 0])
            row[0] += 1
            row[1] += r.bytes_per_rank
        return [(k, d, c, b) for (k, d), (c, b) in rows.items()]


_listeners: list[CommLedger] = []
_phase = ["forward"]


@contextmanager
def phase(name: str):
    """Records made inside are marked ``phase=name`` (the autograd engine: "backward")."""
    _phase.append(name)
    try:
        yield
    finally:
        _phase.pop()


def kind_label(rec: CommRecord) -> str:
    """How tables name a record's collective: its kind, marked when backward ran it.

    >>> kind_label(CommRecord("all_reduce", 0, "dp", ((0, 1),), 8, "sum", "backward"))
    'all_reduce (backward)'
    """
    return rec.kind if getattr(rec, "phase", "forward") == "forward" else \
        f"{rec.kind} ({rec.phase})"


def record(rec: CommRecord) -> None:
    """Tell every open ledger about one issued collective."""
    for ledger in _listeners:
        ledger.add(rec)


def record_steps(steps: Iterable) -> None:
    """Record the collective steps of a redistribute plan, or of a composite op's plan
    (``CompositePlan.collectives``: its all_to_all and send_recv steps, as the ranks run them)."""
    if not _listeners:
        return
    for s in steps:
        if s.kind in COMM_KINDS:
            op = s.src.reduce_op if s.kind in ("all_reduce", "reduce_scatter") else None
            record(CommRecord(s.kind, s.mesh_dim, s.mesh_dim_name, s.groups, s.bytes_per_rank, op,
                              _phase[-1]))


def listen(ledger: CommLedger) -> None:
    _listeners.append(ledger)


def unlisten(ledger: CommLedger) -> None:
    if ledger in _listeners:
        _listeners.remove(ledger)


class CommDebugMode(CommLedger):
    """``with dtorch.CommDebugMode() as m: ...`` then ``m.get_comm_counts()``."""

    def __enter__(self) -> "CommDebugMode":
        listen(self)
        return self

    def __exit__(self, *exc) -> None:
        unlisten(self)

    def get_comm_records(self) -> list[CommRecord]:
        return list(self.records)
