"""Interned values in batches: meshes, rank tuples and planned steps travel once per rank.

A 1,024-rank mesh pickles to kilobytes; an op naming it would cost every rank that much per op.
The controller's pickler puts a small id in place of each such value (``reducer_override``);
the first batch a rank receives that uses an id carries the definition, and the rank resolves
ids from its own table while it unpickles. Example::

    >>> from dtorch import init_device_mesh
    >>> table, rank_table = InternTable(), {}
    >>> mesh = init_device_mesh("cpu", 64)
    >>> data, used = dumps([mesh, mesh], table)
    >>> len(data) < 80, len(pickle.dumps(mesh)) > 100
    (True, True)
    >>> rank_table.update(pickle.loads(definitions(table, used)))
    >>> loads(data, rank_table) == [mesh, mesh]
    True
"""

from __future__ import annotations

import io
import pickle
import threading

from ..mesh import DeviceMesh, RankTuple
from ..redistribute import Step
from .messages import CompositePlan

_INTERNED = (DeviceMesh, RankTuple, Step, CompositePlan)
_local = threading.local()  # the table of the rank unpickling on this thread


class InternTable:
    """The controller's ids: by identity first (values are reused objects: cached plans, a
    mesh's rank tuple), then by value for meshes (users build equal meshes anew)."""

    def __init__(self):
        self._by_identity: dict[int, tuple[int, object]] = {}
        self._by_value: dict = {}
        self.values: dict[int, object] = {}

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


class _Pickler(pickle.Pickler):
    def __init__(self, file, table: InternTable, used: set):
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self._table, self._used = table, used

    def reducer_override(self, obj):
        if type(obj) in _INTERNED:
            iid = self._table.iid(obj)
            self._used.add(iid)
            return _resolve, (iid,)
        return NotImplemented


def dumps(obj, table: InternTable) -> tuple[bytes, set]:
    """``obj`` pickled with interned values replaced by ids; returns the ids it uses."""
    buf, used = io.BytesIO(), set()
    _Pickler(buf, table, used).dump(obj)
    return buf.getvalue(), used


def definitions(table: InternTable, ids) -> bytes:
    """The values of ``ids``, pickled in full (sent once to each rank that needs them)."""
    return pickle.dumps({i: table.values[i] for i in ids}, protocol=pickle.HIGHEST_PROTOCOL)


def loads(data: bytes, rank_table: dict):
    """Unpickle a batch on a rank, resolving ids from ``rank_table``."""
    _local.table = rank_table
    try:
        return pickle.loads(data)
    finally:
        _local.table = None


def _resolve(iid: int):
    return _local.table[iid]
