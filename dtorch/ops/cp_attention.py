"""Context-parallel ``F.scaled_dot_product_attention``: Ulysses and ring, as composite ops.

Q/K/V ``[N, H, L, E]`` sharded ``Shard(2)`` (the sequence) on a mesh dim named
``ulysses_cp`` (or the seed's ``ulysess_cp``) or ``ring_cp`` switch the op to a composite plan
(planned here, purely; run by ``dtorch.runtime.composite``):

- Ulysses: all_to_all Q, K, V from sequence-sharded to head-sharded, local attention on the
  whole sequence, all_to_all the output back (4 all_to_all);
- ring: each rank keeps its Q rows; K/V blocks travel the ring with ``cp - 1`` shifts
  (``send_recv``, overlapped with the compute on the block in hand), merged by log-sum-exp
  (online softmax); a rank holds its current block and the one in flight, never the whole
  K/V; under ``is_causal`` key pieces whose positions all come after a query piece's are
  skipped, and the work is balanced: Q/K/V first move (one all_to_all each) into a zig-zag
  layout where rank i of the ring holds chunks i and 2n-1-i of 2n (an early and a late one),
  and the output moves back (one more); the user-visible layout stays contiguous Shard(2);
- both on one mesh (any order): Ulysses first, then the ring on the head-sharded blocks.

Other mesh dims follow the plain rule (``dp`` Shard(0), ``tp`` Shard(1) heads, Replicate).
The output's placements are Q's. Example::

    >>> from dtorch import init_device_mesh
    >>> cp_dims(init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "ring_cp")))
    {'ring_cp': 1}
"""

from __future__ import annotations

from ..layout import chunk_sizes, rank_block
from ..placement import Replicate, Shard
from ..runtime.messages import Slot
from .composite import PlanBuilder, per_rank
from .cp_kernels import (  # noqa: F401 - the rank side, named by the plans (and tests)
    cat_last, check_versions, gather_seq, local_attention, repeat_heads, ring_finish, ring_init,
    ring_lse, ring_step, split_last, tensor_versions)
from .explain import with_dim
from .registry import Decision, TArg

R = Replicate()
SEQ, HEADS = 2, 1
ULYSSES_NAMES = ("ulysses_cp", "ulysess_cp")
RING_NAMES = ("ring_cp",)
LEGAL = ("on a ulysses_cp / ring_cp mesh dim: S(2), S(2), S(2) -> S(2) (the sequence of "
         "[N, H, L, E]); other mesh dims: R or S(0) / S(1) on query, key and value alike; "
         "attn_mask Replicate on every mesh dim; dropout_p=0")


def cp_dims(mesh) -> dict[str, int]:
    """``{"ulysses_cp" | "ring_cp": mesh dim}`` for the CP-named dims of ``mesh``."""
    out = {}
    for i, name in enumerate(mesh.mesh_dim_names or ()):
        kind = ("ulysses_cp" if name in ULYSSES_NAMES else
                "ring_cp" if name in RING_NAMES else None)
        if kind is not None:
            out[kind + "2" if kind in out else kind] = i  # a second one: the rule refuses it
    return out


def active(q, k, v) -> dict[str, int]:
    """The CP dims on which query, key or value shards the sequence (CP is on), else {}."""
    if q.ndim < 3:
        return {}
    dims = cp_dims(q.mesh)
    return {kind: m for kind, m in dims.items()
            if any(t.placements[m] == Shard(t.ndim - 2) for t in (q, k, v))}


# the rule ----------------------------------------------------------------------------------------
def cp_rule(op, q, k, v, mask, dims: dict[str, int]) -> Decision:
    """Check placements and plan the composite (see the module doc)."""
    from . import attention
    if q.ndim != 4:
        op.fail(None, LEGAL, {}, "context parallelism needs 4-D [N, H, L, E] query, key "
                "and value")
    for kind in dims:
        if kind.endswith("2"):
            op.fail(dims[kind], LEGAL, {}, f"the mesh has two {kind[:-1]} dims; use one")
    narrow: dict = {}
    for mdim in range(q.mesh.ndim):
        if mdim in dims.values():
            for t in (q, k, v):
                if t.placements[mdim] != Shard(SEQ):
                    op.fail(mdim, LEGAL, {t: with_dim(t.placements, mdim, Shard(SEQ))},
                            "context parallelism needs query, key and value all Shard(2) "
                            "on this dim")
        elif attention._qkv_dim(op, q, k, v, mdim, narrow).is_partial():
            op.fail(mdim, LEGAL, {v: with_dim(v.placements, mdim, R)},
                    "a Partial value is not supported with context parallelism")
        if narrow:
            t, target = next(iter(narrow.values()))
            op.fail(mdim, LEGAL, {t: target}, "with context parallelism query, key and value "
                    "must be sharded alike on the other mesh dims")
    attention._check_groups(op, q, k, q.placements)
    if type(mask) is TArg and any(not p.is_replicate() for p in mask.placements):
        op.fail(next(i for i, p in enumerate(mask.placements) if not p.is_replicate()), LEGAL,
                {mask: (R,) * q.mesh.ndim}, "with context parallelism attn_mask must be "
                "Replicate on every mesh dim (each rank cuts its rows and columns)")
    plan = plan_cp_attention(q, k, v, type(mask) is TArg, bool(op.arg(5, "is_causal", False)),
                 op.arg(6, "scale", None), dims.get("ulysses_cp"), dims.get("ring_cp"))
    args = (q, k, v) + ((mask,) if type(mask) is TArg else ())
    return Decision((q.placements,), plan, args, {})


