"""Ulysses attention in the graph: when its inputs require grad, the composite is issued as
its three parts, each recorded - query, key and value redistributed from the sequence
``Shard(2)`` to the heads ``Shard(1)`` on the ``ulysses_cp`` dim (all_to_all), the local
attention on whole sequences (an op node: its backward is torch's attention VJP on every
rank), and the output redistributed back (all_to_all). The forward costs the composite's four
all_to_alls; the backward is their transpose, planned by the engine: one all_to_all for the
output's gradient and one per input that requires grad. Example::

    out = ulysses_attention(F.scaled_dot_product_attention, (q, k, v), {"is_causal": True})
"""

from __future__ import annotations

from ..placement import Shard

SEQ, HEADS = 2, 1
NAMES = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale")


def bind(args, kwargs) -> dict:
    """The call's arguments by name (``F.scaled_dot_product_attention``'s signature)."""
    bound = dict(zip(NAMES, args))
    bound.update(kwargs)
    return bound


def ulysses_dim(q, k, v) -> int | None:
    """The ``ulysses_cp`` mesh dim when Ulysses alone is active, the other mesh dims hold
    query, key and value Replicate or batch-sharded, and the heads split evenly enough for
    query and key/value to stay aligned (else None: the composite runs)."""
    from ..ops.cp_attention import cp_dims
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        return None
    dims = cp_dims(q.device_mesh)
    u = dims.get("ulysses_cp")
    if u is None or "ulysses_cp2" in dims:
        return None
    for m in range(q.device_mesh.ndim):
        for t in (q, k, v):
            p = t.placements[m]
            if (m == u and p != Shard(SEQ)) or (m != u and not (p.is_replicate() or
                                                                p == Shard(0))):
                return None  # a ring, heads split on tp, ...: the composite runs
    n, hq, hk = q.device_mesh.shape[u], q.shape[HEADS], k.shape[HEADS]
    if hq != hk and (hq % n or hk % n):
        return None
    return u


def ulysses_attention(func, args, kwargs):
    """``func(*args, **kwargs)`` (scaled_dot_product_attention) as recorded parts."""
    bound = bind(args, kwargs)
    q, k, v = bound.pop("query"), bound.pop("key"), bound.pop("value")
    u = ulysses_dim(q, k, v)

    def heads(t):
        return t.redistribute(placements=[Shard(HEADS) if m == u else p
                                          for m, p in enumerate(t.placements)])
    out = func(heads(q), heads(k), heads(v), **bound)
    return out.redistribute(placements=[Shard(SEQ) if m == u else p
                                        for m, p in enumerate(out.placements)])
