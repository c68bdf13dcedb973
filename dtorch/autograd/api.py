"""The autograd methods of a DTensor handle, with torch's checks and messages. Example::

    w = dtorch.zeros(4, device_mesh=mesh).requires_grad_()
    w.is_leaf, w.grad               # (True, None)
    h = w.register_hook(lambda g: g * 2)
    h.remove()
"""

from __future__ import annotations

from collections import OrderedDict

from torch.utils.hooks import RemovableHandle

from .node import NAMES_CHANGED, AutogradMeta


def _differentiable_dtype(dtype) -> bool:
    return dtype.is_floating_point or dtype.is_complex


def requires_grad_(x, flag: bool = True):
    flag = bool(flag)
    meta = x._ag
    if meta is not None and meta.grad_fn is not None:
        if not flag:
            raise RuntimeError("you can only change requires_grad flags of leaf variables. If "
                               "you want to use a computed variable in a subgraph that doesn't "
                               "require differentiation use var_no_grad = var.detach().")
        return x
    if flag and not _differentiable_dtype(x.dtype):
        raise RuntimeError(f"only Tensors of floating point dtype can require "
                           f"gradients (this DTensor is {x.dtype}; make it with a float dtype, "
                           f"e.g. dtorch.zeros(..., dtype=torch.float32, requires_grad=True))")
    if meta is None:
        if flag:
            x._ag = AutogradMeta(True)
            NAMES_CHANGED[0] += 1  # a module that holds x names it at its next call
    else:
        meta.requires_grad = flag
    return x


def set_grad(x, value) -> None:
    """``x.grad = g`` (a DTensor of x's shape and mesh) or ``x.grad = None``."""
    from ..tensor import DTensor
    if value is not None:
        if not isinstance(value, DTensor):
            raise TypeError(f"assigned grad must be a DTensor or None; got "
                            f"{type(value).__name__}")
        if tuple(value.shape) != tuple(x.shape):
            raise RuntimeError(f"assigned grad has data of a different size: "
                               f"{tuple(value.shape)} vs the tensor's {tuple(x.shape)}")
        if value.dtype != x.dtype:
            raise RuntimeError(f"assigned grad has data of a different type: {value.dtype} vs "
                               f"the tensor's {x.dtype}")
        if value.device_mesh != x.device_mesh:
            raise RuntimeError("assigned grad lives on another mesh than the tensor; "
                               "redistribute it to the tensor's mesh first")
    if x._ag is None:
        if value is None:
            return
        x._ag = AutogradMeta(False)
    x._ag.grad = value


def detach(x):
    """A new handle on the same local tensors, outside the graph."""
    from ..tensor import DTensor, _identity
    from ..runtime import messages as m
    c = x._live()
    tid = c.new_tid()
    c.issue(m.Call((tid,), _identity, (m.Ref(x._tid),), {}, x._spec.mesh.ranks))
    from .versions import counter
    out = DTensor._wrap(x._spec, tid, c)
    out._version = counter(x)  # the same local tensors: in place through either counts
    return out


def detach_(x):
    """Cut ``x`` out of the graph in place (it becomes a leaf that does not require grad)."""
    x._ag = None
    return x


def retain_grad(x) -> None:
    meta = x._ag
    if meta is None or not meta.requires_grad:
        raise RuntimeError("can't retain_grad on Tensor that has requires_grad=False")
    if meta.grad_fn is not None:
        meta.retains_grad = True


def register_hook(x, hook) -> RemovableHandle:
    """``hook(grad)`` runs when ``x``'s gradient is computed; a DTensor it returns replaces
    the gradient. Returns a handle with ``remove()``."""
    meta = x._ag
    if meta is None or not meta.requires_grad:
        raise RuntimeError("cannot register a hook on a tensor that doesn't require gradient")
    if meta.hooks is None:
        meta.hooks = OrderedDict()
        if meta.grad_fn is not None:  # kept by the node: the handle may go first
            meta.grad_fn.keep_hooks(meta.output_nr, meta.hooks)
    handle = RemovableHandle(meta.hooks)
    meta.hooks[handle.id] = hook
    return handle


def zero_grads(parameters, set_to_none: bool = True) -> None:
    """Each parameter's ``.grad`` to None (default), or to zeros in place (``Module.zero_grad``
    and the optimizers' ``zero_grad``)."""
    import torch
    for p in parameters:
        if p.grad is None:
            continue
        if set_to_none:
            p.grad = None
        else:
            with torch.no_grad():
                p.grad.zero_()
