"""Factories: DTensors made on the ranks, or sent from a torch tensor.

Each rank builds or receives only its own shard. Random factories give the same global values
as ``torch.manual_seed(s); torch.randn(size)`` on one device, whatever the placements. Example::

    x = dtorch.randn(8, 4, device_mesh=mesh, placements=[Shard(0)])
    y = dtorch.tensor(torch.arange(16.).reshape(4, 4), device_mesh=mesh2d,
                      placements=[Shard(0), Shard(1)])
"""

from __future__ import annotations

import operator

import torch

from . import layout
from .graph import mesh_or_default
from .mesh import DeviceMesh
from .runtime import messages as m
from .runtime import session
from .tensor import DTensor
from .spec import make_spec

_RANDOM = ("rand", "randn", "randint", "randperm")


def _size(size) -> tuple[int, ...]:
    if len(size) == 1 and isinstance(size[0], (tuple, list, torch.Size)):
        size = tuple(size[0])
    out = []
    for s in size:
        try:
            if isinstance(s, bool):
                raise TypeError
            n = operator.index(s)  # numpy and torch ints too
        except TypeError:
            n = -1
        if n < 0:
            raise ValueError(f"sizes must be non-negative ints; got {tuple(size)!r}")
        out.append(n)
    return tuple(out)


def _grad(t: DTensor, requires_grad) -> DTensor:
    """``requires_grad=True`` as torch's factories take it (float and complex dtypes only)."""
    return t.requires_grad_() if requires_grad else t


def _check_grad_dtype(dtype, requires_grad) -> None:
    """Refuse before anything is sent, with torch's message."""
    if requires_grad and not (dtype.is_floating_point or dtype.is_complex):
        raise RuntimeError(f"only Tensors of floating point dtype can require "
                           f"gradients (got dtype={dtype}); pass a float dtype")


def _create(fn: str, shape, dtype, device_mesh, placements, device=None, args=(),
            all_ranks=False, requires_grad=False) -> DTensor:
    _check_grad_dtype(dtype, requires_grad)
    mesh = mesh_or_default(device_mesh, device)
    spec = make_spec(shape, dtype, mesh, placements)
    c = session.get_controller()
    c.ensure_mesh(mesh)
    tid = c.new_tid()
    c.issue(m.Create(tid, fn, tuple(args), {}, spec.shape, spec.dtype, mesh, spec.placements,
                     mesh.ranks, all_ranks))
    return _grad(DTensor._wrap(spec, tid, c), requires_grad)


def _float_dtype(dtype):
    return dtype if dtype is not None else torch.get_default_dtype()


def zeros(*size, dtype=None, device_mesh=None, placements=None, device=None,
          requires_grad=False) -> DTensor:
    """``dtorch.zeros(4, 8, device_mesh=mesh, placements=[Shard(0)])``."""
    return _create("zeros", _size(size), _float_dtype(dtype), device_mesh, placements, device,
                   requires_grad=requires_grad)


def ones(*size, dtype=None, device_mesh=None, placements=None, device=None,
         requires_grad=False) -> DTensor:
    """``dtorch.ones(4, 8, device_mesh=mesh)``; a Partial('sum') one holds the ones once."""
    return _create("ones", _size(size), _float_dtype(dtype), device_mesh, placements, device,
                   requires_grad=requires_grad)


def empty(*size, dtype=None, device_mesh=None, placements=None, device=None,
          requires_grad=False) -> DTensor:
    """Uninitialized values, like ``torch.empty``."""
    return _create("empty", _size(size), _float_dtype(dtype), device_mesh, placements, device,
                   requires_grad=requires_grad)


def full(size, fill_value, *, dtype=None, device_mesh=None, placements=None, device=None,
         requires_grad=False) -> DTensor:
    """``dtorch.full((2, 3), 7.0, device_mesh=mesh)``."""
    if dtype is None:
        dtype = torch.full((), fill_value).dtype
    return _create("full", _size((size,)), dtype, device_mesh, placements, device,
                   (fill_value,), requires_grad=requires_grad)


def rand(*size, dtype=None, device_mesh=None, placements=None, device=None,
         requires_grad=False) -> DTensor:
    """Uniform [0, 1) values equal to ``torch.rand`` under the same ``manual_seed``."""
    return _create("rand", _size(size), _float_dtype(dtype), device_mesh, placements, device,
                   all_ranks=True, requires_grad=requires_grad)


