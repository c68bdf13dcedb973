"""Dropout in training on DTensors: a mask from the counter-based stream, then a multiply.

``F.dropout(x, p, training=True)`` (and ``torch.dropout``, ``F.dropout1d/2d/3d``,
``torch.feature_dropout``, their in-place forms, ``nn.Dropout``) runs as two DTensor ops:
a factory that makes torch's dropout noise (``1 / (1 - p)`` where kept, 0 where dropped),
each rank hashing only its own block's global indices (:mod:`dtorch.random`), and
``x * noise``. The noise is sharded like ``x`` and Replicate where ``x`` is Partial (dropout
is linear, so ``Partial`` stays ``Partial``: ``sum(noise * share) == noise * sum(share)``);
nothing is communicated, and the gradient is the multiply's, ``noise * grad``, from the
ranks' local graphs. Alpha dropout (``F.alpha_dropout``, ``F.feature_alpha_dropout``) is
torch's ``x * noise + shift`` from a 0/1 mask, in DTensor ops.
``F.scaled_dot_product_attention(..., dropout_p=p)`` draws a bool mask over the attention
weights ``(*batch, L, S)`` the same way and runs torch's math attention with it. Each mask takes the next counter of the stream: the same program after the same
``dtorch.manual_seed`` gives the same masks, equal to :func:`dtorch.random.dropout` on one
device. Example::

    dtorch.manual_seed(0)
    y = F.dropout(x, 0.1)          # == dtorch.random.dropout(x.to_torch(), 0.1, seed=0, counter=0)
"""

from __future__ import annotations

import functools
import inspect
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F

from .. import random as stream
from ..errors import PlacementError, UnsupportedOpError
from ..placement import Replicate, Shard
from ..tensor import DTensor
from . import cp_attention
from .registry import TArg, decomposed


def _torch_dropout(input, p, train):
    """``torch.dropout``'s signature (a builtin: inspect cannot read it)."""


def _sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None,
          enable_gqa=False):
    """``F.scaled_dot_product_attention``'s signature (a builtin)."""


class Dropout(NamedTuple):
    """One dropout callable: its mask's kind (:func:`dtorch.random.feature_shape`), its
    signature, the name of its training flag, and whether it works in place (None: its
    ``inplace`` argument says)."""

    kind: str
    signature: Callable
    training: str
    inplace: bool | None


DROPOUTS = {
    F.dropout: Dropout("dropout", F.dropout, "training", None),
    F.dropout1d: Dropout("dropout1d", F.dropout1d, "training", None),
    F.dropout2d: Dropout("dropout2d", F.dropout2d, "training", None),
    F.dropout3d: Dropout("dropout3d", F.dropout3d, "training", None),
    torch.dropout: Dropout("dropout", _torch_dropout, "train", False),
    torch.dropout_: Dropout("dropout", _torch_dropout, "train", True),
    torch.feature_dropout: Dropout("dropout2d", _torch_dropout, "train", False),
    torch.feature_dropout_: Dropout("dropout2d", _torch_dropout, "train", True),
    F.alpha_dropout: Dropout("alpha_dropout", F.alpha_dropout, "training", None),
    F.feature_alpha_dropout: Dropout("feature_alpha_dropout", F.feature_alpha_dropout,
                                     "training", None),
    torch.alpha_dropout: Dropout("alpha_dropout", _torch_dropout, "train", False),
    torch.alpha_dropout_: Dropout("alpha_dropout", _torch_dropout, "train", True),
    torch.feature_alpha_dropout: Dropout("feature_alpha_dropout", _torch_dropout, "train",
                                         False),
    torch.feature_alpha_dropout_: Dropout("feature_alpha_dropout", _torch_dropout, "train",
                                          True),
}


def bind(signature, args, kwargs) -> dict:
    """The call's arguments by name, defaults filled in (a TypeError for a bad call, as
    torch's)."""
    bound = _signature(signature).bind(*args, **kwargs)
    bound.apply_defaults()
    return dict(bound.arguments)


_signature = functools.lru_cache(maxsize=None)(inspect.signature)


def draws_mask(func, args, kwargs) -> bool:
    """Whether this dropout call is in training with ``p > 0``.

    >>> draws_mask(F.dropout, (None, 0.5), {}), draws_mask(F.alpha_dropout, (None, 0.5), {})
    (True, False)
    """
    bound = bind(DROPOUTS[func].signature, args, kwargs)
    return bool(bound[DROPOUTS[func].training]) and bound["p"] != 0


