"""The values that stand for failures on a rank: a ``RemoteFailure`` (where, what, the
remote traceback) and the ``Poison`` the store holds in place of a value whose computation
failed (see ``interpreter.py``)."""

from __future__ import annotations

from typing import NamedTuple


class RemoteFailure(NamedTuple):
    """An exception on a rank: where, what, and the remote traceback."""

    rank: int
    op: str
    message: str
    traceback: str


class Poison(NamedTuple):
    """Stands in the store for a value whose computation failed."""

    failure: RemoteFailure
