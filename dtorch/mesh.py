"""DeviceMesh: an n-dimensional grid of ranks with optional dim names.

A small immutable value type: equal when device type, ranks and names are; hashable and
picklable, so it can key caches and travel to workers. Example::

    >>> from dtorch import DeviceMesh, init_device_mesh
    >>> m = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    >>> m
    DeviceMesh('cpu', [[0, 1], [2, 3]], mesh_dim_names=('dp', 'tp'))
    >>> m.groups("tp")
    ((0, 1), (2, 3))
    >>> [sub.ranks for sub in m.unbind("dp")]
    [(0, 1), (2, 3)]
"""

from __future__ import annotations

import math
from functools import cached_property
from typing import Iterable, Sequence

from . import config
from .errors import MeshError

DEVICE_TYPES = ("cpu", "cuda")


def _nested_shape(data) -> tuple[int, ...]:
    if isinstance(data, (list, tuple)):
        if not data:
            raise MeshError("a mesh needs at least one rank; got an empty list")
        inner = [_nested_shape(x) for x in data]
        if any(s != inner[0] for s in inner):
            raise MeshError(f"the mesh {data!r} is ragged; every row must have the same length")
        return (len(data),) + inner[0]
    return ()


def _flatten(data) -> list:
    if isinstance(data, (list, tuple)):
        return [r for x in data for r in _flatten(x)]
    return [data]


def _to_nested_list(mesh):
    tolist = getattr(mesh, "tolist", None)
    return tolist() if tolist is not None else mesh


class RankTuple(tuple):
    """A mesh's ranks: a plain tuple of ints, of its own type so batches can send it once per
    rank instead of once per instruction (``dtorch.runtime.intern``)."""

    __slots__ = ()


