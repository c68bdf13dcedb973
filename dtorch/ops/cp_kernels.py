"""The rank side of context-parallel attention: the local kernels a Ulysses or ring plan
(``dtorch.ops.cp_attention``) runs on each rank's blocks, with the online-softmax state of the
ring (accumulator, row max, denominator) and the log-sum-exp its backward recomputes from.
Pure torch on local tensors; nothing here plans or communicates. Example::

    acc, mx, den = ring_init(q, v)
    acc, mx, den = ring_step(q, k, v, acc, mx, den, ((0, 4),), ((0, 4),), None, None,
                             False, None)
    out = ring_finish(acc, mx, den, q.dtype)
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

SEQ, HEADS = 2, 1


def repeat_heads(x, g: int):
    """K/V heads repeated for grouped-query attention (what ``enable_gqa`` means)."""
    return x.repeat_interleave(g, dim=HEADS)


def _positions(ranges, device) -> torch.Tensor:
    return torch.cat([torch.arange(s, s + n, device=device) for s, n in ranges] or
                     [torch.zeros(0, dtype=torch.long, device=device)])


def _mask_block(mask, block, qpos=None, kpos=None):
    """This rank's part of a Replicate ``attn_mask`` (broadcast dims stay size 1)."""
    (n0, nn), (h0, hn) = block
    m = mask.reshape((1,) * (4 - mask.ndim) + tuple(mask.shape))
    if m.shape[0] > 1:
        m = m.narrow(0, n0, nn)
    if m.shape[1] > 1:
        m = m.narrow(1, h0, hn)
    if qpos is not None and m.shape[2] > 1:
        m = m.index_select(2, qpos)
    if kpos is not None and m.shape[3] > 1:
        m = m.index_select(3, kpos)
    return m


def local_attention(q, k, v, mask, block, causal, scale):
    """Ulysses' middle: plain attention over the whole sequence on this rank's heads."""
    if q.shape[HEADS] == 0:
        return q.new_zeros(tuple(q.shape[:-1]) + (v.shape[-1],))
    m = _mask_block(mask, block) if mask is not None else None
    return F.scaled_dot_product_attention(q, k, v, attn_mask=m, is_causal=causal, scale=scale,
                                          enable_gqa=k.shape[HEADS] != q.shape[HEADS])


def _acc_dtype(dtype):
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def ring_init(q, v):
    """Empty accumulators: weighted values, running max, running denominator."""
    n, h, lq = q.shape[:3]
    dt = _acc_dtype(q.dtype)
    return (torch.zeros((n, h, lq, v.shape[-1]), dtype=dt, device=q.device),
            torch.full((n, h, lq, 1), -math.inf, dtype=dt, device=q.device),
            torch.zeros((n, h, lq, 1), dtype=dt, device=q.device))


def gather_seq(x, spans):
    """``x``'s sequence pieces ``(offset, length)`` concatenated in the given order."""
    parts = [x.narrow(SEQ, o, ln) for o, ln in spans if ln]
    return torch.cat(parts, SEQ) if parts else x.narrow(SEQ, 0, 0).clone()


def _offsets(ranges):
    """``[(local offset, start, length)]`` of position ranges laid out one after another."""
    out, at = [], 0
    for s, n in ranges:
        if n:
            out.append((at, s, n))
        at += n
    return out


def ring_step(q, k, v, acc, mx, den, q_ranges, k_ranges, mask, block, causal, scale):
    """Merge one K/V block into the accumulators (online softmax). Under ``causal``, key
    pieces entirely in the future of a query piece are skipped without computing (with the
    zig-zag layout a rank holds two query pieces and a block two key pieces)."""
    if q.shape[2] == 0 or k.shape[2] == 0 or q.shape[HEADS] == 0:
        return acc, mx, den
    if causal and (len(q_ranges) > 1 or len(k_ranges) > 1):
        return _ring_step_pieces(q, k, v, acc, mx, den, q_ranges, k_ranges, mask, block, scale)
    last_q = max(s + n - 1 for s, n in q_ranges if n)
    if causal and min(s for s, n in k_ranges if n) > last_q:
        return acc, mx, den
    return _merge_block(q, k, v, acc, mx, den, q_ranges, k_ranges, mask, block, causal, scale)


def _ring_step_pieces(q, k, v, acc, mx, den, q_ranges, k_ranges, mask, block, scale):
    """``ring_step`` one query piece at a time, each with the key pieces not all in its
    future."""
    keys = _offsets(k_ranges)
    outs = []
    for qo, qs, qn in _offsets(q_ranges):
        rows = slice(qo, qo + qn)
        part = [acc[:, :, rows], mx[:, :, rows], den[:, :, rows]]
        live = [(ko, ks, kn) for ko, ks, kn in keys if ks <= qs + qn - 1]
        if live:
            kk = torch.cat([k.narrow(SEQ, ko, kn) for ko, _, kn in live], SEQ)
            vv = torch.cat([v.narrow(SEQ, ko, kn) for ko, _, kn in live], SEQ)
            part = _merge_block(q[:, :, rows], kk, vv, *part, ((qs, qn),),
                                tuple((ks, kn) for _, ks, kn in live), mask, block, True,
                                scale)
        outs.append(part)
    return tuple(torch.cat([o[i] for o in outs], SEQ) for i in range(3))


