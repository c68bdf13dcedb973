"""PyTorch's tensor-parallel styles, by its names and arguments, on dtorch's single controller.

``ColwiseParallel`` shards a Linear's weight and bias ``Shard(0)`` (an Embedding's weight
``Shard(1)``) on the plan's mesh dim; ``RowwiseParallel`` a Linear's weight ``Shard(1)`` with
bias Replicate (an Embedding's ``Shard(0)``); ``SequenceParallel`` replicates a module's
parameters and shards its input on the sequence dim. Colwise then Rowwise keeps the activation
sharded between them: the row-parallel matmul's output is ``Partial``, and its
``output_layouts=Replicate()`` is the forward's one all_reduce.

Differences from PyTorch, all from there being one controller:

- a ``torch.Tensor`` input is the *global* value (PyTorch reads it as this rank's local shard),
  so it is sent straight in the layout the style wants (no gather); a DTensor input keeps its
  real placements and is redistributed to that layout: ``input_layouts`` is accepted, and only
  PyTorch's local tensors needed it;
- ``use_local_output`` is accepted and ignored: outputs stay DTensors (there is no "this
  rank's" local tensor to hand back);
- a row-parallel Linear's bias is ``Partial()`` (PyTorch: Replicate): one rank holds it, the
  others zeros, so it adds once to the Partial product (its ``to_torch()`` and ``state_dict``
  value are the bias itself);
- layouts are placements on the plan's mesh dim ("tp", or the one ``mesh["tp"]`` names); every
  other mesh dim keeps what the tensor has (a torch input: Replicate there).

Example::

    parallelize_module(mlp, mesh, {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
"""

from __future__ import annotations

import torch

from ..errors import PlacementError
from ..placement import Partial, Placement, Replicate, Shard
from .base import ParallelStyle
from .convert import Target
from .prepare import lay_out


def _unsupported(style, module, path: str, supported: str) -> PlacementError:
    return PlacementError(
        f"{type(style).__name__} cannot shard {path or 'the root module'} "
        f"({type(module).__name__}): it supports {supported}. Fix: use SequenceParallel() or "
        f"no plan entry (its parameters are then replicated), or distribute_module with a "
        f"partition_fn for this module")


class _LinearOrEmbedding(ParallelStyle):
    """What Colwise and Rowwise share: arguments, the module-type check and the hooks."""

    def __init__(self, *, input_layouts: Placement | None = None,
                 output_layouts: Placement | None = None, use_local_output: bool = True):
        self.input_layouts = (input_layouts or self._default_in,)
        self.output_layouts = (output_layouts or self._default_out,)
        self.use_local_output = use_local_output  # accepted; outputs stay DTensors

    def _check(self, module, path: str) -> None:
        if not isinstance(module, (torch.nn.Linear, torch.nn.Embedding)):
            raise _unsupported(self, module, path, "torch.nn.Linear and torch.nn.Embedding")

    def _desired_input(self, module) -> Placement:
        return Replicate()

    def _hooks(self, module, target: Target) -> None:
        layout, desired = self.input_layouts[0], self._desired_input(module)
        out_layout = self.output_layouts[0]

        def pre(mod, args):
            return (lay_out(args[0], target, layout, desired),) + tuple(args[1:])

        def post(mod, args, output):
            return lay_out(output, target, None, out_layout)

        module.register_forward_pre_hook(pre)
        module.register_forward_hook(post)

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(input_layouts={self.input_layouts}, "
                f"output_layouts={self.output_layouts}, use_local_output={self.use_local_output})")


class ColwiseParallel(_LinearOrEmbedding):
    """Linear: weight and bias ``Shard(0)``, input Replicate, output ``Shard(-1)``. Embedding:
    weight ``Shard(1)``."""

    _default_in, _default_out = Replicate(), Shard(-1)

    def _partition(self, module) -> dict[str, Placement]:
        if isinstance(module, torch.nn.Embedding):
            return {"weight": Shard(1)}
        return {"weight": Shard(0), "bias": Shard(0)}


class RowwiseParallel(_LinearOrEmbedding):
    """Linear: weight ``Shard(1)``, bias ``Partial()``, input ``Shard(-1)``, output Replicate (one
    all_reduce of the Partial result). Embedding: weight ``Shard(0)``, input Replicate."""

    _default_in, _default_out = Shard(-1), Replicate()

    def _partition(self, module) -> dict[str, Placement]:
        if isinstance(module, torch.nn.Embedding):
            return {"weight": Shard(0)}
        return {"weight": Shard(1), "bias": Partial()}

    def _desired_input(self, module) -> Placement:
        return Replicate() if isinstance(module, torch.nn.Embedding) else Shard(-1)


class SequenceParallel(ParallelStyle):
    """Parameters Replicate; the input sharded on ``sequence_dim`` (a torch input is the global
    value, laid out so); the output stays as the module's ops leave it (sharded on the sequence
    dim for norms and dropout)."""

    def __init__(self, *, sequence_dim: int = 1, use_local_output: bool = False):
        self.sequence_sharding = (Shard(sequence_dim),)
        self.use_local_output = use_local_output

    def _partition(self, module) -> dict[str, Placement]:
        return {name: Replicate() for name, p in module._parameters.items() if p is not None}

    def _hooks(self, module, target: Target) -> None:
        shard = self.sequence_sharding[0]

        def pre(mod, args):
            if not args or not isinstance(args[0], torch.Tensor) and not _is_dtensor(args[0]):
                raise PlacementError(f"expecting the input of {type(mod).__name__} to be a "
                                     f"torch.Tensor or DTensor, but got {args[:1]!r}")
            return (lay_out(args[0], target, shard, shard),) + tuple(args[1:])

        module.register_forward_pre_hook(pre)

    def __repr__(self) -> str:
        return (f"SequenceParallel(sequence_dim={self.sequence_sharding[0].dim}, "
                f"use_local_output={self.use_local_output})")


def _is_dtensor(x) -> bool:
    from ..tensor import DTensor
    return isinstance(x, DTensor)
