"""Version counters on the controller: an in-place op on a tensor a recorded node saved is
refused at backward, before anything is sent, with torch's message.

torch's backward checks each saved tensor's version counter on the ranks; the controller
knows the same from its plans. Which inputs and outputs an op saves comes from running it
once on meta tensors under ``torch.autograd.graph.saved_tensors_hooks`` (cached with the
op's grad info); the node keeps ``(counter, version)`` for each, and every in-place op
issued on a handle bumps its counter (a ``detach()``-ed handle shares it). Aliases made by
view ops are not followed: there torch's own check on the ranks answers, at the next read.
Example::

    y = x.exp()          # exp saves its output
    y.add_(1)            # version 1
    y.sum().backward()   # RuntimeError: ... modified by an inplace operation ...
"""

from __future__ import annotations

import torch


def counter(t) -> list:
    """``t``'s version counter (a one-element list shared by its detached handles)."""
    if t._version is None:
        t._version = [0]
    return t._version


def bump(t) -> None:
    """An in-place op was issued on ``t``."""
    if t._version is not None:
        t._version[0] += 1


def saved_by(func, args, kwargs):
    """``(result, packed)``: ``func`` run with autograd on, and the tensors its backward
    saved (as given to a pack hook: the root of a saved view)."""
    packed: list = []

    def pack(t):
        root = t
        while root._base is not None:
            root = root._base
        packed.append(root)
        return t
    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        result = func(*args, **kwargs)
    return result, packed


def is_saved(t, packed) -> bool:
    return any(p is t for p in packed)


def expected(tensors, outputs, saved_inputs, saved_outputs, name: str) -> tuple:
    """What a node remembers: ``(counter, version, spec, which)`` per saved DTensor
    (``which``: ``("input", i)`` or ``("output", i)``; the message is made only on failure)."""
    out = []
    for i in saved_inputs:
        cell = counter(tensors[i])
        out.append((cell, cell[0], tensors[i]._spec, ("input", i)))
    for i in saved_outputs:
        cell = counter(outputs[i])
        out.append((cell, cell[0], outputs[i]._spec, ("output", i)))
    return tuple(out)


def check(node) -> None:
    """Raise torch's error when a tensor ``node`` saved was modified in place since."""
    for cell, version, spec, (kind, i) in node.saved:
        if cell[0] != version:
            what = f"output {i} of {node.name()}" if kind == "output" else \
                f"input {i} of {node.name()}"
            raise RuntimeError(
                f"one of the variables needed for gradient computation has been modified by "
                f"an inplace operation: [DTensor {spec.dtype} {list(spec.shape)}], which is "
                f"{what}, is at version {cell[0]}; expected version {version} instead. Use "
                f"an out-of-place op (or .clone() the tensor before modifying it)")
