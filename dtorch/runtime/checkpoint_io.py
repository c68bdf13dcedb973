"""The rank side of ``dtorch.checkpoint``: torch.distributed.checkpoint on this rank's shards.

Every rank of the world runs one ``Checkpoint`` instruction. Each of its DTensor shards is
handed to DCP as a PyTorch DTensor over the same layout (no data copied), so each rank writes
and reads only its own blocks, in DCP's format, over the world's process group; rank 0 adds
the Python values and plain tensors (they live on the controller). A save writes a directory
beside the target and renames it into place once complete: an interrupted save leaves the
previous checkpoint where it was. Example (what the interpreter does)::

    answer = checkpoint_io.run(interp, instr, post_later)   # (req, ("ok", ...)) or None
"""

from __future__ import annotations

import ctypes
import glob
import os
import shutil
import threading
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import torch

from ..layout import holds_value
from . import messages as m
from .poison import Poison, RemoteFailure

_TORCH_MESHES: dict = {}   # (dtorch mesh, world) -> PyTorch DeviceMesh on this rank (no groups)
_WRITER: list = []         # the one thread that writes save_async checkpoints here
_ASYNC_GROUP: list = []    # the process group those writes coordinate over
_lock = threading.Lock()
PEER_FAILED = ("another rank's part of the checkpoint came from a failed op; "
               "dtorch.synchronize() raises that failure")


def run(interp, instr: m.Checkpoint, post_later):
    """Run ``instr`` on this rank; returns its answer, or None when ``post_later`` will be
    called with it (save_async). Whatever fails here is decided by every rank together (one
    vote before DCP starts), so nobody waits in a collective a peer skipped."""
    import torch.distributed as dist
    op = f"dtorch.checkpoint.{instr.action}"
    failure, zeroed = None, []
    try:
        if instr.action == "save_async":
            group = _async_group(interp)  # every rank makes it here, before anything fails
        if interp.rank == 0 and instr.action != "load":
            check_save_path(instr.path)
        items, poison, zeroed = _items(interp, instr)
        if poison is not None:
            failure = poison.failure
        state = nest(items, dict(instr.lists))
        if instr.action == "save_async" and failure is None:
            state = _staged_copy(state)
    except Exception as exc:  # noqa: BLE001 - this rank's own failure: put to the vote
        failure = _failure(interp, op, exc)
    try:
        if _any_rank(failure is not None, interp.device):
            return instr.req, ("err", failure or RemoteFailure(interp.rank, op, PEER_FAILED, ""))
        if instr.action == "save":
            _save(state, instr, dist.group.WORLD)
            return instr.req, ("ok", None)
        if instr.action == "load":
            _load(state, instr)
            with torch.no_grad():
                for t in zeroed:  # a Partial('sum') holds its loaded value on one rank
                    t.zero_()
            return instr.req, ("ok", _loaded_values(state, instr) if interp.rank == 0 else None)
        _writer(interp).submit(_save_later, state, instr, group, post_later, interp)
        return None
    except Exception as exc:  # noqa: BLE001 - every rank answers; DCP told its peers
        return instr.req, ("err", _failure(interp, op, exc))


def _failure(interp, op: str, exc: BaseException) -> RemoteFailure:
    """The failure to answer with: not queued for ``synchronize()`` (the caller of the
    checkpoint gets it), except a broken collective, which leaves this rank out of step."""
    import traceback
    from .collectives import is_comm_failure
    if is_comm_failure(exc):
        return interp._collective_failure(op, exc).failure
    return RemoteFailure(interp.rank, op, f"{type(exc).__name__}: {exc}",
                         "".join(traceback.format_exception(exc)))


def check_save_path(path: str) -> None:
    """Refuse to replace ``path`` unless it is absent, empty or a checkpoint (only DCP's
    ``.metadata`` and ``*.distcp`` files): a save swaps the directory out whole. Run on the
    controller and again on rank 0, which does the swap (its file system may differ).

    >>> import tempfile, pathlib
    >>> d = pathlib.Path(tempfile.mkdtemp()); (d / "notes.txt").write_text("mine")
    4
    >>> try:
    ...     check_save_path(str(d))
    ... except FileExistsError as e:
    ...     print(str(e).split(":")[-1].strip())
    notes.txt; choose an empty or new path
    """
    if os.path.islink(path):
        raise FileExistsError(f"{path} is a symbolic link; a save replaces the directory it "
                              f"names, so give the link's target ({os.path.realpath(path)})")
    if os.path.isfile(path):
        raise FileExistsError(f"{path} is a file; a checkpoint is a directory: save to a "
                              f"new path or a directory")
    if not os.path.isdir(path):
        return
    others = sorted(f for f in os.listdir(path)
                    if f != ".metadata" and not f.endswith(".distcp"))
    if others:
        raise FileExistsError(f"{path} holds files that are not a checkpoint's and a save "
                              f"replaces the directory it names: {', '.join(others[:3])}"
                              f"{' ...' if len(others) > 3 else ''}; choose an empty or new "
                              f"path")


