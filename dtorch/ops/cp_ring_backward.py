"""The ring attention's backward, as a composite plan (planned here, purely; run by
``dtorch.runtime.composite`` like the forward of ``dtorch.ops.cp_attention``).

Inputs (slots): 0-2 query, key, value, 3 the output, 4 its log-sum-exp (``[N, H, L, 2]``,
saved by the forward: ``cp_attention.ring_lse``), 5 the output's gradient, 6 the mask (if
any), then the inputs' versions at forward (checked first: torch's in-place error), all in
the user's layout (sequence ``Shard(2)`` on ``ring_cp``). Each rank keeps its
query rows and accumulates dQ there; K/V blocks travel the ring as in the forward (``n - 1``
shifts, each overlapped with the compute on the block in hand), and the dK/dV of a block
travel with it one step behind (``n`` shifts: the last one brings them home; each posted
after the block's compute, received while the next block computes). Each block's
contribution is recomputed from the saved log-sum-exp (``P = exp(S - lse)``) and
differentiated by torch's autograd on the forward's own score function (masks, GQA and
causal positions as in the forward). Under ``is_causal`` the forward's zig-zag balance is
kept: query rows, output, log-sum-exp and its gradient move into the zig-zag layout in one
all_to_all, K/V in a second, dQ comes back in a third and dK/dV in a fourth; key pieces
wholly in a query piece's future are skipped. Only the gradients asked for are computed and
moved. Example::

    >>> from dtorch import init_device_mesh, Shard
    >>> from dtorch.spec import make_spec
    >>> import torch
    >>> mesh = init_device_mesh("cpu", 2, mesh_dim_names=("ring_cp",))
    >>> q = make_spec((1, 2, 8, 4), torch.float32, mesh, [Shard(2)])
    >>> plan = plan_ring_backward(q, q, q, False, False, None, 0, (True, True, True))
    >>> [s.kind for s in plan.collectives]
    ['send_recv', 'send_recv', 'send_recv']
"""

from __future__ import annotations

import torch

from ..layout import rank_block
from ..runtime.messages import Slot
from .composite import PlanBuilder, per_rank
from .cp_attention import (HEADS, SEQ, _Local, _balanceable, _peers, _start, _zigzag_in,
                           _zigzag_out)
from .cp_kernels import (_acc_dtype, _offsets, cat_last, check_versions, scores, split_last,
                         weighted_values)


def plan_ring_backward(q, k, v, has_mask: bool, causal: bool, scale, ring: int, needs):
    """The backward plan for query/key/value specs with the ring on mesh dim ``ring``;
    ``needs`` says which of dQ, dK, dV to compute: the outputs, in that order."""
    mesh = q.mesh
    e, ev = q.shape[3], v.shape[3]
    b = PlanBuilder("scaled_dot_product_attention backward (ring)", 7 + has_mask, q.dtype)
    checked, = b.local(check_versions, Slot(6 + has_mask),
                       *map(Slot, (0, 1, 2, 6)[:3 + has_mask]))
    b.drop(checked, 6 + has_mask)
    lq, lk = _start(q, 0), _start(k, 1)
    rows, = b.local(cat_last, Slot(0), Slot(3), Slot(4), Slot(5))  # q | out | lse | dout
    keys, = b.local(cat_last, Slot(1), Slot(2))                    # k | v
    b.drop(0, 1, 2, 3, 4, 5)
    zq = _Local(rows, {r: s[:3] + (e + 2 * ev + 2,) for r, s in lq.shapes.items()}, lq.seq,
                lq.heads)
    zk = _Local(keys, {r: s[:3] + (e + ev,) for r, s in lk.shapes.items()}, lk.seq, lk.heads)
    balance = causal and mesh.shape[ring] > 1 and _balanceable(mesh, ring, lq, lk,
                                                               q.shape[SEQ], k.shape[SEQ])
    if balance:
        zq, zk = (_zigzag_in(b, mesh, ring, x, q.shape[SEQ]) for x in (zq, zk))
        b.drop(rows, keys)
    qs, outs, lses, douts = b.local(split_last, Slot(zq.slot), (e, ev, 2, ev), outs=4)
    ks, vs = b.local(split_last, Slot(zk.slot), (e, ev), outs=2)
    b.drop(zq.slot, zk.slot)
    delta, = b.local(ring_delta, Slot(outs), Slot(douts))
    b.drop(outs)
    batch = {r: (rank_block(q.shape, mesh, q.placements, mesh.get_coordinate(r)).offset[0],
                 lq.shapes[r][0]) for r in mesh.ranks}
    shapes = {"k": {r: s[:3] + (e,) for r, s in zk.shapes.items()},
              "v": {r: s[:3] + (ev,) for r, s in zk.shapes.items()}}
    dq, dkv = _ring_backward(b, mesh, ring, (qs, ks, vs, douts, lses, delta), zq.seq, zk.seq,
                             shapes, Slot(6) if has_mask else None, batch, zq.heads, causal,
                             scale, needs)
    outputs = []
    if needs[0]:
        if balance:
            dq = _zigzag_out(b, mesh, ring, dq, zq, lq, q.shape[SEQ], e)
        outputs.append(dq)
    if dkv:
        sizes = tuple(s for s, need in zip((e, ev), needs[1:]) if need)
        if balance:
            both, = b.local(cat_last, *map(Slot, dkv))
            b.drop(*dkv)
            back = _zigzag_out(b, mesh, ring, both, zk, lk, k.shape[SEQ], sum(sizes))
            dkv = b.local(split_last, Slot(back), sizes, outs=len(sizes))
            b.drop(back)
        outputs += list(dkv)
    return b.build(tuple(outputs), (ks, vs))