class DeviceMesh:
    """A grid of ranks: ``DeviceMesh("cpu", [[0, 1], [2, 3]], mesh_dim_names=["dp", "tp"])``.

    ``mesh`` is a nested list, tuple or tensor of distinct non-negative ints; ``None`` means a
    1-D mesh of every rank of the cluster.
    """

    def __init__(self, device_type: str, mesh=None, mesh_dim_names: Sequence[str] | None = None):
        if device_type not in DEVICE_TYPES:
            raise MeshError(f"device_type must be one of {DEVICE_TYPES}; got {device_type!r}")
        if mesh is None:
            mesh = list(range(config.world_size()))
        mesh = _to_nested_list(mesh)
        if not isinstance(mesh, (list, tuple)):
            mesh = [mesh]
        shape = _nested_shape(mesh)
        ranks = RankTuple(_flatten(mesh))
        for r in ranks:
            if isinstance(r, bool) or not isinstance(r, int) or r < 0:
                raise MeshError(f"mesh entries must be non-negative int ranks; got {r!r} in {mesh!r}")
        if len(set(ranks)) != len(ranks):
            raise MeshError(f"a rank may appear only once in a mesh; {mesh!r} repeats one")
        names = None
        if mesh_dim_names is not None:
            names = tuple(mesh_dim_names)
            if len(names) != len(shape):
                raise MeshError(
                    f"mesh_dim_names has {len(names)} names for a {len(shape)}-D mesh of shape "
                    f"{shape}; give one name per mesh dim")
            if len(set(names)) != len(names) or not all(isinstance(n, str) and n for n in names):
                raise MeshError(f"mesh_dim_names must be distinct non-empty strings; got {names!r}")
        for attr, value in (("_device_type", device_type), ("_shape", shape), ("_ranks", ranks),
                            ("_names", names), ("_hash", hash((device_type, shape, ranks, names)))):
            object.__setattr__(self, attr, value)

    # value semantics -------------------------------------------------------------------------
    def __eq__(self, other) -> bool:
        return (isinstance(other, DeviceMesh) and self._hash == other._hash
                and self._key() == other._key())

    def __hash__(self) -> int:
        return self._hash

    def _key(self):
        return (self._device_type, self._shape, self._ranks, self._names)

    def __reduce__(self):
        return (_rebuild_mesh, self._key())

    def __setattr__(self, name, value):
        raise AttributeError("DeviceMesh is immutable; build a new one instead")

    def __repr__(self) -> str:
        names = f", mesh_dim_names={self._names!r}" if self._names else ""
        return f"DeviceMesh({self._device_type!r}, {self.mesh_list!r}{names})"

    def _repr_html_(self) -> str:
        """Static picture of the rank grid (renders on GitHub and in nbconvert output)."""
        from dtorch_widgets.html import mesh_html
        return mesh_html(self)

    def _repr_mimebundle_(self, include=None, exclude=None) -> dict:
        """The static picture, plus the interactive MeshView inside a Jupyter kernel."""
        from dtorch_widgets.display import mesh_mimebundle
        return mesh_mimebundle(self, include, exclude)

    # attributes ------------------------------------------------------------------------------
    @property
    def device_type(self) -> str:
        return self._device_type

    @property
    def shape(self) -> tuple[int, ...]:
        return self._shape

    @property
    def ndim(self) -> int:
        return len(self._shape)

    @property
    def ranks(self) -> tuple[int, ...]:
        """Ranks in row-major order of the grid."""
        return self._ranks

    @property
    def mesh_dim_names(self) -> tuple[str, ...] | None:
        return self._names

    @property
    def mesh_list(self) -> list:
        """The rank grid as a nested list (a fresh copy each time)."""
        out: list = list(self._ranks)
        for n in reversed(self._shape[1:]):
            out = [out[i:i + n] for i in range(0, len(out), n)]
        return out

    @property
    def mesh(self):
        """The rank grid as a torch int64 tensor."""
        import torch
        return torch.tensor(self._ranks, dtype=torch.int64).reshape(self._shape)

    def size(self, dim: int | str | None = None) -> int:
        """Number of ranks in the mesh, or along one dim (index or name)."""
        if dim is None:
            return len(self._ranks)
        return self._shape[self.dim_index(dim)]

    # dims by name ----------------------------------------------------------------------------
    def dim_name_index(self, name: str) -> int | None:
        """Index of the dim called ``name``, or None when the mesh has no such dim."""
        if self._names is None or name not in self._names:
            return None
        return self._names.index(name)

    def dim_index(self, dim: int | str) -> int:
        """Normalize a dim given by index (negative allowed) or by name; raises if absent."""
        if isinstance(dim, str):
            idx = self.dim_name_index(dim)
            if idx is None:
                raise MeshError(
                    f"this mesh has no dim named {dim!r}; its dims are {self._names!r}. "
                    f"Pass one of those names or an index below {self.ndim}")
            return idx
        if isinstance(dim, bool) or not isinstance(dim, int) or not -self.ndim <= dim < self.ndim:
            raise MeshError(f"mesh dim {dim!r} is out of range for a {self.ndim}-D mesh; "
                            f"pass an index in [{-self.ndim}, {self.ndim}) or a dim name")
        return dim % self.ndim

    def check_all_dim_names_in_set(self, names: Iterable[str]) -> None:
        """Raise unless every dim of this mesh has a name in ``names``."""
        allowed = set(names)
        if self._names is None:
            raise MeshError(f"this mesh has no dim names; expected names from {sorted(allowed)}")
        extra = [n for n in self._names if n not in allowed]
        if extra:
            raise MeshError(f"mesh dim names {extra} are not in the allowed set {sorted(allowed)}")

    def __getitem__(self, name: str | tuple) -> "MeshDim":
        """``mesh["tp"]``: PyTorch's sub-mesh by dim name, read by ``dtorch.parallelize_module``
        and ``distribute_module`` as "the tp dim of this mesh" (other dims Replicate). A single
        controller has no "current rank", so there is no 1-D mesh of "my" tp group to return."""
        names = name if isinstance(name, tuple) else (name,)
        if len(names) == 1:
            return MeshDim(self, self.dim_index(names[0]) if isinstance(names[0], str)
                           else _name_error(self, names[0]))
        if names == self._names:
            return MeshDim(self, None)
        raise MeshError(f"mesh[{name!r}]: dtorch slices one dim by name (mesh['tp']) or all of "
                        f"them in order {self._names!r}")

    # coordinates and groups ------------------------------------------------------------------
    @cached_property
    def _coords(self) -> dict[int, tuple[int, ...]]:
        out = {}
        for flat, rank in enumerate(self._ranks):
            coord = []
            for n in reversed(self._shape):
                coord.append(flat % n)
                flat //= n
            out[rank] = tuple(reversed(coord))
        return out

    def get_coordinate(self, rank: int) -> tuple[int, ...] | None:
        """Coordinate of ``rank`` in the grid, or None when the mesh does not hold it."""
        return self._coords.get(rank)

    def rank_at(self, coord: Sequence[int]) -> int:
        """The rank at a grid coordinate."""
        flat = 0
        for c, n in zip(coord, self._shape):
            flat = flat * n + c
        return self._ranks[flat]

    def groups(self, dim: int | str) -> tuple[tuple[int, ...], ...]:
        """Rank tuples along ``dim``: the process groups a collective over that dim uses."""
        return _groups(self, self.dim_index(dim))

    def unbind(self, name: str) -> list["DeviceMesh"]:
        """Sub-meshes with dim ``name`` removed, one per index along it; ``[self]`` if absent."""
        idx = self.dim_name_index(name)
        if idx is None:
            return [self]
        if self.ndim == 1:
            return [DeviceMesh(self._device_type, [r]) for r in self._ranks]
        names = self._names[:idx] + self._names[idx + 1:]
        out = []
        for i in range(self._shape[idx]):
            sub = _take(self.mesh_list, idx, i)
            out.append(DeviceMesh(self._device_type, sub, mesh_dim_names=names))
        return out


