"""Laying out module inputs and outputs: ``PrepareModuleInput`` / ``PrepareModuleOutput``.

``lay_out(x, target, layout, desired)`` is the one conversion every style uses: a DTensor keeps
its placements on the other mesh dims and is redistributed to ``desired`` on the plan's dim; a
torch tensor is the global value (one controller), so it is sent straight in the ``desired``
layout (Replicate on the other dims), nothing gathered: ``layout`` (PyTorch's "how this rank's
local tensor is laid out") only says whether to convert it at all. Example (shard the batch
on "dp" before a tp-parallel model)::

    parallelize_module(model, mesh["dp"], PrepareModuleInput(
        input_layouts=Replicate(), desired_input_layouts=Shard(0)))
"""

from __future__ import annotations

import torch

from ..errors import PlacementError
from ..placement import Placement, Shard
from ..tensor import DTensor
from .base import ParallelStyle
from .convert import Target


def _norm(p: Placement, ndim: int) -> Placement:
    return Shard(p.dim % max(ndim, 1)) if isinstance(p, Shard) else p


def lay_out(x, target: Target, layout: Placement | None, desired: Placement | None):
    """``x`` on ``target``'s mesh: see the module docstring. Non-tensors pass unchanged."""
    if isinstance(x, DTensor):
        if desired is None:
            return x
        if x.device_mesh != target.mesh:
            raise PlacementError(
                f"a module input lives on {x.device_mesh!r}, but the module was parallelized on "
                f"{target.mesh!r}. Fix: distribute the input on that mesh")
        return x.redistribute_by_dict(placements_dict={target.dim: _norm(desired, x.ndim)},
                                      default_placement_mode="keep")
    if not isinstance(x, torch.Tensor) or layout is None:
        return x
    if x.requires_grad and torch.is_grad_enabled():
        from ..errors import MixedTensorError
        raise MixedTensorError(
            f"a plain torch.Tensor input of shape {tuple(x.shape)} that requires grad met a "
            f"parallelized module: sent to the ranks as a new DTensor, its gradient would not "
            f"reach your graph. Make it a DTensor first (dtorch.tensor(t, device_mesh=mesh, "
            f"placements=[...], requires_grad=True)), or pass t.detach()")
    from ..factories import distribute_tensor
    want = desired if desired is not None else layout
    return distribute_tensor(x, target.mesh, target.placements(_norm(want, x.dim())))


def _as_tuple(layouts):
    return (layouts,) if isinstance(layouts, Placement) else layouts


class PrepareModuleInput(ParallelStyle):
    """Lay out a module's positional inputs (``input_layouts`` -> ``desired_input_layouts``,
    ``None`` leaves one as it is) and keyword inputs (``input_kwarg_layouts`` ->
    ``desired_input_kwarg_layouts``) before its forward."""

    def __init__(self, *, input_layouts=None, desired_input_layouts=None,
                 input_kwarg_layouts=None, desired_input_kwarg_layouts=None,
                 use_local_output: bool = False):
        self.input_layouts = _as_tuple(input_layouts)
        self.desired_input_layouts = _as_tuple(desired_input_layouts)
        self.use_local_output = use_local_output  # accepted; inputs stay DTensors
        if self.input_layouts is not None:
            if self.desired_input_layouts is None:
                raise PlacementError("PrepareModuleInput: give desired_input_layouts with "
                                     "input_layouts (one per input, None to leave one alone)")
            if len(self.input_layouts) != len(self.desired_input_layouts):
                raise PlacementError("PrepareModuleInput: input_layouts and "
                                     "desired_input_layouts must have the same length")
        self.with_kwargs = input_kwarg_layouts is not None
        self.input_kwarg_layouts = input_kwarg_layouts or {}
        self.desired_input_kwarg_layouts = desired_input_kwarg_layouts or {}
        if self.with_kwargs and len(self.input_kwarg_layouts) != len(
                self.desired_input_kwarg_layouts):
            raise PlacementError("PrepareModuleInput: input_kwarg_layouts and "
                                 "desired_input_kwarg_layouts must have the same length")

    def _prepare_args(self, args, target: Target):
        if self.input_layouts is None:
            return args
        if len(args) != len(self.input_layouts):
            raise PlacementError(f"PrepareModuleInput got {len(args)} inputs but "
                                 f"{len(self.input_layouts)} input_layouts; give one layout per "
                                 f"input (None for an input to leave alone)")
        return tuple(lay_out(x, target, lay, want) if lay is not None else x
                     for x, lay, want in zip(args, self.input_layouts,
                                             self.desired_input_layouts))

    def _apply(self, module, target: Target, conv) -> None:
        if self.with_kwargs:
            def pre_kw(mod, args, kwargs):
                kwargs = {k: lay_out(v, target, self.input_kwarg_layouts.get(k),
                                     self.desired_input_kwarg_layouts.get(k))
                          for k, v in kwargs.items()}
                return self._prepare_args(args, target), kwargs
            module.register_forward_pre_hook(pre_kw, with_kwargs=True)
        else:
            module.register_forward_pre_hook(lambda mod, args: self._prepare_args(args, target))

    def __repr__(self) -> str:
        return (f"PrepareModuleInput(input_layouts={self.input_layouts}, desired_input_layouts="
                f"{self.desired_input_layouts}, input_kwarg_layouts={self.input_kwarg_layouts}, "
                f"desired_input_kwarg_layouts={self.desired_input_kwarg_layouts}, "
                f"use_local_output={self.use_local_output})")


class PrepareModuleOutput(ParallelStyle):
    """Lay out a module's outputs (``output_layouts`` -> ``desired_output_layouts``) after its
    forward; a single output comes back unwrapped, as in PyTorch."""

    def __init__(self, *, output_layouts, desired_output_layouts, use_local_output=True):
        self.output_layouts = _as_tuple(output_layouts)
        self.desired_output_layouts = _as_tuple(desired_output_layouts)
        self.use_local_output = use_local_output  # accepted; outputs stay DTensors
        if len(self.output_layouts) != len(self.desired_output_layouts):
            raise PlacementError("PrepareModuleOutput: output_layouts and "
                                 "desired_output_layouts must have the same length")

    def _prepare(self, outputs, target: Target):
        outs = outputs if isinstance(outputs, tuple) else (outputs,)
        if len(outs) != len(self.output_layouts):
            raise PlacementError(f"PrepareModuleOutput got {len(outs)} outputs but "
                                 f"{len(self.output_layouts)} output_layouts; give one per output")
        done = tuple(x if lay is None else lay_out(x, target, lay, want)
                     for x, lay, want in zip(outs, self.output_layouts,
                                             self.desired_output_layouts))
        return done[0] if len(done) == 1 else done

    def _apply(self, module, target: Target, conv) -> None:
        module.register_forward_hook(lambda mod, args, out: self._prepare(out, target))

    def __repr__(self) -> str:
        return (f"PrepareModuleOutput(output_layouts={self.output_layouts}, "
                f"desired_output_layouts={self.desired_output_layouts}, "
                f"use_local_output={self.use_local_output})")
