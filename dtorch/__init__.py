"""dtorch: single-controller distributed tensors for PyTorch.

>>> import dtorch
>>> from dtorch import init_device_mesh, Shard, Replicate, Partial
>>> init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp")).groups("dp")
((0, 2), (1, 3))
"""

from .errors import (ClusterError, DTorchError, FreedTensorError, InterpreterStuckError,
                     MeshError, MixedTensorError, PlacementError, PlacementValueError,
                     RemoteError, UnsupportedOpError, WorkerLostError)
from .layout import chunk_sizes, local_shapes, rank_blocks
from .mesh import DeviceMesh, init_device_mesh
from .pipeline import assign_layers_to_stages, pipeline_backward
from .placement import Partial, Placement, Replicate, Shard
from .redistribute import plan_redistribute
from .comm_debug import CommDebugMode

from .tensor import DTensor, Tensor
from .factories import (arange, distribute_tensor, empty, from_local, empty_like, full, full_like, ones,
                        ones_like, rand, rand_like, randint, randn, randn_like, tensor, zeros,
                        zeros_like)
from .graph import Graph
from .runtime.session import (cluster_info, init, manual_seed, rank_stats, restart, shutdown,
                              synchronize)
from .runtime.dry_run import DryRunError
from .runtime.links import measure_links, predict, time_comms
from torch import (bfloat16, bool, complex64, float16, float32, float64, int8, int16, int32,
                   int64, uint8)

float = float32
double = float64
half = float16
long = int64
int = int32

__version__ = "0.1.0"
_PARALLEL = ("parallelize_module", "distribute_module", "fully_shard", "loss_parallel",
             "DistributedDataParallel",
             "ColwiseParallel",
             "RowwiseParallel", "SequenceParallel", "PrepareModuleInput", "PrepareModuleOutput",
             "ParallelStyle")


def __getattr__(name: str):
    """``dtorch.relu``, ``dtorch.matmul``, ...: torch functions with a placement rule."""
    if name.startswith("__"):
        raise AttributeError(f"module 'dtorch' has no attribute {name!r}")
    if name in ("constants_sent", "clear_constants"):  # plain tensors as constants
        from .ops import constants
        return getattr(constants, name)
    if name in ("nn", "ops", "random", "parallel", "optim", "checkpoint"):
        import importlib
        return importlib.import_module(f".{name}", __name__)
    if name in _PARALLEL:  # dtorch.parallelize_module, dtorch.ColwiseParallel, ...
        from . import parallel
        return getattr(parallel, name)
    from .ops.exports import missing, routed
    func = routed(name)
    if func is None:
        raise missing("dtorch", name)
    globals()[name] = func
    return func
