"""Redistribute in the graph: a node with no local graph on the ranks. Its backward is a
planned redistribute of the gradient back to the input's mesh and placements (Partial ->
Replicate), so the table in docs/autograd.md holds by construction: Replicate <- Shard is a
local slice (a reduce_scatter when the gradient arrives Partial), Shard <- Replicate an
all_gather, Partial -> Replicate nothing, Shard(i) <-> Shard(j) an all_to_all, a move
between meshes point to point. Example::

    y = x.redistribute(placements=[Replicate()])   # x Shard(0), requires grad
    y.grad_fn.name()                               # 'RedistributeBackward'
"""

from __future__ import annotations

from . import cotangent
from .node import Node, edge_of, mark_output


def record_redistribute(src, out) -> None:
    """Make ``out`` (``src`` redistributed) an output of a redistribute node."""
    node = Node(out._controller.new_tid(), "RedistributeBackward", out._controller,
                src._spec.mesh, [src._spec], [out._spec], [edge_of(src)], keeps_graph=False)
    mark_output(out, node, 0)


def grad_target(node: Node):
    """``(mesh, placements)`` the input's gradient is brought to."""
    spec = node.in_specs[0]
    return spec.mesh, cotangent.redistribute_grad_placements(spec.placements)
