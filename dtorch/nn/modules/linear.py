"""``Linear`` and its tensor-parallel presets (seed 003 section 3).

Only the ``tp_dim`` mesh dim shards the weight; every other dim (dp, cp, ...) keeps it
Replicate. ``tp_shard_type="col"`` (or None) shards the output features (weight ``Shard(0)``,
bias ``Shard(0)``, input must be Replicate on tp); ``"row"`` the input features (weight
``Shard(1)``, bias ``Partial()``, input must be ``Shard(-1)`` on tp, output Partial).

| preset | tp_shard_type | input on tp | output on tp |
| --- | --- | --- | --- |
| ColumnParallelLinear | col | checked Replicate | Shard(-1) |
| ColumnParallelLinearWithReplicateOutput | col | checked Replicate | -> Replicate (all_gather) |
| ColumnParallelLinearWithReplicateInputOutput | col | -> Replicate | -> Replicate |
| RowParallelLinear | row | checked Shard(-1) | Partial |
| RowParallelLinearWithReplicateOutput | row | checked Shard(-1) | -> Replicate (all_reduce) |
| ReplicateParallelLinear | (tp_dim=None) | anything | unchanged |

Example::

    >>> from dtorch import init_device_mesh
    >>> mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    >>> tp_placements(mesh, 1, "row")                              # doctest: +SKIP
    ((Replicate(), Shard(dim=1)), (Replicate(), Partial(reduce_op='sum')))
"""

from __future__ import annotations

import math

import torch.nn.functional as F

from ...errors import PlacementError
from ...graph import mesh_or_default
from ...placement import Partial, Replicate, Shard
from ...tensor import DTensor
from .. import init
from .module import Module, ModuleError
from .placement_io import as_dtensor

SHARD_TYPES = ("col", "row", None)


def resolve_tp_dim(mesh, tp_dim) -> int | None:
    """The mesh dim index tensor parallelism shards on: a name the mesh lacks means none."""
    if tp_dim is None:
        return None
    if isinstance(tp_dim, str):
        return mesh.dim_name_index(tp_dim)
    if isinstance(tp_dim, bool) or not isinstance(tp_dim, int):
        raise ModuleError(f"tp_dim must be a mesh dim name, an int or None; got {tp_dim!r}")
    if not -mesh.ndim <= tp_dim < mesh.ndim:
        raise ModuleError(f"tp_dim={tp_dim} is out of range for a {mesh.ndim}-D mesh; use a dim "
                          f"in [{-mesh.ndim}, {mesh.ndim}) or a name of {mesh.mesh_dim_names}")
    return tp_dim % mesh.ndim


def tp_placements(mesh, tp_dim: int | None, shard_type) -> tuple[tuple, tuple]:
    """(weight placements, bias placements) for a Linear on ``mesh``."""
    weight = [Replicate()] * mesh.ndim
    bias = [Replicate()] * mesh.ndim
    if tp_dim is not None:
        weight[tp_dim] = Shard(1) if shard_type == "row" else Shard(0)
        bias[tp_dim] = Partial() if shard_type == "row" else Shard(0)
    return tuple(weight), tuple(bias)