def scores(q, k, q_ranges, k_ranges, mask, block, causal, scale, dt):
    """Scaled, masked attention scores ``[N, Hq, Lq, Lk]`` of a query block against a key
    block at the given sequence positions (grouped-query heads by reshaping, no copies)."""
    n, hq, lq, e = q.shape
    hk = k.shape[HEADS]
    qg = q.to(dt).reshape(n, hk, hq // hk, lq, e)
    s = (qg @ k.to(dt).unsqueeze(2).transpose(-1, -2)).reshape(n, hq, lq, k.shape[2])
    s = s * (scale if scale is not None else 1 / math.sqrt(e))
    qpos, kpos = _positions(q_ranges, q.device), _positions(k_ranges, q.device)
    if causal:
        s = s.masked_fill(kpos[None, :] > qpos[:, None], -math.inf)
    if mask is not None:
        m = _mask_block(mask, block, qpos, kpos)
        s = s.masked_fill(~m, -math.inf) if m.dtype == torch.bool else s + m.to(dt)
    return s


def weighted_values(p, v, dt):
    """``p @ v`` with grouped-query heads: ``p`` ``[N, Hq, Lq, Lk]``, ``v`` ``[N, Hk, Lk, Ev]``."""
    n, hq, lq, _ = p.shape
    hk = v.shape[HEADS]
    return (p.reshape(n, hk, hq // hk, lq, -1) @ v.to(dt).unsqueeze(2)).reshape(n, hq, lq, -1)


def _merge_block(q, k, v, acc, mx, den, q_ranges, k_ranges, mask, block, causal, scale):
    """The online-softmax update of the accumulators with one block of keys and values."""
    dt = acc.dtype
    s = scores(q, k, q_ranges, k_ranges, mask, block, causal, scale, dt)
    new_mx = torch.maximum(mx, s.amax(-1, keepdim=True))
    safe = torch.where(torch.isinf(new_mx) & (new_mx < 0), torch.zeros_like(new_mx), new_mx)
    p = torch.exp(s - safe)
    corr = torch.exp(mx - safe)
    return (acc * corr + weighted_values(p, v, dt), new_mx,
            den * corr + p.sum(-1, keepdim=True))


def ring_finish(acc, mx, den, dtype):
    """Normalize; rows with no allowed key are 0 (as torch gives for fully masked rows)."""
    out = torch.where(den > 0, acc / den.clamp_min(torch.finfo(den.dtype).tiny),
                      torch.zeros_like(acc))
    return out.to(dtype)


def ring_lse(mx, den, dtype):
    """The log-sum-exp of each query row's scores (``-inf`` where no key is allowed) as two
    columns in ``dtype``, a rounded value and its rounding error: their sum keeps about twice
    the dtype's precision (float16/bfloat16 outputs; the error column is 0 in float32/64)."""
    lse = torch.where(den > 0, mx + torch.log(den.clamp_min(torch.finfo(den.dtype).tiny)),
                      torch.full_like(mx, -math.inf))
    hi = lse.to(dtype)
    lo = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse - hi.to(lse.dtype))
    return torch.cat((hi, lo.to(dtype)), -1)


def tensor_versions(*xs):
    """``[[id, torch version counter], ...]`` of the tensors a backward will read again."""
    return torch.tensor([[id(x), x._version] for x in xs], dtype=torch.int64)


def check_versions(versions, *xs):
    """Raise torch's in-place error when a tensor was replaced or modified since
    :func:`tensor_versions` saw it (returns a dummy: a step has an output)."""
    for (ident, then), x, name in zip(versions.tolist(), xs, ("query", "key", "value",
                                                              "attn_mask")):
        if ident != id(x) or then != x._version:
            raise RuntimeError(
                f"one of the variables needed for gradient computation has been modified by an "
                f"inplace operation: the {name} of ring attention is at version {x._version}; "
                f"expected version {then} instead. Do not modify it in place before backward "
                f"(clone it first)")
    return versions


def cat_last(*xs):
    """Tensors of one shape but the last dim, side by side (one all_to_all carries them)."""
    return torch.cat(xs, -1)


def split_last(x, sizes):
    """The inverse of ``cat_last``: pieces of ``sizes`` along the last dim (contiguous)."""
    return tuple(p.contiguous() for p in torch.split(x, list(sizes), -1))
