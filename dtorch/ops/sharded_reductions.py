"""Selections along a sharded dim: ``max``/``min`` with ``dim`` (values and indices),
``argmax``/``argmin`` (with ``dim``, or over all dims: the flat index), ``topk``,
``kthvalue`` and ``logsumexp``, as DTensor ops (``registry.decomposed``).

Each rank reduces its own block to a few candidates carrying their global indices
(:func:`~dtorch.ops.sharded_blocks.block_reduce`: 1 per block for an extremum or a
log-sum-exp, ``k`` for ``topk``/``kthvalue``), the candidates alone are gathered along the
mesh dims that shard the reduced dim (one all_gather per such mesh dim for the values, one
for the indices), and a local pick on the gathered candidates gives torch's answer. An
extremum takes the smallest global index among the tied candidates (torch's first
occurrence; NaN wins, as in torch); a candidate from an empty block is the reduction's
identity with an index that never wins. ``topk``/``kthvalue`` refuse when ``k x blocks >=
n / 2`` (the candidates would move as much as gathering the dim); their tied values come
with the smallest global indices (torch's own choice among ties is unspecified). The
backward is the ops': the gradient of a value goes to the element it came from. Example::

    x = dtorch.distribute_tensor(torch.randn(8, 10), mesh, [Shard(1)])
    values, indices = x.max(1)     # torch's; 2 all_gathers of 4 candidates per row
    x.topk(2, dim=1)               # 2 all_gathers of 8 candidates per row

    >>> pick_extreme(torch.tensor([3., 5., 5.]), torch.tensor([4, 9, 2]), (0,), "max", False)
    (tensor(5.), tensor(2))
"""

from __future__ import annotations

import torch

from ..tensor import DTensor
from .dispatch import dispatch
from .reduction import reduce_placements, reduced_dims
from .registry import decomposed, rule
from .sharded_blocks import (BIG, block_reduce, flatten_dims, gathered, grid_of, has_partial,
                             identity, n_blocks, reduced_shape, refuse_gather,
                             sharding_mesh_dims, torch_check)


# kernels (one block) -----------------------------------------------------------------------
def extreme_kernel(block, offsets, dims, kind, shape):
    """``(value, global index)`` of the first extremum of ``block`` over ``dims`` (a flat
    index in ``shape`` when several dims are reduced), kept dims of size 1."""
    out = reduced_shape(block.shape, dims, True)
    if any(block.shape[d] == 0 for d in dims):
        return (torch.full(out, identity(kind, block.dtype), dtype=block.dtype,
                           device=block.device),
                torch.full(out, BIG, dtype=torch.long, device=block.device))
    flat = flatten_dims(block, dims)
    value, j = flat.max(-1) if kind == "max" else flat.min(-1)
    index = torch.zeros_like(j)
    stride = 1
    for d, o in reversed(list(zip(dims, offsets))):
        index = index + (j % block.shape[d] + o) * stride
        j = j // block.shape[d]
        stride *= shape[d]
    return value.reshape(out), index.reshape(out)


def topk_kernel(block, offsets, dims, k, largest):
    """The ``k`` largest (smallest) of ``block`` along its dim with global indices, padded
    with values that never win (-inf / NaN, which sorts last) and the index BIG."""
    d = dims[0]
    kk = min(k, block.shape[d])
    values, j = torch.sort(block, dim=d, descending=largest, stable=True)  # ties: first
    values, j = values.narrow(d, 0, kk), j.narrow(d, 0, kk)
    pad = list(block.shape)
    pad[d] = k - kk
    if largest or not block.dtype.is_floating_point:
        fill = identity("max" if largest else "min", block.dtype)
    else:
        fill = float("nan")
    values = torch.cat([values, torch.full(pad, fill, dtype=block.dtype, device=block.device)], d)
    j = torch.cat([j + offsets[0], torch.full(pad, BIG, dtype=torch.long, device=block.device)], d)
    return values, j


def lse_kernel(block, offsets, dims):
    """``logsumexp`` of ``block`` over ``dims``, kept (an empty block gives -inf)."""
    return torch.logsumexp(block, dims, keepdim=True)


