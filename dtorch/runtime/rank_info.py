"""Where one rank lives: a plain record (no Dask import: the dry-run controller uses it too)."""

from __future__ import annotations

from typing import NamedTuple


class RankInfo(NamedTuple):
    """Where one rank lives."""

    rank: int
    address: str
    host: str
    actor: object
    future: object
    device: str = "cpu"
    channel: tuple | None = None  # (host, port) of the rank's channel (channel.py)
    token: bytes = b""  # what the controller presents there (made per world)
