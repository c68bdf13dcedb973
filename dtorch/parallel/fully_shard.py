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

import weakref

import torch
import torch.utils._pytree as pytree

from ..errors import MeshError, PlacementError
from ..graph import mesh_or_default
from ..mesh import DeviceMesh, MeshDim
from ..nn.modules import module as dtorch_module
from ..placement import Shard
from ..tensor import DTensor
from . import fsdp_gather, meta_init
from .convert import Conversion, Target, check_same_mesh, place, replicate_rest, swap_classes
from .fsdp_kernels import flat_layout

_UNSUPPORTED = ("shard_placement_fn", "mp_policy", "offload_policy", "dp_mesh_dims")
_running: list = []  # the groups whose forward is running, outermost first
# id(tensor) -> (weakref, where): the parameters (original and sharded) a group took, so that a
# tied one met again elsewhere, or a group made in the wrong order, is refused
_taken: dict = {}


class Group(NamedTuple):
    """The parameters one ``fully_shard`` call manages: ``(owner module, name)`` slots, each
    naming one of the group's distinct parameters (``index``: a tied one appears twice)."""

    module: torch.nn.Module
    slots: tuple
    index: tuple[int, ...]
    names: tuple[str, ...]
    reshard_after_forward: bool | None

    def shards(self) -> list:
        """The distinct sharded parameters, in order."""
        out: dict = {}
        for (owner, name), i in zip(self.slots, self.index):
            out.setdefault(i, owner._parameters[name])
        return [out[i] for i in sorted(out)]


class Forward:
    """One forward's whole parameters, until the backward has them back (or nothing needs
    them)."""

    def __init__(self, shards: list, whole: list, root: bool):
        self.shards, self.whole, self.root = shards, whole, root
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
    mesh = _check_arguments(module, mesh, reshard_after_forward, shard_placement_fn,
                            mp_policy, offload_policy, dp_mesh_dims)
    mesh = mesh_or_default(mesh, None)
    check_same_mesh(module, mesh)
    slots, index, names = _slots(module, {id(p) for p in (ignored_params or ())})
    _check_dtypes(slots, names)
    _check_requires_grad(slots, names)
    conv = Conversion(meta_init.record_inits(module))
    swap_classes(module)
    target = Target(mesh, 0)
    for sub, name in slots:
        original = sub._parameters[name]
        place(sub, name, target, Shard(0), conv)
        where = f"{type(module).__name__}'s fully_shard group"
        for t in (original, sub._parameters[name]):
            _taken[id(t)] = (weakref.ref(t), where)
            weakref.finalize(t, _taken.pop, id(t), None)
    replicate_rest(module, mesh, conv)
    group = Group(module, tuple(slots), tuple(index), tuple(names), reshard_after_forward)
    module.__dict__["_fully_shard"] = group
    active: list = []  # this module's forwards running (nested calls: innermost last)
    module.register_forward_pre_hook(lambda mod, args: _before(group, active))
    module.register_forward_hook(lambda mod, args, out: _after(group, active, out),
                                 always_call=True)
    return module


def _slots(module, ignored: set):
    """``(slots, index, names)`` of the parameters this call takes: every one below
    ``module`` that no inner group took, not ignored, at least 1-D (a 0-dim one has no dim
    0 to shard: it stays Replicate). A parameter an earlier group took under another name
    (tied across groups), or one an outer group took, is refused."""
    inner = _taken_by_inner(module)
    slots, index, names, seen, listed = [], [], [], {}, set()
    for path, sub in module.named_modules(remove_duplicate=False):
        for name, p in sub._parameters.items():
            key = (id(sub), name)
            if p is None or id(p) in ignored or key in inner or p.dim() == 0 or key in listed:
                continue  # (a submodule reached twice lists its parameters once)
            listed.add(key)
            where = f"{path}.{name}" if path else name
            taken = _taken.get(id(p))
            if taken is not None and taken[0]() is p:
                raise PlacementError(
                    f"{where} is already in {taken[1]}: a parameter belongs to one "
                    f"fully_shard group. Call fully_shard innermost first (each layer, then "
                    f"the root), and keep tied parameters (a tied embedding and head) in one "
                    f"group: their common parent's")
            slots.append((sub, name))
            index.append(seen.setdefault(id(p), len(seen)))
            names.append(where)
    return slots, index, names


