"""Python and NumPy protocol of DTensor: ``np.asarray``, iteration, ``len``, scalar conversions.

:class:`TensorProtocol` is a mixin :class:`dtorch.DTensor` inherits. Each method answers as
``torch.Tensor`` does, the value gathered on the controller where one is needed:

- ``np.asarray(x)`` gathers (``x.to_torch()``) and converts (NumPy 2's ``__array__``);
- ``for row in x`` / ``list(x)`` / ``a, b = x`` yield ``x[i]`` along dim 0 (DTensors, placements as
  ``x[i]`` gives); along a dim 0 that is sharded it raises a PlacementError naming the fix
  before anything is sent;
- ``len``, ``bool``, ``float``, ``int``, ``complex``, ``__index__``, ``format``: as torch, with
  torch's error for a tensor that is not a single element (raised before anything is sent).

Example (needs a running cluster)::

    >>> import numpy as np, torch, dtorch                                    # doctest: +SKIP
    >>> mesh = dtorch.init_device_mesh("cpu", 4)                            # doctest: +SKIP
    >>> t = torch.arange(6.).view(3, 2)                                      # doctest: +SKIP
    >>> x = dtorch.distribute_tensor(t, mesh, [dtorch.Shard(1)])            # doctest: +SKIP
    >>> np.asarray(x).sum(), len(x), [tuple(r.placements) for r in x][0]   # doctest: +SKIP
    (15.0, 3, (Shard(dim=0),))

The refusal's text, pure (no cluster)::

    >>> from dtorch import init_device_mesh, Shard, Replicate
    >>> m = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    >>> print(iteration_error(m, (Shard(0), Replicate()), 0))  # doctest: +ELLIPSIS
    iterating a DTensor walks dim 0, which is sharded on mesh dim 0 ('dp'): ...
      fix: x.redistribute(placements=[Replicate(), Replicate()]) first   # all_gather
       or: iterate over x.to_torch() (one torch tensor on the controller)
"""

from __future__ import annotations

import torch

from .errors import PlacementError
from .placement import Replicate, Shard


class TensorProtocol:
    """The dunder methods of the Python and NumPy protocols (see the module doc)."""

    __slots__ = ()
    __array_priority__ = 1000  # as torch.Tensor: ``ndarray + x`` calls x.__radd__, no gather

    # NumPy -----------------------------------------------------------------------------------
    def __array__(self, dtype=None, copy=None):
        """``np.asarray(x)``: the gathered global value (``x.to_torch()``) as an ndarray.

        ``copy=False`` raises ValueError, as NumPy 2 asks when a copy cannot be avoided: the
        values live on the ranks, so any array is a copy (writing to it leaves ``x`` as it is).
        """
        if copy is False:
            raise ValueError("np.asarray(dtensor, copy=False): a DTensor's values live on the "
                             "ranks, so the array is always a gathered copy; pass copy=None "
                             "(the default) or copy=True")
        if self.dtype == torch.bfloat16:  # NumPy has no bfloat16: torch's error, nothing sent
            torch.empty(0, dtype=self.dtype).numpy()
        array = self.to_torch().numpy()
        return array if dtype is None else array.astype(dtype, copy=False)

    # iteration -------------------------------------------------------------------------------
    def __iter__(self):
        """Rows along dim 0, each ``x[i]``; refused up front when dim 0 is sharded."""
        spec = self._spec
        if not spec.shape:
            raise TypeError("iteration over a 0-d tensor")
        for m, p in enumerate(spec.placements):
            if isinstance(p, Shard) and p.dim == 0:
                raise iteration_error(spec.mesh, spec.placements, m)
        return (self[i] for i in range(spec.shape[0]))

    def __len__(self) -> int:
        if not self._spec.shape:
            raise TypeError("len() of a 0-d tensor")
        return self._spec.shape[0]

    def __contains__(self, element) -> bool:
        """``v in x``: whether some element equals ``v``, as torch's ``(x == v).any()``;
        counted with a sum (a sharded ``any`` has no rule: a sum reduces as Partial)."""
        return bool((self == element).sum())

    # scalars ---------------------------------------------------------------------------------
    def __bool__(self) -> bool:
        return _scalar(self, "__bool__")

    def __float__(self) -> float:
        return _scalar(self, "__float__")

    def __int__(self) -> int:
        return _scalar(self, "__int__")

    def __complex__(self) -> complex:
        return _scalar(self, "__complex__")

    def __index__(self) -> int:
        """``range(n)``, ``seq[i]`` with a single-element integer (or bool) DTensor."""
        return _scalar(self, "__index__")

    def __format__(self, spec: str) -> str:
        """``f"{loss:.3f}"`` on a 0-d DTensor formats its value, as torch; else ``str``."""
        if self.ndim == 0 and spec:
            return format(self.item(), spec)
        return object.__format__(self, spec)


def _scalar(x, name: str):
    """``getattr(value, name)()`` on the gathered value; a tensor that is not one element (or,
    for ``__index__``, not an integer) raises torch's own error before anything is sent."""
    spec = x._spec
    if _numel(spec.shape) != 1 or (name == "__index__" and (spec.dtype.is_floating_point
                                                            or spec.dtype.is_complex)):
        getattr(torch.empty(spec.shape, dtype=spec.dtype, device="meta"), name)()  # raises
    return getattr(x.to_torch(), name)()


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def iteration_error(mesh, placements, mesh_dim: int) -> PlacementError:
    """The PlacementError for iterating along a dim 0 sharded on ``mesh_dim``."""
    names = mesh.mesh_dim_names
    where = f"mesh dim {mesh_dim}" + (f" ({names[mesh_dim]!r})" if names else "")
    target = [Replicate() if isinstance(p, Shard) and p.dim == 0 else p for p in placements]
    code = "[" + ", ".join(_code(p) for p in target) + "]"
    err = PlacementError(
        f"iterating a DTensor walks dim 0, which is sharded on {where}: each row lives on one "
        f"rank, and x[i] on a sharded dim is not a local op\n"
        f"  fix: x.redistribute(placements={code}) first   # all_gather\n"
        f"   or: iterate over x.to_torch() (one torch tensor on the controller)")
    err.op = "iter"
    return err


def _code(p) -> str:
    if isinstance(p, Shard):
        return f"Shard({p.dim})"
    if isinstance(p, Replicate):
        return "Replicate()"
    return f"Partial({p.reduce_op!r})"
