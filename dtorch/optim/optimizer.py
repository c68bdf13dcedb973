"""What dtorch's optimizers share: DTensor parameters in torch.optim's own ``Optimizer``.

A dtorch optimizer is a subclass of torch's (``torch.optim.Adam``: its ``__init__`` checks the
hyper-parameters, its ``param_groups`` are what ``torch.optim.lr_scheduler`` edits) whose
parameters are DTensors. ``step()`` makes the missing state with each parameter's placements
(shard by shard, on the ranks) and issues, per parameter group and mesh, **one** instruction in
which every rank runs torch's own functional step (``torch.optim.adam.adam``, ...) on its local
shards: no collective when the gradients have their parameters' placements (one that does not,
a Partial left by ``no_sync``, is brought there first, counted). Example::

    opt = dtorch.optim.AdamW(model.parameters(), lr=1e-3)
    loss.backward(); opt.step(); opt.zero_grad()
"""

from __future__ import annotations

import torch
from torch.optim.optimizer import required

from ..autograd import versions
from ..autograd.api import zero_grads
from ..local_call import run_local
from ..tensor import DTensor


class DTensorOptimizer:
    """Mixed in before a torch.optim class (see module doc)."""

    _torch_name = "Optimizer"

    def __init__(self, params, *args, **kwargs):
        if isinstance(params, DTensor):
            raise TypeError("params argument given to the optimizer should be an iterable of "
                            "DTensors or dicts, but got a DTensor: pass [tensor]")
        super().__init__(params, *args, **kwargs)

    def add_param_group(self, param_group: dict) -> None:
        """torch's, for DTensors: a list (not a set) of leaf DTensors, or of (name, DTensor)."""
        if not isinstance(param_group, dict):
            raise TypeError(f"param_group must be a dict, but got {type(param_group)}")
        params = param_group["params"]
        if isinstance(params, DTensor):
            params = [params]
        elif isinstance(params, set):
            raise TypeError("optimizer parameters need to be organized in ordered collections, "
                            "but the ordering of tensors in sets will change between runs. "
                            "Please use a list instead.")
        params = list(params)
        names = [p[0] for p in params if isinstance(p, tuple)]
        params = [p[1] if isinstance(p, tuple) else p for p in params]
        if names and len(names) != len(params):
            raise ValueError("all optimizer params should be with/without names. Some param "
                             "names are missing")
        for p in params:
            self._check_param(p)
        param_group["params"] = params
        if names:
            param_group["param_names"] = names
        for name, default in self.defaults.items():
            if default is required and name not in param_group:
                raise ValueError(f"parameter group didn't specify a value of required "
                                 f"optimization parameter {name}")
            param_group.setdefault(name, default)
        self._check_options(param_group)
        seen = {id(p) for g in self.param_groups for p in g["params"]}
        if any(id(p) in seen for p in params):
            raise ValueError("some parameters appear in more than one parameter group")
        if len({id(p) for p in params}) != len(params):
            raise ValueError("a parameter group lists a parameter twice; list each once")
        self.param_groups.append(param_group)

    def _check_param(self, p) -> None:
        if not isinstance(p, DTensor):
            raise TypeError(
                f"dtorch.optim.{type(self).__name__} optimizes DTensors, but one of the params is "
                f"a {type(p).__name__}. Use torch.optim.{self._torch_name} for torch tensors, or "
                f"make the model's parameters DTensors first (parallelize_module, fully_shard, "
                f"dtorch.nn)")
        if not p.is_leaf:
            raise ValueError("can't optimize a non-leaf Tensor")

    def _check_options(self, group: dict) -> None:
        for key in ("capturable", "differentiable", "fused"):
            if group.get(key):
                raise NotImplementedError(f"{key}=True is not supported on DTensors; leave it "
                                          f"out (the step runs eagerly on every rank, foreach "
                                          f"where torch would)")
        if isinstance(group.get("lr"), torch.Tensor):
            raise TypeError("lr must be a Python number for dtorch optimizers (a tensor lr is "
                            "for capturable steps); pass float(lr)")

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Each parameter's ``.grad`` to None (default), or zeroed in place."""
        zero_grads([p for group in self.param_groups for p in group["params"]], set_to_none)

    # state -----------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """torch's layout: ``{"state": {index: {name: DTensor}}, "param_groups": [...]}``
        with parameters numbered in order (the values are the optimizer's own, not copies)."""
        index: dict = {}
        groups = []
        for hook in self._optimizer_state_dict_pre_hooks.values():
            hook(self)
        for g in self.param_groups:
            packed = {k: v for k, v in g.items() if k != "params"}
            packed["params"] = [index.setdefault(id(p), len(index)) for p in g["params"]]
            groups.append(packed)
        state = {index[id(p)]: dict(s) for p, s in self.state.items() if id(p) in index}
        out = {"state": state, "param_groups": groups}
        for hook in self._optimizer_state_dict_post_hooks.values():
            result = hook(self, out)
            if result is not None:
                out = result
        return out

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a dtorch optimizer's ``state_dict()`` (DTensors, copied and brought to each
        parameter's placements) or a torch optimizer's / :func:`full_state_dict`'s (torch
        tensors, sent shard by shard); everything is checked before anything is sent. torch's
        load hooks run, and the class's own fix-ups (AdamW's decoupled weight decay)."""
        for hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = hook(self, state_dict)
            if result is not None:
                state_dict = result
        groups = state_dict["param_groups"]
        if len(groups) != len(self.param_groups):
            raise ValueError("loaded state dict has a different number of parameter groups")
        params = {}
        for mine, theirs in zip(self.param_groups, groups):
            if len(mine["params"]) != len(theirs["params"]):
                raise ValueError("loaded state dict contains a parameter group that doesn't "
                                 "match the size of optimizer's group")
            params.update(zip(theirs["params"], mine["params"]))
        for i, entries in state_dict["state"].items():
            if i not in params:
                raise KeyError(f"the loaded state names parameter {i}, which no group has")
            for name, value in entries.items():
                _check_state_value(params[i], name, value)
        new_state = {params[i]: {name: _placed(params[i], name, value)
                                 for name, value in entries.items()}
                     for i, entries in state_dict["state"].items()}
        new_groups = []
        for mine, theirs in zip(self.param_groups, groups):
            group = {**self.defaults, **{k: v for k, v in theirs.items() if k != "params"}}
            group["params"] = mine["params"]
            if "param_names" in mine:
                group["param_names"] = mine["param_names"]
            new_groups.append(self._fix_loaded_group(group))
        self.state.clear()
        self.state.update(new_state)
        self.param_groups[:] = new_groups
        for hook in self._optimizer_load_state_dict_post_hooks.values():
            hook(self)

    def init_state(self) -> "DTensorOptimizer":
        """Make the state a first step would make (zeros, in each parameter's placements)
        for every parameter that has none, without stepping: ``state_dict()`` then has every
        entry a checkpoint holds, so ``dtorch.checkpoint.load`` can fill it (what
        ``torch.distributed.checkpoint.state_dict`` does with a zero-learning-rate step).

        >>> # opt.init_state(); sd = {"optim": opt.state_dict()}
        >>> # dtorch.checkpoint.load(sd, path); opt.load_state_dict(sd["optim"])
        """
        for group in self.param_groups:
            for p in group["params"]:
                if not self.state[p]:
                    self._init_param_state(group, p)
        return self

    def _init_param_state(self, group: dict, p: DTensor) -> None:
        raise NotImplementedError

    def _fix_loaded_group(self, group: dict) -> dict:
        """What the torch class's ``__setstate__`` fixes in a loaded group (AdamW: override)."""
        return group

    @torch.no_grad()
    def step(self, closure=None):
        """One step of every parameter that has a gradient (see module doc)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:  # every check before the first group steps
            self._check_options(group)
            for p in group["params"]:
                if p.grad is not None:
                    _check_grad_mesh(p)
        for group in self.param_groups:
            for params in _by_mesh(p for p in group["params"] if p.grad is not None):
                grads = [_in_placements(p) for p in params]
                self._step(group, params, grads)
                for p in params:
                    versions.bump(p)
        return loss

    def _step(self, group: dict, params: list, grads: list) -> None:
        raise NotImplementedError


def _check_state_value(p: DTensor, name: str, value) -> None:
    if name == "step" or not isinstance(value, (DTensor, torch.Tensor)):
        return
    if tuple(value.shape) != tuple(p.shape):
        raise ValueError(f"the loaded state {name!r} has shape {tuple(value.shape)}, its "
                         f"parameter {tuple(p.shape)}: the state dict is another model's")


def _placed(p: DTensor, name: str, value):
    """A loaded state value as this optimizer keeps it: a DTensor on ``p``'s mesh, in ``p``'s
    placements (``step``: 0-dim Replicate), never shared with the source."""
    from .. import factories
    from ..placement import Replicate
    if name == "step" and isinstance(value, (int, float)):  # an older checkpoint's step
        value = torch.tensor(float(value), dtype=scalar_dtype())
    if not isinstance(value, (DTensor, torch.Tensor)):
        return value
    mesh = p.device_mesh
    placements = [Replicate()] * mesh.ndim if name == "step" else list(p.placements)
    dtype = value.dtype if name == "step" else (
        p.dtype if value.dtype.is_floating_point or value.dtype.is_complex else value.dtype)
    if isinstance(value, DTensor):
        moved = value if value.device_mesh == mesh and value.placements == tuple(placements) \
            else value.redistribute(mesh, placements)
        return moved.to(dtype).clone()
    return factories.distribute_tensor(value.detach().to(dtype).clone(), mesh, placements)


def scalar_dtype() -> torch.dtype:
    """The dtype of a ``step`` count, as torch picks it (float64 under that default dtype)."""
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32


def full_state_dict(optimizer) -> dict:
    """The optimizer's ``state_dict()`` with every DTensor gathered into a torch tensor: what
    a torch optimizer of the same kind loads on one device (and dtorch's loads back).

    >>> full_state_dict(torch.optim.SGD([torch.zeros(1)], lr=0.1))["param_groups"][0]["lr"]
    0.1
    """
    sd = optimizer.state_dict()
    state = {i: {k: v.to_torch() if isinstance(v, DTensor) else v for k, v in entries.items()}
             for i, entries in sd["state"].items()}
    return {"state": state, "param_groups": sd["param_groups"]}


def _by_mesh(params) -> list:
    """The parameters grouped by mesh, in order (one instruction per mesh)."""
    groups: dict = {}
    for p in params:
        groups.setdefault(p.device_mesh, []).append(p)
    return list(groups.values())


def _check_grad_mesh(p: DTensor) -> None:
    g = p.grad
    if g.device_mesh != p.device_mesh:
        raise ValueError(f"a gradient lives on {g.device_mesh}, its parameter on "
                         f"{p.device_mesh}; assign a gradient on the parameter's mesh")


def _in_placements(p: DTensor) -> DTensor:
    """``p.grad`` in ``p``'s placements (a planned, counted move when it is not yet)."""
    g = p.grad
    if g.placements != p.placements:
        g = g._move(p.device_mesh, p.placements)
    return g


def run_step(kernel, params: list, lists: tuple, hyper: dict, new_specs=()) -> list:
    """Issue ``kernel(params, *lists, **hyper)`` on the ranks of the parameters' mesh."""
    return run_local(kernel, (params, *lists), hyper, list(new_specs))
