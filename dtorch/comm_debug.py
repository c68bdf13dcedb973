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
    gradient_of: str | None = None  # the parameter whose gradient it reduced (backward)
    origin: str | None = None  # what issued it: "redistribute [S(0)] -> [R]", "torch.matmul"

    @property
    def total_bytes(self) -> int:
        return self.bytes_per_rank * sum(len(g) for g in self.groups)


class CommLedger:
    """An ordered list of records with counts by kind (and by mesh dim)."""

    def __init__(self):
        self.records: list[CommRecord] = []
        self.constant_sends = 0  # plain tensors sent from the controller as constants
        self.constant_bytes = 0  # their bytes per receiving rank (not collectives)

    def add(self, record: CommRecord) -> None:
        self.records.append(record)

    def add_constant(self, nbytes: int) -> None:
        self.constant_sends += 1
        self.constant_bytes += nbytes

    def clear(self) -> None:
        self.records.clear()
        self.constant_sends = self.constant_bytes = 0

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


class CommRow(NamedTuple):
    """One row of a collectives table: records of one label and mesh dim, summed."""

    label: str  # the kind, marked when backward ran it: ``kind_label``
    dim: str  # ``dim_name``
    count: int
    bytes_per_rank: int
    total_bytes: int
    gradients: tuple[str, ...]  # the parameters whose gradients these reduced, in order


def dim_name(rec: CommRecord) -> str:
    """The mesh dim a record ran along, by name when known, ``-`` for none."""
    if rec.mesh_dim_name is not None:
        return str(rec.mesh_dim_name)
    return "-" if rec.mesh_dim is None or rec.mesh_dim < 0 else str(rec.mesh_dim)


def group_records(records) -> list[CommRow]:
    """Records grouped by (``kind_label``, ``dim_name``) in order of first appearance: what
    the kernel's per-cell summary and the widgets' tables show.

    >>> r = CommRecord("all_reduce", 0, "dp", ((0, 1),), 8, "sum", "backward", "fc.weight")
    >>> group_records([r, r._replace(gradient_of="fc.bias")])
    [CommRow(label='all_reduce (backward)', dim='dp', count=2, bytes_per_rank=16, total_bytes=32, gradients=('fc.weight', 'fc.bias'))]
    """
    rows: dict[tuple[str, str], list] = {}
    for rec in records:
        row = rows.setdefault((kind_label(rec), dim_name(rec)), [0, 0, 0, []])
        row[0] += 1
        row[1] += rec.bytes_per_rank
        row[2] += rec.total_bytes
        name = getattr(rec, "gradient_of", None)
        if name is not None and name not in row[3]:
            row[3].append(name)
    return [CommRow(k, d, c, b, tb, tuple(g)) for (k, d), (c, b, tb, g) in rows.items()]


def gradients_text(names, limit: int = 3) -> str:
    """``names`` shortened for a table cell.

    >>> gradients_text(["a.weight", "a.bias", "b.weight", "b.bias"])
    'a.weight, a.bias, b.weight (+1 more)'
    """
    names = list(names)
    text = ", ".join(names[:limit])
    return text + (f" (+{len(names) - limit} more)" if len(names) > limit else "")


_listeners: list[CommLedger] = []
_phase = ["forward"]
_gradient_of: list = [None]
_origin: list = [None]


@contextmanager
def origin(name):
    """Records made inside name ``name`` as what issued them (an op whose rule or decomposition
    runs collectives; the outermost name wins). ``name`` may be a function giving it: it is
    called only when a record is made (the ops' hot path pays no formatting).

    >>> from dtorch import init_device_mesh, Shard, Replicate, plan_redistribute
    >>> steps = plan_redistribute(init_device_mesh("cpu", 2), (4,), [Shard(0)], [Replicate()])
    >>> ledger = CommLedger(); listen(ledger)
    >>> record_steps(steps, "redistribute [S(0)] -> [R]")
    >>> with origin("torch.cdist"):
    ...     record_steps(steps, "redistribute [S(0)] -> [R]")
    >>> unlisten(ledger); [r.origin for r in ledger.records]
    ['redistribute [S(0)] -> [R]', 'torch.cdist']
    """
    _origin.append(_origin[-1] or name)
    try:
        yield
    finally:
        _origin.pop()


@contextmanager
def phase(name: str):
    """Records made inside are marked ``phase=name`` (the autograd engine: "backward")."""
    _phase.append(name)
    try:
        yield
    finally:
        _phase.pop()


@contextmanager
def gradient_of(name: str | None):
    """Records made inside name the parameter whose gradient they reduce (the engine, while it
    brings a leaf's gradient to the leaf's placements)."""
    _gradient_of.append(name)
    try:
        yield
    finally:
        _gradient_of.pop()


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


def record_constant(nbytes: int, ranks: int) -> None:
    """Tell every open ledger the controller sent a constant of ``nbytes`` to each of
    ``ranks`` ranks (see :mod:`dtorch.ops.constants`; not a collective)."""
    for ledger in _listeners:
        ledger.add_constant(nbytes)


def record_steps(steps: Iterable, issued_by: str | None = None) -> None:
    """Record the collective steps of a redistribute plan, or of a composite op's plan
    (``CompositePlan.collectives``: its all_to_all and send_recv steps, as the ranks run them);
    ``issued_by`` names what issued them when no enclosing :func:`origin` does."""
    if not _listeners:
        return
    who = _origin[-1] or issued_by
    if callable(who):
        who = who()
    for s in steps:
        if s.kind in COMM_KINDS:
            op = s.src.reduce_op if s.kind in ("all_reduce", "reduce_scatter") else None
            record(CommRecord(s.kind, s.mesh_dim, s.mesh_dim_name, s.groups, s.bytes_per_rank, op,
                              _phase[-1], _gradient_of[-1], who))


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

    def get_constant_bytes(self) -> int:
        """Bytes per rank of the plain-tensor constants sent from the controller meanwhile
        (none for a cached one; see :mod:`dtorch.ops.constants`)."""
        return self.constant_bytes

    def get_gradient_comm_counts(self) -> dict[str, dict[str, int]]:
        """``{parameter name: {kind: count}}`` for the collectives a backward ran to bring
        parameters' gradients to their placements (DP's all_reduce, FSDP's reduce_scatter).
        A parameter is named as in ``model.named_parameters()`` of the outermost module that
        ran it; leaves outside a module are not listed.

        >>> m = CommDebugMode()
        >>> m.add(CommRecord("all_reduce", 0, "dp", ((0, 1),), 8, "sum", "backward", "fc.bias"))
        >>> m.get_gradient_comm_counts()
        {'fc.bias': {'all_reduce': 1}}
        """
        out: dict = {}
        for r in self.records:
            if r.phase == "backward" and r.gradient_of is not None:
                kinds = out.setdefault(r.gradient_of, {})
                kinds[r.kind] = kinds.get(r.kind, 0) + 1
        return out
