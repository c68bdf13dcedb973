"""Recording an op whose DTensor inputs require grad: one :class:`~dtorch.autograd.node.Node`
on the controller, one ``RecordedCall`` to the ranks (which keep the local graph).

Which outputs require grad, and the node's name (``MulBackward0``), come from running the
torch function once on ``meta`` tensors with autograd on, cached per call signature and
requires-grad mask like the forward plan. Checks that torch would make at forward time run
here, before anything is sent: an in-place op on a leaf that requires grad, an op whose
outputs depend on values (no plan to record), a composite without a backward plan, a
Partial('max'/'min') in the way of a gradient. Example::

    out = record_call(c, torch.mul, plan, key, (x, 2.0), {}, [x], cargs, {})
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.utils._pytree as pytree

from ..errors import UnsupportedOpError
from ..placement import format_placements
from ..runtime import messages as m
from . import cotangent, versions
from .node import Node, edge_of, mark_output

_CACHE_MAX = 20_000


class GradInfo(NamedTuple):
    """Per output whether it requires grad, the node's name, and which DTensor inputs (by
    position) and outputs its backward saved (their in-place versions are checked)."""

    differentiable: tuple[bool, ...]
    name: str
    saved_inputs: tuple[int, ...] = ()
    saved_outputs: tuple[int, ...] = ()


_info_cache: dict = {}


def wants_grad(tensors) -> bool:
    """Whether an op on these DTensors records a node (some input requires grad, grad mode
    is on: not under ``torch.no_grad()`` / ``inference_mode()``)."""
    for t in tensors:
        meta = t._ag
        if meta is not None and meta.requires_grad:
            return torch.is_grad_enabled()
    return False


def requires(t) -> bool:
    meta = t._ag
    return meta is not None and meta.requires_grad


NOT_RECORDED = object()
_deps = None  # (DTensor._wrap, infer.rebuild, registry.display_name), bound on first use


def _load_deps():
    """The ops-side helpers, imported once (dtorch.ops imports this module)."""
    global _deps
    from ..ops.dispatch import _wrap
    from ..ops.infer import rebuild
    from ..ops.registry import display_name
    _deps = (_wrap, rebuild, display_name)
    return _deps


def record_call(c, func, plan, key, args, kwargs, tensors, cargs, ckwargs, fill, fill_kwargs):
    """Issue ``func``'s planned call with its local graph kept; returns the result with the
    outputs marked, or NOT_RECORDED when no output requires grad (the plain call runs).
    ``fill(template, tensors)`` / ``fill_kwargs`` fill a plan's argument template."""
    _wrap, rebuild, display_name = _deps or _load_deps()
    outputs = plan.outputs
    if outputs.kind == "value":
        return outputs.value
    if outputs.kind == "eager":
        return _eager(c, func, plan, cargs, ckwargs, tensors, display_name(func))
    if type(plan.fn) is m.CompositePlan:
        from . import ring, ulysses
        why = None
        if func is torch.nn.functional.scaled_dot_product_attention:
            bound = ulysses.bind(args, kwargs)
            if ulysses.ulysses_dim(bound["query"], bound["key"], bound["value"]) is not None:
                return ulysses.ulysses_attention(func, args, kwargs)
            why = ring.refusal(bound)
            if why is None:
                return ring.ring_attention(c, bound)
        return _composite(c, plan, tensors, fill, fill_kwargs, why)
    if plan.inplace is not None:
        _check_inplace(func, tensors[plan.inplace])
    mask = tuple(requires(t) for t in tensors)
    info = grad_info(key, mask, func, plan, args, kwargs)
    grad_inputs = _unique([t for t in tensors if requires(t)])
    if not any(info.differentiable):
        return NOT_RECORDED  # argmax, a comparison: the plain call, nothing recorded
    _check_placements(func, grad_inputs, [s for s, d in zip(plan.out_specs, info.differentiable)
                                          if d])
    if plan.args is not None:
        cargs, ckwargs = fill(plan.args, tensors), fill_kwargs(plan.kwargs, tensors)
    node = Node(c.new_tid(), info.name, c, tensors[0]._spec.mesh,
                [t._spec for t in grad_inputs], plan.out_specs,
                [edge_of(t) for t in grad_inputs], keeps_graph=True)
    grad_tids = tuple(t._tid for t in grad_inputs)
    if plan.inplace is not None:
        target = tensors[plan.inplace]
        c.issue(m.RecordedCall(node.id, (target._tid,), plan.fn, tuple(cargs), ckwargs or {},
                               plan.ranks, grad_tids, target._tid))
        saved = versions.expected(tensors, (), info.saved_inputs, (), info.name)  # as read
        versions.bump(target)  # ``x.mul_(x)`` saved x at the version this op leaves behind
        mark_output(target, node, 0)
        node.saved = saved + versions.expected((), [target], (), info.saved_outputs, info.name)
        return target
    tids = tuple(c.new_tid() for _ in plan.out_specs)
    c.issue(m.RecordedCall(node.id, tids, plan.fn, tuple(cargs), ckwargs or {}, plan.ranks,
                           grad_tids))
    outs = [_wrap(s, t, c) for s, t in zip(plan.out_specs, tids)]
    for i, (out, diff) in enumerate(zip(outs, info.differentiable)):
        if diff:
            mark_output(out, node, i)
    if info.saved_inputs or info.saved_outputs:
        node.saved = versions.expected(tensors, outs, info.saved_inputs, info.saved_outputs,
                                       info.name)
    return outs[0] if outputs.kind == "one" else rebuild(outputs, outs)