@decomposed(*DROPOUTS)
def dropout_on_dtensors(func, args, kwargs):
    """``x * noise`` for a dropout in training with ``p > 0``; ``x`` itself in eval mode or
    with ``p == 0`` (as torch returns its input), after torch's own checks."""
    spec = DROPOUTS[func]
    bound = bind(spec.signature, args, kwargs)
    x, p, training = bound["input"], bound["p"], bool(bound[spec.training])
    if not isinstance(x, DTensor):
        return NotImplemented
    _check_with_torch(func, tuple(x.shape), x.dtype, float(p), training)
    if not training or p == 0:
        return x
    alpha = "alpha" in spec.kind and p != 1  # p == 1: zeros, as torch gives
    _refuse_partial(func, x, ("avg",) if alpha else ("sum", "avg"))
    inplace = spec.inplace if spec.inplace is not None else bound["inplace"]
    shape = stream.feature_shape(spec.kind, x.shape)
    placements = mask_placements(shape, x)
    if not alpha:
        noise = _mask(shape, x.dtype, x.device_mesh, placements, float(p), noise=True)
        return x.mul_(noise) if inplace else torch.mul(x, noise)
    keep = _mask(shape, x.dtype, x.device_mesh, placements, float(p), noise=False)
    noise, shift = stream.alpha_dropout_terms(keep, float(p))
    return x.mul_(noise).add_(shift) if inplace else torch.add(torch.mul(x, noise), shift)


@functools.lru_cache(maxsize=1024)
def _check_with_torch(func, shape, dtype, p, training) -> None:
    """torch's own checks (``p`` in [0, 1], the input's dims and dtype), on ``meta``,
    before anything is sent."""
    func(torch.empty(shape, dtype=dtype, device="meta"), p, training)


def _refuse_partial(func, x, commutes) -> None:
    """A Partial input whose reduction the dropout does not commute with raises (a dropout
    is linear: sum and mean; alpha dropout adds a shift: mean only)."""
    for m, pl in enumerate(x.placements):
        if pl.is_partial() and pl.reduce_op not in commutes:
            fix = [Replicate() if i == m else q for i, q in enumerate(x.placements)]
            raise PlacementError(
                f"{_name(func)} in training on a {pl} input: it commutes with a pending "
                f"{' or '.join(commutes)}, not with {pl.reduce_op}. Reduce it first: "
                f"x.redistribute(placements={fix})")


def _name(func) -> str:
    from .registry import display_name
    return display_name(func)


def mask_placements(mask_shape, x) -> tuple:
    """The mask's placements: ``x``'s Shard where the mask has that dim whole, Replicate
    elsewhere (Replicate, Partial, a dim the mask broadcasts over)."""
    return tuple(pl if isinstance(pl, Shard) and mask_shape[pl.dim] == x.shape[pl.dim]
                 else Replicate() for pl in x.placements)


def _mask(shape, dtype, mesh, placements, p: float, noise: bool) -> DTensor:
    """The stream's next mask, made on the ranks (dtorch.runtime.random_masks): torch's
    dropout noise (``noise``), else the keep mask itself in ``dtype`` (bool or 0/1)."""
    from ..factories import _create
    seed, counter = stream.take()
    return _create("dropout_mask", tuple(shape), dtype, mesh, placements,
                   args=(p, seed, counter, noise))


# attention ---------------------------------------------------------------------------------
@decomposed(F.scaled_dot_product_attention)
def attention_with_dropout(func, args, kwargs):
    """Attention with ``dropout_p > 0`` on DTensors: the mask over the attention weights from
    the stream, then :func:`dtorch.random.attention_with_mask` on the ranks."""
    bound = bind(_sdpa, args, kwargs)
    p = bound.pop("dropout_p")
    q, k, v = bound.pop("query"), bound.pop("key"), bound.pop("value")
    if not p:
        return NotImplemented
    if not all(isinstance(t, DTensor) for t in (q, k, v)):  # a plain tensor among them
        raise UnsupportedOpError(
            "F.scaled_dot_product_attention with dropout_p > 0 on DTensors needs query, key "
            "and value all DTensors (the mask is drawn over their attention weights); make "
            "them DTensors with dtorch.tensor(t, device_mesh=..., placements=...)")
    if not 0 <= p <= 1:
        raise ValueError(f"dropout_p has to be between 0 and 1, but got {p}")
    _refuse_context_parallel(q, k, v)
    from .dispatch import dispatch, plan_of
    out = plan_of(func, (q, k, v), bound).out_specs[0]  # every check of the plain attention
    shape = stream.attention_weights_shape(out.shape, k.shape)
    placements = tuple(Replicate() if pl.is_partial() else pl for pl in out.placements)
    keep = _mask(shape, torch.bool, q.device_mesh, placements, float(p), noise=False)
    return dispatch(stream.attention_with_mask, None, (q, k, v),
                    dict(bound, dropout_p=float(p), dropout_mask=keep))


def _refuse_context_parallel(q, k, v) -> None:
    specs = [TArg(i, name, t._spec) for i, (name, t) in enumerate(zip("qkv", (q, k, v)))]
    cp = cp_attention.active(*specs)
    if cp:
        raise UnsupportedOpError(
            f"F.scaled_dot_product_attention with dropout_p > 0 under context parallelism "
            f"({', '.join(cp)}) is not supported yet (the composite has no dropout step). "
            f"Pass dropout_p=0.0, or redistribute the sequence dim of query, key and value "
            f"to Replicate")
