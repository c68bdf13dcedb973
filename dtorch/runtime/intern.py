"""Interned values in batches: meshes, rank tuples and planned steps travel once per rank.

A 1,024-rank mesh pickles to kilobytes; an op naming it would cost every rank that much per op.
The controller's pickler puts a small id in place of each such value (``reducer_override``);
the first batch a rank receives that uses an id carries the definition, and the rank resolves
ids from its own table while it unpickles. Example::

    >>> from dtorch import init_device_mesh
    >>> table, rank_table = InternTable(), {}
    >>> mesh = init_device_mesh("cpu", 64)
    >>> data, used, ids = dumps([mesh, mesh], table)
    >>> len(data) < 80, len(pickle.dumps(mesh)) > 100
    (True, True)
    >>> rank_table.update(pickle.loads(definitions(table, used)))
    >>> loads(data, rank_table) == [mesh, mesh]
    True

Ids the controller made (``messages.Tid``: tensors, graph nodes, requests) become slots: the
bytes say "the i-th id of this run" and the ids travel beside them, so a run that repeats with
fresh ids pickles to the same bytes. The second time the same bytes come, they become a
``Program`` (interned like a mesh: sent once per rank) and the run travels as its id and its
ids (``replay.py`` prepares it once on the rank)::

    >>> from dtorch.runtime.messages import Free, Tid
    >>> a, _, ids_a = dumps([Free((Tid(7), Tid(8)))], table)
    >>> b, _, ids_b = dumps([Free((Tid(9), Tid(10)))], table)
    >>> a == b, ids_a, ids_b
    (True, (7, 8), (9, 10))
    >>> loads(b, rank_table, ids_b)
    [Free(tids=(9, 10), ranks=None)]
    >>> table.program(a) is None, table.program(b) is not None  # seen once, then repeated
    (True, True)
"""

from __future__ import annotations

import io
import pickle
import threading
from typing import NamedTuple

from ..mesh import DeviceMesh, RankTuple
from ..redistribute import Step
from .messages import CompositePlan, Tid

_INTERNED = (DeviceMesh, RankTuple, Step, CompositePlan)
_local = threading.local()  # the table and ids of the run a rank unpickles on this thread
MAX_PROGRAMS = 1024  # distinct repeated runs kept per world (then runs travel whole)
_MAX_SEEN = 4096  # runs seen once, remembered to notice a repeat


class Program(NamedTuple):
    """A run of instructions that repeated, pickled with slots for its ids."""

    data: bytes


class Slot(NamedTuple):
    """Where the ``index``-th id of a run goes (a prepared program's placeholder)."""

    index: int


class _Slots:
    """Stands in for a run's ids while a program is prepared: the i-th id is ``Slot(i)``."""

    def __getitem__(self, index: int) -> Slot:
        return Slot(index)


SLOTS = _Slots()


class InternTable:
    """The controller's ids: by identity first (values are reused objects: cached plans, a
    mesh's rank tuple), then by value for meshes (users build equal meshes anew)."""

    def __init__(self):
        self._by_identity: dict[int, tuple[int, object]] = {}
        self._by_value: dict = {}
        self.values: dict[int, object] = {}
        self._programs: dict[bytes, int] = {}  # repeated runs' bytes -> their Program's id
        self._seen: set[int] = set()  # hashes of runs seen once

    def iid(self, obj) -> int:
        hit = self._by_identity.get(id(obj))
        if hit is not None:
            return hit[0]
        key = (type(obj), obj)
        try:
            iid = self._by_value.get(key)
        except TypeError:  # unhashable (a composite plan's tables): by identity only
            key, iid = None, None
        if iid is None:
            iid = len(self.values)
            self.values[iid] = obj
            if key is not None:
                self._by_value[key] = iid
        self._by_identity[id(obj)] = (iid, obj)  # obj kept alive: its id is never reused
        return iid

    def program(self, data: bytes) -> int | None:
        """The interned id of the ``Program`` these run bytes make once they repeat; None the
        first time (they are remembered) or once ``MAX_PROGRAMS`` exist."""
        programs, seen = self._programs, self._seen
        iid = programs.get(data)
        if iid is not None:
            return iid
        key = hash(data)
        if key in seen and len(programs) < MAX_PROGRAMS:
            iid = programs[data] = self.iid(Program(data))
            return iid
        if len(seen) >= _MAX_SEEN:
            seen.clear()
        seen.add(key)
        return None


class _Pickler(pickle.Pickler):
    def __init__(self, file, table: InternTable, used: set, slots: dict):
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self._table, self._used, self._slots = table, used, slots

    def reducer_override(self, obj):
        kind = type(obj)
        if kind is Tid:
            slot = self._slots.get(obj)
            if slot is None:
                slot = self._slots[obj] = len(self._slots)
            return _slot, (slot,)
        if kind in _INTERNED:
            iid = self._table.iid(obj)
            self._used.add(iid)
            return _resolve, (iid,)
        return NotImplemented


def dumps(obj, table: InternTable) -> tuple[bytes, set, tuple]:
    """``obj`` pickled with interned values replaced by ids and the controller's ids by
    slots; returns the interned ids it uses and the run's ids, in slot order."""
    buf, used, slots = io.BytesIO(), set(), {}
    _Pickler(buf, table, used, slots).dump(obj)
    return buf.getvalue(), used, tuple(int(t) for t in slots)


def definitions(table: InternTable, ids) -> bytes:
    """The values of ``ids``, pickled in full (sent once to each rank that needs them)."""
    return pickle.dumps({i: table.values[i] for i in ids}, protocol=pickle.HIGHEST_PROTOCOL)


def loads(data: bytes, rank_table: dict, ids=()):
    """Unpickle a run on a rank, resolving interned values from ``rank_table`` and slots from
    ``ids`` (``SLOTS``: leave them as ``Slot`` placeholders)."""
    _local.table, _local.ids = rank_table, ids
    try:
        return pickle.loads(data)
    finally:
        _local.table = _local.ids = None


def _resolve(iid: int):
    return _local.table[iid]


def _slot(index: int):
    return _local.ids[index]
