"""Norms with Replicate DTensor weights: ``RMSNorm`` and ``LayerNorm`` (torch.nn's arguments
and init: weight ones, bias zeros). The normalized dims must not be sharded (the op raises
``PlacementError`` naming the fix). Example::

    norm = RMSNorm(64, eps=1e-6, device_mesh=mesh)
    y = norm(x)                     # x Shard(0) on dp, Replicate on tp -> same placements
"""

from __future__ import annotations

import numbers

import torch.nn.functional as F

from ...factories import ones, zeros
from ...placement import Replicate
from ...graph import mesh_or_default
from .module import Module


def _shape(normalized_shape) -> tuple[int, ...]:
    if isinstance(normalized_shape, numbers.Integral):
        return (int(normalized_shape),)
    return tuple(int(s) for s in normalized_shape)


class _Norm(Module):
    def __init__(self, normalized_shape, eps, elementwise_affine, bias, device, dtype,
                 device_mesh):
        super().__init__()
        self.normalized_shape = _shape(normalized_shape)
        self.eps = eps
        self.elementwise_affine = elementwise_affine
        self.device_mesh = mesh_or_default(device_mesh, device)
        replicate = [Replicate()] * self.device_mesh.ndim
        if elementwise_affine:
            self.weight = ones(*self.normalized_shape, dtype=dtype, device_mesh=self.device_mesh,
                               placements=replicate)
            if bias:
                self.bias = zeros(*self.normalized_shape, dtype=dtype,
                                  device_mesh=self.device_mesh, placements=replicate)
            else:
                self.register_parameter("bias", None)
        else:
            self.register_parameter("weight", None)
            self.register_parameter("bias", None)

    def extra_repr(self) -> str:
        return (f"{self.normalized_shape}, eps={self.eps}, "
                f"elementwise_affine={self.elementwise_affine}")


class RMSNorm(_Norm):
    """``torch.nn.RMSNorm(normalized_shape, eps=None, elementwise_affine=True)``."""

    def __init__(self, normalized_shape, eps: float | None = None, elementwise_affine: bool = True,
                 device=None, dtype=None, device_mesh=None):
        super().__init__(normalized_shape, eps, elementwise_affine, False, device, dtype,
                         device_mesh)
        del self._parameters["bias"]  # torch.nn.RMSNorm has no bias entry

    def forward(self, input):
        return F.rms_norm(input, self.normalized_shape, self.weight, self.eps)


class LayerNorm(_Norm):
    """``torch.nn.LayerNorm(normalized_shape, eps=1e-5, elementwise_affine=True, bias=True)``."""

    def __init__(self, normalized_shape, eps: float = 1e-5, elementwise_affine: bool = True,
                 bias: bool = True, device=None, dtype=None, device_mesh=None):
        super().__init__(normalized_shape, eps, elementwise_affine, bias, device, dtype,
                         device_mesh)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", bias={self.bias is not None}"

    def forward(self, input):
        return F.layer_norm(input, self.normalized_shape, self.weight, self.bias, self.eps)