# picks (on the gathered candidates) ---------------------------------------------------------
def pick_extreme(values, indices, dims, kind, keepdim):
    """The extremum over ``dims`` and the smallest global index among its ties (NaN wins)."""
    v, i = flatten_dims(values, dims), flatten_dims(indices, dims)
    best = v.amax(-1, keepdim=True) if kind == "max" else v.amin(-1, keepdim=True)
    tie = v == best
    if v.dtype.is_floating_point:
        tie = tie | (v.isnan() & best.isnan())
    chosen = torch.where(tie, i, BIG).amin(-1, keepdim=True)
    pos = (tie & (i == chosen)).to(torch.uint8).argmax(-1, keepdim=True)
    out = reduced_shape(values.shape, dims, keepdim)
    return v.gather(-1, pos).reshape(out), chosen.reshape(out)


def lex_order(values, indices, d, descending):
    """The candidates along ``d`` sorted by value (NaN largest, as torch.sort), ties by
    index."""
    by_index = torch.argsort(indices, dim=d, stable=True)
    values, indices = values.gather(d, by_index), indices.gather(d, by_index)
    by_value = torch.sort(values, dim=d, descending=descending, stable=True).indices
    return values.gather(d, by_value), indices.gather(d, by_value)


def pick_topk(values, indices, d, k, largest):
    values, indices = lex_order(values, indices, d, largest)
    return values.narrow(d, 0, k), indices.narrow(d, 0, k)


def pick_kth(values, indices, d, k, keepdim):
    values, indices = lex_order(values, indices, d, False)
    values, indices = values.narrow(d, k - 1, 1), indices.narrow(d, k - 1, 1)
    return (values, indices) if keepdim else (values.squeeze(d), indices.squeeze(d))


@rule(pick_extreme, family="composite", arg_names=("values", "indices"))
def pick_extreme_rule(op):
    x = op.tensors[0]
    return [reduce_placements(op, x, op.arg(2, "dims"), bool(op.arg(4, "keepdim")), None)] * 2


@rule(pick_topk, family="composite", arg_names=("values", "indices"))
def pick_topk_rule(op):
    x = op.tensors[0]
    return [reduce_placements(op, x, (op.arg(2, "d"),), True, None)] * 2


@rule(pick_kth, family="composite", arg_names=("values", "indices"))
def pick_kth_rule(op):
    x = op.tensors[0]
    return [reduce_placements(op, x, (op.arg(2, "d"),), bool(op.arg(4, "keepdim")), None)] * 2


# the composites ------------------------------------------------------------------------------
def _along_shard(x, dims) -> bool:
    """Whether this call is ours: a DTensor sharded on a reduced dim, no Partial."""
    return (isinstance(x, DTensor) and x.ndim > 0 and not has_partial(x.placements)
            and bool(sharding_mesh_dims(x.placements, dims)))


def extreme(x, dims, kind, keepdim):
    """``(values, indices)`` of the first max/min of ``x`` over ``dims`` (flat indices when
    several)."""
    grid = grid_of(x.shape, x.device_mesh, x.placements, dims)
    values, indices = dispatch(block_reduce, None, (x, extreme_kernel, dims, grid, 1, kind,
                                                    tuple(x.shape)))
    values, indices = gathered(values, dims), gathered(indices, dims)
    return dispatch(pick_extreme, None, (values, indices, dims, kind, keepdim))


def _arg(args, kwargs, pos, name, default=None):
    if name in kwargs:
        return kwargs[name]
    return args[pos] if pos < len(args) else default


@decomposed(torch.max, torch.Tensor.max, torch.min, torch.Tensor.min)
def max_min_with_dim(func, args, kwargs):
    """``torch.max(x, dim, keepdim)`` along a sharded dim (see module doc)."""
    x, dim = args[0] if args else kwargs.get("input"), _arg(args, kwargs, 1, "dim")
    if not isinstance(dim, int) or isinstance(dim, bool) or not isinstance(x, DTensor):
        return NotImplemented  # max(x), max(x, other): the rules
    dims = reduced_dims(dim, x.ndim)
    if not _along_shard(x, dims):
        return NotImplemented
    torch_check(func, x, args, kwargs)
    kind = "max" if func in (torch.max, torch.Tensor.max) else "min"
    values, indices = extreme(x, dims, kind, bool(_arg(args, kwargs, 2, "keepdim", False)))
    result = torch.return_types.max if kind == "max" else torch.return_types.min
    return result((values, indices))


def _reduced_call(func, args, kwargs):
    """``(x, dims)`` of a ``f(x, dim=None, keepdim)`` reduction over sharded dims of a DTensor
    (torch's own argument checks run first), or None: the op's rule takes it."""
    x, dim = args[0] if args else kwargs.get("input"), _arg(args, kwargs, 1, "dim")
    if not isinstance(x, DTensor) or x.ndim == 0:
        return None
    dims = reduced_dims(dim, x.ndim)
    if not _along_shard(x, dims):
        return None
    torch_check(func, x, args, kwargs)
    return x, dims


