"""DTensor: a handle to a tensor whose shards live on the ranks.

The handle holds metadata only (shape, dtype, mesh, placements); values stay on the workers
until asked for. Example::

    >>> import torch, dtorch                                               # doctest: +SKIP
    >>> from dtorch import init_device_mesh, Shard, Replicate              # doctest: +SKIP
    >>> mesh = init_device_mesh("cpu", 4)                                  # doctest: +SKIP
    >>> x = dtorch.tensor(torch.arange(8.), device_mesh=mesh, placements=[Shard(0)])  # doctest: +SKIP
    >>> x.redistribute(placements=[Replicate()]).to_local(3)               # doctest: +SKIP
    tensor([0., 1., 2., 3., 4., 5., 6., 7.])
"""

from __future__ import annotations

import sys
from functools import lru_cache

import torch

from . import comm_debug, layout, tensor_operators
from .errors import DTorchError, FreedTensorError, PlacementValueError
from .future import TensorFuture
from .mesh import DeviceMesh, RankTuple
from .placement import Partial, Placement, Replicate, Shard, format_placements
from .redistribute import plan_redistribute
from .runtime import messages as m
from .spec import TensorSpec, make_spec  # noqa: F401 - re-exported
from .runtime import session
from .runtime.wire import WireFormatError, unpack
from .tensor_protocol import TensorProtocol

_REPR_MAX_ELEMENTS = 1 << 22


