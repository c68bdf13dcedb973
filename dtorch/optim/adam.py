"""``dtorch.optim.Adam`` and ``AdamW``: torch's (amsgrad, weight_decay, maximize, decoupled
weight decay) on DTensor parameters, one instruction per rank per parameter group. Example::

    opt = dtorch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01, amsgrad=True)
"""

from __future__ import annotations

import torch

from .. import factories
from ..placement import Replicate
from . import kernels
from .optimizer import DTensorOptimizer, run_step, scalar_dtype


class Adam(DTensorOptimizer, torch.optim.Adam):
    """torch.optim.Adam's signature, defaults and checks; ``exp_avg``, ``exp_avg_sq`` (and
    ``max_exp_avg_sq``) are DTensors with the parameters' placements, ``step`` a 0-dim
    Replicate one, made on the ranks at a parameter's first step."""

    _torch_name = "Adam"

    def _state_of(self, p, amsgrad: bool) -> dict:
        state = self.state[p]
        if not state:
            mesh = p.device_mesh
            state["step"] = factories.zeros(dtype=scalar_dtype(), device_mesh=mesh,
                                            placements=[Replicate()] * mesh.ndim)
            state["exp_avg"] = factories.zeros_like(p)
            state["exp_avg_sq"] = factories.zeros_like(p)
        if amsgrad and "max_exp_avg_sq" not in state:
            state["max_exp_avg_sq"] = factories.zeros_like(p)
        return state

    def _init_param_state(self, group: dict, p) -> None:
        self._state_of(p, group["amsgrad"])

    def _step(self, group: dict, params: list, grads: list) -> None:
        amsgrad = group["amsgrad"]
        states = [self._state_of(p, amsgrad) for p in params]
        lists = (grads, [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states],
                 [s["max_exp_avg_sq"] for s in states] if amsgrad else [],
                 [s["step"] for s in states])
        beta1, beta2 = group["betas"]
        hyper = dict(amsgrad=amsgrad, has_complex=any(p.dtype.is_complex for p in params),
                     beta1=beta1, beta2=beta2, lr=group["lr"],
                     weight_decay=group["weight_decay"], eps=group["eps"],
                     maximize=group["maximize"], foreach=group["foreach"],
                     fused=group["fused"],
                     decoupled_weight_decay=group.get("decoupled_weight_decay", False))
        run_step(kernels.adam_step, params, lists, hyper)


class AdamW(Adam, torch.optim.AdamW):
    """torch.optim.AdamW (Adam with decoupled weight decay, default 0.01) on DTensors."""

    _torch_name = "AdamW"

    def _fix_loaded_group(self, group: dict) -> dict:
        group["decoupled_weight_decay"] = True  # as torch's AdamW.__setstate__: an Adam
        return group                            # state dict loads as AdamW still
