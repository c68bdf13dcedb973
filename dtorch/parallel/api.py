"""``parallelize_module``: PyTorch's tensor-parallel entry point, on a plain torch.nn.Module.

The module is converted in place and returned: every submodule's class gains dtorch's DTensor
behaviour (``convert.swap_classes``), each plan entry's style lays its tensors out along the
plan's mesh dim ("tp": a 1-D mesh's only dim, the dim named "tp", or the one ``mesh["tp"]``
names; other dims Replicate), and every parameter or buffer no style placed is replicated
(PyTorch leaves those to the user). A ``meta``-device module is initialised on the ranks with
its own torch.nn init distributions. Every check (keys, module types, mesh, meta inits) runs
before anything is sent. Example::

    parallelize_module(mlp, mesh, {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
    with CommDebugMode() as mode:
        y = mlp(x)                       # mode.get_comm_counts() == {"all_reduce": 1}
"""

from __future__ import annotations

import contextlib

import torch

from ..errors import PlacementError
from . import meta_init
from .base import ParallelStyle
from .convert import (Conversion, check_same_mesh, check_ties, replicate_rest, resolve_target,
                      swap_classes)
from .plan import resolve


def parallelize_module(module: torch.nn.Module, device_mesh=None, parallelize_plan=None, *,
                       src_data_rank: int | None = 0) -> torch.nn.Module:
    """Convert ``module`` in place by ``parallelize_plan`` (a style, or {key: style}); returns it.

    No plan (None or {}) replicates every tensor (PyTorch warns and does nothing: its ranks
    could each keep their own copy; here the module must live on the mesh to meet DTensors).

    ``device_mesh`` defaults to the session's default mesh; ``src_data_rank`` is accepted
    (values come from the module itself, sent by the controller).
    """
    if device_mesh is None:
        from ..graph import mesh_or_default
        device_mesh = mesh_or_default(None, None)
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"parallelize_module takes a torch.nn.Module; got {type(module).__name__}")
    target = resolve_target(device_mesh)
    entries = resolve(module, parallelize_plan if parallelize_plan is not None else {})
    for path, sub, style in entries:
        if not isinstance(style, ParallelStyle):
            raise PlacementError(f"the plan entry for {path or 'the root module'} is "
                                 f"{style!r}, not a ParallelStyle (ColwiseParallel(), ...)")
        style._check(sub, path)
    check_same_mesh(module, target.mesh)
    check_ties(entries)
    conv = Conversion(meta_init.record_inits(module))
    swap_classes(module)
    for _, sub, style in entries:
        style._apply(sub, target, conv)
    replicate_rest(module, target.mesh, conv)
    return module


@contextlib.contextmanager
def loss_parallel():
    """PyTorch's context for a cross-entropy over class-sharded logits; a no-op in dtorch,
    whose loss rules already run on sharded logits (no gather of the vocabulary)."""
    yield