class DTensor(TensorProtocol):
    """A distributed tensor: ``dtorch.Tensor(torch_tensor, device_mesh=, placements=)``.

    ``np.asarray``, iteration, ``len``, ``bool``, ``float``, ``int``, ``__index__``: see
    :mod:`dtorch.tensor_protocol`."""

    __slots__ = ("_spec", "_tid", "_controller", "_ag", "_version", "__weakref__")

    def __init__(self, data, device_mesh: DeviceMesh | None = None, placements=None,
                 requires_grad: bool = False):
        from .factories import tensor as _tensor
        made = _tensor(data, device_mesh=device_mesh, placements=placements,
                       requires_grad=requires_grad)
        self._adopt(made)

    def _adopt(self, other: "DTensor") -> None:
        self._spec, self._tid, self._controller = other._spec, other._tid, other._controller
        self._ag = other._ag
        self._version = other._version
        other._tid = None
        other._controller = None

    @classmethod
    def _wrap(cls, spec: TensorSpec, tid: int, controller) -> "DTensor":
        obj = cls.__new__(cls)
        obj._spec, obj._tid, obj._controller = spec, tid, controller
        obj._ag = None  # autograd state (dtorch.autograd.node.AutogradMeta) once it needs one
        obj._version = None  # in-place counter, once a node saved it (autograd/versions.py)
        controller.live_tensors += 1
        return obj

    def __del__(self):
        c = getattr(self, "_controller", None)
        if c is not None and not c.closed and self._tid is not None:
            c.release(self._tid, self._spec.mesh.ranks)

    # metadata --------------------------------------------------------------------------------
    @property
    def shape(self) -> torch.Size:
        return torch.Size(self._spec.shape)

    def size(self, dim: int | None = None):
        return self.shape if dim is None else self._spec.shape[dim]

    @property
    def dtype(self) -> torch.dtype:
        return self._spec.dtype

    @property
    def ndim(self) -> int:
        return len(self._spec.shape)

    def dim(self) -> int:
        return self.ndim

    def numel(self) -> int:
        n = 1
        for s in self._spec.shape:
            n *= s
        return n

    @property
    def device_mesh(self) -> DeviceMesh:
        return self._spec.mesh

    @property
    def placements(self) -> tuple[Placement, ...]:
        return self._spec.placements

    def local_shapes(self) -> dict[int, tuple[int, ...]]:
        """``{rank: local shape}`` without moving data."""
        return layout.local_shapes(self._spec.shape, self._spec.mesh, self._spec.placements)

    def _live(self):
        c = self._controller
        if c is None or self._tid is None:
            raise FreedTensorError("this DTensor was freed or moved into another handle; "
                                   "make it again")
        if c.closed or c is not session._controller:
            raise FreedTensorError("this DTensor belongs to a dtorch cluster that was shut down "
                                   "or restarted; its shards are gone. Make it again")
        return c

    # values ----------------------------------------------------------------------------------
    def to_torch_async(self) -> TensorFuture:
        """Start gathering the global value; returns a TensorFuture."""
        c = self._live()
        spec, tid, cleanup = self._spec, self._tid, None
        if any(p.is_partial() for p in spec.placements):
            target = tuple(Replicate() if p.is_partial() else p for p in spec.placements)
            reduced = self._move(spec.mesh, target)
            spec, tid = reduced._spec, reduced._tid
            cleanup = reduced  # kept alive until the answers are in
        blocks = _distinct_blocks(spec)
        answers = c.request(lambda req: m.Fetch(req, tid, tuple(blocks)), blocks)

        def assemble(results):
            out = torch.empty(spec.shape, dtype=spec.dtype)
            for rank, (status, value) in results.items():
                if status != "ok":
                    raise _remote(c, value)
                out[blocks[rank].slices()] = _received(value, rank, blocks[rank].shape,
                                                       spec.dtype)
            return out

        return TensorFuture(c, answers, assemble, (lambda: cleanup) if cleanup is not None else None)

    def to_torch(self) -> torch.Tensor:
        """The global value as one torch.Tensor (Shard: concatenate; Partial: reduce)."""
        return self.to_torch_async().get()

    full_tensor = to_torch

    def to_local(self, rank: int | None = None) -> torch.Tensor:
        """The local tensor ``rank`` stores (a Partial shard is its partial value).

        PyTorch's SPMD ``to_local()`` returns the calling rank's shard; a single controller is
        no rank, so the rank is required: without one a TypeError lists the mesh's ranks."""
        if rank is None:
            raise TypeError(f"DTensor.to_local(rank) needs the rank whose shard to return: the "
                            f"controller is not a rank; pick one of "
                            f"{list(self._spec.mesh.ranks)}, or use .to_torch() / "
                            f".full_tensor() for the global value")
        c = self._live()
        if self._spec.mesh.get_coordinate(rank) is None:
            raise ValueError(f"rank {rank} is not in this tensor's mesh {self._spec.mesh}; "
                             f"pick one of {list(self._spec.mesh.ranks)}")
        answers = c.wait(c.request(lambda req: m.Fetch(req, self._tid, (rank,)), [rank]))
        status, value = answers[rank]
        if status != "ok":
            raise _remote(c, value)
        coord = self._spec.mesh.get_coordinate(rank)
        shape = layout.local_shape(self._spec.shape, self._spec.mesh, self._spec.placements,
                                   coord)
        return _received(value, rank, shape, self._spec.dtype)

    def item(self):
        return self.to_torch().item()

    def tolist(self):
        return self.to_torch().tolist()

    def numpy(self):
        return self.to_torch().numpy()

    def __repr__(self) -> str:
        spec = self._spec
        head = (f"DTensor(shape={tuple(spec.shape)}, dtype={spec.dtype}, mesh={spec.mesh!r}, "
                f"placements={format_placements(spec.placements)})")
        if self._tid is None:
            return head[:-1] + ", freed)"
        if self.numel() > _REPR_MAX_ELEMENTS:
            return head + f"\n<{self.numel()} elements not gathered for display; call .to_torch()>"
        try:
            return head + "\n" + repr(self.to_torch())
        except DTorchError as exc:  # repr must not raise (Jupyter, debuggers); reads still do
            first = str(exc).splitlines()[0]
            return head + f"\n<values unavailable: {type(exc).__name__}: {first}>"

    # redistribution --------------------------------------------------------------------------
    def redistribute(self, device_mesh: DeviceMesh | None = None, placements=None) -> "DTensor":
        """Same value, new placements and/or mesh (same mesh shape). Runs the collectives the
        change implies; moving to the same mesh and placements returns ``self``."""
        mesh = device_mesh if device_mesh is not None else self._spec.mesh
        if placements is None:
            placements = self._spec.placements
        return self._redistribute_to(mesh, placements)

    def predict_redistribute(self, device_mesh: DeviceMesh | None = None, placements=None,
                             model=None):
        """What ``redistribute(device_mesh, placements)`` would cost, without running it: the
        cost model's :class:`dtorch.cost.Prediction` of each planned step (its collective,
        groups, bytes per rank, predicted seconds) and the total. ``model`` defaults to the
        cluster's fitted links (``dtorch.measure_links``, measured on first use).

        >>> print(x.predict_redistribute(placements=[Replicate()]))   # doctest: +SKIP
        all_gather on 0: 1 group of 4, 4.0 MiB/rank -> 7.1 ms
        total 7.1 ms
        """
        from .runtime.links import predict
        spec = self._spec
        mesh = device_mesh if device_mesh is not None else spec.mesh
        placements = spec.placements if placements is None else placements
        return predict(plan_redistribute(spec.mesh, spec.shape, spec.placements, placements,
                                         spec.dtype.itemsize, dst_mesh=mesh), model)

    def _redistribute_to(self, mesh: DeviceMesh, placements) -> "DTensor":
        """The redistribute users call: recorded for backward when ``self`` requires grad."""
        out = self._move(mesh, placements)
        if out is not self and self._ag is not None and self._ag.requires_grad and \
                torch.is_grad_enabled():
            from .autograd.redistribute import record_redistribute
            record_redistribute(self, out)
        return out

    def _move(self, mesh: DeviceMesh, placements) -> "DTensor":
        """The planned redistribute itself (never recorded: values, gradients)."""
        c = self._live()
        spec = self._spec
        steps = plan_redistribute(spec.mesh, spec.shape, spec.placements, placements,
                                  spec.dtype.itemsize, dst_mesh=mesh)
        target = make_spec(spec.shape, spec.dtype, mesh, placements)
        if not steps and mesh == spec.mesh:
            return self
        c.ensure_mesh(mesh)
        out = c.new_tid()
        ranks = _union_ranks(spec.mesh, mesh)
        if steps:
            c.issue(m.Redistribute(out, self._tid, spec.shape, spec.dtype, spec.mesh,
                                   mesh if mesh != spec.mesh else None, steps, ranks))
            if comm_debug._listeners:  # what issued it, for the kernel's %dtorch explain
                comm_debug.record_steps(steps, f"redistribute {format_placements(spec.placements)}"
                                        f" -> {format_placements(steps[-1].after)}")
        else:  # a different mesh whose ranks sit at the same coordinates: nothing moves
            c.issue(m.Call((out,), _identity, (m.Ref(self._tid),), {}, ranks))
        return DTensor._wrap(target, out, c)

    def redistribute_by_dict(self, *args, placements_dict=None,
                             device_mesh: DeviceMesh | None = None,
                             default_placement_mode: str = "keep") -> "DTensor":
        """Redistribute with placements given by mesh dim name (or index).

        Dims missing from the dict follow ``default_placement_mode``: ``"keep"`` the current
        placement, ``"replicate"`` Replicate(), ``"raise_error"`` raise. Names the target mesh
        lacks are ignored. ``x.redistribute_by_dict(mesh, placements_dict={...})`` works too.
        """
        for arg in args:  # (placements_dict[, device_mesh]) or the seed's (device_mesh, dict)
            if isinstance(arg, DeviceMesh):
                device_mesh = arg
            elif isinstance(arg, dict):
                placements_dict = arg
            else:
                raise TypeError(f"redistribute_by_dict takes a dict of placements and a "
                                f"DeviceMesh; got {arg!r}")
        placements_dict = dict(placements_dict or {})
        mesh = device_mesh if device_mesh is not None else self._spec.mesh
        if default_placement_mode not in ("keep", "replicate", "raise_error"):
            raise ValueError(f"default_placement_mode must be 'keep', 'replicate' or "
                             f"'raise_error'; got {default_placement_mode!r}")
        if mesh.ndim != self._spec.mesh.ndim:
            raise PlacementValueError(f"cannot redistribute from a {self._spec.mesh.ndim}-D mesh "
                                      f"to a {mesh.ndim}-D mesh; meshes must have the same shape")
        wanted = {}
        for key, p in placements_dict.items():
            idx = key if isinstance(key, int) else mesh.dim_name_index(key)
            if idx is not None:
                wanted[mesh.dim_index(idx)] = p
        placements = []
        for i in range(mesh.ndim):
            if i in wanted:
                placements.append(wanted[i])
            elif default_placement_mode == "keep":
                placements.append(self._spec.placements[i])
            elif default_placement_mode == "replicate":
                placements.append(Replicate())
            else:
                name = mesh.mesh_dim_names[i] if mesh.mesh_dim_names else i
                raise PlacementValueError(
                    f"redistribute_by_dict got no placement for mesh dim {name!r} and "
                    f"default_placement_mode='raise_error'; add {name!r} to the dict")
        return self._redistribute_to(mesh, placements)

    def redistribute_like(self, other: "DTensor") -> "DTensor":
        """Redistribute to ``other``'s mesh and placements."""
        return self._redistribute_to(other.device_mesh, other.placements)

    def check_placement(self, dim: int | str, placement: Placement) -> bool:
        """Whether mesh dim ``dim`` (index or name) has ``placement`` (Shard dims normalized)."""
        idx = self._spec.mesh.dim_index(dim)
        if isinstance(placement, Shard):
            placement = Shard(placement.dim % max(self.ndim, 1))
        return self._spec.placements[idx] == placement

    def _repr_html_(self) -> str:
        """Static picture of the layout (metadata only; fetches no values)."""
        from dtorch_widgets.html import dtensor_html
        return dtensor_html(self)

    def _repr_mimebundle_(self, include=None, exclude=None):
        """The static picture, plus the interactive ShardView inside a Jupyter kernel."""
        from dtorch_widgets.display import dtensor_mimebundle
        return dtensor_mimebundle(self, include, exclude)

    # autograd (dtorch.autograd) ----------------------------------------------------------------
    @property
    def requires_grad(self) -> bool:
        return self._ag is not None and self._ag.requires_grad

    @requires_grad.setter
    def requires_grad(self, flag: bool) -> None:
        self.requires_grad_(flag)

    def requires_grad_(self, requires_grad: bool = True) -> "DTensor":
        """Like torch's: leaves only; floating point and complex dtypes only."""
        return _autograd().requires_grad_(self, requires_grad)

    @property
    def grad(self) -> "DTensor | None":
        """The accumulated gradient (a DTensor with this tensor's placements) or None."""
        return self._ag.grad if self._ag is not None else None

    @grad.setter
    def grad(self, value) -> None:
        _autograd().set_grad(self, value)

    @property
    def grad_fn(self):
        """The node that made this tensor (``.name()`` as torch's), None for a leaf."""
        return self._ag.grad_fn if self._ag is not None else None

    @property
    def is_leaf(self) -> bool:
        return self._ag is None or self._ag.grad_fn is None

    @property
    def retains_grad(self) -> bool:
        return self._ag is not None and self._ag.retains_grad

    @property
    def output_nr(self) -> int:
        return self._ag.output_nr if self._ag is not None else 0

    @property
    def data(self) -> "DTensor":
        """A detached handle over the same shards (as torch's ``.data``)."""
        return self.detach()

    def detach(self) -> "DTensor":
        """A new handle on the same local tensors, outside the graph (shares memory)."""
        return _autograd().detach(self)

    def detach_(self) -> "DTensor":
        return _autograd().detach_(self)

    def retain_grad(self) -> None:
        """Keep this non-leaf's gradient in ``.grad`` after backward."""
        _autograd().retain_grad(self)

    def register_hook(self, hook):
        """``hook(grad) -> DTensor or None`` runs when this tensor's gradient is computed."""
        return _autograd().register_hook(self, hook)

    def backward(self, gradient=None, retain_graph=None, create_graph=False, inputs=None):
        """Accumulate gradients into the leaves' ``.grad`` (see dtorch.autograd.backward)."""
        from . import autograd
        autograd.backward(self, gradient, retain_graph, create_graph, inputs=inputs)

    # ops: torch functions, methods and operators (rules in dtorch.ops) ------------------------
    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        """``torch.relu(x)``, ``F.softmax(x, -1)``, ... on DTensors: see ``dtorch.ops``."""
        return _dispatch(func, types, args, kwargs)

    def __getattr__(self, name):
        """Tensor methods (``x.sum(0)``, ``x.view(2, -1)``) and a few properties (``x.T``)."""
        if name.startswith("_"):
            raise AttributeError(f"'DTensor' object has no attribute {name!r}")
        return _attribute(self, name)

    __hash__ = object.__hash__  # __eq__ is elementwise, as on torch.Tensor; hash by identity


