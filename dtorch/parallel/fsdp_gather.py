"""The controller side of ``fully_shard``'s collectives: one all_gather brings a group of
``Shard(0)`` parameters whole (packed into one flat buffer on every rank), and the backward of
that gather is one reduce_scatter of their gradients (packed the same way), so a layer costs
one collective each way whatever its number of parameters. The whole parameters can be freed
on the ranks after the forward (``free``) and gathered again into the same memory before the
backward (``refill``): the local autograd graphs that saved them see them again.

The gather is a node of the controller's graph with its own backward (no local graph on the
ranks); its incoming gradients are taken as they arrive (``Partial("sum")`` on a data-parallel
batch), so nothing all-reduces them first. Example::

    whole = gather(shards, flat_layout([p.shape for p in shards], 4), record=True)
    # whole[i]: Replicate, shards[i] whole; whole[i].grad_fn.name() == "FullyShardGatherBackward"
"""

from __future__ import annotations

import functools

from .. import comm_debug
from ..autograd.node import Node, edge_of, mark_output
from ..local_call import run_local
from ..placement import Partial, Replicate, Shard
from ..runtime import messages as m
from ..tensor import DTensor
from ..spec import make_spec
from . import fsdp_kernels
from .fsdp_kernels import FlatLayout

R = Replicate()


def _issue(fn, inputs, out_specs, **kwargs) -> list:
    """Run the rank-side kernel ``fn`` on ``inputs`` (DTensors, or a ``Coord``) on their mesh."""
    return run_local(fn, tuple(inputs), kwargs, out_specs)


def _flat_spec(layout: FlatLayout, like: DTensor, placements):
    return make_spec((layout.n * layout.width,), like.dtype, like._spec.mesh, placements)


def gather_whole(shards: list, layout: FlatLayout) -> list:
    """The whole (Replicate) values of ``shards`` through one all_gather (not recorded)."""
    first = shards[0]
    flat, = _issue(fsdp_kernels.pack_shards, shards, [_flat_spec(layout, first, (Shard(0),))],
                   layout=layout)
    whole = flat._move(first._spec.mesh, (R,))
    mesh = first._spec.mesh
    return _issue(fsdp_kernels.unpack_whole, [whole],
                  [make_spec(s.shape, s.dtype, mesh, (R,)) for s in shards], layout=layout)


def gather(shards: list, layout: FlatLayout, record: bool) -> list:
    """:func:`gather_whole`; with ``record`` the outputs are those of a graph node whose
    backward reduce-scatters their gradients back to the shards (see module doc)."""
    whole = gather_whole(shards, layout)
    if not record:
        return whole
    c = shards[0]._controller
    node = Node(c.new_tid(), "FullyShardGatherBackward", c, shards[0]._spec.mesh,
                [s._spec for s in shards], [w._spec for w in whole],
                [edge_of(s) for s in shards], keeps_graph=False,
                backward=functools.partial(reduce_scatter_grads, layout=layout))
    node.partial_grads = True
    for i, w in enumerate(whole):
        mark_output(w, node, i)
    return whole


def _common_placement(grads: list) -> tuple:
    """What the gradients are packed as: ``Partial("sum")`` if any is pending (a Replicate
    one joins it locally), else Replicate."""
    if any(p.is_partial() for g in grads for p in g.placements):
        return (Partial("sum"),)
    return (R,)


def reduce_scatter_grads(node: Node, grads: dict, retain: bool, layout: FlatLayout) -> list:
    """The gather's backward: the whole gradients packed into one flat buffer and moved to
    ``Shard(0)`` (one reduce_scatter when they are Partial, a local slice when Replicate),
    unpacked into the shards' gradients. CommDebugMode names it by the parameters
    (``layers.0.weight+layers.0.bias``)."""
    from ..factories import zeros
    mesh = node.mesh
    whole = [grads.get(i) for i in range(len(node.out_specs))]
    first = next(g for g in whole if g is not None)
    target = _common_placement([g for g in whole if g is not None])
    name = "+".join(e.leaf.name for e in node.edges if e.leaf is not None and e.leaf.name)
    with comm_debug.gradient_of(name or None):
        whole = [zeros(*s.shape, dtype=first.dtype, device_mesh=mesh, placements=target)
                 if g is None else g if g.placements == target else g._move(mesh, target)
                 for g, s in zip(whole, node.out_specs)]
        flat, = _issue(fsdp_kernels.pack_whole, whole, [_flat_spec(layout, first, target)],
                       layout=layout)
        flat = flat._move(mesh, (Shard(0),))
    return _issue(fsdp_kernels.unpack_shards, [flat, m.Coord(mesh)],
                  [make_spec(s.shape, first.dtype, mesh, (Shard(0),)) for s in node.in_specs],
                  layout=layout)


def free(whole: list, outputs: list) -> None:
    """Drop the ranks' memory of the whole parameters (the graphs that saved them too), but
    not where one of the module's ``outputs`` is a view of it."""
    _issue(fsdp_kernels.free_storage, list(whole) + list(outputs), [], n_whole=len(whole))


def refill(whole: list, shards: list, layout: FlatLayout) -> None:
    """Gather ``shards`` again (one all_gather) into the memory :func:`free` dropped."""
    again = gather_whole(shards, layout)
    _issue(fsdp_kernels.refill, list(whole) + again, [])
