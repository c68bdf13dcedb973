"""dtorch.checkpoint: sharded checkpoints in the ``torch.distributed.checkpoint`` format.

Each rank writes and reads its own shards (never through the controller); a load reshards
onto any mesh; a PyTorch SPMD program reads the same directory with
``torch.distributed.checkpoint.load``. See :mod:`dtorch.checkpoint.save_load`.

>>> from dtorch.checkpoint import save, save_async, load
>>> callable(save) and callable(save_async) and callable(load)
True
"""

from .save_load import load, save, save_async

__all__ = ["save", "save_async", "load"]