@decomposed(torch.argmax, torch.Tensor.argmax, torch.argmin, torch.Tensor.argmin)
def argmax_argmin(func, args, kwargs):
    """``argmax``/``argmin`` along a sharded dim, or over all dims (the flat index)."""
    call = _reduced_call(func, args, kwargs)
    if call is None:
        return NotImplemented
    x, dims = call
    kind = "max" if func in (torch.argmax, torch.Tensor.argmax) else "min"
    return extreme(x, dims, kind, bool(_arg(args, kwargs, 2, "keepdim", False)))[1]


def _candidates_k(func, x, k, d):
    """topk / kthvalue: ``k`` candidates per block, refused when they move as much as the
    dim itself would."""
    world, n = n_blocks(x.device_mesh, x.placements, d), x.shape[d]
    if k * world >= n / 2:
        from .registry import display_name
        refuse_gather(display_name(func), x, (d,),
                      f"{k} candidates from each of {world} blocks of dim {d} (size {n}) "
                      f"would move as much as gathering the dim (k x blocks >= n / 2)")
    grid = grid_of(x.shape, x.device_mesh, x.placements, (d,))
    return grid


def _k_call(func, args, kwargs):
    """``(x, k, d, flag)`` of a ``topk``/``kthvalue`` call along a sharded dim (``flag``: the
    4th parameter, ``largest`` / ``keepdim``), or None when it is not one."""
    x, k = args[0] if args else kwargs.get("input"), _arg(args, kwargs, 1, "k")
    if not isinstance(x, DTensor) or x.ndim == 0 or not isinstance(k, int):
        return None
    d = _arg(args, kwargs, 2, "dim", -1) % x.ndim
    if not _along_shard(x, (d,)):
        return None
    torch_check(func, x, args, kwargs)
    name = "largest" if func in (torch.topk, torch.Tensor.topk) else "keepdim"
    return x, k, d, bool(_arg(args, kwargs, 3, name, name == "largest"))


def _gathered_candidates(func, x, k, d, largest):
    """The k best of every block along ``d``, gathered (values, global indices)."""
    grid = _candidates_k(func, x, k, d)
    values, indices = dispatch(block_reduce, None, (x, topk_kernel, (d,), grid, k, k, largest))
    return gathered(values, (d,)), gathered(indices, (d,))


def _k_along_shard(func, args, kwargs, pick, result, largest=None):
    """topk / kthvalue along a sharded dim: the k best candidates of every block, gathered,
    then ``pick``; ``largest=None`` reads it from the call (topk), else it is fixed."""
    call = _k_call(func, args, kwargs)
    if call is None:
        return NotImplemented
    x, k, d, flag = call
    values, indices = _gathered_candidates(func, x, k, d, flag if largest is None else largest)
    return result(dispatch(pick, None, (values, indices, d, k, flag)))


@decomposed(torch.topk, torch.Tensor.topk)
def topk_along_shard(func, args, kwargs):
    """``topk(x, k, dim, largest, sorted)`` along a sharded dim (see module doc)."""
    return _k_along_shard(func, args, kwargs, pick_topk, torch.return_types.topk)


@decomposed(torch.kthvalue, torch.Tensor.kthvalue)
def kthvalue_along_shard(func, args, kwargs):
    """``kthvalue(x, k, dim, keepdim)`` along a sharded dim: the k smallest per block."""
    return _k_along_shard(func, args, kwargs, pick_kth, torch.return_types.kthvalue,
                          largest=False)


@decomposed(torch.logsumexp, torch.Tensor.logsumexp)
def logsumexp_along_shard(func, args, kwargs):
    """``logsumexp(x, dim, keepdim)`` over sharded dims: each block's, gathered, then the
    log-sum-exp of those (exact for -inf and empty blocks)."""
    call = _reduced_call(func, args, kwargs)
    if call is None:
        return NotImplemented
    x, dims = call
    keepdim = bool(_arg(args, kwargs, 2, "keepdim", False))
    grid = grid_of(x.shape, x.device_mesh, x.placements, dims)
    if not x.dtype.is_floating_point:
        x = x.to(torch.get_default_dtype())
    parts = gathered(dispatch(block_reduce, None, (x, lse_kernel, dims, grid, 1)), dims)
    return dispatch(torch.logsumexp, None, (parts, dims, keepdim))
