"""dtorch: single-controller distributed tensors for PyTorch.

>>> import dtorch
>>> from dtorch import init_device_mesh, Shard, Replicate, Partial
>>> init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp")).groups("dp")
((0, 2), (1, 3))
"""

from .errors import (ClusterError, DTorchError, FreedTensorError, MeshError, PlacementError,
                     PlacementValueError, RemoteError, WorkerLostError)
from .layout import chunk_sizes, local_shapes, rank_blocks
from .mesh import DeviceMesh, init_device_mesh
from .pipeline import assign_layers_to_stages
from .placement import Partial, Placement, Replicate, Shard
from .redistribute import plan_redistribute
from .comm_debug import CommDebugMode

__version__ = "0.1.0"
