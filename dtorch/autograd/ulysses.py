"""Ulysses attention in the graph: when its inputs require grad, the composite is issued as
its three parts, each recorded - query, key and value redistributed from the sequence
``Shard(2)`` to the heads ``Shard(1)`` on the ``ulysses_cp`` dim (all_to_all), the local
attention on whole sequences (an op node: its backward is torch's attention VJP on every
rank), and the output redistributed back (all_to_all). Other mesh dims may hold them
Replicate, batch-sharded or head-sharded (tp x ulysses: the heads split on both dims; with
tp listed after ulysses_cp the heads are viewed as ``[A, H/A]`` blocks first), or
sequence-sharded on a ``ring_cp`` dim listed before ``ulysses_cp`` (the ring then runs on
the head-sharded blocks, with its own backward: ``autograd/ring.py``); grouped key/value
heads that would not stay over their query heads are repeated first. The forward costs the
composite's four all_to_alls; the backward is their transpose, planned by the engine: one
all_to_all for the output's gradient and one per input that requires grad. Example::

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
    """The ``ulysses_cp`` mesh dim when Ulysses can be issued as recorded parts: query, key
    and value ``Shard(2)`` there; on the other mesh dims Replicate, batch- or head-sharded
    (``Shard(0)``/``Shard(1)``), or ``Shard(2)`` on a ``ring_cp`` dim (the ring then runs on
    the head-sharded blocks, recorded with its own backward); and moving each to the heads
    costs one all_to_all on ``ulysses_cp`` (else None: see :func:`refusal`)."""
    from ..ops.cp_attention import cp_dims
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        return None
    dims = cp_dims(q.device_mesh)
    u, ring = dims.get("ulysses_cp"), dims.get("ring_cp")
    if u is None or "ulysses_cp2" in dims or "ring_cp2" in dims:
        return None
    for m in range(q.device_mesh.ndim):
        for t in (q, k, v):
            p = t.placements[m]
            ok = (p == Shard(SEQ) if m == u else
                  p.is_replicate() or p in (Shard(0), Shard(HEADS)) or
                  (m == ring and p == Shard(SEQ)))
            if not ok:
                return None
    if all(_one_all_to_all(t, u) for t in (q, k, v)) or head_blocks(q, k, u) is not None:
        return u
    return None


def head_blocks(q, k, u) -> int | None:
    """With a heads dim (tp) listed after ``ulysses_cp`` and no ring dim at all: the number
    ``A`` of head blocks the other mesh dims split the heads into (the product of their
    sizes). Heads ``[N, H, ...]`` viewed as ``[N, A, H/A, ...]`` keep those dims on the
    blocks and let ``ulysses_cp`` split each block, as the composite does: one all_to_all.
    None when not needed or when the head counts do not divide by ``A``."""
    mesh = q.device_mesh
    later = range(u + 1, mesh.ndim)
    if any(q.placements[m] == Shard(SEQ) for m in range(mesh.ndim) if m != u) or not any(
            q.placements[m] == Shard(HEADS) for m in later):
        return None  # a ring dim anywhere: the blocked view would move its sequence dim
    a = 1
    for m, p in enumerate(q.placements):
        if m != u and p == Shard(HEADS):
            a *= mesh.shape[m]
    return a if q.shape[HEADS] % a == 0 and k.shape[HEADS] % a == 0 else None


def _one_all_to_all(t, u) -> bool:
    """Whether moving ``t``'s sequence shards on ``u`` to the heads is one all_to_all there
    (not so when a later mesh dim splits the heads or the sequence inside ``u``'s)."""
    from ..redistribute import plan_redistribute
    steps = [s for s in plan_redistribute(t.device_mesh, t.shape, t.placements,
                                          _heads(t.placements, u), t.dtype.itemsize)
             if s.is_collective]
    return [(s.kind, s.mesh_dim) for s in steps] == [("all_to_all", u)]


def refusal(q, k, v) -> str:
    """Why a Ulysses composite has no backward (``ulysses_dim`` is None)."""
    mesh = q.device_mesh
    names = mesh.mesh_dim_names or ()
    u = next((i for i, n in enumerate(names) if n in ("ulysses_cp", "ulysess_cp")), None)
    if u is not None and all(t.placements[u] == Shard(SEQ) for t in (q, k, v)):
        later = [names[m] for m in range(u + 1, mesh.ndim)
                 if any(t.placements[m] in (Shard(HEADS), Shard(SEQ)) for t in (q, k, v))]
        if later and not all(_one_all_to_all(t, u) for t in (q, k, v)):
            return (f"no backward yet for Ulysses attention with {later[0]!r} after "
                    f"{names[u]} in the mesh: moving the sequence to the heads on "
                    f"{names[u]} would cost more than one all_to_all there (the heads or the "
                    f"sequence split on {names[u]} inside {later[0]!r}); list {later[0]!r} "
                    f"before {names[u]} in mesh_dim_names")
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
    blocks = head_blocks(q, k, u)
    if blocks is not None:
        return _blocked(func, q, k, v, bound, u, blocks)
    if q.shape[HEADS] != k.shape[HEADS] and not groups_aligned(q, k, u):
        g = q.shape[HEADS] // k.shape[HEADS]
        k, v = repeat_heads(k, g), repeat_heads(v, g)
    out = func(*(t.redistribute(placements=_heads(t.placements, u)) for t in (q, k, v)),
               **bound)
    return out.redistribute(placements=[Shard(SEQ) if m == u else p
                                        for m, p in enumerate(out.placements)])


def _blocked(func, q, k, v, bound, u, a):
    """Ulysses with the heads viewed as ``[N, A, H/A, L, E]`` (see :func:`head_blocks`):
    ``ulysses_cp`` moves from the sequence (dim 3) to the heads within a block (dim 2)."""
    from ..layout import chunk_sizes
    n = q.device_mesh.shape[u]
    g = q.shape[HEADS] // k.shape[HEADS]
    if g > 1 and chunk_sizes(q.shape[HEADS] // a, n) != tuple(
            g * c for c in chunk_sizes(k.shape[HEADS] // a, n)):
        k, v = repeat_heads(k, g), repeat_heads(v, g)

    def fold(t):
        b, h, length, e = t.shape
        t = t.reshape(b, a, h // a, length, e)
        return t.redistribute(placements=[Shard(HEADS + 1) if m == u else p
                                          for m, p in enumerate(t.placements)])
    out = func(fold(q), fold(k), fold(v), **bound)
    out = out.redistribute(placements=[Shard(SEQ + 1) if m == u else p
                                       for m, p in enumerate(out.placements)])
    b, _, hb, length, e = out.shape
    return out.reshape(b, a * hb, length, e)


def repeat_heads(t, g: int):
    """``t.repeat_interleave(g, dim=1)`` as expand and reshape, which keep heads sharded on
    tp (each rank repeats its own heads; no communication)."""
    n, h, length, e = t.shape
    return t.unsqueeze(2).expand(n, h, g, length, e).reshape(n, h * g, length, e)
