"""Autograd through DTensors: the graph lives on the controller, the ranks keep each op's
local torch graph, and backward is planned instructions and counted collectives.

``loss.backward()``, ``dtorch.autograd.grad(outputs, inputs)`` and
``dtorch.autograd.backward(tensors)`` work as torch's (see docs/autograd.md). Example::

    w = dtorch.randn(4, 4, device_mesh=mesh, requires_grad=True)
    loss = (x @ w).sum()
    loss.backward()
    w.grad.placements            # w's own placements
"""

from __future__ import annotations


def backward(tensors, grad_tensors=None, retain_graph=None, create_graph=False,
             grad_variables=None, inputs=None) -> None:
    """Accumulate the gradients of ``tensors`` into the leaves' ``.grad`` (torch's API)."""
    from .engine import run_backward
    if grad_variables is not None:
        grad_tensors = grad_variables
    run_backward(tensors, grad_tensors, retain_graph, create_graph, inputs=inputs)


def grad(outputs, inputs, grad_outputs=None, retain_graph=None, create_graph=False,
         allow_unused=None, is_grads_batched=False, materialize_grads=False):
    """The gradients of ``outputs`` with respect to ``inputs`` (a tuple of DTensors or None),
    without touching any ``.grad`` (torch's API)."""
    from .engine import run_grad
    if is_grads_batched:
        raise NotImplementedError("dtorch.autograd.grad(is_grads_batched=True) is not "
                                  "supported yet; call it once per gradient")
    return run_grad(outputs, inputs, grad_outputs, retain_graph, create_graph,
                    bool(allow_unused) or materialize_grads, materialize_grads)


__all__ = ["backward", "grad"]