def nest(items: list[tuple[tuple, Any]], lists: dict[tuple, int]) -> dict:
    """The nested dict this rank hands to DCP: ``(path, value)`` pairs placed by path; a list
    this rank holds every element of is a list again, else a dict of its indices as str
    (same keys once flattened).

    >>> nest([(("a", 0), 1), (("a", 1), 2), (("b", 1), 3)], {("a",): 2, ("b",): 2})
    {'a': [1, 2], 'b': {'1': 3}}
    """
    root: dict = {}
    for path, value in items:
        node = root
        for k in path[:-1]:
            node = node.setdefault(str(k), {})
        node[str(path[-1])] = value

    def relist(path: tuple, node):
        if not isinstance(node, dict):
            return node
        out = {k: relist(path + (int(k) if path in lists else k,), v) for k, v in node.items()}
        n = lists.get(path)
        if n is not None and sorted(out) == sorted(map(str, range(n))):
            return [out[str(i)] for i in range(n)]
        return out

    return {k: relist((k,), v) for k, v in root.items()}


def _items(interp, instr) -> tuple[list, Poison | None, list]:
    """``(path, value)`` for what this rank holds, the first poisoned shard among them, and
    (load) the shards of Partial values this rank does not hold, to zero once loaded."""
    from torch.distributed.tensor import DTensor as TorchDTensor
    items, poison, zeroed = [], None, []
    for e in instr.entries:
        if e.mesh is None:  # on the controller: rank 0 writes or reads it
            if interp.rank != 0:
                continue
            if e.dtype is None:  # a Python value (None: a place for the loaded one)
                items.append((e.path, e.value))
                continue
            value = torch.empty(e.shape, dtype=e.dtype) if instr.action == "load" else \
                interp.store.get(e.tid)
        elif interp.rank not in e.mesh.ranks:
            continue
        else:
            value = interp.store.get(e.tid)
            if isinstance(value, torch.Tensor) and instr.action == "load":
                value = _writable(interp, e.tid, value)
                if not holds_value(e.mesh, e.placements, e.mesh.get_coordinate(interp.rank)):
                    zeroed.append(value)
                    continue
        if isinstance(value, Poison) or value is None:
            poison = poison or (value if value is not None else interp._fail(
                "checkpoint", KeyError(f"tensor {e.tid} not found")))
            continue
        if e.mesh is not None:
            value = TorchDTensor.from_local(value, _torch_mesh(e.mesh), _placements(e),
                                            run_check=False, shape=torch.Size(e.shape),
                                            stride=torch.empty(e.shape, device="meta").stride())
        items.append((e.path, value))
    return items, poison, zeroed


def _writable(interp, tid: int, value: torch.Tensor) -> torch.Tensor:
    """A shard a load can write into in place: one whose elements share memory (an expanded
    value) gets its own first."""
    from .local_graphs import _overlaps
    if _overlaps(value):
        value = value.clone()
        interp.store[tid] = value
    return value


