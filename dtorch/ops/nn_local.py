"""Norms, distances, ``embedding_bag``, ``bilinear``, ``prelu``, ``glu``, ``grid_sample`` on
batch-sharded inputs: labelers on :mod:`dtorch.ops.batch_local` (no data moves).

- ``group_norm`` / ``native_group_norm``: the batch dim; ``instance_norm`` batch and channels
  (without running stats to update: their update averages over the batch);
  ``local_response_norm`` every dim but the channels;
- ``embedding_bag``: bags of a 2-D input on dim 0 (``per_sample_weights`` alike, the weight
  Replicate); the offsets form refuses when sharded (its bags are not the ranks' blocks);
- ``cosine_similarity`` / ``pairwise_distance``: every dim but the one reduced; ``cdist``: the
  batch dims and the rows of either input; ``bilinear``: the batch dims and the out features;
- ``prelu`` every dim (the weight per channel is narrowed), ``glu`` every dim but ``dim``;
- ``grid_sample`` / ``grid_sampler_{2,3}d``: the batch (input and grid alike), the channels,
  the grid's output positions.

Example::

    >>> cdist_labels(3, 3)[1]
    [('b0', 'p', 'r')]
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..placement import Replicate
from .batch_local import aligned, attr, get, register
from .explain import with_dim
from .local_dims import free_labels
from .registry import TArg

R = Replicate()

LEGAL = "S(d) on a dim the op keeps apart (alike on every operand that has it) -> S(d); R; " \
        "no Partial"
NORM_LEGAL = "input S(0) (batch; instance_norm: channels too) -> the same; weight/bias R"


# norms ------------------------------------------------------------------------------------------
def _group_norm(op):
    labels = ("n",) + (None,) * (get(op, "input").ndim - 1)
    return {"input": labels, "weight": (None,), "bias": (None,)}, [labels]


def _native_group_norm(op):
    labels = ("n",) + (None,) * (get(op, "input").ndim - 1)
    return ({"input": labels, "weight": (None,), "bias": (None,)},
            [labels, ("n", None), ("n", None)])


def native_group_norm_local(input, weight, bias, N, C, HxW, group, eps):
    """Rank-side: ``torch.native_group_norm`` with ``N`` this rank's batch."""
    return torch.native_group_norm(input, weight, bias, input.shape[0], C, HxW, group, eps)


def _instance_norm(op):
    x = get(op, "input")
    stats = type(get(op, "running_mean")) is TArg or type(get(op, "running_var")) is TArg
    if stats and get(op, "use_input_stats", True) and any(p.is_shard() for p in x.placements):
        m = next(i for i, p in enumerate(x.placements) if p.is_shard())
        op.fail(m, NORM_LEGAL, {x: with_dim(x.placements, m, R)},
                "instance_norm updates running_mean/running_var with an average over the "
                "whole batch; shard the batch without running stats (track_running_stats="
                "False) or in eval mode (use_input_stats=False)")
    labels = ("n", "c") + (None,) * (x.ndim - 2)
    c = ("c",)
    return ({"input": labels, "running_mean": c, "running_var": c, "weight": c, "bias": c},
            [labels])


def _mixed(dims):
    def labeler(op):
        labels = free_labels(get(op, "input").ndim, mixed=dims(op))
        return {"input": labels}, [labels]
    return labeler


# embedding_bag ----------------------------------------------------------------------------------
BAG_LEGAL = "2-D input S(0) (bags), per_sample_weights S(0), weight R -> S(0); R -> R"


def _embedding_bag(op):
    x, w = get(op, "input"), get(op, "weight")
    sharded = [t for t in op.tensors if any(not p.is_replicate() for p in t.placements)]
    if sharded and x.ndim != 2:
        m = next(i for i, p in enumerate(sharded[0].placements) if not p.is_replicate())
        op.fail(m, BAG_LEGAL, {t: (R,) * len(t.placements) for t in sharded},
                "the offsets form (a 1-D input cut into bags by offsets) does not split into "
                "bags per rank; pass a 2-D input (bags of one length, padding_idx for the "
                "short ones) sharded on dim 0")
    if sharded and get(op, "max_norm") is not None:
        op.fail(None, BAG_LEGAL, {}, "max_norm renormalizes the weight rows each rank's bags "
                "touch in place, so the ranks' weights would drift apart; renormalize first "
                "and pass max_norm=None")
    bags = ("b", None) if x.ndim == 2 else (None,)
    return ({"input": bags, "per_sample_weights": bags, "weight": (None,) * w.ndim,
             "offsets": (None,)}, [("b", None) if x.ndim == 2 else (None, None)])


