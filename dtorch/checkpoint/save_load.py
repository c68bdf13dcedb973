"""``dtorch.checkpoint.save`` / ``save_async`` / ``load``: sharded checkpoints in the
``torch.distributed.checkpoint`` format, written and read by the ranks themselves.

Every check runs on the controller before anything is sent: the state dict's structure, a
Python value that cannot be pickled, a path that holds something else, and on load the
checkpoint's own metadata (keys, shapes). A Partial DTensor (a row-parallel bias) is saved
as its value (reduced first, counted) and loaded as one (the value where it is held, zeros
on the other ranks: no collective).
The ranks then run one ``Checkpoint`` instruction each (``runtime/checkpoint_io.py``).
Example::

    sd = {"model": model.state_dict(), "optim": opt.state_dict(), "step": 100}
    dtorch.checkpoint.save(sd, "ckpt/")
    dtorch.checkpoint.load(sd, "ckpt/")          # in place, onto any mesh
    opt.load_state_dict(sd["optim"])
"""

from __future__ import annotations

import os
import pickle
import threading
import uuid

import torch

from ..errors import ClusterError
from ..future import TensorFuture
from ..placement import Replicate
from ..runtime import messages as m
from ..tensor import DTensor
from .entries import Entry, Leaf, check_against, flatten, set_value

_in_flight: dict[str, TensorFuture] = {}  # path -> its save_async, until done
_lock = threading.Lock()


def save(state_dict: dict, path) -> None:
    """Write ``state_dict`` (nested dicts and lists of DTensors, torch tensors and Python
    values) to the directory ``path``; each rank writes its own shards. A checkpoint already
    at ``path`` is replaced only once the new one is complete."""
    _start_save(state_dict, path, "save").result()


def save_async(state_dict: dict, path) -> TensorFuture:
    """Start a save and return at once: every rank copies its shards in stream order (later
    ops do not change what is written) and writes them from a thread of its own while the
    next steps run. ``result()`` waits and raises what failed.

    >>> # fut = dtorch.checkpoint.save_async(sd, "ckpt/"); train(); fut.result()
    """
    return _start_save(state_dict, path, "save_async")


def _start_save(state_dict: dict, path, action: str) -> TensorFuture:
    path = _checked_save_path(path)
    leaves, lists = flatten(state_dict)
    c = _controller(leaves)
    _wait_for_save(path)
    entries, staged, reduced = _save_entries(c, leaves)
    staging = f"{path}.dtorch-tmp-{uuid.uuid4().hex[:12]}"
    futures = c.request(lambda req: m.Checkpoint(req, action, path, staging, tuple(entries),
                                                 tuple(lists.items()), tuple(range(c.world))),
                        range(c.world))
    if staged:
        c.issue(m.Free(tuple(staged), (0,)))
    def done():
        reduced.clear()  # the reduced Partial values, kept until written
        with _lock:
            if _in_flight.get(path) is fut:
                del _in_flight[path]

    fut = TensorFuture(c, futures, lambda answers: _raise_failures(c, answers), cleanup=done)
    with _lock:
        _in_flight[path] = fut
    return fut


def load(state_dict: dict, path) -> None:
    """Fill ``state_dict`` in place from the checkpoint at ``path``: every DTensor from the
    saved blocks it overlaps, whatever mesh and placements it was saved with (each rank reads
    only what its own shards need); torch tensors and Python values are set back in the dict.
    Keys the checkpoint has and ``state_dict`` does not are left unread."""
    from ..autograd import versions
    path = os.path.abspath(os.fspath(path))
    leaves, lists = flatten(state_dict)
    _wait_for_save(path)  # a save_async to it still writing: what it writes is what loads
    metadata = _metadata(path)
    if metadata is not None:
        check_against(metadata, leaves)
    c = _controller(leaves)
    entries = [_load_entry(leaf) for leaf in leaves]
    for e in entries:
        if e.mesh is not None:
            c.ensure_mesh(e.mesh)
    futures = c.request(lambda req: m.Checkpoint(req, "load", path, None, tuple(entries),
                                                 tuple(lists.items()), tuple(range(c.world))),
                        range(c.world))
    for leaf in leaves:
        if isinstance(leaf.value, DTensor):
            versions.bump(leaf.value)  # written in place on the ranks
    loaded = TensorFuture(c, futures, lambda answers: _raise_failures(c, answers)).result()
    _set_loaded(state_dict, leaves, loaded)


# checks ------------------------------------------------------------------------------------------
def _checked_save_path(path) -> str:
    from ..runtime.checkpoint_io import check_save_path
    path = os.path.abspath(os.fspath(path))
    check_save_path(path)
    return path


