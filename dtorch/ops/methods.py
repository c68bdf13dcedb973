"""Tensor methods and properties on DTensors: ``x.sum(0)``, ``x.view(2, -1)``, ``x.T``, ``x.mH``.

``DTensor.__getattr__`` ends here for any name it does not define itself: a method of
``torch.Tensor`` becomes a bound dispatcher, and every public property of ``torch.Tensor`` is
either computed by dispatching ops (``T mT H mH real imag``) or answered from the spec
(``device``, ``is_cuda`` ...): a DTensor has no sparse or quantized layout and lives on its
mesh's device (its autograd attributes are its own: ``dtorch.autograd``). A property with no answer raises
:class:`UnsupportedAttributeError` (an ``AttributeError``, so ``hasattr`` stays False), and a
method DTensors cannot have (raw memory) raises ``UnsupportedOpError`` when called,
saying what to do instead. Example::

    >>> import torch
    >>> tensor_method("softmax") is tensor_method("softmax")
    True
    >>> sorted(PROPERTIES)[:4]
    ['H', 'T', 'device', 'grad_dtype']
"""

from __future__ import annotations

import torch

from ..errors import DTorchError
from .dispatch import UnsupportedOpError, dispatch

_methods: dict = {}


class UnsupportedAttributeError(DTorchError, AttributeError):
    """A ``torch.Tensor`` attribute that DTensors do not have (``hasattr`` gives False)."""


def tensor_method(name: str):
    """A function ``(self, *args, **kwargs)`` dispatching ``torch.Tensor.<name>``."""
    fn = _methods.get(name)
    if fn is None:
        func = getattr(torch.Tensor, name)

        def fn(self, *args, **kwargs):
            return dispatch(func, None, (self, *args), kwargs)
        fn.__name__ = name
        fn.__doc__ = f"``torch.Tensor.{name}`` on a DTensor (placement rule: dtorch.ops)."
        _methods[name] = fn
    return fn


# properties computed by ops -----------------------------------------------------------------------
def _torch_check(x, name: str) -> None:
    """Raise the error torch raises for ``t.<name>`` on a tensor of ``x``'s shape and dtype."""
    getattr(torch.empty(x.shape, dtype=x.dtype, device="meta"), name)


def _conj(x):
    return dispatch(torch.conj, None, (x,)) if x.dtype.is_complex else x


def _T(x):
    return dispatch(torch.Tensor.permute, None, (x, tuple(range(x.ndim - 1, -1, -1))))


def _mT(x, name="mT"):
    if x.ndim == 1:
        _torch_check(x, name)
    if x.ndim == 0:
        return dispatch(torch.Tensor.permute, None, (x, ()))
    return dispatch(torch.Tensor.transpose, None, (x, -2, -1))


def _H(x):
    """``x.H``: the conjugate transpose of a matrix (0-D: the conjugate)."""
    if x.ndim not in (0, 2):
        _torch_check(x, "H")
    return _conj(_T(x))


def _mH(x):
    """``x.mH``: the conjugate transpose of the last two dims."""
    return _conj(_mT(x, "mH"))


def _real(x):
    return dispatch(torch.real, None, (x,))


def _imag(x):
    return dispatch(torch.imag, None, (x,))


def _device(x):
    return torch.device(x.device_mesh.device_type)


def _on(device_type: str):
    """``is_cuda``-style flags: whether the mesh is of that device type."""
    return lambda x: x.device_mesh.device_type == device_type


def _false(x):
    return False


def _none(x):
    return None


PROPERTIES = {
    "T": _T, "mT": _mT, "H": _H, "mH": _mH, "real": _real, "imag": _imag,
    "device": _device,
    "layout": lambda x: torch.strided,
    "itemsize": lambda x: x.dtype.itemsize,
    "nbytes": lambda x: x.numel() * x.dtype.itemsize,
    # autograd: requires_grad, grad, grad_fn, is_leaf, ... are DTensor's own (dtorch.autograd)
    "grad_dtype": lambda x: x.dtype, "volatile": _false, "name": _none,
    # layouts DTensors do not have
    "is_sparse": _false, "is_sparse_csr": _false, "is_quantized": _false, "is_mkldnn": _false,
    "is_nested": _false,
    **{f"is_{d}": _on(d) for d in ("cpu", "cuda", "xpu", "mps", "ipu", "maia", "mtia", "xla",
                                   "vulkan", "meta")},
}

# public torch.Tensor properties DTensors do not provide: name -> what to do instead
UNSUPPORTED: dict[str, str] = {}

# methods that cannot have a DTensor meaning: name -> what to do instead
_NO_AUTOGRAD = ("dtorch's autograd has no post-accumulate hooks yet; use register_hook, or "
                "read .grad after backward")
_NO_MEMORY = ("a DTensor's memory is spread over the ranks' processes; use .to_torch() for a "
              "local tensor, or .to_local(rank) for one rank's shard")
UNSUPPORTED_METHODS = {
    "register_post_accumulate_grad_hook": _NO_AUTOGRAD,
    "data_ptr": _NO_MEMORY, "storage": _NO_MEMORY, "untyped_storage": _NO_MEMORY,
    "share_memory_": _NO_MEMORY, "pin_memory": _NO_MEMORY, "record_stream": _NO_MEMORY,
}


def _refuse(name: str, advice: str):
    def refused(self, *args, **kwargs):
        raise UnsupportedOpError(f"Tensor.{name} is not supported on DTensors: {advice}")
    refused.__name__ = name
    return refused


def attribute(x, name: str):
    """``x.<name>`` for a name DTensor does not define (see module doc)."""
    prop = PROPERTIES.get(name)
    if prop is not None:
        return prop(x)
    fn = _methods.get(name)
    if fn is None:
        fn = _new_method(name)
    return fn.__get__(x)


def _new_method(name: str):
    """The DTensor method for ``name``, or the AttributeError saying why there is none."""
    attr = getattr(torch.Tensor, name, None)
    if attr is None or name.startswith("_"):
        raise AttributeError(f"'DTensor' object has no attribute {name!r}")
    if not callable(attr):
        advice = UNSUPPORTED.get(name, "dtorch does not provide it yet")
        raise UnsupportedAttributeError(
            f"torch.Tensor.{name} is not supported on DTensors: {advice}")
    if name in UNSUPPORTED_METHODS:
        fn = _refuse(name, UNSUPPORTED_METHODS[name])
    else:
        return tensor_method(name)
    _methods[name] = fn
    return fn
