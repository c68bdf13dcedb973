"""``dtorch.nn.Module``: a ``torch.nn.Module`` whose parameters and buffers are DTensors.

A DTensor is a handle, not a ``torch.Tensor``, so it cannot be a ``torch.nn.Parameter``; this
class keeps DTensors in torch's own ``_parameters`` / ``_buffers`` tables, so
``named_parameters()``, ``state_dict()`` keys, ``modules()``, ``repr``, ``train()``/``eval()``
and hooks are exactly torch.nn's. ``__call__`` runs ``redistribute_input`` -> ``forward`` ->
``redistribute_output`` (seed 003 section 1). Example::

    class Scale(dtorch.nn.Module):
        def __init__(self, mesh):
            super().__init__()
            self.w = dtorch.ones(4, device_mesh=mesh)       # a parameter (a DTensor)
        def forward(self, x):
            return x * self.w

    m = Scale(mesh)
    [name for name, _ in m.named_parameters()]              # ['w']
    m.load_state_dict({"w": torch.full((4,), 2.0)})         # sharded by w's placements
"""

from __future__ import annotations

import contextlib

import torch

from ...errors import DTorchError
from ...tensor import DTensor
from ...autograd.node import NAMES_CHANGED
from ..state_dict import load_value


_running: list = []  # the dtorch modules whose __call__ is running, outermost first


def running_module_path(stack: list) -> str:
    """The dotted name of the innermost running module under the outermost one
    (``model.layers.0.self_attn``), as ``named_modules()`` spells it; ``""`` for the root."""
    names = []
    for parent, child in zip(stack, stack[1:]):
        names.append(next((n for n, m in parent.named_modules() if m is child), "?"))
    return ".".join(n for n in names if n)


def _note_module(error: DTorchError) -> None:
    """Say once, on the error, in which module's forward it arose (the innermost running)."""
    if getattr(error, "_module_noted", False):
        return
    error._module_noted = True
    module = _running[-1]
    torch_class = next((c for c in type(module).__mro__ if c.__module__ != __name__
                        and not c.__name__.startswith("DTorch")), type(module))
    path = running_module_path(_running) or "the root module"
    note = (f"raised in the forward of {path} ({torch_class.__name__}, "
            f"{type(_running[0]).__name__} at the root)")
    if hasattr(error, "add_note"):
        error.add_note(note)
    else:  # Python 3.10: no add_note; tracebacks there do not print notes either
        error.__notes__ = [*getattr(error, "__notes__", []), note]


