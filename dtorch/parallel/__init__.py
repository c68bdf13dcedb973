"""dtorch.parallel: PyTorch's tensor-parallel API on plain torch.nn modules (one controller).

>>> from dtorch.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
>>> RowwiseParallel().output_layouts
(Replicate(),)
"""

from .api import loss_parallel, parallelize_module
from .base import ParallelStyle
from .distribute_module import distribute_module
from .meta_init import MetaInitError
from .prepare import PrepareModuleInput, PrepareModuleOutput
from .styles import ColwiseParallel, RowwiseParallel, SequenceParallel

__all__ = ["parallelize_module", "distribute_module", "loss_parallel", "ParallelStyle",
           "ColwiseParallel", "RowwiseParallel", "SequenceParallel", "PrepareModuleInput",
           "PrepareModuleOutput", "MetaInitError"]