# planning ----------------------------------------------------------------------------------------
class _Local:
    """What every rank holds of one tensor while the plan is built: its slot, local shape,
    sequence ranges ``((start, length), ...)`` and head block ``(offset, length)``."""

    def __init__(self, slot, shapes, seq, heads):
        self.slot, self.shapes, self.seq, self.heads = slot, shapes, seq, heads


def _start(t, slot) -> _Local:
    mesh = t.mesh
    blocks = {r: rank_block(t.shape, mesh, t.placements, mesh.get_coordinate(r))
              for r in mesh.ranks}
    return _Local(slot, {r: b.shape for r, b in blocks.items()},
                  {r: ((b.offset[SEQ], b.shape[SEQ]),) for r, b in blocks.items()},
                  {r: (b.offset[HEADS], b.shape[HEADS]) for r, b in blocks.items()})


def _peers(mesh, rank, mdim) -> tuple[int, ...]:
    return next(g for g in mesh.groups(mdim) if rank in g)


def _ulysses_in(b: PlanBuilder, mesh, u, x: _Local) -> _Local:
    """all_to_all from sequence-sharded to head-sharded along mesh dim ``u``."""
    n = mesh.shape[u]
    slot = b.exchange(mesh, u, x.slot, x.shapes, HEADS, SEQ)
    shapes, seq, heads = {}, {}, {}
    for r in mesh.ranks:
        peers, j = _peers(mesh, r, u), mesh.get_coordinate(r)[u]
        chunks = chunk_sizes(x.shapes[r][HEADS], n)
        shapes[r] = (x.shapes[r][0], chunks[j], sum(x.shapes[p][SEQ] for p in peers),
                     x.shapes[r][3])
        seq[r] = tuple(rng for p in peers for rng in x.seq[p])
        heads[r] = (x.heads[r][0] + sum(chunks[:j]), chunks[j])
    return _Local(slot, shapes, seq, heads)


def _ulysses_out(b: PlanBuilder, mesh, u, out: _Local, q0: _Local) -> int:
    """all_to_all the output back: split the sequence into the pieces Q came in."""
    sizes = {r: tuple(q0.shapes[p][SEQ] for p in _peers(mesh, r, u)) for r in mesh.ranks}
    return b.exchange(mesh, u, out.slot, out.shapes, SEQ, HEADS, sizes)


def _gqa_aligned(mesh, u, q: _Local, k: _Local, g: int) -> bool:
    """Whether splitting local heads into ``mesh.shape[u]`` chunks keeps every rank's query
    heads over its own kv heads (else K/V are expanded to the query heads first)."""
    n = mesh.shape[u]
    for r in mesh.ranks:
        j = mesh.get_coordinate(r)[u]
        qc, kc = chunk_sizes(q.shapes[r][HEADS], n), chunk_sizes(k.shapes[r][HEADS], n)
        if (q.heads[r][0] + sum(qc[:j]), qc[j]) != (g * (k.heads[r][0] + sum(kc[:j])),
                                                    g * kc[j]):
            return False
    return True


def _expand(b: PlanBuilder, x: _Local, q: _Local, g: int) -> _Local:
    slot, = b.local(repeat_heads, Slot(x.slot), g)
    shapes = {r: (s[0], q.shapes[r][HEADS], s[2], s[3]) for r, s in x.shapes.items()}
    return _Local(slot, shapes, x.seq, q.heads)


