"""``distribute_module(module, mesh, partition_fn, input_fn, output_fn)``, PyTorch's semantics.

``partition_fn(name, submodule, mesh)`` runs on every submodule (``named_modules()`` order)
and may set DTensor parameters (``submodule.weight = distribute_tensor(...)``: the module
already holds DTensors); every parameter and buffer left a torch tensor is then replicated
(the default when ``partition_fn`` is None). ``input_fn(module, inputs, mesh)`` and
``output_fn(module, outputs, mesh)`` become forward pre- and post-hooks. The functions get the
whole mesh (``mesh["tp"]`` passes its parent: a single controller places tensors on it). Example::

    def shard_rows(name, sub, mesh):
        if isinstance(sub, torch.nn.Linear):
            sub.weight = dtorch.distribute_tensor(sub.weight.detach(), mesh, [Shard(0)])
    distribute_module(model, mesh, shard_rows)
"""

from __future__ import annotations

import torch

from . import meta_init
from ..errors import MeshError
from ..mesh import DeviceMesh, MeshDim
from .convert import Conversion, check_same_mesh, replicate_rest, swap_classes


def distribute_module(module: torch.nn.Module, device_mesh=None, partition_fn=None,
                      input_fn=None, output_fn=None) -> torch.nn.Module:
    """Convert ``module`` in place (see the module docstring); returns it."""
    if device_mesh is None:
        from ..graph import mesh_or_default
        device_mesh = mesh_or_default(None, None)
    mesh = device_mesh.mesh if isinstance(device_mesh, MeshDim) else device_mesh
    if not isinstance(mesh, DeviceMesh):
        raise MeshError(f"device_mesh must be a dtorch.DeviceMesh; got {device_mesh!r}")
    check_same_mesh(module, mesh)
    recipes = meta_init.record_inits(module) if partition_fn is None else {}
    swap_classes(module)
    if partition_fn is not None:
        for name, sub in list(module.named_modules()):
            partition_fn(name, sub, mesh)
        recipes = meta_init.record_inits(module)
    replicate_rest(module, mesh, Conversion(recipes))
    if input_fn is not None:
        module.register_forward_pre_hook(lambda mod, inputs: input_fn(mod, inputs, mesh))
    if output_fn is not None:
        module.register_forward_hook(
            lambda mod, inputs, outputs: output_fn(mod, outputs, mesh))
    return module
