"""An independent, in-one-process reference interpreter for redistribute plans.

It holds ``{rank: local torch.Tensor}`` and applies each planned ``Step`` to those tensors by
simulating the collective inside every group of the step. It deliberately does not use
``dtorch.layout.rank_block`` (the thing under test): groups are recomputed from the mesh's rank
tensor, and the only layout helper used is ``chunk_sizes`` (itself checked against
``torch.chunk`` in test_layout.py).

Semantics simulated (per group, members in group order):
- all_gather: concatenate the members' locals along the source Shard dim.
- all_to_all: member k splits its local along the target Shard dim into n ``chunk_sizes``
  pieces and sends piece j to member j; member j concatenates what it received along the
  source Shard dim, in member order.
- all_reduce: reduce the members' locals with the source Partial's op (avg = mean).
- reduce_scatter: reduce, then member k keeps piece k along the target Shard dim.
- slice: member k keeps piece k of its local along the target Shard dim.
- to_partial: sum -> zeros everywhere but member 0; avg/max/min -> value kept.
- send_recv: ``groups`` are (src_rank, dst_rank) pairs; locals move along them.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import torch

from dtorch.layout import chunk_sizes
from dtorch.placement import Partial, Replicate, Shard

KINDS = ("all_gather", "all_to_all", "all_reduce", "reduce_scatter", "slice", "to_partial",
         "send_recv")


class ReferenceMismatch(AssertionError):
    """A step that is inconsistent with the state the reference tracks."""


def mesh_groups(mesh, dim: int) -> tuple[tuple[int, ...], ...]:
    """Rank tuples along mesh dim ``dim``, computed from the rank tensor (independently of
    ``DeviceMesh.groups``): move ``dim`` last, flatten the rest row-major."""
    t = mesh.mesh
    n = t.shape[dim]
    rows = t.movedim(dim, -1).reshape(-1, n).tolist()
    return tuple(tuple(int(r) for r in row) for row in rows)


def reduce_tensors(tensors: Sequence[torch.Tensor], op: str) -> torch.Tensor:
    stacked = torch.stack(list(tensors))
    if op == "sum":
        return stacked.sum(0)
    if op == "avg":
        return stacked.mean(0)
    if op == "max":
        return stacked.amax(0)
    if op == "min":
        return stacked.amin(0)
    raise ReferenceMismatch(f"unknown reduce op {op!r}")


def pieces(t: torch.Tensor, dim: int, n: int) -> list[torch.Tensor]:
    """``n`` pieces of ``t`` along ``dim`` with ``torch.chunk`` sizes (empty pieces allowed)."""
    return list(torch.split(t, list(chunk_sizes(t.shape[dim], n)), dim=dim))


class ReferenceExecutor:
    """Applies planned steps to ``{rank: tensor}``; tracks the mesh and placements too."""

    def __init__(self, mesh, placements, locals_: Mapping[int, torch.Tensor]):
        self.mesh = mesh
        self.placements = tuple(placements)
        self.locals = {r: t.clone() for r, t in locals_.items()}
        if set(self.locals) != set(mesh.ranks):
            raise ReferenceMismatch(f"locals for ranks {sorted(self.locals)} on a mesh of "
                                 f"ranks {sorted(mesh.ranks)}")

    # -----------------------------------------------------------------------------------------
    def run(self, steps, dst_mesh=None):
        for step in steps:
            self.apply(step, dst_mesh)
        return self.locals

    def apply(self, step, dst_mesh=None) -> None:
        if step.kind not in KINDS:
            raise ReferenceMismatch(f"unknown step kind {step.kind!r}")
        if step.kind == "send_recv":
            self._send_recv(step, dst_mesh)
            return
        if tuple(step.before) != self.placements:
            raise ReferenceMismatch(f"step {step.kind} expects placements {step.before}, "
                                 f"state has {self.placements}")
        i = step.mesh_dim
        if not 0 <= i < self.mesh.ndim:
            raise ReferenceMismatch(f"mesh dim {i} out of range for {self.mesh}")
        if step.src != step.before[i] or step.dst != step.after[i]:
            raise ReferenceMismatch(f"step src/dst {step.src}/{step.dst} disagree with "
                                 f"before/after {step.before}/{step.after} at mesh dim {i}")
        for k, (b, a) in enumerate(zip(step.before, step.after)):
            if k != i and b != a:
                raise ReferenceMismatch(f"step along mesh dim {i} also changes mesh dim {k}")
        expected_groups = mesh_groups(self.mesh, i)
        if tuple(step.groups) != expected_groups:
            raise ReferenceMismatch(f"step groups {step.groups} != mesh groups {expected_groups}")
        names = self.mesh.mesh_dim_names
        if step.mesh_dim_name != (names[i] if names else None):
            raise ReferenceMismatch(f"step names mesh dim {step.mesh_dim_name!r}, mesh has {names}")

        handler = getattr(self, "_" + step.kind)
        new = dict(self.locals)
        for group in step.groups:
            outs = handler(step, [self.locals[r] for r in group])
            for r, t in zip(group, outs):
                new[r] = t
        self.locals = new
        self.placements = tuple(step.after)

    # per-group collectives -------------------------------------------------------------------
    def _all_gather(self, step, xs):
        self._expect(step, Shard, Replicate)
        full = torch.cat(xs, dim=step.src.dim)
        return [full.clone() for _ in xs]

    def _all_to_all(self, step, xs):
        self._expect(step, Shard, Shard)
        n = len(xs)
        d_src, d_dst = step.src.dim, step.dst.dim
        sent = [pieces(x, d_dst, n) for x in xs]
        return [torch.cat([sent[k][j] for k in range(n)], dim=d_src) for j in range(n)]

    def _all_reduce(self, step, xs):
        self._expect(step, Partial, Replicate)
        red = reduce_tensors(xs, step.src.reduce_op)
        return [red.clone() for _ in xs]

    def _reduce_scatter(self, step, xs):
        self._expect(step, Partial, Shard)
        red = reduce_tensors(xs, step.src.reduce_op)
        return [p.clone() for p in pieces(red, step.dst.dim, len(xs))]

    def _slice(self, step, xs):
        self._expect(step, Replicate, Shard)
        n = len(xs)
        return [pieces(x, step.dst.dim, n)[k].clone() for k, x in enumerate(xs)]

    def _to_partial(self, step, xs):
        self._expect(step, Replicate, Partial)
        if step.dst.reduce_op == "sum":
            return [x.clone() if k == 0 else torch.zeros_like(x) for k, x in enumerate(xs)]
        return [x.clone() for x in xs]

    @staticmethod
    def _expect(step, src_type, dst_type):
        if not (isinstance(step.src, src_type) and isinstance(step.dst, dst_type)):
            raise ReferenceMismatch(f"{step.kind} cannot go from {step.src} to {step.dst}")

    # point to point --------------------------------------------------------------------------
    def _send_recv(self, step, dst_mesh) -> None:
        if dst_mesh is None:
            raise ReferenceMismatch("send_recv step without a destination mesh")
        if tuple(step.before) != self.placements or tuple(step.after) != self.placements:
            raise ReferenceMismatch(f"send_recv must keep placements {self.placements}; step has "
                                 f"{step.before} -> {step.after}")
        # Expected pairs: same coordinate on both meshes, computed from the rank tensors.
        src_flat = self.mesh.mesh.flatten().tolist()
        dst_flat = dst_mesh.mesh.flatten().tolist()
        expected = {(s, d) for s, d in zip(src_flat, dst_flat) if s != d}
        pairs = [tuple(p) for p in step.groups]
        if any(len(p) != 2 for p in pairs) or set(pairs) != expected or \
                len(pairs) != len(expected):
            raise ReferenceMismatch(f"send_recv pairs {pairs} != expected {sorted(expected)}")
        moved = {d: self.locals[s] for s, d in pairs}
        new = {}
        for r in dst_flat:
            if r in moved:
                new[r] = moved[r].clone()
            elif r in self.locals:
                new[r] = self.locals[r]
            else:
                raise ReferenceMismatch(f"rank {r} of the target mesh receives nothing")
        self.locals = new
        self.mesh = dst_mesh
