"""``fully_shard``: PyTorch's FSDP2 entry point, on a plain torch.nn.Module (one controller).

``fully_shard(module, mesh)`` makes the parameters of ``module`` that no inner ``fully_shard``
took ``Shard(0)`` DTensors on the 1-D ``mesh`` (built shard by shard from the module's own
values; buffers Replicate), in place. Around each forward of ``module``:

- before: its parameters are gathered whole in one all_gather (``fsdp_gather.gather``) and
  stand in for the shards while the forward runs;
- after: the shards are back. With ``reshard_after_forward=True`` the whole
  parameters are freed on the ranks, also where the local autograd graphs saved them, and
  gathered again (one more all_gather) just before the backward reaches the module's outputs;
  with ``False`` they stay until the backward has used them; ``None`` (PyTorch's default) is
  ``False`` for the root (the outermost ``fully_shard`` module running: its backward comes
  first) and ``True`` for the others;
- in backward: their gradients are reduce-scattered back to ``Shard(0)`` in one collective and
  accumulate into the shards' ``.grad``.

Use it as with PyTorch: innermost first (each layer, then the root). Example::

    for layer in model.layers:
        dtorch.fully_shard(layer, mesh)
    dtorch.fully_shard(model, mesh)
    model(x).sum().backward()   # per layer: all_gather x2, reduce_scatter x1
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.utils._pytree as pytree

from ..errors import MeshError
from ..graph import mesh_or_default
from ..mesh import DeviceMesh
from ..placement import Shard
from ..tensor import DTensor
from . import fsdp_gather
from .convert import Conversion, Target, check_same_mesh, place, replicate_rest, swap_classes
from .fsdp_kernels import flat_layout
from . import meta_init

_UNSUPPORTED = ("shard_placement_fn", "mp_policy", "offload_policy", "dp_mesh_dims")
_running: list = []  # the groups whose forward is running, outermost first


class Group(NamedTuple):
    """The parameters one ``fully_shard`` call manages: ``(owner module, name)`` slots."""

    slots: tuple
    names: tuple[str, ...]
    reshard_after_forward: bool | None

    def shards(self) -> list:
        return [owner._parameters[name] for owner, name in self.slots]


class Forward:
    """One forward's whole parameters, until the backward has them back (or nothing needs
    them)."""

    def __init__(self, group: Group, shards: list, whole: list, recorded: bool, root: bool):
        self.group, self.shards, self.whole, self.recorded = group, shards, whole, recorded
        self.root = root  # no other fully_shard forward was running around it
        self.freed = False

    def regather(self) -> None:
        """Before the backward reaches the module: the freed memory gathered again (once)."""
        if self.freed:
            fsdp_gather.refill(self.whole, self.shards, _layout(self.shards))
            self.freed = False
        self.whole = None  # the local graphs keep the memory until their backward ran


def fully_shard(module: torch.nn.Module, mesh: DeviceMesh | None = None, *,
                reshard_after_forward: bool | None = None, shard_placement_fn=None,
                mp_policy=None, offload_policy=None, ignored_params=None,
                dp_mesh_dims=None) -> torch.nn.Module:
    """Shard ``module``'s parameters ``Shard(0)`` on ``mesh`` and gather them around each
    forward (see module doc); returns ``module``. ``ignored_params`` stay Replicate."""
    _check_arguments(module, mesh, reshard_after_forward, shard_placement_fn, mp_policy,
                     offload_policy, dp_mesh_dims)
    mesh = mesh_or_default(mesh, None)
    check_same_mesh(module, mesh)
    ignored = {id(p) for p in (ignored_params or ())}
    taken = _taken_by_inner(module)
    slots, names = [], []
    for path, sub in module.named_modules():
        for name, p in sub._parameters.items():
            if p is None or id(p) in ignored or (id(sub), name) in taken:
                continue
            if p.dim() == 0:
                continue  # a 0-dim parameter has no dim 0 to shard: it stays Replicate
            if (id(sub), name) not in {(id(o), n) for o, n in slots}:
                slots.append((sub, name))
                names.append(f"{path}.{name}" if path else name)
    _check_dtypes(slots, names)
    conv = Conversion(meta_init.record_inits(module))
    swap_classes(module)
    target = Target(mesh, 0)
    for sub, name in slots:
        place(sub, name, target, Shard(0), conv)
    replicate_rest(module, mesh, conv)
    group = Group(tuple(slots), tuple(names), reshard_after_forward)
    module.__dict__["_fully_shard"] = group
    active: list = []  # this module's forwards running (nested calls: innermost last)
    module.register_forward_pre_hook(lambda mod, args: _before(group, active))
    module.register_forward_hook(lambda mod, args, out: _after(group, active, out),
                                 always_call=True)
    return module


def _check_arguments(module, mesh, reshard_after_forward, shard_placement_fn, mp_policy,
                     offload_policy, dp_mesh_dims) -> None:
    if isinstance(module, (list, tuple)):
        raise TypeError("fully_shard takes one module here (a list grouping several into one "
                        "collective is not supported yet); call it on each, or on their parent")
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"fully_shard takes a torch.nn.Module; got {type(module).__name__}")
    if "_fully_shard" in module.__dict__:
        raise ValueError(f"this {type(module).__name__} is fully_shard'ed already; call "
                         f"fully_shard once per module (innermost first)")
    if mesh is not None and not isinstance(mesh, DeviceMesh):
        raise MeshError(f"mesh must be a 1-D dtorch.DeviceMesh; got {mesh!r}")
    if mesh is not None and mesh.ndim != 1:
        raise MeshError(f"fully_shard shards along one mesh dim; this mesh has {mesh.ndim} "
                        f"({mesh.mesh_dim_names}). Pass a 1-D mesh, e.g. mesh['dp'] of it "
                        f"(HSDP and FSDP with tensor parallelism are not supported yet)")
    if reshard_after_forward is not None and type(reshard_after_forward) is not bool:
        raise TypeError(f"reshard_after_forward must be True, False or None; got "
                        f"{reshard_after_forward!r} (resharding to a smaller world is not "
                        f"supported)")
    given = dict(zip(_UNSUPPORTED, (shard_placement_fn, mp_policy, offload_policy,
                                    dp_mesh_dims)))
    for key, value in given.items():
        if value is not None:
            raise NotImplementedError(f"fully_shard({key}=...) is not supported yet; leave it "
                                      f"out (parameters are Shard(0), in their own dtype, on "
                                      f"the ranks' device)")


def _taken_by_inner(module) -> set:
    """``(id(owner), name)`` of the parameters an inner ``fully_shard`` manages."""
    taken = set()
    for sub in module.modules():
        group = sub.__dict__.get("_fully_shard")
        if group is not None and sub is not module:
            taken |= {(id(o), n) for o, n in group.slots}
    return taken


def _check_dtypes(slots, names) -> None:
    dtypes = {sub._parameters[name].dtype for sub, name in slots}
    if len(dtypes) > 1:
        listing = ", ".join(f"{n}: {sub._parameters[nm].dtype}"
                            for n, (sub, nm) in zip(names, slots))
        raise TypeError(f"fully_shard gathers a module's parameters in one buffer, so they "
                        f"share a dtype; these differ ({listing}). Cast the module "
                        f"(module.to(dtype)), or fully_shard the differing submodules first")


def _layout(shards: list):
    return flat_layout([s.shape for s in shards], shards[0].device_mesh.size())


def _before(group: Group, active: list) -> None:
    if not group.slots:  # nothing to gather; still the root when outermost
        active.append(None)
        _running.append(group)
        return
    shards = group.shards()
    recorded = torch.is_grad_enabled() and any(s.requires_grad for s in shards)
    whole = fsdp_gather.gather(shards, _layout(shards), recorded)
    for (owner, name), w in zip(group.slots, whole):
        owner._parameters[name] = w
    active.append(Forward(group, shards, whole, recorded, root=not _running))
    _running.append(group)


def _after(group: Group, active: list, output) -> None:
    if not active:  # the pre-hook did not run (it raised before gathering)
        return
    forward = active.pop()
    _running.remove(group)
    if forward is None:
        return
    for (owner, name), s in zip(group.slots, forward.shards):
        owner._parameters[name] = s
    if not forward.recorded:
        forward.whole = None  # nothing saved them: the ranks free them with the handles
        return
    nodes = _output_nodes(output)
    reshard = group.reshard_after_forward
    if reshard is None:
        reshard = not forward.root
    if reshard and nodes:
        fsdp_gather.free(forward.whole)
        forward.freed = True
    for node in nodes:
        node.pre_hooks = (node.pre_hooks or []) + [forward.regather]
    if not nodes:
        forward.whole = None


def _output_nodes(output) -> list:
    """The graph nodes that made the DTensors of ``output`` (any nesting; once each)."""
    nodes = {}
    for leaf in pytree.tree_leaves(output, is_leaf=lambda x: isinstance(x, DTensor)):
        if isinstance(leaf, DTensor) and leaf._ag is not None and leaf._ag.grad_fn is not None:
            nodes[leaf._ag.grad_fn.id] = leaf._ag.grad_fn
    return list(nodes.values())
