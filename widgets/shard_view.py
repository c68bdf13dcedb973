"""ShardView: which rank holds which block of a distributed tensor.

Takes the DTensor you hold, ``ShardView(dtensor, show_values=False)`` (``show_values=True``
fetches each rank's shard), or a plain description, ``ShardView(shape, mesh, placements,
values=None)`` with ``values`` an optional ``{rank: local torch.Tensor}``. An
``ipywidgets.VBox``: a rank picker (highlight what one rank holds), a values checkbox, and the
picture from :func:`dtorch_widgets.html.tiling_html`. All state is readable without a
frontend. Example::

    >>> from dtorch import init_device_mesh, Shard, Replicate, Partial
    >>> m = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    >>> v = ShardView((4, 5), m, [Shard(1), Replicate()])
    >>> v.block_owners
    {((0, 4), (0, 3)): (0, 1), ((0, 4), (3, 5)): (2, 3)}
    >>> v.uneven, v.replicate_dims
    (True, (1,))
    >>> ShardView((4,), m, [Shard(0), Partial()]).block_layers[((0, 2),)]
    ((0,), (1,))
"""

from __future__ import annotations

import itertools
import math

import ipywidgets as W

from .display import StaticFallback, type_name
from .html import tiling_html
from .tiles import Tiling

NONE = -1  # rank picker value for "all ranks"
MAX_PICKER = 256  # ranks listed in the picker; larger meshes get a number box
USAGE = ("ShardView takes a DTensor, ShardView(dtensor, show_values=False), or a plain "
         "description, ShardView(shape, mesh, placements, values=None)")


def is_dtensor(x) -> bool:
    """Whether ``x`` looks like a DTensor (has ``shape``, ``device_mesh`` and ``placements``)."""
    return all(hasattr(x, a) for a in ("shape", "device_mesh", "placements"))


def _rank_picker(mesh):
    """A dropdown of the mesh's ranks ("all" first), or a number box on a big mesh."""
    if len(mesh.ranks) > MAX_PICKER:
        return W.IntText(value=NONE, description="highlight rank:")
    opts = [("all", NONE)] + [(f"rank {r}", r) for r in mesh.ranks]
    return W.Dropdown(options=opts, value=NONE, description="highlight:")


def _describe(dtensor, values, title, show_values):
    """``(shape, mesh, placements, values, title)`` of a DTensor; fetches each rank's shard
    only for ``show_values``."""
    if not is_dtensor(dtensor):
        raise TypeError(f"{USAGE}; got ShardView({type_name(dtensor)}) with no mesh and "
                        f"placements")
    mesh = dtensor.device_mesh
    if values is None and show_values:
        values = {r: dtensor.to_local(r) for r in mesh.ranks}
    if title is None:
        dtype = getattr(dtensor, "dtype", None)
        title = "DTensor" + (f" {str(dtype).replace('torch.', '')}" if dtype is not None else "")
    return tuple(dtensor.shape), mesh, dtensor.placements, values, title