def randn(*size, dtype=None, device_mesh=None, placements=None, device=None,
          requires_grad=False) -> DTensor:
    """Normal values equal to ``torch.randn`` under the same ``manual_seed``."""
    return _create("randn", _size(size), _float_dtype(dtype), device_mesh, placements, device,
                   all_ranks=True, requires_grad=requires_grad)


def randint(low, high=None, size=None, *, dtype=None, device_mesh=None, placements=None,
            device=None, requires_grad=False) -> DTensor:
    """``dtorch.randint(10, (4,))`` or ``dtorch.randint(3, 10, (4,))`` like torch."""
    if size is None:
        low, high, size = 0, low, high
    if size is None:
        raise TypeError("randint needs a size, e.g. dtorch.randint(0, 10, (4, 4))")
    return _create("randint", _size((size,)), dtype or torch.int64, device_mesh, placements,
                   device, (low, high), all_ranks=True, requires_grad=requires_grad)


def arange(start, end=None, step=1, *, dtype=None, device_mesh=None, placements=None,
           device=None, requires_grad=False) -> DTensor:
    """``dtorch.arange(16, device_mesh=mesh, placements=[Shard(0)])`` like torch.arange."""
    if end is None:
        start, end = 0, start
    meta = torch.arange(start, end, step, dtype=dtype, device="meta")
    return _create("arange", tuple(meta.shape), meta.dtype, device_mesh, placements, device,
                   (start, end, step), requires_grad=requires_grad)


# torch's *_like arguments a DTensor cannot honour otherwise than by its default
_LIKE_DEFAULTS = {"layout": (torch.strided, None),
                  "memory_format": (torch.preserve_format, torch.contiguous_format, None),
                  "pin_memory": (False, None)}


def _check_like_kwargs(t: DTensor, kw: dict) -> None:
    """Refuse, rather than drop, torch arguments a DTensor factory cannot honour."""
    for name, value in kw.items():
        if name == "device":
            if value is not None and torch.device(value).type != t.device_mesh.device_type:
                raise ValueError(f"device={value!r}: a DTensor's device is set by its mesh "
                                 f"({t.device_mesh.device_type!r}); pass device_mesh= instead")
        elif name not in _LIKE_DEFAULTS:
            raise TypeError(f"unexpected keyword argument {name!r}")
        elif value not in _LIKE_DEFAULTS[name]:
            raise ValueError(f"{name}={value!r} is not supported: DTensors are dense and "
                             f"strided; leave {name} at its default")


def _like(fn, t: DTensor, dtype, device_mesh, placements, requires_grad=False, **kw):
    """``kw``: torch's ``device=``, ``layout=``, ``memory_format=``, ``pin_memory=``, accepted
    at values a DTensor honours (its mesh's device, dense, strided), refused otherwise."""
    _check_like_kwargs(t, kw)
    return fn(*t.shape, dtype=dtype or t.dtype,
              device_mesh=device_mesh if device_mesh is not None else t.device_mesh,
              placements=placements if placements is not None else t.placements,
              requires_grad=requires_grad)


def zeros_like(t, *, dtype=None, device_mesh=None, placements=None, requires_grad=False,
               **kw) -> DTensor:
    return _like(zeros, t, dtype, device_mesh, placements, requires_grad, **kw)


def ones_like(t, *, dtype=None, device_mesh=None, placements=None, requires_grad=False,
              **kw) -> DTensor:
    return _like(ones, t, dtype, device_mesh, placements, requires_grad, **kw)


def empty_like(t, *, dtype=None, device_mesh=None, placements=None, requires_grad=False,
               **kw) -> DTensor:
    return _like(empty, t, dtype, device_mesh, placements, requires_grad, **kw)


def rand_like(t, *, dtype=None, device_mesh=None, placements=None, requires_grad=False,
              **kw) -> DTensor:
    return _like(rand, t, dtype, device_mesh, placements, requires_grad, **kw)


def randn_like(t, *, dtype=None, device_mesh=None, placements=None, requires_grad=False,
               **kw) -> DTensor:
    return _like(randn, t, dtype, device_mesh, placements, requires_grad, **kw)


def full_like(t, fill_value, *, dtype=None, device_mesh=None, placements=None,
              requires_grad=False, **kw) -> DTensor:
    _check_like_kwargs(t, kw)
    return full(tuple(t.shape), fill_value, dtype=dtype or t.dtype,
                device_mesh=device_mesh if device_mesh is not None else t.device_mesh,
                placements=placements if placements is not None else t.placements,
                requires_grad=requires_grad)


