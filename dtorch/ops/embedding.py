"""``F.embedding(indices, weight)``: per mesh dim, from (indices, weight) placements:

- (R, R) -> R;  (S(d), R) -> S(d) (sharded batch/sequence of indices);
- (R, S(1)) -> S(last) (the embedding dim is sharded);
- (R, S(0)) -> ``Partial("sum")``: the vocabulary is sharded; each rank looks up the rows it
  holds and writes zeros for the others (:func:`vocab_parallel_embedding`), so the sum over
  ranks is the lookup. No data moves;
- (R, P(op)) -> P(op) (a lookup selects rows, which commutes with every reduction).

Example::

    >>> import torch
    >>> w = torch.arange(8.).reshape(4, 2)
    >>> vocab_parallel_embedding({(1,): (2, 2)}, (1,), torch.tensor([0, 3]), w[2:])
    tensor([[0., 0.],
            [6., 7.]])
"""

from __future__ import annotations

import torch.nn.functional as F

from ..layout import rank_block
from ..placement import Partial, Replicate, Shard
from ..runtime.messages import Coord
from .explain import with_dim
from .registry import Decision, rule

R = Replicate()
LEGAL = ("(indices, weight): (R, R) -> R; (S(d), R) -> S(d); (R, S(1)) -> S(last); "
         "(R, S(0)) -> P(sum) (vocab-parallel: rows a rank lacks read as zeros); "
         "(R, P(op)) -> P(op)")


def vocab_parallel_embedding(table, coord, indices, weight, **kwargs):
    """Local kernel: look up the rows this rank holds (``table[coord]`` = (first row,
    count)); indices outside them give zeros."""
    first, count = table[coord]
    outside = (indices < first) | (indices >= first + count)
    if count == 0:
        return weight.new_zeros((*indices.shape, weight.shape[-1]))
    local = (indices - first).masked_fill(outside, 0)
    out = F.embedding(local, weight, **kwargs)
    return out.masked_fill(outside.unsqueeze(-1), 0)


@rule("embedding", family="embedding", arg_names=("input", "weight"))
def embedding_rule(op):
    idx, w = op.arg(0, "input"), op.arg(1, "weight")
    out, vocab = [], False
    for m, (p, q) in enumerate(zip(idx.placements, w.placements)):
        if p.is_partial() or (not p.is_replicate() and not q.is_replicate()):
            fix = {idx: with_dim(idx.placements, m, R)}
            op.fail(m, LEGAL, fix, f"indices {p} with weight {q}")
        if isinstance(p, Shard):
            out.append(p)
        elif isinstance(q, Shard) and q.dim == 1:
            out.append(Shard(idx.ndim))
        elif isinstance(q, Shard):
            out.append(Partial("sum"))
            vocab = True
        else:
            out.append(q)
    out = tuple(out)
    if not vocab:
        return out
    if op.arg(None, "max_norm") is not None:
        op.fail(None, LEGAL, {w: tuple(R if isinstance(q, Shard) and q.dim == 0 else q
                                       for q in w.placements)},
                "max_norm renormalizes looked-up rows in place; not with a vocab-sharded weight")
    mesh = w.mesh
    table = {}
    for r in mesh.ranks:
        c = mesh.get_coordinate(r)
        b = rank_block(w.shape, mesh, w.placements, c)
        table[c] = (b.offset[0], b.shape[0])
    return Decision((out,), vocab_parallel_embedding, (table, Coord(mesh), idx, w), {})