class MeshDim:
    """``mesh["tp"]``: a parent mesh and one of its dims (``dim=None``: every dim).

    >>> m = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    >>> m["tp"], m["tp"].size(), m["tp"].mesh is m
    (DeviceMesh('cpu', [[0, 1], [2, 3]], mesh_dim_names=('dp', 'tp'))['tp'], 2, True)
    """

    __slots__ = ("mesh", "dim")

    def __init__(self, mesh: DeviceMesh, dim: int | None):
        self.mesh, self.dim = mesh, dim

    @property
    def ndim(self) -> int:
        return 1 if self.dim is not None else self.mesh.ndim

    @property
    def mesh_dim_names(self):
        names = self.mesh.mesh_dim_names
        return names if self.dim is None else (names[self.dim],)

    def size(self, dim=None) -> int:
        return self.mesh.size(self.dim) if self.dim is not None else self.mesh.size(dim)

    def __eq__(self, other) -> bool:
        return isinstance(other, MeshDim) and (self.mesh, self.dim) == (other.mesh, other.dim)

    def __hash__(self) -> int:
        return hash((self.mesh, self.dim))

    def __repr__(self) -> str:
        names = self.mesh_dim_names
        return f"{self.mesh!r}[{names[0] if self.dim is not None else names!r}]"


def _name_error(mesh: DeviceMesh, name):
    raise MeshError(f"mesh[{name!r}]: index a mesh by a dim name, one of {mesh.mesh_dim_names!r}")


def _take(nested, axis: int, index: int):
    if axis == 0:
        return nested[index]
    return [_take(x, axis - 1, index) for x in nested]


def _groups(mesh: DeviceMesh, dim: int) -> tuple[tuple[int, ...], ...]:
    cache = mesh.__dict__.setdefault("_group_cache", {})
    if dim not in cache:
        by_rest: dict[tuple, list[tuple[int, int]]] = {}
        for rank, coord in mesh._coords.items():
            rest = coord[:dim] + coord[dim + 1:]
            by_rest.setdefault(rest, []).append((coord[dim], rank))
        cache[dim] = tuple(tuple(r for _, r in sorted(v)) for _, v in sorted(by_rest.items()))
    return cache[dim]


def _rebuild_mesh(device_type, shape, ranks, names):
    flat: list = list(ranks)
    for n in reversed(shape[1:]):
        flat = [flat[i:i + n] for i in range(0, len(flat), n)]
    return DeviceMesh(device_type, flat, mesh_dim_names=names)


def init_device_mesh(device_type: str, mesh_shape, mesh_dim_names: Sequence[str] | None = None):
    """A mesh of ranks ``0..N-1`` laid out row-major in ``mesh_shape`` (an int or a tuple).

    >>> init_device_mesh("cpu", 4)
    DeviceMesh('cpu', [0, 1, 2, 3])
    """
    if isinstance(mesh_shape, int):
        mesh_shape = (mesh_shape,)
    mesh_shape = tuple(mesh_shape)
    if not mesh_shape or any(isinstance(n, bool) or not isinstance(n, int) or n < 1
                             for n in mesh_shape):
        raise MeshError(f"mesh_shape must be a positive int or a tuple of them; got {mesh_shape!r}")
    flat: list = list(range(math.prod(mesh_shape)))
    for n in reversed(mesh_shape[1:]):
        flat = [flat[i:i + n] for i in range(0, len(flat), n)]
    return DeviceMesh(device_type, flat, mesh_dim_names=mesh_dim_names)