def tensor(data, dtype=None, device_mesh=None, placements=None, device=None,
           requires_grad=False) -> DTensor:
    """Send a value to the ranks, each rank receiving only its own shard.

    ``data`` is a torch.Tensor, a numpy array, a number or nested lists. A Partial('sum')
    placement stores the value on the first rank of that mesh dim and zeros elsewhere.
    """
    if isinstance(data, DTensor):
        raise TypeError("dtorch.tensor got a DTensor; use .redistribute(...) to change its "
                        "placements, or .to_torch() first")
    if isinstance(dtype, DeviceMesh):  # dtorch.tensor(t, mesh, placements), as distribute_tensor
        dtype, device_mesh, placements = None, dtype, device_mesh
    value = torch.as_tensor(data, dtype=dtype).detach()
    if value.layout != torch.strided:
        from .errors import UnsupportedOpError
        raise UnsupportedOpError(f"dtorch.tensor takes dense tensors; this one is "
                                 f"{value.layout}. Convert it first: t.to_dense()")
    value = value.cpu()
    _check_grad_dtype(value.dtype, requires_grad)
    mesh = mesh_or_default(device_mesh, device)
    spec = make_spec(value.shape, value.dtype, mesh, placements)
    c = session.get_controller()
    c.ensure_mesh(mesh)
    tid = c.new_tid()
    for rank in mesh.ranks:
        c.stage(rank, tid, layout.shard_of(value, mesh, spec.placements,
                                           mesh.get_coordinate(rank)))
    c.issue(m.Load(tid, mesh.ranks))
    return _grad(DTensor._wrap(spec, tid, c), requires_grad)


def from_local(local_tensors, device_mesh: DeviceMesh, placements, shape=None) -> DTensor:
    """A DTensor from each rank's local tensor, as stored (handy for teaching Partial).

    ``local_tensors`` is a list in ``device_mesh.ranks`` order or a ``{rank: tensor}`` dict.
    ``shape`` (the global shape) is needed when a placement is a Shard.

    ``dtorch.from_local([t0, t1, t2, t3], mesh, [Partial()])`` holds ``t0 + t1 + t2 + t3``.
    """
    if not isinstance(local_tensors, dict):
        local_tensors = dict(zip(device_mesh.ranks, local_tensors))
    missing = [r for r in device_mesh.ranks if r not in local_tensors]
    if missing:
        raise ValueError(f"from_local needs a local tensor for every rank of the mesh; "
                         f"missing ranks {missing}")
    first = torch.as_tensor(local_tensors[device_mesh.ranks[0]])
    if shape is None:
        if any(p.is_shard() for p in placements):
            raise ValueError("from_local with a Shard placement needs the global shape: pass "
                             "shape=(...)")
        shape = tuple(first.shape)
    spec = make_spec(shape, first.dtype, device_mesh, placements)
    c = session.get_controller()
    c.ensure_mesh(device_mesh)
    tid = c.new_tid()
    for rank in device_mesh.ranks:
        local = torch.as_tensor(local_tensors[rank]).detach().cpu()
        want = layout.local_shape(spec.shape, device_mesh, spec.placements,
                                  device_mesh.get_coordinate(rank))
        if tuple(local.shape) != want or local.dtype != spec.dtype:
            raise ValueError(f"rank {rank}'s local tensor is {tuple(local.shape)} {local.dtype}; "
                             f"the layout needs {want} {spec.dtype}")
        c.stage(rank, tid, local.clone())
    c.issue(m.Load(tid, device_mesh.ranks))
    return DTensor._wrap(spec, tid, c)


def distribute_tensor(tensor_, device_mesh: DeviceMesh, placements=None, *,
                      requires_grad=None) -> DTensor:
    """PyTorch's name for :func:`tensor`: ``distribute_tensor(t, mesh, [Shard(0)])``; the
    result requires grad when ``tensor_`` does (a new leaf: gradients do not flow back to
    the torch tensor)."""
    if requires_grad is None:
        requires_grad = isinstance(tensor_, torch.Tensor) and tensor_.requires_grad
    return tensor(tensor_, device_mesh=device_mesh, placements=placements,
                  requires_grad=requires_grad)


__all__ = ["zeros", "ones", "empty", "full", "rand", "randn", "randint", "arange", "zeros_like",
           "ones_like", "empty_like", "rand_like", "randn_like", "full_like", "tensor",
           "distribute_tensor", "from_local"]