def _ring_backward(b: PlanBuilder, mesh, rd, slots, q_seq, k_seq, shapes, mask, batch, heads,
                   causal, scale, needs):
    """The ring loop: returns ``(dQ slot or None, the dK/dV slots asked for)``, each in the
    layout the loop ran in."""
    n = mesh.shape[rd]
    qs, ks, vs, douts, lses, delta = slots
    want = tuple(x for x, need in zip(("k", "v"), needs[1:]) if need)
    dq, = b.local(ring_grad_init, Slot(qs))
    cur, acc = (ks, vs), None
    blocks = per_rank({r: (batch[r], heads[r]) for r in mesh.ranks})
    for t in range(n):
        src = {r: _peers(mesh, r, rd)[(mesh.get_coordinate(r)[rd] - t) % n]
               for r in mesh.ranks}  # whose K/V block each rank holds at step t
        nxt = None
        if t < n - 1:
            nxt = b.shift(mesh, rd, cur, [{r: shapes[x][src[r]] for r in mesh.ranks}
                                          for x in ("k", "v")])
        grads = b.local(ring_grad_step, Slot(qs), Slot(cur[0]), Slot(cur[1]), Slot(douts),
                        Slot(lses), Slot(delta), Slot(dq), per_rank(q_seq),
                        per_rank({r: k_seq[src[r]] for r in mesh.ranks}), mask, blocks,
                        causal, scale, want, outs=(dq,) + b.slots(len(want)))[1:]
        if want:
            if acc is not None:  # the dK/dV of this block so far, from the previous rank
                b.wait(acc)
                summed = b.local(add_each, *map(Slot, acc + grads), outs=len(want))
                b.drop(*acc, *grads)
                grads = summed
            if n > 1:
                acc = b.shift(mesh, rd, grads, [{r: shapes[x][src[r]] for r in mesh.ranks}
                                                for x in want])
                b.drop(*grads)
            else:
                acc = grads
        if nxt is not None:
            b.wait(nxt)
        b.drop(*cur)
        cur = nxt
    if want and n > 1:
        b.wait(acc)  # the last shift brought each rank its own block's dK/dV
    b.drop(qs, douts, lses, delta)
    if needs[0]:
        final, = b.local(cast_to, Slot(dq), dtype=b.dtype)
        b.drop(dq)
        dq = final
    else:
        b.drop(dq)
        dq = None
    return dq, tuple(acc) if want else ()


# the kernels the ranks run (module level: they travel by name) ----------------------------------
def ring_delta(out, dout):
    """``rowsum(dO * O)``: the softmax's correction term of every query row."""
    dt = _acc_dtype(out.dtype)
    return (out.to(dt) * dout.to(dt)).sum(-1, keepdim=True)


def ring_grad_init(q):
    """The dQ accumulator (the accumulation dtype)."""
    return torch.zeros(q.shape, dtype=_acc_dtype(q.dtype), device=q.device)


def add_each(*xs):
    """``(a0 + b0, a1 + b1, ...)`` of two equal-length groups."""
    half = len(xs) // 2
    return tuple(a + b for a, b in zip(xs[:half], xs[half:]))


def cast_to(x, dtype):
    return x.to(dtype)


def ring_grad_step(q, k, v, dout, lse, delta, dq, q_ranges, k_ranges, mask, block, causal,
                   scale, want):
    """One K/V block's part of the backward: ``(dQ + this block's share, then its dK and/or
    dV as ``want`` names them)``. The probabilities are recomputed from the saved
    log-sum-exp; ``sum(dO * (P @ V)) - sum(delta * rowsum(P))`` differentiated by autograd
    gives the attention's VJP (``dS = P * (dP - delta)``) through the forward's own scores."""
    dt = dq.dtype
    qq, kk, vv = (x.detach().to(dt).requires_grad_() for x in (q, k, v))
    lse = lse[..., :1].to(dt) + lse[..., 1:].to(dt)  # rounded value + its rounding error
    safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    total = None
    with torch.enable_grad():
        for qo, qst, qn in _offsets(q_ranges):
            live = [(ko, ks, kn) for ko, ks, kn in _offsets(k_ranges)
                    if not causal or ks <= qst + qn - 1]
            if not live or q.shape[HEADS] == 0:
                continue
            kb = torch.cat([kk.narrow(SEQ, ko, kn) for ko, _, kn in live], SEQ)
            vb = torch.cat([vv.narrow(SEQ, ko, kn) for ko, _, kn in live], SEQ)
            rows = slice(qo, qo + qn)
            s = scores(qq[:, :, rows], kb, ((qst, qn),), tuple((ks, kn) for _, ks, kn in live),
                       mask, block, causal, scale, dt)
            p = torch.exp(s - safe[:, :, rows])
            part = ((dout[:, :, rows].to(dt) * weighted_values(p, vb, dt)).sum()
                    - (delta[:, :, rows] * p.sum(-1, keepdim=True)).sum())
            total = part if total is None else total + part
        if total is None:
            found = (None, None, None)
        else:
            found = torch.autograd.grad(total, (qq, kk, vv), allow_unused=True)
    gq, gk, gv = (torch.zeros_like(x) if g is None else g for g, x in zip(found, (qq, kk, vv)))
    pick = {"k": gk.to(k.dtype), "v": gv.to(v.dtype)}
    return (dq + gq,) + tuple(pick[x] for x in want)

