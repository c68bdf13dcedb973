"""Ring attention in the graph: when its query, key or value require grad, the ring composite
runs in a variant that also keeps the output and its log-sum-exp (same collectives), and
its node's backward is the ring backward plan of ``dtorch.ops.cp_ring_backward``: one
composite call, planned like the forward, counted in ``CommDebugMode`` as backward. The
gradients have the inputs' placements (the sequence ``Shard(2)`` on ``ring_cp``). Cases it
cannot differentiate (a mask that requires grad, Ulysses and the ring on one mesh) say why
at backward. Example::

    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)   # q: ring_cp Shard(2)
    out.grad_fn.name()                                               # 'RingAttentionBackward'
"""

from __future__ import annotations

from functools import lru_cache

import torch

from .. import comm_debug
from ..placement import Shard
from ..runtime import messages as m
from ..spec import make_spec
from . import cotangent
from .node import Node, edge_of, mark_output


def refusal(bound) -> str | None:
    """Why the ring's backward does not apply to this call (None: it does). Ulysses beside
    the ring is issued by ``autograd/ulysses.py`` first, so here only the ring is on."""
    from ..ops.cp_attention import cp_dims
    q, k, v = bound["query"], bound["key"], bound["value"]
    dims = cp_dims(q.device_mesh)
    on = {kind for kind, m in dims.items() if any(t.placements[m] == Shard(2)
                                                 for t in (q, k, v))}
    if on != {"ring_cp"}:
        from .ulysses import refusal as ulysses_refusal
        return ulysses_refusal(q, k, v)
    mask = bound.get("attn_mask")
    if mask is not None and getattr(mask, "requires_grad", False):
        return ("no backward yet for ring attention with an attn_mask that requires grad "
                "(detach the mask)")
    return None


@lru_cache(maxsize=256)
def _forward_plan(q, k, v, has_mask, causal, scale, ring):
    from ..ops.cp_attention import plan_cp_attention
    return plan_cp_attention(q, k, v, has_mask, causal, scale, None, ring, save_lse=True)


@lru_cache(maxsize=256)
def _backward_plan(q, k, v, has_mask, causal, scale, ring, needs):
    from ..ops.cp_ring_backward import plan_ring_backward
    return plan_ring_backward(q, k, v, has_mask, causal, scale, ring, needs)


def ring_attention(c, bound):
    """The ring composite on ``bound`` (``F.scaled_dot_product_attention``'s arguments by
    name), recorded: returns the output, whose node's backward is the ring backward."""
    from ..ops.cp_attention import cp_dims
    from ..ops.dispatch import _wrap
    from .record import requires, _unique
    q, k, v, mask = bound["query"], bound["key"], bound["value"], bound.get("attn_mask")
    mesh = q.device_mesh
    config = (q._spec, k._spec, v._spec, mask is not None, bool(bound.get("is_causal", False)),
              bound.get("scale"), cp_dims(mesh)["ring_cp"])
    plan = _forward_plan(*config)
    comm_debug.record_steps(plan.collectives)
    tids = tuple(c.new_tid() for _ in range(4))
    inputs = (q, k, v) + ((mask,) if mask is not None else ())
    c.issue(m.Call(tids, plan, tuple(m.Ref(t._tid) for t in inputs), {}, mesh.ranks))
    out_spec = make_spec(q.shape[:3] + (v.shape[3],), q.dtype, mesh, q.placements)
    lse_spec = make_spec(q.shape[:3] + (2,), q.dtype, mesh, q.placements)  # see ring_lse
    # each rank's own [inputs, 2] (id, version) pairs: an internal handle, never read as a value
    versions_spec = make_spec((len(inputs), 2), torch.int64, mesh, None)
    out, kept, lse, versions = (_wrap(s, t, c) for s, t in zip(
        (out_spec, out_spec, lse_spec, versions_spec), tids))
    grad_inputs = _unique([t for t in (q, k, v) if requires(t)])
    needs = tuple(requires(t) for t in (q, k, v))
    saved = (q, k, v, kept, lse) + ((mask,) if mask is not None else ()) + (versions,)
    node = Node(c.new_tid(), "RingAttentionBackward", c, mesh, [t._spec for t in grad_inputs],
                [out_spec], [edge_of(t) for t in grad_inputs], keeps_graph=False,
                backward=RingBackward(config, needs, saved, [t._tid for t in grad_inputs]))
    mark_output(out, node, 0)
    return out


class RingBackward:
    """A ring node's backward: the configuration its plans are cached under, which of
    query, key and value need a gradient, the saved handles (query, key, value, output,
    log-sum-exp, mask, the inputs' versions on each rank; dropped after a backward without
    ``retain_graph``) and the node's inputs (their tids, in the node's order)."""

    def __init__(self, config, needs, saved, inputs):
        self.config, self.needs, self.saved, self.inputs = config, needs, saved, inputs

    def __call__(self, node: Node, grads: dict, retain: bool) -> list:
        """Issue the backward plan for the output's gradient ``grads[0]``; returns one
        gradient per input of ``node`` (an input given twice, as ``q is k``, gets the sum)."""
        from ..tensor import DTensor
        c, mesh = node.controller, node.mesh
        q, k, v, out, _ = self.saved[:5]
        plan = _backward_plan(*self.config, self.needs)
        comm_debug.record_steps(plan.collectives)
        tids = tuple(c.new_tid() for _ in range(sum(self.needs)))
        args = self.saved[:5] + (grads[0],) + self.saved[5:]
        c.issue(m.Call(tids, plan, tuple(m.Ref(t._tid) for t in args), {}, mesh.ranks))
        by_input: dict = {}
        for t, tid in zip([t for t, need in zip((q, k, v), self.needs) if need], tids):
            spec = make_spec(t.shape, t.dtype, mesh,
                             cotangent.grad_placements(t.placements, [out.placements]))
            g = DTensor._wrap(spec, tid, c)
            by_input[t._tid] = g if t._tid not in by_input else by_input[t._tid] + g
        if not retain:
            self.saved = None
            node.release()
        return [by_input[tid] for tid in self.inputs]
