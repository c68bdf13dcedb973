"""Convolution, pooling, resampling and padding on batch- (and channel-) sharded inputs.

Each family is a labeler on :mod:`dtorch.ops.batch_local`: no data moves, a Shard on a free
dim stays a Shard, a Shard on a dim the op mixes raises ``PlacementError`` with the fix.

- ``conv{1,2,3}d`` / ``conv_transpose{1,2,3}d``: the batch dim is free; with ``groups=1`` the
  out channels too (a weight sharded on them gives an output ``Shard(1)``, the bias is narrowed);
- pooling (max, avg, adaptive, lp, max_unpool), ``interpolate``, ``_upsample_bilinear2d_aa``:
  batch and channel dims free, the spatial ones mixed;
- ``pixel_shuffle`` / ``pixel_unshuffle`` (the last 3 dims mixed), ``channel_shuffle``
  (channels mixed), ``F.unfold`` / ``F.fold`` (batch), ``constant_pad_nd`` (unpadded dims),
  ``Tensor.unfold`` (every dim but ``dimension``).

Example::

    x = dtorch.distribute_tensor(torch.randn(5, 3, 8, 8), mesh, [Shard(0)])
    F.conv2d(x, w).placements           # (Shard(0),): each rank convolves its samples

    >>> conv_labels(4, 2, transposed=False, groups=1)[1]
    [('n', 'co', None, None)]
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .batch_local import attr, get, register
from .local_dims import free_labels

CONV_LEGAL = ("input S(0) (batch), weight R -> S(0); weight S(0) (out channels, groups=1), "
              "input R -> S(1); bias like the out channels; no Partial")
POOL_LEGAL = "input S(d) on a batch or channel dim -> S(d); spatial dims R; no Partial"
LEGAL = "input S(d) on a dim the op keeps apart -> S(d); the dims it mixes R; no Partial"

CONV_NAMES = ("input", "weight", "bias", "stride", "padding", "dilation", "groups")
CONV_T_NAMES = ("input", "weight", "bias", "stride", "padding", "output_padding", "groups",
                "dilation")
POOL_NAMES = ("input", "kernel_size", "stride", "padding", "dilation", "ceil_mode",
              "return_indices")
AVG_NAMES = ("input", "kernel_size", "stride", "padding", "ceil_mode", "count_include_pad",
             "divisor_override")


def conv_labels(ndim: int, k: int, transposed: bool, groups) -> tuple:
    """``({parameter: labels}, [output labels])`` of a k-d convolution on an ``ndim`` input."""
    co = "co" if groups == 1 else None
    batched = ndim == k + 2
    weight = ((None, co) if transposed else (co, None)) + (None,) * k
    x = (("n",) if batched else ()) + (None,) * (k + 1)
    out = (("n",) if batched else ()) + (co,) + (None,) * k
    return {"input": x, "weight": weight, "bias": (co,)}, [out]


def _conv(k: int, transposed: bool):
    def labeler(op):
        return conv_labels(get(op, "input").ndim, k, transposed, get(op, "groups", 1))
    return labeler


def _spatial(k):
    """Labels of an op whose last ``k`` dims are mixed (``k`` None: all but batch, channel)."""
    def labeler(op):
        x = get(op, "input")
        n = x.ndim - 2 if k is None else k
        labels = free_labels(x.ndim, mixed=range(x.ndim - n, x.ndim))
        tensors = {"input": labels, "indices": labels}
        return tensors, [labels] * len(op.out.shapes)
    return labeler


def _channel_shuffle(op):
    labels = free_labels(get(op, "input").ndim, mixed=(1,))
    return {"input": labels}, [labels]


def _batch_only(batched_ndim: int, out_ndim: int):
    """``F.unfold`` / ``F.fold``: the batch dim free when the input has ``batched_ndim`` dims."""
    def labeler(op):
        x = get(op, "input")
        batched = x.ndim == batched_ndim
        lead = ("n",) if batched else ()
        return ({"input": lead + (None,) * (x.ndim - len(lead))},
                [lead + (None,) * (out_ndim - (0 if batched else 1) - len(lead))])
    return labeler


def _constant_pad(op):
    x, pad = get(op, "input"), get(op, "pad")
    padded = {x.ndim - 1 - i // 2 for i, v in enumerate(pad) if v}
    labels = free_labels(x.ndim, mixed=padded)
    return {"input": labels}, [labels]


def _tensor_unfold(op):
    x = get(op, "input")
    labels = free_labels(x.ndim, mixed=(get(op, "dimension"),)) if x.ndim else ()
    return {"input": labels}, [labels + (None,)]


for _k, _suffix in ((1, "1d"), (2, "2d"), (3, "3d")):
    register(attr(torch, f"conv{_suffix}"), _conv(_k, False), CONV_LEGAL, "conv", CONV_NAMES)
    register(attr(torch, f"conv_transpose{_suffix}"), _conv(_k, True), CONV_LEGAL, "conv",
             CONV_T_NAMES)
    register(attr(F, f"max_pool{_suffix}", f"max_pool{_suffix}_with_indices"), _spatial(_k),
             POOL_LEGAL, "pool", POOL_NAMES)
    register(attr(F, f"avg_pool{_suffix}"), _spatial(_k), POOL_LEGAL, "pool", AVG_NAMES)
    register(attr(F, f"adaptive_avg_pool{_suffix}", f"adaptive_max_pool{_suffix}",
                  f"adaptive_max_pool{_suffix}_with_indices"), _spatial(_k), POOL_LEGAL, "pool",
             ("input", "output_size", "return_indices"))
    register(attr(F, f"lp_pool{_suffix}", f"max_unpool{_suffix}"), _spatial(_k), POOL_LEGAL,
             "pool")
register([F.interpolate], _spatial(None), POOL_LEGAL, "resample")
register([torch.ops.aten._upsample_bilinear2d_aa], _spatial(2), POOL_LEGAL, "resample",
         ("input", "output_size", "align_corners", "scale_factors"))
register(attr(torch, "pixel_shuffle", "pixel_unshuffle"), _spatial(3), LEGAL, "resample",
         ("input", "upscale_factor"))
register(attr(torch, "channel_shuffle", "native_channel_shuffle"), _channel_shuffle, LEGAL,
         "resample", ("input", "groups"))
register([F.unfold], _batch_only(4, 3), LEGAL, "resample")
register([F.fold], _batch_only(3, 4), LEGAL, "resample")
register([torch.constant_pad_nd], _constant_pad, LEGAL, "shape", ("input", "pad", "value"))
register([torch.Tensor.unfold], _tensor_unfold, LEGAL, "shape",
         ("input", "dimension", "size", "step"))

__all__ = ["conv_labels"]