class ShardView(StaticFallback, W.VBox):
    """Blocks of a DTensor (``source``), or of a ``source``-shaped tensor laid out by
    ``placements`` on ``mesh``, by owning rank."""

    def __init__(self, source, mesh=None, placements=None, values=None, title=None,
                 show_values: bool = False, **kwargs):
        if mesh is None and placements is None:
            source, mesh, placements, values, title = _describe(source, values, title,
                                                                show_values)
        elif mesh is None or placements is None or is_dtensor(source):
            raise TypeError(USAGE + f"; got ShardView({type_name(source)}, mesh={mesh!r}, "
                                    f"placements={placements!r})")
        self.tiling = Tiling(source, mesh, placements)
        self.values = dict(values) if values is not None else None
        self.title = title
        self.rank_picker = _rank_picker(mesh)
        self.values_box = W.Checkbox(value=values is not None, description="values",
                                     disabled=values is None, indent=False)
        self.picture = W.HTML()
        super().__init__(children=[W.HBox([self.rank_picker, self.values_box]), self.picture],
                         **kwargs)
        self._redraw()
        self.rank_picker.observe(self._on_change, names="value")
        self.values_box.observe(self._on_change, names="value")

    @classmethod
    def of(cls, dtensor, show_values: bool = False, **kwargs) -> "ShardView":
        """The view of a DTensor; the same as ``ShardView(dtensor, show_values=...)``.

        >>> from types import SimpleNamespace
        >>> from dtorch import init_device_mesh, Shard
        >>> x = SimpleNamespace(shape=(4,), device_mesh=init_device_mesh("cpu", 2),
        ...                     placements=(Shard(0),))
        >>> ShardView.of(x).local_shapes
        {0: (2,), 1: (2,)}
        """
        if not is_dtensor(dtensor):
            raise TypeError(f"ShardView.of takes a DTensor; got {type_name(dtensor)}")
        return cls(dtensor, show_values=show_values, **kwargs)

    # layout state ---------------------------------------------------------------------------
    @property
    def shape(self) -> tuple[int, ...]:
        return self.tiling.shape

    @property
    def mesh(self):
        return self.tiling.mesh

    @property
    def placements(self) -> tuple:
        """The placements, normalized (Shard dims non-negative)."""
        return self.tiling.placements

    @property
    def blocks(self) -> dict:
        """``{rank: RankBlock(shape, offset)}``: each rank's block of the global tensor."""
        return self.tiling.blocks

    @property
    def local_shapes(self) -> dict[int, tuple[int, ...]]:
        """``{rank: local shape}``."""
        return {r: b.shape for r, b in self.tiling.blocks.items()}

    @property
    def block_owners(self) -> dict[tuple, tuple[int, ...]]:
        """``{block: ranks that hold it}``; a block is one ``(start, stop)`` per tensor dim.

        Blocks are the tensor cut at every rank-block boundary, so each has one set of owners:
        one rank when sharded, several when replicated or partial.
        """
        return self.tiling.owners

    @property
    def block_layers(self) -> dict[tuple, tuple[tuple[int, ...], ...]]:
        """``{block: (ranks holding partial value 0, ...)}``; one layer without Partial."""
        return self.tiling.layers

    @property
    def partial_dims(self) -> tuple[int, ...]:
        """Mesh dims placed ``Partial``."""
        return self.tiling.partial_dims

    @property
    def replicate_dims(self) -> tuple[int, ...]:
        """Mesh dims placed ``Replicate``."""
        return self.tiling.replicate_dims

    @property
    def shard_dims(self) -> dict[int, int]:
        """``{mesh dim: tensor dim}`` for each ``Shard``."""
        return self.tiling.shard_dims

    @property
    def uneven(self) -> bool:
        """True when ranks hold blocks of different shapes."""
        return self.tiling.uneven

    @property
    def empty_ranks(self) -> tuple[int, ...]:
        """Ranks that hold no elements."""
        return self.tiling.empty_ranks

    def owners_of(self, index) -> tuple[int, ...]:
        """Ranks that hold global element ``index``.

        >>> from dtorch import init_device_mesh, Shard
        >>> ShardView((5,), init_device_mesh("cpu", 2), [Shard(0)]).owners_of((3,))
        (1,)
        """
        return self.tiling.owners_of(index)

    def element_owners(self, limit: int = 4096) -> dict[tuple[int, ...], tuple[int, ...]]:
        """``{element index: ranks}`` for every element (tensors of at most ``limit`` elements).

        >>> from dtorch import init_device_mesh, Shard
        >>> ShardView((3,), init_device_mesh("cpu", 2), [Shard(0)]).element_owners()
        {(0,): (0,), (1,): (0,), (2,): (1,)}
        """
        n = math.prod(self.shape)
        if n > limit:
            raise ValueError(f"a {self.shape} tensor has {n} elements, more than limit={limit}; "
                             f"use block_owners, or pass a larger limit")
        return {i: self.owners_of(i) for i in itertools.product(*(range(s) for s in self.shape))}

    # interactive state ----------------------------------------------------------------------
    @property
    def selected_rank(self) -> int | None:
        """The highlighted rank, or None for all."""
        v = self.rank_picker.value
        return v if v in self.blocks else None  # "all", or a number box holding no rank

    @property
    def highlighted_blocks(self) -> tuple[tuple, ...]:
        """Blocks the selected rank holds (all blocks when none is selected)."""
        r = self.selected_rank
        return tuple(b for b, owners in self.block_owners.items() if r is None or r in owners)

    def select_rank(self, rank: int | None) -> "ShardView":
        """Highlight what ``rank`` holds (None: all ranks). Returns self."""
        if rank is not None and rank not in self.blocks:
            raise ValueError(f"rank {rank} is not in the mesh {self.mesh.ranks}")
        self.rank_picker.value = NONE if rank is None else rank
        return self

    @property
    def show_values(self) -> bool:
        """Whether per-rank values are drawn (only possible when values were given)."""
        return self.values is not None and self.values_box.value

    def _on_change(self, change) -> None:
        self._redraw()

    def _redraw(self) -> None:
        self.picture.value = tiling_html(self.tiling, self.values if self.show_values else None,
                                         highlight_rank=self.selected_rank, title=self.title)
