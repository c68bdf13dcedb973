"""ipywidgets views of meshes, shards and collectives (installed as ``dtorch_widgets``).

Static pictures (pure HTML/SVG, size-capped; what ``_repr_html_`` returns):
:func:`mesh_html`, :func:`shard_html`, :func:`comm_html`, :func:`dtensor_html`.
Interactive widgets (``ipywidgets.VBox`` subclasses whose state reads without a frontend):
:class:`MeshView`, :class:`ShardView`, :class:`CommView`; explorers (anywidgets, state in
traitlets): :class:`PlacementExplorer` (a redistribute's plan, animated, predicted and run)
and :class:`OpExplorer` (an op's rule on input layouts, or its fixes). Example::

    >>> from dtorch import init_device_mesh, Shard, Replicate
    >>> from dtorch_widgets import MeshView, ShardView
    >>> m = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    >>> MeshView(m, highlight_dim="dp").highlighted_groups
    ((0, 2), (1, 3))
    >>> ShardView((4, 4), m, [Shard(0), Shard(1)]).owners_of((3, 0))
    (2,)
"""

from .comm_view import CommView
from .display import comm_mimebundle, dtensor_mimebundle, mesh_mimebundle
from .comm_picture import comm_html
from .html import dtensor_html, mesh_html, shard_html
from .mesh_view import MeshView
from .op_explorer import OpExplorer
from .placement_explorer import PlacementExplorer
from .shard_view import ShardView
from .tiles import Tiling

__all__ = ["MeshView", "ShardView", "CommView", "PlacementExplorer", "OpExplorer", "Tiling", "mesh_html", "shard_html",
           "comm_html", "dtensor_html", "mesh_mimebundle", "dtensor_mimebundle",
           "comm_mimebundle"]
