"""Embeddings: ``Embedding`` (weight Replicate), ``EmbeddingWithReplicateOutput`` (weight
``Shard(1)`` on tp, the output gathered to Replicate: one all_gather) and
``VocabParallelEmbedding`` (weight ``Shard(0)`` on tp: each rank looks up the rows it holds,
the output is ``Partial()``; ``reduce_output=True`` all-reduces it to Replicate).

Indices must be Replicate on tp (``Shard(0)`` on dp for a sharded batch is fine). Example::

    embed = EmbeddingWithReplicateOutput(vocab_size, hidden, device_mesh=mesh)
    h = embed(token_ids)            # Replicate on tp
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ...errors import PlacementError
from ...placement import Replicate, Shard
from .. import init
from ...graph import mesh_or_default
from .linear import resolve_tp_dim
from .module import Module, ModuleError
from .placement_io import as_dtensor


class Embedding(Module):
    """``torch.nn.Embedding`` with a DTensor weight (Replicate unless a subclass shards it)."""

    weight_shard: Shard | None = None  # the weight's placement on tp (None: Replicate)
    output_placement = None  # what the output becomes on tp

    def __init__(self, num_embeddings: int, embedding_dim: int, padding_idx: int | None = None,
                 device=None, dtype=None, device_mesh=None, *, tp_dim="tp"):
        super().__init__()
        for name, value in (("num_embeddings", num_embeddings), ("embedding_dim", embedding_dim)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ModuleError(f"{name} must be a positive int; got {value!r}")
        if padding_idx is not None:
            if not -num_embeddings <= padding_idx < num_embeddings:
                raise ModuleError(f"padding_idx must be within num_embeddings ({num_embeddings});"
                                  f" got {padding_idx}")
            padding_idx %= num_embeddings
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.padding_idx = padding_idx
        self.device_mesh = mesh_or_default(device_mesh, device)
        self.tp_dim = resolve_tp_dim(self.device_mesh, tp_dim) if self.weight_shard else None
        placements = [Replicate()] * self.device_mesh.ndim
        if self.tp_dim is not None:
            placements[self.tp_dim] = self.weight_shard
        self.weight = init.normal((num_embeddings, embedding_dim), dtype=dtype,
                                  device_mesh=self.device_mesh, placements=placements)
        if padding_idx is not None:  # torch.nn.Embedding zeroes the padding row
            with torch.no_grad():  # an initial value, not a step of the graph
                self.weight = self.weight * _row_mask(num_embeddings, padding_idx, self.weight)

    def redistribute_input(self, input):
        input = as_dtensor(input, self.device_mesh, None, None)
        if self.tp_dim is not None and not input.check_placement(self.tp_dim, Replicate()):
            names = self.device_mesh.mesh_dim_names
            dim = names[self.tp_dim] if names else self.tp_dim
            raise PlacementError(
                f"{type(self).__name__} expects the indices to be Replicate on mesh dim {dim!r} "
                f"(the tensor-parallel dim), but they are {input.placements[self.tp_dim]}. Fix: "
                f"input.redistribute_by_dict(placements_dict={{{dim!r}: Replicate()}})")
        return (input,), {}

    def redistribute_output(self, output):
        if self.tp_dim is not None and self.output_placement is not None:
            output = output.redistribute_by_dict(
                placements_dict={self.tp_dim: self.output_placement},
                default_placement_mode="keep")
        return output

    def forward(self, input):
        return F.embedding(input, self.weight, self.padding_idx)

    def extra_repr(self) -> str:
        pad = "" if self.padding_idx is None else f", padding_idx={self.padding_idx}"
        return f"{self.num_embeddings}, {self.embedding_dim}{pad}"


def _row_mask(rows: int, zero_row: int, like):
    """A (rows, 1) DTensor of ones with a zero at ``zero_row``, placed to multiply ``like``."""
    from ...factories import distribute_tensor
    mask = torch.ones(rows, 1, dtype=like.dtype)
    mask[zero_row] = 0
    placements = [Replicate() if p == Shard(1) else p for p in like.placements]
    return distribute_tensor(mask, like.device_mesh, placements)


class EmbeddingWithReplicateOutput(Embedding):
    """Weight ``Shard(1)`` (embedding dim) on tp; the output is all-gathered to Replicate."""

    weight_shard = Shard(1)
    output_placement = Replicate()


class VocabParallelEmbedding(Embedding):
    """Weight ``Shard(0)`` (vocabulary) on tp; each rank looks up the rows it holds and the
    output is ``Partial()`` on tp, or Replicate (one all_reduce) with ``reduce_output=True``."""

    weight_shard = Shard(0)

    def __init__(self, num_embeddings: int, embedding_dim: int, padding_idx: int | None = None,
                 device=None, dtype=None, device_mesh=None, *, tp_dim="tp",
                 reduce_output: bool = False):
        super().__init__(num_embeddings, embedding_dim, padding_idx, device, dtype, device_mesh,
                         tp_dim=tp_dim)
        self.output_placement = Replicate() if reduce_output else None
