"""MeshView: the rank grid of a DeviceMesh; choosing a dim highlights its rank groups.

``MeshView(mesh)`` takes a DeviceMesh, or a DTensor (then it shows the tensor's mesh).

An ``ipywidgets.VBox`` of a ToggleButtons (``none`` and one button per mesh dim) and an
``HTML`` picture from :func:`dtorch_widgets.html.mesh_html`. Its state can be read and set
without a frontend. Example::

    >>> from dtorch import init_device_mesh
    >>> v = MeshView(init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp")))
    >>> v.grid, v.selected_dim, v.highlighted_groups
    ([[0, 1], [2, 3]], None, ())
    >>> v.select("tp").highlighted_groups
    ((0, 1), (2, 3))
    >>> v.buttons.value = 0   # what a click on "dp" does
    >>> v.selected_dim, v.highlighted_groups
    (0, ((0, 2), (1, 3)))
"""

from __future__ import annotations

import ipywidgets as W

from .display import StaticFallback, type_name
from .html import dim_label, mesh_html

NONE = -1  # the ToggleButtons value for "no dim highlighted"
MESH_ATTRS = ("ranks", "ndim", "mesh_list", "groups", "dim_index")


def mesh_of(x):
    """``x`` if it is a DeviceMesh, a DTensor's ``device_mesh``; TypeError otherwise.

    >>> from types import SimpleNamespace
    >>> from dtorch import init_device_mesh
    >>> m = init_device_mesh("cpu", 2)
    >>> mesh_of(SimpleNamespace(device_mesh=m)) is m
    True
    """
    mesh = getattr(x, "device_mesh", x)
    if not all(hasattr(mesh, a) for a in MESH_ATTRS):
        raise TypeError(f"MeshView takes a dtorch DeviceMesh (or a DTensor, to show its mesh), "
                        f"e.g. MeshView(init_device_mesh('cpu', (2, 2))); got "
                        f"{type_name(x)}")
    return mesh


class MeshView(StaticFallback, W.VBox):
    """Interactive picture of ``mesh`` (a DeviceMesh, or a DTensor's mesh);
    ``highlight_dim`` (index or name) starts selected."""

    def __init__(self, mesh, highlight_dim=None, **kwargs):
        self.mesh = mesh = mesh_of(mesh)
        options = [("none", NONE)] + [(dim_label(mesh, d), d) for d in range(mesh.ndim)]
        self.buttons = W.ToggleButtons(options=options, value=NONE, description="groups:",
                                       style={"button_width": "auto"})
        self.picture = W.HTML()
        super().__init__(children=[self.buttons, self.picture], **kwargs)
        self.select(highlight_dim)
        self._redraw()
        self.buttons.observe(self._on_pick, names="value")

    @property
    def grid(self) -> list:
        """The ranks as a nested list, laid out like the mesh.

        >>> from dtorch import DeviceMesh
        >>> MeshView(DeviceMesh("cpu", [[4, 5, 6], [7, 8, 9]])).grid
        [[4, 5, 6], [7, 8, 9]]
        """
        return self.mesh.mesh_list

    @property
    def selected_dim(self) -> int | None:
        """The highlighted mesh dim (an index), or None."""
        v = self.buttons.value
        return None if v == NONE else v

    @property
    def selected_dim_name(self) -> str | None:
        """The highlighted dim's name (``dim{i}`` on an unnamed mesh), or None."""
        d = self.selected_dim
        return None if d is None else dim_label(self.mesh, d)

    @property
    def highlighted_groups(self) -> tuple[tuple[int, ...], ...]:
        """The rank groups along the selected dim (``mesh.groups(dim)``), or ``()``."""
        d = self.selected_dim
        return () if d is None else self.mesh.groups(d)

    def group_of(self, rank: int) -> tuple[int, ...] | None:
        """The highlighted group that holds ``rank``, or None when no dim is selected.

        >>> from dtorch import init_device_mesh
        >>> MeshView(init_device_mesh("cpu", (2, 2)), highlight_dim=1).group_of(3)
        (2, 3)
        """
        for g in self.highlighted_groups:
            if rank in g:
                return g
        return None

    def select(self, dim=None) -> "MeshView":
        """Highlight the groups along ``dim`` (index or name); None clears. Returns self."""
        self.buttons.value = NONE if dim is None else self.mesh.dim_index(dim)
        return self

    def _on_pick(self, change) -> None:
        self._redraw()

    def _redraw(self) -> None:
        self.picture.value = mesh_html(self.mesh, self.selected_dim)