def _identity(x):
    return x


def _autograd():
    from .autograd import api
    return api


@lru_cache(maxsize=1024)
def _union_ranks(a: DeviceMesh, b: DeviceMesh) -> RankTuple:
    """The ranks of both meshes, sorted (one cached object per pair: batches intern it)."""
    return a.ranks if a == b else RankTuple(sorted(set(a.ranks) | set(b.ranks)))


def _dispatch(func, types, args, kwargs=None):
    """Late-bound ``dtorch.ops.dispatch.dispatch`` (rebinds itself on first use)."""
    global _dispatch
    from .ops.dispatch import dispatch
    _dispatch = dispatch
    return dispatch(func, types, args, kwargs)


def _attribute(x, name):
    global _attribute
    from .ops.methods import attribute
    _attribute = attribute
    return attribute(x, name)


tensor_operators.install(DTensor, sys.modules[__name__])


def _distinct_blocks(spec: TensorSpec) -> dict[int, layout.RankBlock]:
    """One rank per distinct block: coordinate 0 along every non-Shard mesh dim."""
    out = {}
    for rank in spec.mesh.ranks:
        coord = spec.mesh.get_coordinate(rank)
        if all(c == 0 for p, c in zip(spec.placements, coord) if not isinstance(p, Shard)):
            out[rank] = layout.rank_block(spec.shape, spec.mesh, spec.placements, coord)
    return out


def _received(wire, rank: int, shape, dtype) -> torch.Tensor:
    """A rank's answer as a tensor, checked against the metadata (never trusted blindly)."""
    try:
        value = unpack(wire)
    except WireFormatError as exc:
        raise WireFormatError(f"rank {rank} sent a malformed value: {exc}") from None
    if tuple(value.shape) != tuple(shape) or value.dtype != dtype:
        raise WireFormatError(f"rank {rank} sent a {value.dtype} tensor of shape "
                              f"{tuple(value.shape)}; this tensor's metadata says {dtype} "
                              f"{tuple(shape)} there. The op that made it computed something "
                              f"else on that rank than the controller planned; please report it")
    return value


def _remote(controller, failure):
    return controller.error_for(failure, "reading this tensor")


Tensor = DTensor
