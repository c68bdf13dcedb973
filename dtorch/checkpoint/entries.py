"""What a checkpoint holds, planned on the controller (pure: no cluster, no files).

A state dict is walked the way ``torch.distributed.checkpoint`` walks it (mappings always;
a list when it holds a tensor or a mapping; anything else is one value), so the keys dtorch
writes are the keys a PyTorch SPMD program writes for the same nested dict. Example::

    >>> import torch
    >>> leaves, lists = flatten({"model": {"w": torch.zeros(2)}, "step": 3, "lrs": [0.1]})
    >>> [(leaf.fqn, type(leaf.value).__name__) for leaf in leaves]
    [('model.w', 'Tensor'), ('step', 'int'), ('lrs', 'list')]
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import torch


class Leaf(NamedTuple):
    """One value of a state dict: its DCP path (str keys, int list indices), the keys that
    reach it in the user's dict (to set a loaded value back) and the value."""

    path: tuple
    keys: tuple
    value: Any

    @property
    def fqn(self) -> str:
        return ".".join(map(str, self.path))


class Entry(NamedTuple):
    """One value as the ranks see it: a DTensor's shards (``tid`` on ``mesh``), a plain
    tensor staged on rank 0 (``tid``, no mesh) or a Python ``value`` (rank 0 writes it)."""

    path: tuple
    tid: int | None
    mesh: Any
    placements: tuple
    shape: tuple
    dtype: Any
    value: Any = None


def _is_tensor(value) -> bool:
    from ..tensor import DTensor
    return isinstance(value, (torch.Tensor, DTensor))


def _is_terminal(value) -> bool:
    """DCP's rule: a list is walked into when it holds a tensor or a non-terminal container."""
    if isinstance(value, Mapping):
        return False
    if not isinstance(value, list):
        return True
    return not any(_is_tensor(v) or (isinstance(v, (Mapping, list)) and not _is_terminal(v))
                   for v in value)


def flatten(state_dict: Mapping) -> tuple[list[Leaf], dict[tuple, int]]:
    """The leaves of ``state_dict`` in DCP's order, and the length of every list walked into
    (by its path), so a rank can rebuild the same containers."""
    if not isinstance(state_dict, Mapping):
        raise TypeError(f"a checkpoint's state_dict is a dict (of DTensors, tensors and "
                        f"Python values), not a {type(state_dict).__name__}; wrap it, e.g. "
                        f"{{'model': model.state_dict()}}")
    leaves: list[Leaf] = []
    lists: dict[tuple, int] = {}

    def walk(path: tuple, keys: tuple, value) -> None:
        if isinstance(value, Mapping):
            for k, v in value.items():
                walk(path + (str(k),), keys + (k,), v)
        elif _is_terminal(value):
            leaves.append(Leaf(path, keys, value))
        else:
            lists[path] = len(value)
            for i, v in enumerate(value):
                walk(path + (i,), keys + (i,), v)

    for key, value in state_dict.items():
        walk((str(key),), (key,), value)
    seen: dict[str, Leaf] = {}
    for leaf in leaves:
        if leaf.fqn in seen:
            raise ValueError(f"two values of the state dict have the key {leaf.fqn!r} once "
                             f"joined with dots ({seen[leaf.fqn].keys} and {leaf.keys}); "
                             f"rename one")
        seen[leaf.fqn] = leaf
    return leaves, lists


def set_value(root, keys: tuple, value) -> None:
    """Put ``value`` where ``keys`` lead in the user's dict (a loaded Python value)."""
    for k in keys[:-1]:
        root = root[k]
    root[keys[-1]] = value


def check_against(metadata, leaves: list[Leaf]) -> None:
    """Raise before anything is sent when a checkpoint cannot fill ``leaves``: a key it does
    not have, a tensor of another shape, a tensor saved as a Python value or back."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata
    saved = metadata.state_dict_metadata
    missing = [leaf.fqn for leaf in leaves if leaf.fqn not in saved]
    if missing:
        near = sorted(saved)[:6]
        raise KeyError(f"the checkpoint has no {', '.join(map(repr, missing[:5]))}"
                       f"{f' (and {len(missing) - 5} more)' if len(missing) > 5 else ''}; it "
                       f"holds {len(saved)} keys, e.g. {near}. Load a state dict with the keys "
                       f"it was saved with")
    for leaf in leaves:
        md = saved[leaf.fqn]
        is_bytes = isinstance(md, BytesStorageMetadata)
        if _is_tensor(leaf.value) == is_bytes:
            what = "a Python value" if is_bytes else "a tensor"
            raise TypeError(f"{leaf.fqn!r} was saved as {what}; the state dict to load "
                            f"holds a {type(leaf.value).__name__} there")
        if not is_bytes and tuple(md.size) != tuple(leaf.value.shape):
            raise ValueError(f"{leaf.fqn!r} was saved with shape {tuple(md.size)}; the "
                             f"tensor to load it into has shape {tuple(leaf.value.shape)}")
