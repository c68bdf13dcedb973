"""Moments and norms over sharded dims, as DTensor ops (``registry.decomposed``).

``var``/``std``/``var_mean``/``std_mean`` (``correction`` or ``unbiased``, ``keepdim``)
over a sharded dim or all dims: each rank's block gives its mean and sum of squared
deviations ``M2`` (:func:`moments_kernel`), those two candidates per block are gathered
(one all_gather each per mesh dim that shards a reduced dim) and merged with the exact
per-block counts from the layout (Chan et al.: ``M2 = sum(M2_b + n_b (mean_b - mean)^2)``,
an empty block counts 0), then divided by ``max(0, N - correction)``.
``norm`` / ``torch.linalg.vector_norm`` of order ``p`` over a sharded dim: the sum of
``|x|^p`` is a ``Partial("sum")``, reduced (one all_reduce per such mesh dim), then the
root; ``p = -inf`` is ``amin |x|`` (a ``Partial("min")``, as ``p = inf`` gives
``Partial("max")`` by the reduction rule), ``p = 0`` the count of nonzeros (a
``Partial("sum")``). The backward is the ops'. Example::

    x = dtorch.distribute_tensor(torch.randn(10, 3), mesh, [Shard(0)])
    torch.var(x, 0)                 # torch's; 2 all_gathers of 4 x 3 values
    torch.linalg.vector_norm(x, 3)  # one all_reduce of 1 value

    >>> merge_moments(torch.tensor([1., 4.]), torch.tensor([2., 0.]), (0,), ((3, 1),), 1,
    ...               False, "var_mean")
    (tensor(2.9167), tensor(1.7500))
"""

from __future__ import annotations

import math

import torch

from ..tensor import DTensor
from .dispatch import dispatch
from .losses import replicated
from .reduction import reduce_placements, reduced_dims
from .registry import decomposed, rule
from .sharded_blocks import block_reduce, gathered, grid_of, has_partial, sharding_mesh_dims, \
    torch_check


def moments_kernel(block, offsets, dims):
    """``(mean, M2)`` of ``block`` over ``dims``, kept; zeros for an empty block."""
    if any(block.shape[d] == 0 for d in dims):
        shape = [1 if d in dims else s for d, s in enumerate(block.shape)]
        zeros = torch.zeros(shape, dtype=block.dtype, device=block.device)
        return zeros, zeros.clone()
    mean = block.mean(dims, keepdim=True)
    return mean, (block - mean).square().sum(dims, keepdim=True)


def block_counts(grid, dims, ndim, dtype, device=None):
    """The element count of every block, shaped to broadcast against the candidates."""
    counts = torch.ones((), dtype=dtype, device=device)
    for d, sizes in zip(dims, grid):
        shape = [1] * ndim
        shape[d] = len(sizes)
        counts = counts * torch.tensor(sizes, dtype=dtype, device=device).reshape(shape)
    return counts


def merge_moments(mean, m2, dims, grid, correction, keepdim, what):
    """``var``, ``std``, ``var_mean`` or ``std_mean`` from the per-block moments."""
    n = block_counts(grid, dims, mean.ndim, mean.dtype, mean.device)
    total = math.prod(sum(sizes) for sizes in grid)
    mu = (n * mean).sum(dims, keepdim=True) / total
    var = (m2 + n * (mean - mu).square()).sum(dims, keepdim=True) / max(0, total - correction)
    if not keepdim:
        var, mu = var.squeeze(dims), mu.squeeze(dims)
    spread = var.sqrt() if what.startswith("std") else var
    return (spread, mu) if what.endswith("_mean") else spread


@rule(merge_moments, family="composite", arg_names=("mean", "m2"))
def merge_moments_rule(op):
    x = op.tensors[0]
    placements = reduce_placements(op, x, op.arg(2, "dims"), bool(op.arg(5, "keepdim")), None)
    return [placements] * len(op.out.shapes)


_WHAT = {torch.var: "var", torch.Tensor.var: "var", torch.std: "std", torch.Tensor.std: "std",
         torch.var_mean: "var_mean", torch.std_mean: "std_mean"}


