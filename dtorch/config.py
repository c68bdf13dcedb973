"""Process-wide settings the pure modules may read (no cluster import).

>>> import dtorch.config as c
>>> c.world_size() >= 1
True
"""

import os

# Set by the runtime while a cluster is up; None before it starts.
_running_world_size: int | None = None


def default_workers() -> int:
    """Workers the embedded cluster starts with: ``DTORCH_WORKERS`` or 4."""
    value = os.environ.get("DTORCH_WORKERS", "4")
    try:
        n = int(value)
    except ValueError:
        raise ValueError(f"DTORCH_WORKERS must be a positive int; got {value!r}") from None
    if n < 1:
        raise ValueError(f"DTORCH_WORKERS must be a positive int; got {value!r}")
    return n


def world_size() -> int:
    """Ranks of the running cluster, or the number the embedded one would start with."""
    return _running_world_size if _running_world_size is not None else default_workers()


def set_running_world_size(n: int | None) -> None:
    global _running_world_size
    _running_world_size = n
