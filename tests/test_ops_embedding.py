"""F.embedding: batch-sharded indices, column-sharded and vocab-sharded (Partial) weights."""

import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dtorch import Partial, Replicate, Shard
from test_ops_support import Batch, dt, illegal, make, no_comm, placements_1d

R = Replicate()


def oracle(p, q, idx_ndim):
    if p.is_partial():
        return None
    if not p.is_replicate() and not q.is_replicate():
        return None
    if isinstance(p, Shard):
        return p
    if isinstance(q, Shard):
        return Shard(idx_ndim) if q.dim == 1 else Partial("sum")
    return q


@settings(max_examples=10, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(vocab=st.integers(1, 11), dim=st.integers(1, 6),
       idx_shape=st.lists(st.integers(1, 5), min_size=1, max_size=2).map(tuple),
       seed=st.integers(0, 99))
def test_every_placement_pair_1d(mesh1d, vocab, dim, idx_shape, seed):
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, vocab, idx_shape, generator=g)
    w = torch.randn(vocab, dim, generator=g, dtype=torch.float64)
    expected = F.embedding(idx, w)
    batch = Batch()
    for (p,) in placements_1d(len(idx_shape), partial=False):
        for (q,) in placements_1d(2):
            di, dw = dt(idx, mesh1d, [p]), make(w, mesh1d, [q], seed)
            want = oracle(p, q, idx.ndim)
            if want is None:
                illegal(lambda: F.embedding(di, dw))
            else:
                batch.add(no_comm(lambda: F.embedding(di, dw)), expected, (want,))
    batch.check()


def test_2d_mesh_and_padding_idx(mesh2d):
    idx = torch.randint(0, 11, (4, 6))
    w = torch.randn(11, 6)
    batch = Batch()
    cases = [([Shard(0), R], [R, Shard(0)], [Shard(0), Partial()]),
             ([Shard(0), R], [R, Shard(1)], [Shard(0), Shard(2)]),
             ([R, R], [Shard(0), Shard(0)], [Partial(), Partial()]),
             ([Shard(1), Shard(0)], [R, R], [Shard(1), Shard(0)]),
             ([R, R], [Shard(0), Shard(1)], [Partial(), Shard(2)])]
    for pi, pw, want in cases:
        di, dw = dt(idx, mesh2d, pi), dt(w, mesh2d, pw)
        batch.add(no_comm(lambda: F.embedding(di, dw)), F.embedding(idx, w), want)
        batch.add(no_comm(lambda: F.embedding(di, dw, padding_idx=0)),
                  F.embedding(idx, w, padding_idx=0), want)
    batch.check()
    di, dw = dt(idx, mesh2d, [Shard(0), R]), dt(w, mesh2d, [Shard(0), R])
    err = illegal(lambda: F.embedding(di, dw))
    assert "input [S(0), R], weight [S(0), R]" in str(err)
