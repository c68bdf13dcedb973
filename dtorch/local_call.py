"""Running a rank-side kernel on the local shards of DTensors: one ``Call`` instruction.

For library code whose work is a local function of each rank's shards (fully_shard's packing,
an optimizer's step): the DTensors anywhere in ``args`` (lists, tuples, dicts) become ``Ref``
placeholders, ``messages.Coord(mesh)`` stays one, and the kernel's outputs come back as
DTensors of ``out_specs``. Nothing is planned: the caller says what the outputs are.
Example::

    flat, = run_local(pack_shards, (w, b), {"layout": layout}, [flat_spec])
"""

from __future__ import annotations

import torch.utils._pytree as pytree

from .runtime import messages as m
from .tensor import DTensor


def run_local(fn, args: tuple, kwargs: dict, out_specs, mesh=None) -> list:
    """Issue ``fn(*args, **kwargs)`` on every rank of ``mesh`` (default: the first DTensor's)
    with each DTensor replaced by its local shard; the outputs as DTensors of ``out_specs``."""
    from .runtime import session
    leaves = pytree.tree_leaves((args, kwargs), is_leaf=lambda x: isinstance(x, DTensor))
    tensors = [t for t in leaves if isinstance(t, DTensor)]
    if not tensors and mesh is None:
        raise TypeError("run_local without a DTensor argument needs mesh=")
    c = tensors[0]._live() if tensors else session.get_controller()
    for t in tensors:
        t._live()
    mesh = mesh if mesh is not None else tensors[0]._spec.mesh
    c.ensure_mesh(mesh)
    cargs, ckwargs = pytree.tree_map(lambda x: m.Ref(x._tid) if isinstance(x, DTensor) else x,
                                     (tuple(args), dict(kwargs)),
                                     is_leaf=lambda x: isinstance(x, DTensor))
    tids = tuple(c.new_tid() for _ in out_specs)
    c.issue(m.Call(tids, fn, tuple(cargs), ckwargs, mesh.ranks))
    return [DTensor._wrap(spec, tid, c) for spec, tid in zip(out_specs, tids)]