class DTensorModuleMixin:
    """What makes a ``torch.nn.Module`` hold DTensors: mixed in before a torch.nn class (``Module``
    below; ``dtorch.parallelize_module`` swaps a plain module's class to ``(this, cls)``)."""

    # hooks around forward (seed 003) ---------------------------------------------------------
    def redistribute_input(self, *args, **kwargs):
        """Override to convert or check the inputs; returns ``(args, kwargs)``."""
        return args, kwargs

    def redistribute_output(self, output):
        """Override to convert the output; returns it."""
        return output

    def __call__(self, *args, **kwargs):
        if not _running:
            self._name_parameters()
        _running.append(self)
        try:
            args, kwargs = self.redistribute_input(*args, **kwargs)
            output = super().__call__(*args, **(kwargs or {}))
            return self.redistribute_output(output)
        except DTorchError as error:
            _note_module(error)
            raise
        finally:
            _running.pop()

    def _name_parameters(self) -> None:
        """The outermost module a call runs names its parameters (``named_parameters()``), so
        the collectives a backward runs for their gradients say whose they are
        (``CommDebugMode.get_gradient_comm_counts()``, the kernel's per-cell table). The walk
        runs again only after some module tree or parameter changed (``NAMES_CHANGED``)."""
        if not torch.is_grad_enabled() or self.__dict__.get("_named_at") == NAMES_CHANGED[0]:
            return
        for name, p in self.named_parameters():
            if isinstance(p, DTensor) and p._ag is not None:
                p._ag.name = name
        self.__dict__["_named_at"] = NAMES_CHANGED[0]

    # DTensor parameters and buffers ----------------------------------------------------------
    def __setattr__(self, name: str, value) -> None:
        NAMES_CHANGED[0] += 1
        if isinstance(value, DTensor):
            buffers = self.__dict__.get("_buffers")
            if buffers is not None and name in buffers:
                buffers[name] = value
            else:
                self.register_parameter(name, value)
            return
        super().__setattr__(name, value)

    def register_parameter(self, name: str, param) -> None:
        """Like torch.nn's; a DTensor is a parameter as it is, and a floating-point leaf
        requires grad from then on (as ``torch.nn.Parameter`` does; ``requires_grad_(False)``
        freezes it)."""
        if not isinstance(param, DTensor):
            return super().register_parameter(name, param)
        _check_name(self, name, "parameter")
        self.__dict__.pop(name, None)
        if param.is_leaf and not param.requires_grad and (param.dtype.is_floating_point or
                                                          param.dtype.is_complex):
            param.requires_grad_(True)
        self._parameters[name] = param

    def register_buffer(self, name: str, tensor, persistent: bool = True) -> None:
        """Like torch.nn's; DTensor buffers too (``persistent=False`` keeps them out of
        ``state_dict()``)."""
        if not isinstance(tensor, DTensor):
            return super().register_buffer(name, tensor, persistent)
        _check_name(self, name, "buffer")
        self.__dict__.pop(name, None)
        self._buffers[name] = tensor
        if persistent:
            self._non_persistent_buffers_set.discard(name)
        else:
            self._non_persistent_buffers_set.add(name)

    def add_module(self, name: str, module) -> None:
        NAMES_CHANGED[0] += 1
        super().add_module(name, module)

    def _apply(self, fn, recurse=True):
        """``model.float()``, ``model.to(dtype)``: applied to every DTensor as a DTensor op."""
        NAMES_CHANGED[0] += 1
        if recurse:
            for module in self.children():
                module._apply(fn)
        for table in (self._parameters, self._buffers):
            for key, value in table.items():
                if isinstance(value, DTensor):
                    with torch.no_grad():  # a new leaf, as torch.nn does for Parameters
                        new = fn(value)
                    if table is self._parameters and new is not value:
                        new.requires_grad_(value.requires_grad and (
                            new.dtype.is_floating_point or new.dtype.is_complex))
                    table[key] = new
                elif value is not None:
                    new = fn(value)
                    table[key] = (torch.nn.Parameter(new, value.requires_grad)
                                  if isinstance(value, torch.nn.Parameter) else new)
        return self

    @contextlib.contextmanager
    def no_sync(self):
        """DDP's name: inside, backward leaves the parameters' gradients unreduced
        (``p.grad.placements`` shows the Partial) while accumulating over micro-batches; the
        first backward outside reduces them once (with its own gradients)."""
        from ...autograd.engine import deferring
        with deferring([p._ag for p in self.parameters() if p._ag is not None]):
            yield

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset the parameters' gradients: to None (default), or to zeros in place."""
        from ...autograd.api import zero_grads
        zero_grads(self.parameters(), set_to_none)

    # state_dict ------------------------------------------------------------------------------
    def _save_to_state_dict(self, destination, prefix, keep_vars):
        """state_dict values are the DTensors themselves (``full_state_dict`` gathers)."""
        for name, param in self._parameters.items():
            if param is not None:
                destination[prefix + name] = param if keep_vars or isinstance(
                    param, DTensor) else param.detach()
        for name, buf in self._buffers.items():
            if buf is not None and name not in self._non_persistent_buffers_set:
                destination[prefix + name] = buf if keep_vars or isinstance(
                    buf, DTensor) else buf.detach()

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        """Each DTensor entry is sharded by its parameter's placements and sent rank by rank,
        one tensor at a time; torch.nn's messages for missing, unexpected and wrong-shape keys."""
        NAMES_CHANGED[0] += 1
        local = {**{k: v for k, v in self._parameters.items() if v is not None},
                 **{k: v for k, v in self._buffers.items()
                    if v is not None and k not in self._non_persistent_buffers_set}}
        for name, current in local.items():
            key = prefix + name
            if key not in state_dict:
                if strict:
                    missing_keys.append(key)
                continue
            value = state_dict[key]
            if not isinstance(current, DTensor):
                _torch_load_one(self, name, current, value, key, error_msgs)
                continue
            if tuple(value.shape) != tuple(current.shape):
                error_msgs.append(f"size mismatch for {key}: copying a param with shape "
                                  f"{tuple(value.shape)} from checkpoint, the shape in current "
                                  f"model is {tuple(current.shape)}.")
                continue
            table = self._parameters if name in self._parameters else self._buffers
            loaded = load_value(value, current)
            if table is self._parameters:
                loaded.requires_grad_(current.requires_grad)
            table[name] = loaded
        if strict:
            for key in state_dict:
                if not key.startswith(prefix):
                    continue
                head = key[len(prefix):].split(".", 1)
                if (len(head) > 1 and head[0] not in self._modules) or (
                        len(head) == 1 and head[0] not in local):
                    unexpected_keys.append(key)


class Module(DTensorModuleMixin, torch.nn.Module):
    """torch.nn.Module with DTensor parameters/buffers and redistribute hooks."""


def _check_name(module, name: str, kind: str) -> None:
    if "_parameters" not in module.__dict__:
        raise AttributeError(f"cannot assign a {kind} before Module.__init__() is called")
    if not isinstance(name, str) or not name or "." in name:
        raise KeyError(f"{kind} name must be a non-empty string without '.'; got {name!r}")
    if name in module._modules:
        raise KeyError(f"attribute {name!r} already names a submodule")


def _torch_load_one(module, name, current, value, key, error_msgs) -> None:
    """A plain torch parameter inside a dtorch Module loads as torch.nn would."""
    if isinstance(value, DTensor):
        value = value.to_torch()
    if value.shape != current.shape:
        error_msgs.append(f"size mismatch for {key}: copying a param with shape "
                          f"{tuple(value.shape)} from checkpoint, the shape in current model is "
                          f"{tuple(current.shape)}.")
        return
    with torch.no_grad():
        current.copy_(value)


class ModuleError(DTorchError, ValueError):
    """A module was built with arguments that do not fit its mesh."""
