"""``dtorch.nn.functional``: ``torch.nn.functional`` for DTensors.

Every function here is the torch one, routed to dtorch's dispatch; ``F.softmax(x, -1)`` with
``import torch.nn.functional as F`` works on DTensors too (through ``__torch_function__``).
The list is ``dtorch.ops.coverage()``. Example::

    >>> import dtorch.nn.functional as DF
    >>> DF.gelu.__wrapped__ is torch.nn.functional.gelu
    True
"""

import torch
import torch.nn.functional as _F


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(f"module 'dtorch.nn.functional' has no attribute {name!r}")
    from ..ops.exports import missing, routed
    func = routed(name, (_F, torch))
    if func is None:
        raise missing("dtorch.nn.functional", name)
    globals()[name] = func
    return func