class Linear(Module):
    """``y = x @ weight.T + bias`` with the weight sharded on ``tp_dim`` by ``tp_shard_type``."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None,
                 dtype=None, device_mesh=None, *, tp_dim="tp", tp_shard_type=None):
        super().__init__()
        if tp_shard_type not in SHARD_TYPES:
            raise ModuleError(f"tp_shard_type must be 'col', 'row' or None; got "
                              f"{tp_shard_type!r}")
        for name, value in (("in_features", in_features), ("out_features", out_features)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ModuleError(f"{name} must be a positive int; got {value!r}")
        self.in_features, self.out_features = in_features, out_features
        self.device_mesh = mesh_or_default(device_mesh, device)
        self.tp_dim = resolve_tp_dim(self.device_mesh, tp_dim)
        self.tp_shard_type = tp_shard_type
        w_place, b_place = tp_placements(self.device_mesh, self.tp_dim, tp_shard_type)
        bound = 1 / math.sqrt(in_features)  # torch.nn.Linear's init distribution
        self.weight = init.uniform((out_features, in_features), -bound, bound, dtype=dtype,
                                   device_mesh=self.device_mesh, placements=w_place)
        if bias:
            self.bias = init.uniform((out_features,), -bound, bound, dtype=dtype,
                                     device_mesh=self.device_mesh, placements=b_place)
        else:
            self.register_parameter("bias", None)

    @property
    def expected_input_placement(self):
        """What the input must be on ``tp_dim`` (None: no tensor parallelism)."""
        if self.tp_dim is None:
            return None
        return Shard(-1) if self.tp_shard_type == "row" else Replicate()

    def redistribute_input(self, input, input_placement=None):
        """Convert the input on ``tp_dim`` to ``input_placement`` when given, then check it."""
        input = as_dtensor(input, self.device_mesh, self.tp_dim, self.expected_input_placement)
        if self.tp_dim is not None and input_placement is not None:
            input = input.redistribute_by_dict(placements_dict={self.tp_dim: input_placement},
                                               default_placement_mode="keep")
        expect = self.expected_input_placement
        if expect is not None:
            expect = Shard(input.dim() - 1) if isinstance(expect, Shard) else expect
            if not input.check_placement(self.tp_dim, expect):
                raise _input_error(self, input, expect)
        return (input,), {}

    def redistribute_output(self, output, output_placement=None):
        """Convert the output on ``tp_dim`` to ``output_placement`` (other dims kept)."""
        if self.tp_dim is not None and output_placement is not None:
            output = output.redistribute_by_dict(placements_dict={self.tp_dim: output_placement},
                                                 default_placement_mode="keep")
        return output

    def forward(self, input):
        return F.linear(input, self.weight, self.bias)

    def extra_repr(self) -> str:
        names = self.device_mesh.mesh_dim_names
        dim = names[self.tp_dim] if names and self.tp_dim is not None else self.tp_dim
        tp = "" if self.tp_dim is None else f", tp_dim={dim!r}, tp_shard_type=" \
                                            f"{self.tp_shard_type!r}"
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}{tp}")


def _input_error(module, input: DTensor, expect) -> PlacementError:
    from ...ops.explain import code_placement
    names = module.device_mesh.mesh_dim_names
    dim = names[module.tp_dim] if names else module.tp_dim
    kind = type(module).__name__
    row = isinstance(expect, Shard)
    preset = ("RowParallelLinear" if row else "ColumnParallelLinearWithReplicateInputOutput")
    return PlacementError(
        f"{kind} expects its input to be {code_placement(expect)} on mesh dim {dim!r} (the "
        f"tensor-parallel dim), but it is {code_placement(input.placements[module.tp_dim])}. "
        f"Fix: input.redistribute_by_dict(placements_dict={{{dim!r}: "
        f"{'Shard(-1)' if row else 'Replicate()'}}})" +
        ("" if row else f", or use {preset}, which converts its input"))


class _Preset(Linear):
    """A Linear with ``tp_shard_type`` fixed and input/output conversions on tp."""

    shard_type: str | None = "col"
    input_placement = None
    output_placement = None

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None,
                 dtype=None, device_mesh=None, *, tp_dim="tp"):
        super().__init__(in_features, out_features, bias, device, dtype, device_mesh,
                         tp_dim=tp_dim, tp_shard_type=self.shard_type)

    def redistribute_input(self, input, input_placement=None):
        return super().redistribute_input(input, input_placement or self.input_placement)

    def redistribute_output(self, output, output_placement=None):
        return super().redistribute_output(output, output_placement or self.output_placement)


class ColumnParallelLinear(_Preset):
    """Weight ``Shard(0)`` on tp; input must be Replicate there; output ``Shard(-1)``."""


class ColumnParallelLinearWithReplicateOutput(_Preset):
    """Column parallel; the output is gathered to Replicate on tp (one all_gather)."""

    output_placement = Replicate()


class ColumnParallelLinearWithReplicateInputOutput(_Preset):
    """Column parallel; the input is converted to Replicate on tp, the output gathered."""

    input_placement = Replicate()
    output_placement = Replicate()


class RowParallelLinear(_Preset):
    """Weight ``Shard(1)`` on tp; input must be ``Shard(-1)`` there; output ``Partial()``."""

    shard_type = "row"


class RowParallelLinearWithReplicateOutput(_Preset):
    """Row parallel; the Partial output is all-reduced to Replicate on tp."""

    shard_type = "row"
    output_placement = Replicate()


class ReplicateParallelLinear(Linear):
    """No tensor parallelism: weight and bias Replicate on every mesh dim."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None,
                 dtype=None, device_mesh=None):
        super().__init__(in_features, out_features, bias, device, dtype, device_mesh,
                         tp_dim=None)
