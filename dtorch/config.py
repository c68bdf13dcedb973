"""Process-wide settings the pure modules may read (no cluster import).

>>> import dtorch.config as c
>>> c.world_size() >= 1
True
"""

import os

# Plain torch tensors beside DTensors are sent as Replicate constants (dtorch.ops.constants):
# the controller's cache of them holds at most this many bytes (each rank holds each whole),
constant_cache_bytes: int = 256 * 2**20
# and one bigger than this warns once per shape (make it a DTensor instead).
constant_warn_bytes: int = 64 * 2**20

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