def _metadata(path: str):
    """The checkpoint's metadata where this process can read it (the ranks' file system is
    often the controller's); None when only the ranks can (they then raise what is wrong)."""
    import torch.distributed.checkpoint as dcp
    if not os.path.isdir(path):
        if os.path.exists(path) or os.path.isdir(os.path.dirname(path)):
            raise FileNotFoundError(f"no checkpoint at {path} (not a directory); give the "
                                    f"directory dtorch.checkpoint.save wrote")
        return None
    if not os.path.exists(os.path.join(path, ".metadata")):
        raise FileNotFoundError(f"{path} is not a checkpoint: it has no .metadata file "
                                f"(written last by a save that completed)")
    return dcp.FileSystemReader(path).read_metadata()


def _controller(leaves: list[Leaf]):
    from ..runtime import session
    controllers = {leaf.value._live() for leaf in leaves if isinstance(leaf.value, DTensor)}
    if len(controllers) > 1:
        raise ClusterError("the state dict holds DTensors of two clusters; save each "
                           "cluster's own")
    return controllers.pop() if controllers else session.get_controller()


def _check_savable(leaves: list[Leaf]) -> None:
    for leaf in leaves:
        v = leaf.value
        if not isinstance(v, (DTensor, torch.Tensor)):
            try:
                pickle.dumps(v)
            except Exception as exc:  # noqa: BLE001 - say which value and why
                raise TypeError(f"{leaf.fqn!r} ({type(v).__name__}) cannot be saved: "
                                f"pickling it failed ({exc}); store something picklable "
                                f"there") from exc


def _save_entries(c, leaves: list[Leaf]) -> tuple[list[Entry], list[int], list[DTensor]]:
    """The entries of a save, once every value is checked; plain tensors are staged on
    rank 0 (their ids returned, to free after the save). A Partial DTensor is saved reduced
    (its Partial mesh dims made Replicate: a planned, counted all_reduce, as ``to_torch``
    does); those reduced values are returned, to keep until the ranks have written them."""
    _check_savable(leaves)
    entries, staged, reduced = [], [], []
    for leaf in leaves:
        v = leaf.value
        if isinstance(v, DTensor):
            c.ensure_mesh(v.device_mesh)
            if any(p.is_partial() for p in v.placements):
                v = v._move(v.device_mesh, tuple(Replicate() if p.is_partial() else p
                                                 for p in v.placements))
                reduced.append(v)
            entries.append(Entry(leaf.path, v._tid, v.device_mesh, tuple(v.placements),
                                 tuple(v.shape), v.dtype))
        elif isinstance(v, torch.Tensor):
            tid = c.new_tid()
            c.stage(0, tid, v.detach().cpu())
            c.issue(m.Load(tid, (0,)))
            staged.append(tid)
            entries.append(Entry(leaf.path, tid, None, (), tuple(v.shape), v.dtype))
        else:
            entries.append(Entry(leaf.path, None, None, (), (), None, v))
    return entries, staged, reduced


def _load_entry(leaf: Leaf) -> Entry:
    v = leaf.value
    if isinstance(v, DTensor):  # Partial: the value on the ranks that hold it, zeros else
        return Entry(leaf.path, v._tid, v.device_mesh, tuple(v.placements), tuple(v.shape),
                     v.dtype)
    if isinstance(v, torch.Tensor):
        return Entry(leaf.path, None, None, (), tuple(v.shape), v.dtype)
    return Entry(leaf.path, None, None, (), (), None, None)


def _wait_for_save(path: str) -> None:
    """A save or load of ``path`` waits for a save_async to it that is still writing."""
    with _lock:
        fut = _in_flight.pop(path, None)
    if fut is not None:
        fut.wait()


# answers ---------------------------------------------------------------------------------------
def _raise_failures(c, answers: dict):
    """Rank 0's answer, or the exception of the first rank that failed itself (before
    those that only say a peer did)."""
    from ..runtime.checkpoint_io import PEER_FAILED
    failures = sorted((value.message == PEER_FAILED, rank, value)
                      for rank, (status, value) in answers.items() if status != "ok")
    if failures:
        raise c.error_for(failures[0][2])
    return answers[0][1]


def _set_loaded(state_dict: dict, leaves: list[Leaf], loaded: dict) -> None:
    """Put rank 0's loaded torch tensors (in place) and Python values into ``state_dict``."""
    from ..runtime.wire import unpack
    for i, leaf in enumerate(leaves):
        if i not in loaded:
            continue
        value = loaded[i]
        if isinstance(leaf.value, torch.Tensor):
            with torch.no_grad():
                leaf.value.copy_(unpack(value))
        else:
            set_value(state_dict, leaf.keys, value)