def plan_cp_attention(q, k, v, has_mask: bool, causal: bool, scale, u: int | None,
                      ring: int | None, save_lse: bool = False):
    """The composite plan for query/key/value specs (anything with shape, dtype, mesh and
    placements) with Ulysses on mesh dim ``u`` and the ring on mesh dim ``ring`` (either may
    be None). Inputs are slots 0-2 (3: the mask). With ``save_lse`` (the ring alone, for its
    backward) the outputs are ``(out, out, lse, versions)``: the output twice (the user's and
    the one the backward keeps), the log-sum-exp of each query row, ``[N, H, L, 2]`` in Q's
    layout (see ``ring_lse``; it rides the output's zig-zag all_to_all: no collective more),
    and the inputs' torch version counters (the backward checks them, as torch would)."""
    mesh = q.mesh
    b = PlanBuilder("scaled_dot_product_attention (context parallel)", 3 + has_mask, q.dtype)
    lq, lk, lv = _start(q, 0), _start(k, 1), _start(v, 2)
    q0 = lq
    batch = {r: (rank_block(q.shape, mesh, q.placements, mesh.get_coordinate(r)).offset[0],
                 lq.shapes[r][0]) for r in mesh.ranks}
    mask = Slot(3) if has_mask else None
    if save_lse:
        versions, = b.local(tensor_versions, *map(Slot, range(3 + has_mask)))
    ulysses = u is not None and mesh.shape[u] > 1
    if ulysses:
        g = q.shape[HEADS] // k.shape[HEADS]
        if g > 1 and not _gqa_aligned(mesh, u, lq, lk, g):
            lk, lv = _expand(b, lk, lq, g), _expand(b, lv, lq, g)
        lq, lk, lv = (_ulysses_in(b, mesh, u, x) for x in (lq, lk, lv))
        b.drop(0, 1, 2)
    if ring is not None and (mesh.shape[ring] > 1 or save_lse):
        balance = causal and mesh.shape[ring] > 1 and _balanceable(mesh, ring, lq, lk,
                                                                   q.shape[SEQ], k.shape[SEQ])
        if balance:  # zig-zag: every rank gets an early and a late chunk of the sequence
            home, total = lq, q.shape[SEQ]
            inputs = (lq.slot, lk.slot, lv.slot)
            lq, lk, lv = (_zigzag_in(b, mesh, ring, x, total) for x in (lq, lk, lv))
            b.drop(*inputs)
        out, lse, watch = _ring(b, mesh, ring, lq, lk, lv, mask, batch, causal, scale,
                                q.dtype, save_lse)
        if balance and save_lse:
            both, = b.local(cat_last, Slot(out), Slot(lse))
            b.drop(out, lse)
            back = _zigzag_out(b, mesh, ring, both, lq, home, total, v.shape[3] + 2)
            out, lse = b.local(split_last, Slot(back), (v.shape[3], 2), outs=2)
            b.drop(back)
        elif balance:
            out = _zigzag_out(b, mesh, ring, out, lq, home, total, v.shape[3])
        if save_lse:
            return b.build((out, out, lse, versions), watch)
    else:
        slot, = b.local(local_attention, Slot(lq.slot), Slot(lk.slot), Slot(lv.slot), mask,
                        per_rank({r: (batch[r], lq.heads[r]) for r in mesh.ranks}), causal,
                        scale)
        out, watch = slot, ()
    if ulysses:
        shapes = {r: lq.shapes[r][:3] + (v.shape[3],) for r in mesh.ranks}
        out = _ulysses_out(b, mesh, u, _Local(out, shapes, lq.seq, lq.heads), q0)
    return b.build((out,), watch)


def _balanceable(mesh, rd, q: _Local, k: _Local, lq: int, lk: int) -> bool:
    """Zig-zag balancing applies when every rank holds one contiguous sequence range (no
    Ulysses before the ring) and queries and keys have the same length."""
    return lq == lk and all(len(x.seq[r]) == 1 for x in (q, k) for r in mesh.ranks)


def _zigzag_chunks(total: int, n: int) -> list[tuple[int, int, int]]:
    """``[(start, length, owner coordinate)]`` of the ``2n`` zig-zag chunks: coordinate i
    owns chunks i and 2n-1-i (an early and a late one: causal work evens out).

    >>> _zigzag_chunks(8, 2)
    [(0, 2, 0), (2, 2, 1), (4, 2, 1), (6, 2, 0)]
    """
    sizes = chunk_sizes(total, 2 * n)
    starts = [sum(sizes[:c]) for c in range(2 * n)]
    return [(starts[c], sizes[c], c if c < n else 2 * n - 1 - c) for c in range(2 * n)]


def _pieces_to(start: int, length: int, chunks, n: int) -> list[tuple[int, int]]:
    """The ``(start, length)`` of ``[start, start + length)`` going to each coordinate
    (one contiguous interval per destination: only chunks n-1 and n share an owner and they
    are adjacent)."""
    out = []
    for j in range(n):
        parts = [(max(start, cs), min(start + length, cs + cl)) for cs, cl, o in chunks
                 if o == j and max(start, cs) < min(start + length, cs + cl)]
        lo = min((a for a, _ in parts), default=start)
        hi = max((e for _, e in parts), default=lo)
        out.append((lo, hi - lo))
    return out


