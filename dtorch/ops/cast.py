"""Casts: ``x.to(dtype)``, ``x.float()``, ``x.half()``, ``x.type_as(y)``: placements kept.

A Partial input stays Partial when the cast commutes with its reduction: float -> float for
``sum``/``avg`` (an int cast would round each partial), a monotone cast for ``max``/``min``
(to a float type; between integer types that hold every source value; float -> int32/int64,
which truncates; never to bool, and never a cast that wraps, such as float -> uint8). The device is the mesh's: ``to("cpu")`` on a cpu mesh is a no-op, another
device raises. Example::

    >>> import torch
    >>> target_dtype((torch.float16,), {}, torch.float32)
    torch.float16
    >>> target_dtype(("cpu",), {}, torch.float32)
    torch.float32
    >>> keeps_order(torch.float32, torch.int64), keeps_order(torch.float32, torch.uint8)
    (True, False)
"""

from __future__ import annotations

import torch

from ..placement import Replicate
from .explain import with_dim
from .registry import Decision, TArg, rule

_METHOD_DTYPES = {"float": torch.float32, "double": torch.float64, "half": torch.float16,
                  "bfloat16": torch.bfloat16, "int": torch.int32, "long": torch.int64,
                  "short": torch.int16, "char": torch.int8, "byte": torch.uint8,
                  "bool": torch.bool, "cfloat": torch.complex64, "cdouble": torch.complex128}
LEGAL = ("placements kept; Partial(sum|avg) only float -> float; Partial(max|min) only a cast "
         "that keeps the order of values (to float; to an integer type holding every source "
         "value; float -> int32/int64)")


def keeps_order(src: torch.dtype, dst: torch.dtype) -> bool:
    """Whether ``cast(max(a, b)) == max(cast(a), cast(b))`` for every value: the cast is
    monotone and does not wrap (a max/min Partial may then be cast share by share)."""
    if dst is torch.bool or src.is_complex:
        return False
    if dst.is_floating_point or dst.is_complex:
        return True
    if src is torch.bool:
        return True
    if src.is_floating_point:
        return dst in (torch.int32, torch.int64)
    s, d = torch.iinfo(src), torch.iinfo(dst)
    return d.min <= s.min and s.max <= d.max


def target_dtype(args, kwargs, current):
    """The dtype ``Tensor.to(*args, **kwargs)`` converts to (devices ignored)."""
    dtype = kwargs.get("dtype")
    for a in args:
        if isinstance(a, torch.dtype):
            dtype = a
        elif isinstance(a, (torch.Tensor, TArg)):
            dtype = a.dtype
    return dtype if dtype is not None else current


def _devices(args, kwargs):
    found = [a for a in args if isinstance(a, (str, torch.device))]
    if kwargs.get("device") is not None:
        found.append(kwargs["device"])
    return [torch.device(d) for d in found]


def _to_meta(self, *args, **kwargs):
    return self.to(target_dtype(args, kwargs, self.dtype))


def _check_partial(op, src, dst) -> tuple:
    for m, p in enumerate(op.tensors[0].placements):
        if not p.is_partial():
            continue
        ok = (src.is_floating_point or src.is_complex) and (dst.is_floating_point or
                                                             dst.is_complex)
        if p.reduce_op in ("max", "min"):
            ok = keeps_order(src, dst)
        if not ok:
            op.fail(m, LEGAL, {op.tensors[0]: with_dim(op.tensors[0].placements, m,
                                                        Replicate())},
                    f"a {src} -> {dst} cast does not commute with the pending {p.reduce_op}")
    return op.tensors[0].placements


@rule(torch.Tensor.to, family="cast", meta=_to_meta, arg_names=("input",))
def to_rule(op):
    self = op.tensors[0]
    args, kwargs = op.args[1:], op.kwargs
    for dev in _devices(args, kwargs):
        if dev.type != op.mesh.device_type:
            raise ValueError(f"{op.name}: a DTensor's device is set by its mesh "
                             f"({op.mesh.device_type!r}); it cannot move to {dev}. Build the "
                             f"tensor on a {dev.type!r} mesh instead")
    dst = op.out.dtypes[0]
    placements = _check_partial(op, self.dtype, dst)
    extra = {"copy": True} if kwargs.get("copy") else {}
    return Decision((placements,), torch.Tensor.to, (self, dst), extra)


@rule(*_METHOD_DTYPES, family="cast", arg_names=("input",))
def method_cast_rule(op):
    return _check_partial(op, op.tensors[0].dtype, op.out.dtypes[0])


@rule(torch.Tensor.type_as, family="cast", arg_names=("input", "other"))
def type_as_rule(op):
    self = op.tensors[0]
    placements = _check_partial(op, self.dtype, op.out.dtypes[0])
    return Decision((placements,), torch.Tensor.to, (self, op.out.dtypes[0]), {})


def _type_meta(self, dtype=None, non_blocking=False, **kwargs):
    if dtype is None:
        raise TypeError("x.type() without a dtype returns a type string; use x.dtype")
    return self.type(dtype)


@rule(torch.Tensor.type, family="cast", meta=_type_meta, arg_names=("input", "dtype"))
def type_rule(op):
    return Decision((_check_partial(op, op.tensors[0].dtype, op.out.dtypes[0]),),
                    torch.Tensor.to, (op.tensors[0], op.out.dtypes[0]), {})


def _same(self, *args, **kwargs):
    return self


def _stays_on_its_mesh(op, device_type: str, fix: str):
    """``x.cpu()`` / ``x.cuda()``: nothing moves (a DTensor's device is its mesh's), so only a
    mesh of that device type is accepted."""
    if op.mesh.device_type != device_type:
        raise ValueError(f"{op.name}: this DTensor lives on a {op.mesh.device_type!r} mesh; "
                         f"{fix}")
    return Decision((op.tensors[0].placements,), _same, (op.tensors[0],), {})


@rule(torch.Tensor.cpu, family="cast", meta=_same, arg_names=("input",))
def cpu_rule(op):
    return _stays_on_its_mesh(op, "cpu", "use .to_torch() to get a local cpu tensor")


@rule(torch.Tensor.cuda, family="cast", meta=_same, arg_names=("input",))
def cuda_rule(op):
    return _stays_on_its_mesh(op, "cuda", "a DTensor's device is set by its mesh")
