"""The default graph: which mesh a tensor or module made without one lives on.

>>> from dtorch import Graph, DeviceMesh
>>> stage = DeviceMesh("cpu", [2, 3])
>>> with Graph.default_graph().device_mesh_guard(stage):
...     Graph.default_graph().device_mesh
DeviceMesh('cpu', [2, 3])
>>> Graph.default_graph().device_mesh is None
True
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from . import config
from .mesh import DeviceMesh


class Graph:
    """Holds the stack of meshes set by ``device_mesh_guard``."""

    _default: "Graph | None" = None

    def __init__(self):
        self._meshes: list[DeviceMesh] = []

    @classmethod
    def default_graph(cls) -> "Graph":
        if cls._default is None:
            cls._default = cls()
        return cls._default

    @property
    def device_mesh(self) -> DeviceMesh | None:
        """The innermost guarded mesh, or None outside every guard."""
        return self._meshes[-1] if self._meshes else None

    @contextmanager
    def device_mesh_guard(self, mesh: DeviceMesh):
        """Tensors and modules created inside live on ``mesh``."""
        if not isinstance(mesh, DeviceMesh):
            raise TypeError(f"device_mesh_guard needs a DeviceMesh; got {type(mesh).__name__}")
        self._meshes.append(mesh)
        try:
            yield mesh
        finally:
            self._meshes.pop()


def default_mesh(device_type: str | None = None) -> DeviceMesh:
    """The mesh of a tensor or module made without one: the innermost ``device_mesh_guard``'s,
    else the whole cluster as a 1-D mesh (``DeviceMesh(device_type)``, as DESIGN.md says) of
    the running cluster's device type. The whole-cluster mesh is built once per device type
    and world size (one object: the controller interns meshes by identity)."""
    mesh = Graph.default_graph().device_mesh
    if mesh is not None:
        return mesh
    if device_type is None:
        from .runtime import session  # late: the runtime imports much of dtorch
        device_type = session._controller.device_type if session.is_running() else "cpu"
    key = (device_type, config.world_size())
    if key not in _WHOLE_CLUSTER:
        _WHOLE_CLUSTER[key] = DeviceMesh(device_type)
    return _WHOLE_CLUSTER[key]


_WHOLE_CLUSTER: dict[tuple[str, int], DeviceMesh] = {}


def mesh_or_default(device_mesh: DeviceMesh | None = None, device=None) -> DeviceMesh:
    """``device_mesh``, else :func:`default_mesh` for ``device``'s type (a factory's or a
    module's ``device_mesh=`` / ``device=`` arguments)."""
    if device_mesh is not None:
        return device_mesh
    return default_mesh(torch.device(device).type if device is not None else None)
