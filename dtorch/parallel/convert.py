"""Turning a plain ``torch.nn.Module`` into one that holds DTensors, in place.

Each module's class is swapped for a generated subclass ``DTorch<Name>(DTensorModuleMixin,
cls)`` (as PyTorch's FSDP2 does): ``isinstance(m, torch.nn.Linear)`` stays True, ``forward`` is
the module's own, and the mixin (``dtorch.nn.Module``'s behaviour) keeps DTensors in torch's
``_parameters`` / ``_buffers`` tables, so ``state_dict()`` keys are torch's. A tensor becomes a
DTensor shard by shard from its own values (``send_streamed``), from a meta tensor's recorded
init (``meta_init``), or, already a DTensor, by a redistribute. Example::

    swap_classes(model)                     # type(model.fc1).__name__ == "DTorchLinear"
    place(model.fc1, "weight", target, Shard(0), Conversion(meta_init.record_inits(model)))
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..autograd.node import NAMES_CHANGED
from ..errors import MeshError, PlacementError
from ..mesh import DeviceMesh, MeshDim
from ..placement import Replicate
from ..tensor import DTensor
from ..nn.modules.module import DTensorModuleMixin
from . import meta_init

class Target(NamedTuple):
    """The mesh a plan lays tensors on and the one dim its styles shard along."""

    mesh: DeviceMesh
    dim: int

    def placements(self, on_dim) -> tuple:
        """Full placements: ``on_dim`` on the plan's dim, Replicate on every other."""
        out = [Replicate()] * self.mesh.ndim
        out[self.dim] = on_dim
        return tuple(out)

    @property
    def dim_name(self):
        names = self.mesh.mesh_dim_names
        return names[self.dim] if names else self.dim


def resolve_target(device_mesh, default_name: str = "tp") -> Target:
    """A 1-D mesh, ``mesh["tp"]``, or a mesh with a dim named ``"tp"``; else a clear error."""
    if isinstance(device_mesh, MeshDim):
        if device_mesh.dim is not None:
            return Target(device_mesh.mesh, device_mesh.dim)
        device_mesh = device_mesh.mesh
    if not isinstance(device_mesh, DeviceMesh):
        raise MeshError(f"device_mesh must be a dtorch.DeviceMesh or mesh['tp']; got "
                        f"{device_mesh!r}")
    if device_mesh.ndim == 1:
        return Target(device_mesh, 0)
    idx = device_mesh.dim_name_index(default_name)
    if idx is None:
        raise MeshError(
            f"a parallelize plan shards along one mesh dim, but this {device_mesh.ndim}-D mesh "
            f"has no dim named {default_name!r} (its names: {device_mesh.mesh_dim_names}). Fix: "
            f"name a dim {default_name!r} in init_device_mesh(..., mesh_dim_names=...), or pass "
            f"mesh['<name>'] to choose the dim")
    return Target(device_mesh, idx)


def dtorch_class(cls: type) -> type:
    """``DTorch<Name>``: ``cls`` with dtorch.nn.Module's DTensor behaviour mixed in first (made
    once per class and kept on it, so a class defined in a function is freed with it)."""
    if issubclass(cls, DTensorModuleMixin):
        return cls
    sub = cls.__dict__.get("_dtorch_class")
    if sub is None:
        sub = type(f"DTorch{cls.__name__}", (DTensorModuleMixin, cls), {"__module__": __name__})
        setattr(cls, "_dtorch_class", sub)
    return sub


def swap_classes(root: torch.nn.Module) -> None:
    """Every module of the tree gets its DTorch class (idempotent)."""
    for module in root.modules():
        module.__class__ = dtorch_class(type(module))
    NAMES_CHANGED[0] += 1


def to_dtensor(value, mesh: DeviceMesh, placements, recipe=None) -> DTensor:
    """A parameter's or buffer's value as a DTensor with ``placements`` (no autograd history)."""
    if isinstance(value, DTensor):
        with torch.no_grad():
            if value.device_mesh == mesh and value.placements == tuple(placements):
                return value
            return value.redistribute(mesh, placements).detach()
    if value.is_meta:
        return meta_init.make(recipe, value, mesh, placements)
    from ..nn.state_dict import send_streamed
    return send_streamed(value.detach(), mesh, placements)


class Conversion:
    """One conversion's state: the meta inits recorded, and the DTensor each tensor became, so a
    tensor two modules share (tied embeddings) stays one DTensor."""

    def __init__(self, recipes: dict):
        self.recipes = recipes
        self.made: dict[int, tuple] = {}  # id(old tensor) -> (old tensor, its DTensor)


def place(module, name: str, target: Target, on_dim, conv: Conversion) -> None:
    """Replace parameter or buffer ``name`` of ``module`` by a DTensor: ``on_dim`` on the
    plan's dim, Replicate elsewhere (a DTensor keeps its placements on the other dims)."""
    table = module._parameters if name in module._parameters else module._buffers
    value = table[name]
    if value is None:
        return
    if id(value) in conv.made:  # shared with a module placed before: the same DTensor
        table[name] = conv.made[id(value)][1]
        return
    placements = list(target.placements(on_dim))
    if isinstance(value, DTensor) and value.device_mesh == target.mesh:
        for i, p in enumerate(value.placements):
            if i != target.dim:
                placements[i] = p
    new = to_dtensor(value, target.mesh, placements, conv.recipes.get(id(value)))
    if table is module._parameters:
        new.requires_grad_(value.requires_grad and (new.dtype.is_floating_point or
                                                    new.dtype.is_complex))
    table[name] = new
    conv.made[id(value)] = (value, new)
    NAMES_CHANGED[0] += 1


def replicate_rest(root, mesh: DeviceMesh, conv: Conversion) -> None:
    """Every parameter and buffer still a torch tensor: Replicate on the whole mesh (PyTorch
    leaves these to the user; a single controller can replicate them itself)."""
    target = Target(mesh, 0)
    for module in root.modules():
        for table in (module._parameters, module._buffers):
            for name, value in list(table.items()):
                if isinstance(value, torch.Tensor):
                    place(module, name, target, Replicate(), conv)


def check_ties(entries) -> None:
    """A tensor two plan entries share must get one placement from both (before sending)."""
    seen: dict[int, tuple] = {}
    for path, module, style in entries:
        for name, on_dim in style._partition(module).items():
            value = module._parameters.get(name, module._buffers.get(name))
            if value is None:
                continue
            where = f"{path + '.' if path else ''}{name}"
            first = seen.setdefault(id(value), (on_dim, where))
            if first[0] != on_dim:
                raise PlacementError(
                    f"{where} is the same tensor as {first[1]} (tied), but the plan places it "
                    f"{first[0]!r} as {first[1]} and {on_dim!r} as {where}. Fix: give both "
                    f"modules styles that shard it alike (e.g. RowwiseParallel embedding + "
                    f"ColwiseParallel head: both Shard(0)), or untie them")


def check_same_mesh(root, mesh: DeviceMesh) -> None:
    """A module already converted onto another mesh cannot mix with this one."""
    for name, value in list(root.named_parameters()) + list(root.named_buffers()):
        if isinstance(value, DTensor) and value.device_mesh != mesh:
            raise MeshError(f"{name} already lives on {value.device_mesh!r}, not on {mesh!r}; "
                            f"parallelize a module on one mesh (use mesh['tp'] / mesh['dp'] of "
                            f"the same mesh for different dims)")
