"""dtorch.parallel: PyTorch's tensor-parallel and FSDP2 APIs on plain torch.nn modules (one
controller).

>>> from dtorch.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
>>> RowwiseParallel().output_layouts
(Replicate(),)
"""

from .api import loss_parallel, parallelize_module
from .base import ParallelStyle
from .ddp import DistributedDataParallel
from .distribute_module import distribute_module
from .fully_shard import fully_shard
from .meta_init import MetaInitError
from .prepare import PrepareModuleInput, PrepareModuleOutput
from .styles import ColwiseParallel, RowwiseParallel, SequenceParallel

__all__ = ["parallelize_module", "distribute_module", "fully_shard", "DistributedDataParallel",
           "loss_parallel", "ParallelStyle",
           "ColwiseParallel", "RowwiseParallel", "SequenceParallel", "PrepareModuleInput",
           "PrepareModuleOutput", "MetaInitError"]
