"""``dtorch.nn.utils``: torch.nn.utils' gradient clipping on DTensor parameters.

``clip_grad_norm_`` counts each element of each gradient once whatever its placements: a
gradient's ``|g|^p`` sum is ``Partial`` over the mesh dims that shard it, and is made
``Partial`` (locally: one rank of the dim keeps it) over those that replicate it, so the sums
of every parameter on a mesh add up to one pending sum (the inf norm: one pending max) and
**one** all_reduce per mesh dim gives the total there (a ``Partial`` gradient, a row-parallel
bias's, is all-reduced first). Parameters on several meshes (pipeline
stages) send their mesh's total to the first mesh (point to point); the clip coefficient,
``max_norm / (total + 1e-6)`` with the epsilon added once, goes back the same way and scales
every gradient in place. Example::

    total = dtorch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
    total.placements      # (Replicate(),): torch's total norm, before clipping
"""

from __future__ import annotations

import math

import torch

from ..placement import Partial, Replicate
from ..tensor import DTensor


def _grads(parameters) -> list:
    if isinstance(parameters, DTensor):
        parameters = [parameters]
    grads = []
    for p in parameters:
        if not isinstance(p, DTensor):
            raise TypeError(f"dtorch.nn.utils clips DTensor parameters' gradients; got a "
                            f"{type(p).__name__}. Use torch.nn.utils for torch tensors")
        if p.grad is not None:
            grads.append(p.grad)
    return grads


def _check_foreach(foreach) -> None:
    if foreach not in (None, False, True):
        raise TypeError(f"foreach must be None, True or False; got {foreach!r}")


def _pending(g: DTensor, norm_type: float) -> DTensor:
    """``g``'s ``sum |g|^p`` (``max |g|`` for inf) as a 0-dim DTensor pending on every mesh
    dim: Partial where ``g`` is sharded (each rank its block), made Partial where it is
    replicated (one rank keeps it: nothing moves), so each element counts once."""
    kind = "max" if math.isinf(norm_type) else "sum"
    if any(p.is_partial() for p in g.placements):  # a Partial parameter's (a row-parallel
        # bias): its value first
        g = g.redistribute(placements=[Replicate() if p.is_partial() else p
                                       for p in g.placements])
    a = g.abs()  # summed in float32 (torch's norms accumulate so): fp16 sums overflow
    part = a.amax().float() if kind == "max" else a.float().pow(norm_type).sum()
    target = [Partial(kind)] * g.device_mesh.ndim
    if any(p.is_partial() and p.reduce_op != kind for p in part.placements):
        part = part.redistribute(placements=[Replicate()] * g.device_mesh.ndim)
    return part.redistribute(placements=target)


@torch.no_grad()
def get_total_norm(tensors, norm_type: float = 2.0, error_if_nonfinite: bool = False,
                   foreach=None) -> DTensor:
    """torch.nn.utils.get_total_norm for DTensors (gradients, or any DTensors): a 0-dim
    Replicate DTensor on the first tensor's mesh, in the first tensor's dtype (accumulated
    in float32); ``torch.tensor(0.)`` for no tensors, as torch. ``foreach`` is accepted: the
    reductions are planned DTensor ops either way."""
    _check_foreach(foreach)
    norm_type = float(norm_type)
    if norm_type <= 0 or math.isnan(norm_type):
        raise NotImplementedError(f"norm_type={norm_type:g} is not supported on DTensors; use "
                                  f"a positive order or float('inf')")
    tensors = [tensors] if isinstance(tensors, DTensor) else list(tensors)
    if not tensors:
        return torch.tensor(0.0)
    per_mesh: dict = {}
    for t in tensors:
        part = _pending(t, norm_type)
        mesh = t.device_mesh
        per_mesh[mesh] = part if mesh not in per_mesh else (
            torch.maximum(per_mesh[mesh], part) if math.isinf(norm_type)
            else per_mesh[mesh] + part)
    first = tensors[0].device_mesh
    totals = [s.redistribute(placements=[Replicate()] * s.device_mesh.ndim)  # one all_reduce
              for s in per_mesh.values()]
    total = None
    for s in totals:
        if s.device_mesh != first:
            s = s.redistribute(device_mesh=first, placements=[Replicate()] * first.ndim)
        total = s if total is None else (torch.maximum(total, s) if math.isinf(norm_type)
                                         else total + s)
    if not math.isinf(norm_type) and norm_type != 1.0:
        total = total.pow(1.0 / norm_type)
    total = total.to(tensors[0].dtype)
    if error_if_nonfinite and not bool(torch.isfinite(total)):
        raise RuntimeError(f"The total norm of order {norm_type} for gradients from "
                           f"`parameters` is non-finite, so it cannot be clipped. To disable "
                           f"this error and scale the gradients by the non-finite norm anyway, "
                           f"set `error_if_nonfinite=False`")
    return total


def clip_grads_with_norm_(parameters, max_norm: float, total_norm: DTensor,
                          foreach=None) -> None:
    """Scale the gradients in place by ``min(1, max_norm / (total_norm + 1e-6))``."""
    _check_foreach(foreach)
    grads = _grads(parameters)
    if not grads:
        return
    if not isinstance(total_norm, DTensor):  # a number, or torch's tensor(0.)
        coef = min(1.0, float(max_norm) / (float(total_norm) + 1e-6))
        with torch.no_grad():
            for g in grads:
                g.mul_(coef)
        return
    coef = torch.clamp(float(max_norm) / (total_norm + 1e-6), max=1.0)
    on_mesh = {total_norm.device_mesh: coef}
    with torch.no_grad():
        for g in grads:
            mesh = g.device_mesh
            if mesh not in on_mesh:
                on_mesh[mesh] = coef.redistribute(device_mesh=mesh,
                                                  placements=[Replicate()] * mesh.ndim)
            g.mul_(on_mesh[mesh].to(g.dtype))


def clip_grad_norm_(parameters, max_norm: float, norm_type: float = 2.0,
                    error_if_nonfinite: bool = False, foreach=None) -> DTensor:
    """torch.nn.utils.clip_grad_norm_: the total norm of the gradients (a 0-dim Replicate
    DTensor, before clipping), each gradient scaled in place so the total is at most
    ``max_norm`` (see module doc); ``torch.tensor(0.)`` when no parameter has a gradient."""
    parameters = [parameters] if isinstance(parameters, DTensor) else list(parameters)
    grads = _grads(parameters)
    if not grads:
        return torch.tensor(0.0)  # torch's answer when no parameter has a gradient
    total = get_total_norm(grads, norm_type, error_if_nonfinite, foreach)
    clip_grads_with_norm_(parameters, max_norm, total, foreach)
    return total


def clip_grad_value_(parameters, clip_value: float, foreach=None) -> None:
    """torch.nn.utils.clip_grad_value_: each gradient clamped to ``[-clip_value, clip_value]``
    in place (shard by shard: no communication)."""
    _check_foreach(foreach)
    clip_value = float(clip_value)
    with torch.no_grad():
        for g in _grads(parameters):
            g.clamp_(-clip_value, clip_value)