def _any_rank(flag: bool, device) -> bool:
    """Whether ``flag`` holds on any rank of the world (one small all_reduce)."""
    import torch.distributed as dist
    t = torch.tensor([1 if flag else 0], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def _torch_mesh(mesh):
    """The PyTorch DeviceMesh of a dtorch mesh in this rank's current world, built the way
    ``DeviceMesh.from_group`` builds one: DCP needs only this rank's coordinate, so no
    process group is made."""
    import torch.distributed as dist
    key = (mesh, id(dist.group.WORLD))  # a restarted world here may give this process
    found = _TORCH_MESHES.get(key)      # another rank
    if found is None:
        from torch.distributed.device_mesh import DeviceMesh as TorchMesh
        found = TorchMesh(mesh.device_type, torch.tensor(mesh.mesh_list, dtype=torch.int),
                          mesh_dim_names=mesh.mesh_dim_names, _init_backend=False)
        _TORCH_MESHES[key] = found
    return found


def _placements(e) -> tuple:
    from torch.distributed.tensor import Replicate, Shard
    return tuple(Shard(p.dim) if p.is_shard() else Replicate() for p in e.placements)


def _save(state: dict, instr, group) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    dcp.save(state, storage_writer=dcp.FileSystemWriter(instr.staging), process_group=group)
    if dist.get_rank() == 0:
        publish(instr.staging, instr.path)


def _load(state: dict, instr) -> None:
    import torch.distributed.checkpoint as dcp
    dcp.load(state, storage_reader=dcp.FileSystemReader(instr.path))


def _loaded_values(state: dict, instr) -> dict:
    """Rank 0's loaded Python values and plain tensors, by their index in ``entries``."""
    from .wire import pack
    out = {}
    for i, e in enumerate(instr.entries):
        if e.mesh is not None:
            continue
        node = state
        for k in e.path:
            node = node[k] if isinstance(node, list) else node[str(k)]
        out[i] = pack(node) if isinstance(node, torch.Tensor) else node
    return out


def _staged_copy(state):
    """What save_async writes: a copy of every shard made now, in CPU memory, so training
    can go on (and a GPU keeps only its own)."""
    from torch.distributed.tensor import DTensor as TorchDTensor

    def copy(v):
        if isinstance(v, TorchDTensor):
            return TorchDTensor.from_local(v.to_local().detach().to("cpu", copy=True),
                                           _cpu_mesh(v.device_mesh), v.placements,
                                           run_check=False, shape=v.shape, stride=v.stride())
        if isinstance(v, torch.Tensor):
            return v.detach().to("cpu", copy=True)
        if isinstance(v, dict):
            return {k: copy(x) for k, x in v.items()}
        if isinstance(v, list):
            return [copy(x) for x in v]
        return v

    return copy(state)


def _cpu_mesh(torch_mesh):
    """The same mesh for CPU copies (the writer's group is gloo)."""
    from torch.distributed.device_mesh import DeviceMesh as TorchMesh
    if torch_mesh.device_type == "cpu":
        return torch_mesh
    return TorchMesh("cpu", torch_mesh.mesh, mesh_dim_names=torch_mesh.mesh_dim_names,
                     _init_backend=False)


def _async_group(interp):
    """The process group save_async's writes coordinate over: gloo (the copies are in CPU
    memory), the world's ranks and timeout, made once per world on every rank in stream
    order (``new_group`` is collective)."""
    import torch.distributed as dist
    with _lock:
        if not _ASYNC_GROUP or _ASYNC_GROUP[0][0] is not dist.group.WORLD:
            group = dist.new_group(list(range(dist.get_world_size())), backend="gloo",
                                   timeout=timedelta(seconds=interp.timeout_s))
            _ASYNC_GROUP[:] = [(dist.group.WORLD, group)]
        return _ASYNC_GROUP[0][1]


def _writer(interp) -> ThreadPoolExecutor:
    """The one thread that runs save_async writes, in order (only it uses their group)."""
    with _lock:
        if not _WRITER:
            _WRITER.append(ThreadPoolExecutor(1, thread_name_prefix="dtorch-ckpt"))
        return _WRITER[0]


def _save_later(state, instr, group, post_later, interp) -> None:
    try:
        _save(state, instr, group)
        answer = ("ok", None)
    except Exception as exc:  # noqa: BLE001 - reported through the future
        answer = ("err", _failure(interp, "dtorch.checkpoint.save_async", exc))
    post_later(instr.req, answer)


# publishing ------------------------------------------------------------------------------------
_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _exchange(a: str, b: str) -> bool:
    """Swap two paths in one step (Linux ``renameat2(RENAME_EXCHANGE)``); False where the
    system cannot."""
    libc = ctypes.CDLL(None, use_errno=True)
    fn = getattr(libc, "renameat2", None)
    if fn is None:
        return False
    return fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0


def publish(staging: str, path: str) -> None:
    """Move the complete checkpoint at ``staging`` to ``path``; a previous one there is
    swapped out in one step where the system can (else renamed aside first), then removed,
    with what interrupted saves to ``path`` left behind.

    >>> import tempfile, pathlib
    >>> d = pathlib.Path(tempfile.mkdtemp())
    >>> (d / "new").mkdir(); (d / "new" / ".metadata").write_text("2")
    1
    >>> (d / "ckpt").mkdir(); (d / "ckpt" / ".metadata").write_text("1")
    1
    >>> publish(str(d / "new"), str(d / "ckpt"))
    >>> (d / "ckpt" / ".metadata").read_text(), sorted(p.name for p in d.iterdir())
    ('2', ['ckpt'])
    """
    old = None
    if os.path.lexists(path):
        if _exchange(staging, path):
            old = staging  # it holds the previous checkpoint now
        else:
            old = staging + ".old"
            os.rename(path, old)
            os.rename(staging, path)
    else:
        os.rename(staging, path)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    for stale in glob.glob(glob.escape(path) + ".dtorch-tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)
