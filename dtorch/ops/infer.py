"""Output shape/dtype inference: run the torch function once on ``meta`` tensors of the
global shapes (the dispatch cache makes this a first-call cost only).

Shape and dtype errors are therefore torch's own, raised on the controller. Example::

    >>> import torch
    >>> from dtorch.ops.infer import infer_outputs
    >>> infer_outputs(torch.matmul, (torch.empty(2, 3, device="meta"),
    ...                              torch.empty(3, 5, device="meta")), {}).shapes
    ((2, 5),)
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from .registry import TArg


class Outputs(NamedTuple):
    """What an op returns: ``shapes``/``dtypes`` per output tensor and how to rebuild the
    Python result (``kind`` ``"one"``: a tensor; ``"seq"``: ``seqtype`` of tensors;
    ``"value"``: no tensor at all, ``value`` is returned as is)."""

    shapes: tuple
    dtypes: tuple
    kind: str
    seqtype: Any = None
    value: Any = None


def _map_targs(obj, make):
    """Replace every TArg in ``obj`` (lists, tuples, dicts too) with ``make(TArg)``."""
    if type(obj) is TArg:
        return make(obj)
    if type(obj) is list:
        return [_map_targs(x, make) for x in obj]
    if type(obj) is tuple:
        return tuple(_map_targs(x, make) for x in obj)
    if type(obj) is dict:
        return {k: _map_targs(v, make) for k, v in obj.items()}
    return obj


def to_meta(obj):
    """TArg -> empty meta tensor of its global shape; containers recursively."""
    return _map_targs(obj, lambda a: torch.empty(a.shape, dtype=a.dtype, device="meta"))


def to_zeros(obj, fill=torch.zeros):
    """Like :func:`to_meta` with zero-filled (or ``fill``-ed) cpu tensors, for error messages."""
    return _map_targs(obj, lambda a: fill(a.shape, dtype=a.dtype))


def infer_outputs(fn, args, kwargs) -> Outputs:
    """Call ``fn`` on meta arguments (already converted) and describe its result."""
    res = fn(*args, **kwargs)
    return describe(res)


def describe(res) -> Outputs:
    if isinstance(res, torch.Tensor):
        return Outputs((tuple(res.shape),), (res.dtype,), "one")
    if isinstance(res, (tuple, list)) and res and all(isinstance(r, torch.Tensor) for r in res):
        return Outputs(tuple(tuple(r.shape) for r in res), tuple(r.dtype for r in res), "seq",
                       type(res))
    if isinstance(res, (tuple, list)) and any(isinstance(r, torch.Tensor) for r in res):
        raise TypeError(f"dtorch ops must return tensors or no tensor at all; got {type(res)}")
    return Outputs((), (), "value", None, res)


def rebuild(outputs: Outputs, values: list):
    """The Python result from the wrapped outputs (the inverse of :func:`describe`)."""
    if outputs.kind == "one":
        return values[0]
    seqtype = outputs.seqtype
    if seqtype is tuple or seqtype is list:
        return seqtype(values)
    return seqtype(values)  # torch.return_types structseq takes one sequence