# distances, bilinear ----------------------------------------------------------------------------
def _cosine_similarity(op):
    x1, x2 = get(op, "x1"), get(op, "x2")
    width = max(x1.ndim, x2.ndim)
    dim = get(op, "dim", 1) % max(width, 1)
    out = tuple(f"b{p}" for p in range(width) if p != dim)
    return ({"x1": aligned(x1.ndim, width, (dim,)), "x2": aligned(x2.ndim, width, (dim,))},
            [out])


def _pairwise_distance(op):
    x1, x2 = get(op, "x1"), get(op, "x2")
    width = max(x1.ndim, x2.ndim)
    out = tuple(f"b{p}" for p in range(width - 1))
    if get(op, "keepdim", False):
        out += (None,)
    return ({"x1": aligned(x1.ndim, width, (-1,)), "x2": aligned(x2.ndim, width, (-1,))},
            [out])


def cdist_labels(n1: int, n2: int) -> tuple:
    """``({"x1": .., "x2": ..}, [output])``: batch dims broadcast, rows ``p`` / ``r``."""
    b = max(n1, n2) - 2
    batch = tuple(f"b{p}" for p in range(b))
    return ({"x1": batch[b - (n1 - 2):] + ("p", None), "x2": batch[b - (n2 - 2):] + ("r", None)},
            [batch + ("p", "r")])


def _cdist(op):
    return cdist_labels(get(op, "x1").ndim, get(op, "x2").ndim)


def cdist_mode(op):
    """The local ``cdist``: the default compute mode chooses mm by the global row counts (the
    local ones would pick differently per rank), so the ranks get torch's choice spelled out."""
    mode = get(op, "compute_mode", "use_mm_for_euclid_dist_if_necessary")
    if mode != "use_mm_for_euclid_dist_if_necessary" or get(op, "p", 2.0) != 2.0:
        return None
    x1, x2 = get(op, "x1"), get(op, "x2")
    big = x1.shape[-2] > 25 or x2.shape[-2] > 25
    return _with_mode("use_mm_for_euclid_dist" if big else "donot_use_mm_for_euclid_dist")


class _with_mode:
    """Rank-side ``torch.cdist`` with ``compute_mode`` fixed (picklable)."""

    def __init__(self, mode):
        self.mode = mode

    def __call__(self, x1, x2, p=2.0, compute_mode=None):
        return torch.cdist(x1, x2, p, compute_mode=self.mode)


def _bilinear(op):
    x1 = get(op, "input1")
    lead = tuple(f"d{i}" for i in range(x1.ndim - 1))
    return ({"input1": lead + (None,), "input2": lead + (None,), "weight": ("o", None, None),
             "bias": ("o",)}, [lead + ("o",)])


def _prelu(op):
    x, w = get(op, "input"), get(op, "weight")
    labels = free_labels(x.ndim)
    c = 1 if x.ndim >= 2 else 0
    per_channel = type(w) is TArg and w.ndim == 1 and x.ndim and w.shape[0] == x.shape[c] > 1
    wl = (labels[c],) if per_channel else (None,) * (w.ndim if type(w) is TArg else 0)
    return {"input": labels, "weight": wl}, [labels]


def _grid(op):
    x = get(op, "input")
    k = x.ndim - 2
    spatial = tuple(f"s{i}" for i in range(k))
    return ({"input": ("n", "c") + (None,) * k, "grid": ("n",) + spatial + (None,)},
            [("n", "c") + spatial])


register([F.group_norm], _group_norm, NORM_LEGAL, "norm")
register([torch.native_group_norm], _native_group_norm, NORM_LEGAL, "norm",
         ("input", "weight", "bias", "N", "C", "HxW", "group", "eps"),
         fn=lambda op: native_group_norm_local)
register([F.instance_norm], _instance_norm, NORM_LEGAL, "norm")
register([F.local_response_norm], _mixed(lambda op: (1,)), NORM_LEGAL, "norm")
register([F.embedding_bag], _embedding_bag, BAG_LEGAL, "embedding")
register([torch.cosine_similarity], _cosine_similarity, LEGAL, "distance",
         ("x1", "x2", "dim", "eps"))
register([torch.pairwise_distance], _pairwise_distance, LEGAL, "distance",
         ("x1", "x2", "p", "eps", "keepdim"))
register([torch.cdist], _cdist, LEGAL, "distance", fn=cdist_mode)
register([torch.bilinear], _bilinear, LEGAL, "matmul", ("input1", "input2", "weight", "bias"))
register([torch.prelu], _prelu, LEGAL, "elementwise", ("input", "weight"))
register([F.glu], _mixed(lambda op: (get(op, "dim", -1),)), LEGAL, "elementwise")
register([F.grid_sample], _grid, LEGAL, "resample")
register(attr(torch, "grid_sampler_2d", "grid_sampler_3d", "grid_sampler"), _grid, LEGAL,
         "resample", ("input", "grid", "interpolation_mode", "padding_mode", "align_corners"))

__all__ = ["cdist_labels", "native_group_norm_local"]