def _zigzag_in(b: PlanBuilder, mesh, rd, x: _Local, total: int) -> _Local:
    """Reorder each rank's block so its pieces lie in destination order, then all_to_all
    along the ring dim into the zig-zag layout; the new sequence ranges are in source order."""
    n = mesh.shape[rd]
    chunks = _zigzag_chunks(total, n)
    pieces = {r: _pieces_to(*x.seq[r][0], chunks, n) for r in mesh.ranks}
    spans = {r: tuple((s - x.seq[r][0][0], ln) for s, ln in pieces[r]) for r in mesh.ranks}
    ordered, = b.local(gather_seq, Slot(x.slot), per_rank(spans))
    slot = b.exchange(mesh, rd, ordered, x.shapes, SEQ, SEQ,
                      {r: tuple(ln for _, ln in pieces[r]) for r in mesh.ranks})
    b.drop(ordered)
    shapes, seq = {}, {}
    for r in mesh.ranks:
        peers, j = _peers(mesh, r, rd), mesh.get_coordinate(r)[rd]
        got = [pieces[p][j] for p in peers]
        seq[r] = tuple(g for g in got if g[1])
        shapes[r] = x.shapes[r][:SEQ] + (sum(ln for _, ln in got),) + x.shapes[r][SEQ + 1:]
    return _Local(slot, shapes, seq, x.heads)


def _zigzag_out(b: PlanBuilder, mesh, rd, out: int, z: _Local, home: _Local, total: int,
                ev: int) -> int:
    """all_to_all the output from the zig-zag layout back to each rank's own block (its
    pieces arrive in destination order of the way in) and undo the local reorder."""
    n = mesh.shape[rd]
    chunks = _zigzag_chunks(total, n)
    shapes = {r: z.shapes[r][:SEQ + 1] + (ev,) for r in mesh.ranks}
    sizes = {}
    for r in mesh.ranks:
        peers, j = _peers(mesh, r, rd), mesh.get_coordinate(r)[rd]
        sizes[r] = tuple(_pieces_to(*home.seq[p][0], chunks, n)[j][1] for p in peers)
    back = b.exchange(mesh, rd, out, shapes, SEQ, SEQ, sizes)
    b.drop(out)
    spans = {}
    for r in mesh.ranks:
        pieces = _pieces_to(*home.seq[r][0], chunks, n)
        offsets = [sum(ln for _, ln in pieces[:j]) for j in range(n)]
        order = sorted(range(n), key=lambda j: pieces[j][0])
        spans[r] = tuple((offsets[j], pieces[j][1]) for j in order)
    restored, = b.local(gather_seq, Slot(back), per_rank(spans))
    b.drop(back)
    return restored


def _ring(b: PlanBuilder, mesh, rd, q: _Local, k: _Local, v: _Local, mask, batch, causal,
          scale, q_dtype, save_lse: bool = False):
    """K/V around the ring: ``n - 1`` shifts, each posted before the compute on the block in
    hand and finished after it. Returns ``(output slot, log-sum-exp slot or None, the K/V
    slots watched)``."""
    n = mesh.shape[rd]
    acc = b.local(ring_init, Slot(q.slot), Slot(v.slot), outs=3)
    cur, watch = (k.slot, v.slot), [k.slot, v.slot]
    blocks = per_rank({r: (batch[r], q.heads[r]) for r in mesh.ranks})
    qpos = per_rank(q.seq)
    for t in range(n):
        src = {r: _peers(mesh, r, rd)[(mesh.get_coordinate(r)[rd] - t) % n]
               for r in mesh.ranks}  # whose K/V block each rank holds at step t
        nxt = None
        if t < n - 1:
            nxt = b.shift(mesh, rd, cur, [{r: k.shapes[src[r]] for r in mesh.ranks},
                                          {r: v.shapes[src[r]] for r in mesh.ranks}])
            watch += nxt
        b.local(ring_step, Slot(q.slot), Slot(cur[0]), Slot(cur[1]), *map(Slot, acc), qpos,
                per_rank({r: k.seq[src[r]] for r in mesh.ranks}), mask, blocks, causal,
                scale, outs=acc)
        if nxt is not None:
            b.wait(nxt)
        b.drop(*cur)
        cur = nxt
    out, = b.local(ring_finish, *map(Slot, acc), dtype=q_dtype)
    lse = b.local(ring_lse, Slot(acc[1]), Slot(acc[2]), dtype=q_dtype)[0] if save_lse else None
    b.drop(*acc)
    return out, lse, watch


# the kernels the ranks run (module level: they travel by name) ----------------------------------