def _composite(c, plan, tensors, fill, fill_kwargs, why=None):
    """A composite op (ring / Ulysses attention) runs as without autograd; its outputs get a
    node that refuses backward (raised on the controller when a backward reaches it, before
    anything is sent), so an inference forward without ``torch.no_grad()`` still works."""
    from ..ops.dispatch import _wrap
    from ..ops.infer import rebuild
    from .. import comm_debug
    cargs, ckwargs = fill(plan.args, tensors), fill_kwargs(plan.kwargs, tensors)
    comm_debug.record_steps(plan.fn.collectives)
    tids = tuple(c.new_tid() for _ in plan.out_specs)
    c.issue(m.Call(tids, plan.fn, tuple(cargs), ckwargs, plan.ranks))
    outs = [_wrap(s, t, c) for s, t in zip(plan.out_specs, tids)]
    grad_inputs = _unique([t for t in tensors if requires(t)])
    node = Node(c.new_tid(), f"{plan.fn.name}Backward", c, tensors[0]._spec.mesh,
                [t._spec for t in grad_inputs], plan.out_specs,
                [edge_of(t) for t in grad_inputs], keeps_graph=False,
                refusal=(why or f"no backward yet for {plan.fn.name} (a composite op)") +
                f"; detach its inputs, or redistribute them so that the plain op runs")
    for i, out in enumerate(outs):
        if out.dtype.is_floating_point or out.dtype.is_complex:
            mark_output(out, node, i)
    return outs[0] if plan.outputs.kind == "one" else rebuild(plan.outputs, outs)


def _eager(c, func, plan, cargs, ckwargs, tensors, name):
    """An op whose outputs depend on the values (all inputs Replicate) runs now, one round
    trip, with its local graph kept: its floating tensor outputs (Replicate) are the node's
    outputs, in pytree order, as the ranks keep them."""
    from ..ops import generic
    from ..ops.dispatch import _eager_wrap
    from ..tensor import DTensor
    mesh = tensors[0]._spec.mesh
    grad_inputs = _unique([t for t in tensors if requires(t)])
    node_id, flags = c.new_tid(), []
    try:  # until a Node owns the ranks' graph (its __del__ releases it), release it here
        result = generic.run_eager(c, plan.fn, cargs, ckwargs, mesh, _eager_wrap(mesh, c),
                                   node_id, tuple(t._tid for t in grad_inputs), flags)
        outs = [v for v in pytree.tree_leaves(result) if isinstance(v, DTensor)]
        node = Node(node_id, name.split(".")[-1] + "Backward", c, mesh,
                    [t._spec for t in grad_inputs], [o._spec for o in outs],
                    [edge_of(t) for t in grad_inputs], keeps_graph=True)
    except BaseException:
        c.release_graph(node_id, mesh.ranks)  # the ranks kept the graph (or the failure)
        raise
    for i, (out, flag) in enumerate(zip(outs, flags)):
        if flag:
            mark_output(out, node, i)
    return result


def _unique(tensors) -> list:
    seen, out = set(), []
    for t in tensors:
        if t._tid not in seen:
            seen.add(t._tid)
            out.append(t)
    return out


