"""Ulysses attention in the graph: when its inputs require grad, the composite is issued as
its three parts, each recorded - query, key and value redistributed from the sequence
``Shard(2)`` to the heads ``Shard(1)`` on the ``ulysses_cp`` dim (all_to_all), the local
attention on whole sequences (an op node: its backward is torch's attention VJP on every
rank), and the output redistributed back (all_to_all). Other mesh dims may hold them
Replicate, batch-sharded or head-sharded (tp x ulysses: the heads split on both dims);
grouped key/value heads that would not stay over their query heads are repeated first. The forward costs the composite's four
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
    """The ``ulysses_cp`` mesh dim when Ulysses alone is on: query, key and value
    ``Shard(2)`` there, and on every other mesh dim Replicate, batch-sharded (``Shard(0)``)
    or head-sharded (``Shard(1)``, tp); else None (a ring dim: see ``autograd/ring.py``)."""
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
                                                                p in (Shard(0), Shard(HEADS)))):
                return None
            if m > u and p == Shard(HEADS):
                return None  # see refusal()
    return u


def refusal(q, k, v) -> str:
    """Why a Ulysses composite has no backward (``ulysses_dim`` is None)."""
    mesh = q.device_mesh
    names = mesh.mesh_dim_names or ()
    u = next((i for i, n in enumerate(names) if n in ("ulysses_cp", "ulysess_cp")), None)
    later = [names[m] for m in range(mesh.ndim) if u is not None and m > u and
             any(t.placements[m] == Shard(HEADS) for t in (q, k, v))]
    if later:
        return (f"no backward yet for Ulysses attention when a mesh dim after {names[u]} "
                f"shards the heads ({later[0]!r}): heads split on {names[u]} inside "
                f"{later[0]!r} have no placement to be recorded in; list {later[0]!r} before "
                f"{names[u]} in mesh_dim_names")
    return "no backward yet for scaled_dot_product_attention (context parallel) here"


def _heads(placements, u) -> list:
    return [Shard(HEADS) if m == u else p for m, p in enumerate(placements)]


def groups_aligned(q, k, u) -> bool:
    """Whether, with the heads sharded on ``u`` too, every rank's query heads sit over its
    own key/value heads (grouped-query attention; always true for equal head counts)."""
    from ..layout import rank_block
    mesh = q.device_mesh
    g = q.shape[HEADS] // k.shape[HEADS]
    for r in mesh.ranks:
        c = mesh.get_coordinate(r)
        a = rank_block(q.shape, mesh, _heads(q.placements, u), c)
        b = rank_block(k.shape, mesh, _heads(k.placements, u), c)
        if (a.offset[HEADS], a.shape[HEADS]) != (g * b.offset[HEADS], g * b.shape[HEADS]):
            return False
    return True


def ulysses_attention(func, args, kwargs):
    """``func(*args, **kwargs)`` (scaled_dot_product_attention) as recorded parts; key and
    value heads are repeated for the query heads first (a local, recorded op, as the
    composite does) when grouped heads would not stay aligned on every rank."""
    bound = bind(args, kwargs)
    q, k, v = bound.pop("query"), bound.pop("key"), bound.pop("value")
    u = ulysses_dim(q, k, v)
    if q.shape[HEADS] != k.shape[HEADS] and not groups_aligned(q, k, u):
        g = q.shape[HEADS] // k.shape[HEADS]
        k, v = repeat_heads(k, g), repeat_heads(v, g)
    out = func(*(t.redistribute(placements=_heads(t.placements, u)) for t in (q, k, v)),
               **bound)
    return out.redistribute(placements=[Shard(SEQ) if m == u else p
                                        for m, p in enumerate(out.placements)])


def repeat_heads(t, g: int):
    """``t.repeat_interleave(g, dim=1)`` as expand and reshape, which keep heads sharded on
    tp (each rank repeats its own heads; no communication)."""
    n, h, length, e = t.shape
    return t.unsqueeze(2).expand(n, h, g, length, e).reshape(n, h * g, length, e)