def var_args(args, kwargs):
    """``(dim, correction, keepdim)`` of a var/std call, by torch's overloads:
    ``(input, unbiased)``, ``(input, dim, unbiased, keepdim)``, ``(input, dim, *,
    correction, keepdim)``.

    >>> var_args((None, 0, False, True), {}), var_args((None,), {"correction": 0})
    ((0, 0, True), (None, 0, False))
    """
    rest, dim, unbiased = list(args[1:]), kwargs.get("dim"), kwargs.get("unbiased")
    keepdim = kwargs.get("keepdim", False)
    if rest and isinstance(rest[0], bool):
        unbiased = rest.pop(0)
    elif rest:
        dim = rest.pop(0)
        if rest:
            unbiased = rest.pop(0)
        if rest:
            keepdim = rest.pop(0)
    correction = kwargs.get("correction")
    if correction is None:
        correction = 0 if unbiased is False else 1
    return dim, correction, bool(keepdim)


@decomposed(*_WHAT)
def var_std_along_shard(func, args, kwargs):
    """var/std (and their ``_mean`` forms) over sharded dims (see module doc)."""
    x = args[0] if args else kwargs.get("input")
    if not isinstance(x, DTensor) or x.ndim == 0 or not x.dtype.is_floating_point:
        return NotImplemented
    dim, correction, keepdim = var_args(args, kwargs)
    dims = reduced_dims(dim, x.ndim)
    if has_partial(x.placements) or not sharding_mesh_dims(x.placements, dims):
        return NotImplemented
    torch_check(func, x, args, kwargs)
    grid = grid_of(x.shape, x.device_mesh, x.placements, dims)
    mean, m2 = dispatch(block_reduce, None, (x, moments_kernel, dims, grid, 1))
    mean, m2 = gathered(mean, dims), gathered(m2, dims)
    return dispatch(merge_moments, None, (mean, m2, dims, grid, correction, keepdim,
                                          _WHAT[func]))


# norms -----------------------------------------------------------------------------------------
def norm_args(func, args, kwargs):
    """``(p, dim, keepdim, dtype)`` of ``torch.norm`` / ``Tensor.norm`` /
    ``linalg.vector_norm``."""
    def arg(pos, name, default=None):
        return kwargs[name] if name in kwargs else args[pos] if pos < len(args) else default
    if func is torch.linalg.vector_norm:
        return arg(1, "ord", 2), arg(2, "dim"), bool(arg(3, "keepdim", False)), kwargs.get(
            "dtype")
    dtype_pos = 5 if func is torch.norm else 4
    return (arg(1, "p", "fro"), arg(2, "dim"), bool(arg(3, "keepdim", False)),
            arg(dtype_pos, "dtype"))


@decomposed(torch.norm, torch.Tensor.norm, torch.linalg.vector_norm)
def norm_along_shard(func, args, kwargs):
    """A vector p-norm over sharded dims (see module doc); p = inf stays with its rule."""
    x = args[0] if args else kwargs.get("input", kwargs.get("x"))
    if not isinstance(x, DTensor) or x.ndim == 0:
        return NotImplemented
    p, dim, keepdim, dtype = norm_args(func, args, kwargs)
    if p == "fro":
        p = 2
    if isinstance(p, str) or p == float("inf") or isinstance(dim, str):
        return NotImplemented  # "nuc", and inf: Partial("max") by the rule
    dims = reduced_dims(dim, x.ndim)
    if has_partial(x.placements) or not sharding_mesh_dims(x.placements, dims):
        return NotImplemented
    torch_check(func, x, args, kwargs)
    if dtype is not None:
        x = x.to(dtype)
    a = x.abs()
    if p == float("-inf"):
        return a.amin(dims, keepdim=keepdim)
    if p == 0:
        return a.sign().sum(dims, keepdim=keepdim)  # 0 or 1 each: differentiable, as torch's
    if p == 1:
        return replicated(a.sum(dims, keepdim=keepdim))
    if p == 2:
        return replicated(a.square().sum(dims, keepdim=keepdim)).sqrt()
    return replicated(a.pow(p).sum(dims, keepdim=keepdim)).pow(1.0 / p)
