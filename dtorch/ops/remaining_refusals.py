"""Ops that need communication on sharded inputs: re-expressed as DTensor ops whose
collectives are planned, or refused with the redistribute that makes them legal.

- ``dist(x, y, p)`` is ``linalg.vector_norm(x - y, p)`` (the norm over sharded dims is a
  ``Partial`` of powers, then the root: :mod:`dtorch.ops.sharded_moments`);
- ``equal(x, y)`` counts the elements where ``x != y`` (a ``Partial("sum")``, reduced when
  read; False when the shapes differ), a Python bool as torch's;
- ``F.linear_cross_entropy`` is ``cross_entropy(linear(x, w, b), target)``, torch's reference
  implementation: a batch-sharded input runs as the losses of :mod:`dtorch.ops.losses`;
- ``cov``, ``corrcoef``, ``pdist``, ``histogramdd`` and training batch norm
  (``_batch_norm_with_update``) pair every row with every other or need the whole batch's
  statistics; ``as_strided_scatter``, ``resize_`` and ``resize_as_`` address the whole
  storage: a ``PlacementError`` names the Replicate fix and the all_gather it costs; the
  ``to_sparse*`` conversions refuse as on Replicate inputs (DTensors are dense). With
  every input Replicate they run as any op does.

Each is taken only when some DTensor input is not Replicate. Example::

    >>> import torch
    >>> equal_shapes(torch.empty(2, 3), torch.empty(3))
    False
"""

from __future__ import annotations

import inspect
import math

import torch
import torch.nn.functional as F

from ..placement import Replicate, Shard
from ..tensor import DTensor
from .explain import with_dim
from .registry import decomposed, rule

R = Replicate()


def _sharded(*values) -> bool:
    """Whether some DTensor among ``values`` is not Replicate."""
    return any(isinstance(v, DTensor) and any(not p.is_replicate() for p in v.placements)
               for v in values)


def _arg(args, kwargs, pos, name, default=None):
    return kwargs[name] if name in kwargs else args[pos] if pos < len(args) else default


# re-expressed ------------------------------------------------------------------------------------
@decomposed(torch.dist, torch.Tensor.dist)
def dist_as_norm(func, args, kwargs):
    x, y = _arg(args, kwargs, 0, "input"), _arg(args, kwargs, 1, "other")
    if not _sharded(x, y):
        return NotImplemented
    p = _arg(args, kwargs, 2, "p", 2)
    return torch.linalg.vector_norm(x - y, float(p))


def equal_shapes(x, y) -> bool:
    return tuple(x.shape) == tuple(y.shape)


@decomposed(torch.equal, torch.Tensor.equal)
def equal_as_all(func, args, kwargs):
    x, y = _arg(args, kwargs, 0, "input"), _arg(args, kwargs, 1, "other")
    if not _sharded(x, y):
        return NotImplemented
    if not equal_shapes(x, y):
        return False
    return int((x != y).sum()) == 0  # a count of the differences: a Partial("sum")


_LCE = inspect.signature(F.linear_cross_entropy)


@decomposed(F.linear_cross_entropy)
def linear_cross_entropy_as_losses(func, args, kwargs):
    """torch's reference implementation (what the chunked ``options`` path computes too)."""
    bound = _LCE.bind(*args, **kwargs)
    bound.apply_defaults()
    a = bound.arguments
    x, w, target, bias = a["input"], a["linear_weight"], a["target"], a["linear_bias"]
    if not _sharded(x, w, target, bias, a["weight"]):
        return NotImplemented
    _refuse_sharded_features(x, w)
    out_features = tuple(w.shape[1:-1])
    num_classes, in_features = w.shape[0], w.shape[-1]
    if out_features:
        w = w.reshape(math.prod(out_features, start=num_classes), in_features)
        if bias is not None:
            bias = bias.reshape(math.prod(out_features, start=num_classes))
    logits = F.linear(x, w, bias)
    if out_features:
        logits = logits.reshape(*x.shape[:-1], num_classes, *out_features)
    ignore = a["ignore_index"] if a["ignore_index"] is not None else -100
    return F.cross_entropy(logits, batch_aligned(target, logits, x.ndim == 2),
                           weight=a["weight"], reduction=a["reduction"],
                           ignore_index=ignore, label_smoothing=a["label_smoothing"])


LCE_LEGAL = "input S(0) (the batch) or R, linear_weight R (or S(0): loss parallel on classes)"


