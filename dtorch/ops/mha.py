"""``F.multi_head_attention_forward`` (what ``torch.nn.MultiheadAttention`` calls) on DTensors
that are not all Replicate, re-expressed as DTensor ops as torch's own code computes it: the
input projections (``F.linear``), the heads split with ``view``/``permute`` into
``(N, H, L, head_dim)``, ``F.scaled_dot_product_attention`` (with ``need_weights``:
``softmax(q / sqrt(head_dim) @ k^T + mask) @ v``, so the weights can be returned), the heads
merged and the output projection. A batch sharded on the ``N`` dim of ``(L, N, E)`` (and
``key_padding_mask`` alike) stays sharded with no communication, and backward comes from those
ops; any other sharding, or a sharded weight or ``attn_mask``, is a PlacementError naming the
fix before anything is sent. Masks as torch reads them: a bool ``attn_mask`` /
``key_padding_mask`` is True where attention is NOT allowed. ``bias_k``/``bias_v``,
``add_zero_attn``, ``static_k``/``static_v`` raise (not supported on sharded inputs yet); dropout
in training draws random numbers (refused as every random op is). With every input Replicate
the call runs whole on each rank as before. Example::

    >>> _heads((5, 2, 8), 4)
    (5, 2, 4, 2)
"""

from __future__ import annotations

import inspect
import math

import torch
import torch.nn.functional as F

from ..errors import PlacementError, UnsupportedOpError
from ..placement import Replicate, Shard, format_placements
from .explain import fix_line
from .generic import all_replicate, random_error
from .registry import decomposed

_SIGNATURE = inspect.signature(F.multi_head_attention_forward)
UNSUPPORTED = ("bias_k", "bias_v", "static_k", "static_v")
R = Replicate()


def _heads(shape, num_heads: int) -> tuple:
    """``(L, N, E)`` split into ``(L, N, H, E // H)``."""
    length, batch, embed = shape
    return (length, batch, num_heads, embed // num_heads)


@decomposed(F.multi_head_attention_forward)
def multi_head_attention(func, args, kwargs):
    """See the module doc; ``NotImplemented`` (run whole) when every DTensor is Replicate."""
    from ..tensor import DTensor
    bound = _SIGNATURE.bind(*args, **kwargs)
    bound.apply_defaults()
    b = dict(bound.arguments)
    tensors = [v for v in b.values() if isinstance(v, DTensor)]
    if not tensors or all_replicate(tensors):
        return NotImplemented
    _refuse_unsupported(func, args, kwargs, b)
    batched = b["query"].ndim == 3
    query, key, value = (t if batched else t.unsqueeze(1) for t in (b["query"], b["key"],
                                                                    b["value"]))
    heads, embed = b["num_heads"], b["embed_dim_to_check"]
    if query.shape[-1] != embed or embed % heads:
        raise AssertionError(f"was expecting embedding dimension of {embed} divisible by "
                             f"num_heads={heads}, but got {query.shape[-1]}")
    q, k, v = _projections(b, query, key, value)
    q, k, v = (t.view(_heads(t.shape, heads)).permute(1, 2, 0, 3) for t in (q, k, v))
    out, weights = _attend(b, q, k, v, batched)
    length, batch = query.shape[0], query.shape[1]
    out = out.permute(2, 0, 1, 3).reshape(length, batch, embed)
    out = F.linear(out, b["out_proj_weight"], b["out_proj_bias"])
    if not batched:
        out = out.squeeze(1)
        weights = weights.squeeze(0) if weights is not None else None
    return out, weights


def _refuse_unsupported(func, args, kwargs, b) -> None:
    random = random_error(func, args, kwargs)
    if random is not None:
        raise random
    given = [name for name in UNSUPPORTED if b[name] is not None]
    given += ["add_zero_attn=True"] if b["add_zero_attn"] else []
    if given:
        raise UnsupportedOpError(
            f"F.multi_head_attention_forward with {', '.join(given)} is not supported on "
            f"sharded DTensors; make every input Replicate "
            f"(x.redistribute(placements=[Replicate()] * mesh.ndim)), or leave them out")
    _check_placements(b)
    if b["is_causal"] and b["attn_mask"] is None:
        raise RuntimeError("Need attn_mask if specifying the is_causal hint. You may use the "
                           "Transformer module method `generate_square_subsequent_mask` to "
                           "create this mask.")


def _check_placements(b) -> None:
    """Before anything is sent: query, key, value and key_padding_mask may be sharded on the
    batch dim only, the weights and attn_mask must be Replicate (else PlacementError)."""
    from ..tensor import DTensor
    batched = b["query"].ndim == 3
    for name, value in b.items():
        if not isinstance(value, DTensor):
            continue
        batch_dim = {"query": 1, "key": 1, "value": 1, "key_padding_mask": 0}.get(name)
        bad = [m for m, p in enumerate(value.placements) if not p.is_replicate() and not (
            batched and batch_dim is not None and p == Shard(batch_dim))]
        if bad:
            target = [R if m in bad else p for m, p in enumerate(value.placements)]
            raise PlacementError(
                f"F.multi_head_attention_forward: {name} is {format_placements(value.placements)}"
                f"; on sharded inputs only the batch dim of query/key/value (dim 1 of (L, N, E)) "
                f"and of key_padding_mask may be sharded, everything else Replicate:\n"
                + fix_line(name, value, target))


def _projections(b, query, key, value):
    """q, k, v: ``F.linear`` by the packed ``in_proj_weight`` (or the three separate ones)."""
    if b["use_separate_proj_weight"]:
        weights = (b["q_proj_weight"], b["k_proj_weight"], b["v_proj_weight"])
    else:
        weights = b["in_proj_weight"].chunk(3)
    bias = b["in_proj_bias"]
    biases = bias.chunk(3) if bias is not None else (None,) * 3
    return tuple(F.linear(x, w, c) for x, w, c in zip((query, key, value), weights, biases))


def _attend(b, q, k, v, batched: bool):
    """``(out (N, H, L, hd), weights or None)`` as torch's two paths compute them."""
    mask = _mask(b, q, k.shape[2], batched)
    if not b["need_weights"]:
        causal = b["is_causal"] and b["key_padding_mask"] is None
        return F.scaled_dot_product_attention(q, k, v, attn_mask=None if causal else mask,
                                              is_causal=causal), None
    scores = (q * math.sqrt(1.0 / q.shape[-1])) @ k.transpose(-2, -1)
    weights = torch.softmax(scores if mask is None else scores + mask, dim=-1)
    out = weights @ v
    return out, weights.mean(dim=1) if b["average_attn_weights"] else weights


def _mask(b, q, src_len: int, batched: bool):
    """``attn_mask`` and ``key_padding_mask`` as one float mask broadcasting to
    ``(N, H, L, S)`` (-inf where a bool mask is True), or None."""
    batch, heads = q.shape[0], q.shape[1]
    out = None
    for name in ("attn_mask", "key_padding_mask"):
        m = b[name]
        if m is None:
            continue
        if m.dtype == torch.bool:
            m = torch.zeros_like(m, dtype=q.dtype).masked_fill(m, float("-inf"))
        if name == "key_padding_mask":
            m = m.view(batch, 1, 1, src_len)
        elif m.ndim == 3:
            m = m.view(batch, heads, m.shape[1], src_len)
        out = m if out is None else out + m
    return out


__all__ = ["multi_head_attention"]
