"""``dtorch.optim.SGD``: torch.optim.SGD (momentum, dampening, nesterov, weight_decay,
maximize) on DTensor parameters, one instruction per rank per parameter group. Example::

    opt = dtorch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True)
"""

from __future__ import annotations

import torch

from .. import factories
from . import kernels
from .optimizer import DTensorOptimizer, run_step


class SGD(DTensorOptimizer, torch.optim.SGD):
    """torch.optim.SGD's signature, defaults and checks; its momentum buffers are DTensors
    with the parameters' placements (made from the first gradient, on the ranks)."""

    _torch_name = "SGD"

    def _init_param_state(self, group: dict, p) -> None:
        if group["momentum"] != 0:  # torch's zero-learning-rate step on zero gradients
            self.state[p]["momentum_buffer"] = factories.zeros_like(p)

    def _step(self, group: dict, params: list, grads: list) -> None:
        momentum = group["momentum"]
        buffers = [self.state[p].get("momentum_buffer") if momentum != 0 else None
                   for p in params]
        created = [p for p, b in zip(params, buffers) if b is None] if momentum != 0 else []
        hyper = dict(weight_decay=group["weight_decay"], momentum=momentum, lr=group["lr"],
                     dampening=group["dampening"], nesterov=group["nesterov"],
                     maximize=group["maximize"], foreach=group["foreach"],
                     fused=group["fused"])
        kernel = kernels.sgd_step if momentum != 0 else kernels.sgd_step_plain
        new = run_step(kernel, params, (grads, buffers), hyper, [p._spec for p in created])
        for p, b in zip(created, new):
            self.state[p]["momentum_buffer"] = b