def _refuse_sharded_features(x, w) -> None:
    """The in_features dim sharded would make the logits a Partial that the softmax must
    reduce: refuse on the controller, naming the input's fix (before anything is sent)."""
    from types import SimpleNamespace
    from .explain import placement_error
    from .registry import TArg
    for m, p in enumerate(x.placements):
        if p.is_shard() and p.dim == x.ndim - 1:
            tx = TArg(0, "input", x._spec)
            tensors = [tx] + ([TArg(1, "linear_weight", w._spec)] if isinstance(w, DTensor)
                              else [])
            op = SimpleNamespace(name="F.linear_cross_entropy", tensors=tensors,
                                 mesh=x.device_mesh)
            fix = [with_dim(x.placements, m, R)]
            if x.ndim == 2:
                fix.insert(0, with_dim(x.placements, m, Shard(0)))
            raise placement_error(op, m, LCE_LEGAL, {tx: fix},
                                  "the in_features dim of input is sharded: the logits would "
                                  "be partial sums, and the softmax needs them whole")


def batch_aligned(target, logits, batched: bool):
    """``target`` Replicate where the logits' batch dim 0 is sharded: cut to the same blocks
    (a local slice, no data moves), as the loss rule needs."""
    if not (batched and isinstance(target, DTensor) and isinstance(logits, DTensor)):
        return target
    want = [lp if lp.is_shard() and lp.dim == 0 and tp.is_replicate() else tp
            for lp, tp in zip(logits.placements, target.placements)]
    return target if tuple(want) == tuple(target.placements) else \
        target.redistribute(placements=want)


# refused -----------------------------------------------------------------------------------------
def any_meta(*args, **kwargs):
    """Shape inference for a rule that always refuses: nothing to infer (torch's own meta
    kernel cannot run ``cov`` with weights, nor ``histogramdd``'s list of edges)."""
    return torch.empty(0, device="meta")


def refusal(legal: str, why: str):
    """A rule that names the Replicate fix for the first input that is not Replicate (every
    input Replicate: the PlacementError makes dispatch run the op as any other)."""
    def rule_fn(op):
        for t in op.tensors:
            for m, p in enumerate(t.placements):
                if not p.is_replicate():
                    op.fail(m, legal, {t: with_dim(t.placements, m, R)},
                            why if not p.is_partial() else
                            f"{op.name} is not linear: a Partial input must be reduced first")
        op.fail(None, legal, {}, why)
    return rule_fn


_REFUSED = (
    (("cov", "corrcoef"), ("input", "correction", "fweights", "aweights"),
     "every input R",
     "each entry pairs two variables over every observation, so it needs every rank's rows "
     "and columns"),
    (("pdist",), ("input", "p"), "every input R",
     "it pairs every row with every other row"),
    (("histogramdd",), ("input", "bins", "range", "weight", "density"), "every input R",
     "each point needs all its coordinates, and the bins without a range span the data"),
    (("as_strided_scatter",), ("input", "src", "size", "stride", "storage_offset"),
     "every input R", "the strides address the whole tensor's storage, not a rank's block"),
    (("resize_", "resize_as_"), ("input", "size"), "every input R",
     "resizing reinterprets the whole tensor's storage in a new shape"),
)
for _names, _params, _legal, _why in _REFUSED:
    rule(*_names, family="refused (needs communication)", arg_names=_params, meta=any_meta)(
        refusal(_legal, _why))

_BN_UPDATE = getattr(torch.ops.aten, "_batch_norm_with_update", None)
if _BN_UPDATE is not None:
    rule(_BN_UPDATE, _BN_UPDATE.default, family="norm", meta=any_meta,
         arg_names=("input", "weight", "bias", "running_mean", "running_var", "momentum",
                    "eps"))(
        refusal("every input R (training batch statistics)",
                "training batch norm's mean and variance per channel need every row of the "
                "batch (an all_reduce of the statistics), and it updates running_mean/"
                "running_var in place; run F.batch_norm on Replicate inputs"))

__all__ = ["dist_as_norm", "equal_as_all", "linear_cross_entropy_as_losses", "refusal",
           "equal_shapes", "any_meta"]


SPARSE_CONVERSIONS = tuple(getattr(torch.Tensor, n) for n in (
    "to_sparse", "to_sparse_csr", "to_sparse_csc", "to_sparse_bsr", "to_sparse_bsc")
    if hasattr(torch.Tensor, n))


@decomposed(*SPARSE_CONVERSIONS)
def sparse_conversion(func, args, kwargs):
    """``x.to_sparse()`` on a sharded DTensor: the same layout refusal as on a Replicate one."""
    if not _sharded(*args, *kwargs.values()):
        return NotImplemented
    from .generic import refuse_layout
    refuse_layout(func, "sparse")