def _check_inplace(func, target) -> None:
    meta = target._ag
    if meta is not None and meta.requires_grad and meta.grad_fn is None:
        raise RuntimeError(
            f"{_deps[2](func)}: a leaf Variable that requires grad is being used in an in-place "
            f"operation. Run it under torch.no_grad() (as optimizers do), or use the "
            f"out-of-place op")


def _check_placements(func, grad_inputs, out_specs) -> None:
    name = None
    for t in grad_inputs + list(out_specs):
        if cotangent.not_differentiable(t.placements) is not None:
            name = _deps[2](func)
    if name is None:
        return
    for t in grad_inputs:
        p = cotangent.not_differentiable(t.placements)
        if p is not None:
            raise UnsupportedOpError(
                f"{name}: an input that requires grad is {format_placements(t.placements)}; "
                f"gradients through {p} are not supported (the shares do not say which rank "
                f"holds the extremum). Redistribute it to Replicate first")
    for s in out_specs:
        p = cotangent.not_differentiable(s.placements)
        if p is not None:
            raise UnsupportedOpError(
                f"{name}: its output would be {format_placements(s.placements)}; gradients "
                f"through {p} are not supported. Redistribute the input to Replicate on that "
                f"mesh dim first, or compute it under torch.no_grad()")


def grad_info(key, mask, func, plan, args, kwargs) -> GradInfo:
    """Cached :func:`infer_grad_info`."""
    from ..ops.dispatch import _NOCACHE
    cache_key = (key, mask)
    cacheable = _NOCACHE not in key
    info = _info_cache.get(cache_key) if cacheable else None
    if info is None:
        info = infer_grad_info(func, plan, args, kwargs, mask)
        if cacheable:
            if len(_info_cache) >= _CACHE_MAX:
                _info_cache.clear()
            _info_cache[cache_key] = info
    return info


def infer_grad_info(func, plan, args, kwargs, mask) -> GradInfo:
    """Run ``func`` with autograd on, on meta tensors (those in ``mask`` requiring grad), or on
    small zero-filled cpu stand-ins where meta has no kernel (``torch.linalg.lstsq``)."""
    from ..ops.registry import display_name
    fallback = GradInfo(tuple(s.dtype.is_floating_point or s.dtype.is_complex
                              for s in plan.out_specs),
                        display_name(func).split(".")[-1].strip("_").capitalize() + "Backward")
    for device in ("meta", "cpu"):
        if device == "cpu" and _numel(args, kwargs) > STAND_IN_LIMIT:
            break
        try:
            return _traced_grad_info(func, plan, args, kwargs, mask, device, fallback)
        except Exception:  # noqa: BLE001 - no kernel here: try the next stand-in
            continue
    return fallback  # nothing could run it: floating outputs require grad


STAND_IN_LIMIT = 1 << 16  # elements: bigger calls are not run on cpu stand-ins


def _numel(args, kwargs) -> int:
    from ..tensor import DTensor
    return sum(math.prod(a.shape) for a in pytree.tree_leaves((tuple(args), dict(kwargs)))
               if isinstance(a, (DTensor, torch.Tensor)))


def _traced_grad_info(func, plan, args, kwargs, mask, device, fallback) -> GradInfo:
    from ..tensor import DTensor
    flags = iter(mask)
    inplace = plan.inplace
    position = [0]
    metas: list = []  # per DTensor input, in order: the stand-in tensor it became

    def stand_in(a):
        if isinstance(a, DTensor):
            t = torch.zeros(a.shape, dtype=a.dtype, device=device)
            index, position[0] = position[0], position[0] + 1
            if next(flags):
                t.requires_grad_()
                if index == inplace:
                    t = t.clone()
            metas.append(t)
            return t
        if isinstance(a, torch.Tensor) and a.device.type != device:
            return a.to(device)
        return a
    margs, mkwargs = pytree.tree_map(stand_in, (tuple(args), dict(kwargs)))
    result, packed = versions.saved_by(func, margs, mkwargs)
    leaves = [r for r in pytree.tree_leaves(result) if isinstance(r, torch.Tensor)]
    if len(leaves) != len(plan.out_specs):
        return fallback
    names = [r.grad_fn.name() for r in leaves if r.grad_fn is not None]
    inputs = tuple(i for i, t in enumerate(metas) if i != inplace and
                   versions.is_saved(t, packed))
    outs = tuple(i for i, r in enumerate(leaves) if versions.is_saved(r, packed))
    return GradInfo(tuple(bool(r.requires_grad) for r in leaves),
                    names[0] if names else fallback.name, inputs, outs)
