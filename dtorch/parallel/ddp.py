"""``DistributedDataParallel``: PyTorch's DDP API on dtorch's single controller.

The module's parameters are Replicate on the data-parallel mesh dim (a plain ``torch.nn``
module is converted in place by ``distribute_module``; a dtorch or tensor-parallel one keeps
its placements), a torch tensor input is the global batch and is sent split along ``dim``
(``Shard(dim)`` on that mesh dim), and backward reduces the gradients in buckets of about
``bucket_cap_mb`` (``dtorch.autograd.buckets``): a 20-parameter model runs one all_reduce
per 25 MB of gradients, not 20. ``no_sync()`` accumulates unreduced. Example::

    model = dtorch.DistributedDataParallel(torch.nn.Sequential(...), device_mesh=mesh)
    model(batch).sum().backward()      # CommDebugMode: {'all_reduce': 1}
"""

from __future__ import annotations

import contextlib

import torch
import torch.utils._pytree as pytree

from ..mesh import DeviceMesh, MeshDim
from ..placement import Replicate, Shard
from ..tensor import DTensor

DEFAULT_BUCKET_CAP_MB = 25  # torch's

# torch's keywords that need a process group per rank; the rest are accepted (init_sync,
# broadcast_buffers, find_unused_parameters, static_graph, gradient_as_bucket_view, ...): the
# parameters are Replicate by construction and unused ones get no gradient
_REFUSED = {"device_ids": "a rank's device is the cluster's (dtorch.init(device_type=))",
            "output_device": "outputs are DTensors on the mesh",
            "process_group": "pass device_mesh= (a dtorch mesh, or mesh['dp'])",
            "mixed_precision": "cast the module (module.to(torch.bfloat16)) instead",
            "delay_all_reduce_named_params": "not supported", "param_to_hook_all_reduce":
            "not supported", "bucket_cap_mb_list": "give one bucket_cap_mb"}


class DistributedDataParallel(torch.nn.Module):
    """torch.nn.parallel.DistributedDataParallel's signature (see the module doc)."""

    def __init__(self, module: torch.nn.Module, device_ids=None, output_device=None, dim=0,
                 broadcast_buffers=None, init_sync=True, process_group=None,
                 bucket_cap_mb=None, find_unused_parameters=False, check_reduction=False,
                 gradient_as_bucket_view=False, static_graph=False,
                 delay_all_reduce_named_params=None, param_to_hook_all_reduce=None,
                 mixed_precision=None, device_mesh=None, skip_all_reduce_unused_params=False,
                 bucket_cap_mb_list=None, batched_grad_copy=False, forward_sync_buffers=None):
        super().__init__()
        given = {"device_ids": device_ids, "output_device": output_device,
                 "process_group": process_group, "mixed_precision": mixed_precision,
                 "delay_all_reduce_named_params": delay_all_reduce_named_params,
                 "param_to_hook_all_reduce": param_to_hook_all_reduce,
                 "bucket_cap_mb_list": bucket_cap_mb_list}
        for name, value in given.items():
            if value is not None:
                raise ValueError(f"DistributedDataParallel({name}=...) is not taken by dtorch: "
                                 f"{_REFUSED[name]}")
        cap = DEFAULT_BUCKET_CAP_MB if bucket_cap_mb is None else bucket_cap_mb
        if isinstance(cap, bool) or not isinstance(cap, (int, float)) or cap <= 0:
            raise ValueError(f"bucket_cap_mb must be a positive number of MB; got {cap!r}")
        self.mesh, self.dp_dim = _data_parallel_dim(device_mesh)
        self.dim = dim
        self.bucket_cap_mb = cap
        if any(not isinstance(p, DTensor) for p in module.parameters()):
            from .distribute_module import distribute_module
            distribute_module(module, self.mesh)
        _check_replicated_on_dp(module, self.mesh, self.dp_dim)
        from ..autograd import buckets
        buckets.register(module.parameters(), int(cap * 2**20))
        self.module = module

    def forward(self, *args, **kwargs):
        """The wrapped module's forward, each torch tensor input split along ``dim``."""
        from ..autograd import buckets  # parameters unfrozen or assigned since: theirs too
        buckets.register(self.module.parameters(), int(self.bucket_cap_mb * 2**20))
        args, kwargs = pytree.tree_map(self._split, (args, kwargs),
                                       is_leaf=lambda x: isinstance(x, DTensor))
        return self.module(*args, **kwargs)

    def _split(self, x):
        if not isinstance(x, torch.Tensor) or isinstance(x, DTensor) or x.ndim == 0:
            return x
        from ..factories import distribute_tensor
        placements = [Replicate()] * self.mesh.ndim
        placements[self.dp_dim] = Shard(self.dim)
        return distribute_tensor(x, self.mesh, placements)

    @contextlib.contextmanager
    def no_sync(self):
        """Inside, backward leaves gradients unreduced (Partial) to accumulate; the first
        backward outside reduces them once, with its own."""
        from ..autograd.engine import deferring
        with deferring([p._ag for p in self.module.parameters() if p._ag is not None]):
            yield


def _data_parallel_dim(device_mesh) -> tuple[DeviceMesh, int]:
    """The mesh and the dim DDP splits the batch on: ``mesh['dp']`` names it, a 1-D mesh
    is it, a mesh with a dim named "dp" has it."""
    if device_mesh is None:
        from ..graph import mesh_or_default
        device_mesh = mesh_or_default(None, None)
    if isinstance(device_mesh, MeshDim):
        if device_mesh.dim is None:
            raise ValueError("device_mesh must name one dim for data parallelism (mesh['dp'])")
        return device_mesh.mesh, device_mesh.dim
    if not isinstance(device_mesh, DeviceMesh):
        raise TypeError(f"device_mesh must be a dtorch.DeviceMesh; got {device_mesh!r}")
    if device_mesh.ndim == 1:
        return device_mesh, 0
    dp = device_mesh.dim_name_index("dp")
    if dp is None:
        raise ValueError(f"a {device_mesh.ndim}-D mesh {device_mesh.mesh_dim_names}: pass "
                         f"device_mesh=mesh['<data-parallel dim>'] to say which dim DDP uses")
    return device_mesh, dp


def _check_replicated_on_dp(module, mesh, dp_dim: int) -> None:
    for name, p in module.named_parameters():
        if p.device_mesh != mesh:
            raise ValueError(f"parameter {name!r} lives on {p.device_mesh}, DDP's mesh is "
                             f"{mesh}: give DDP the mesh the module was parallelized on")
        if p.placements[dp_dim] != Replicate():
            raise ValueError(f"parameter {name!r} is {p.placements[dp_dim]} on the "
                             f"data-parallel mesh dim; DDP replicates parameters there "
                             f"(use fully_shard to shard them)")