def _check_arguments(module, mesh, reshard_after_forward, shard_placement_fn, mp_policy,
                     offload_policy, dp_mesh_dims):
    """The 1-D mesh to use (None: the default one), after refusing what is not supported."""
    if isinstance(module, (list, tuple)):
        raise TypeError("fully_shard takes one module here (a list grouping several into one "
                        "collective is not supported yet); call it on each, or on their parent")
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"fully_shard takes a torch.nn.Module; got {type(module).__name__}")
    if "_fully_shard" in module.__dict__:
        raise ValueError(f"this {type(module).__name__} is fully_shard'ed already; call "
                         f"fully_shard once per module (innermost first)")
    if isinstance(mesh, MeshDim) and mesh.mesh.ndim == 1:
        mesh = mesh.mesh  # mesh["dp"] of a 1-D mesh is the mesh
    if mesh is not None and not isinstance(mesh, DeviceMesh):
        raise MeshError(f"mesh must be a 1-D dtorch.DeviceMesh; got {mesh!r}")
    if mesh is not None and mesh.ndim != 1:
        raise MeshError(f"fully_shard shards along one mesh dim; this mesh has {mesh.ndim} "
                        f"({mesh.mesh_dim_names}). Pass a 1-D mesh, e.g. "
                        f"init_device_mesh('cpu', ({mesh.size()},), mesh_dim_names=('dp',)) "
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
    return mesh


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


def _check_requires_grad(slots, names, when: str = "") -> None:
    flags = [sub._parameters[name].requires_grad for sub, name in slots]
    if any(flags) and not all(flags):
        frozen = [n for n, f in zip(names, flags) if not f]
        raise ValueError(f"fully_shard reduces a group's gradients in one buffer, so its "
                         f"parameters all require grad or none does{when}; frozen: "
                         f"{', '.join(frozen)}. Pass ignored_params={{...}} for them (they "
                         f"stay Replicate), give their module its own fully_shard, or "
                         f"requires_grad_() them alike")


def _layout(shards: list):
    return flat_layout([s.shape for s in shards], shards[0].device_mesh.size())


def _repair(group: Group, active: list) -> None:
    """Undo a forward of this module that an interrupt (``KeyboardInterrupt``: torch runs no
    forward hook then) left half done: its whole parameters back to the shards."""
    calls = sum(1 for m in dtorch_module._running if m is group.module)
    while len(active) >= calls:  # this call's own entry is not pushed yet
        stale = active.pop(0)
        if stale is not None:
            for (owner, name), i in zip(group.slots, group.index):
                owner._parameters[name] = stale.shards[i]
    live = [g for g in _running if any(m is g.module for m in dtorch_module._running)]
    mine = [i for i, g in enumerate(live) if g is group]
    drop = set(mine[calls - 1:])  # more entries than its outer calls: left by the interrupt
    _running[:] = [g for i, g in enumerate(live) if i not in drop]


def _before(group: Group, active: list) -> None:
    _repair(group, active)
    if not group.slots:  # nothing to gather; still the root when outermost
        active.append(None)
        _running.append(group)
        return
    shards = group.shards()
    recorded = torch.is_grad_enabled() and any(s.requires_grad for s in shards)
    if recorded:
        _check_requires_grad(group.slots, group.names, " when it runs")
    whole = fsdp_gather.gather(shards, _layout(shards), recorded)
    for (owner, name), i in zip(group.slots, group.index):
        owner._parameters[name] = whole[i]
    active.append(Forward(shards, whole, root=not _running))
    _running.append(group)


def _after(group: Group, active: list, output) -> None:
    if not active:  # the pre-hook did not run (it raised before gathering)
        return
    forward = active.pop()
    if group in _running:
        _running.remove(group)
    if forward is None:
        return
    for (owner, name), i in zip(group.slots, group.index):
        owner._parameters[name] = forward.shards[i]
    nodes = _output_nodes(output) if torch.is_grad_enabled() else []
    if not nodes:  # nothing will backpropagate through it: the ranks free it with the handles
        forward.whole = None
        return
    reshard = group.reshard_after_forward
    if reshard is None:
        reshard = not forward.root
    if reshard:  # frozen parameters too: the graphs saved them for the input's gradient
        fsdp_gather.free(forward.whole, _dtensors(output))
        forward.freed = True
    for node in nodes:
        node.pre_hooks = (node.pre_hooks or []) + [forward.regather]


def _dtensors(output) -> list:
    return [leaf for leaf in pytree.tree_leaves(output, is_leaf=lambda x: isinstance(x, DTensor))
            if isinstance(leaf, DTensor)]


def _output_nodes(output) -> list:
    """The graph nodes that made the DTensors of ``output`` (any nesting; once each)."""
    nodes = {}
    for leaf in _dtensors(output):
        if leaf._ag is not None and leaf._ag.grad_fn is not None:
            nodes[leaf._ag.grad_fn.id] = leaf._ag.grad_fn
    return list(nodes.values())
