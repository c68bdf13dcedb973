"""Comparisons: broadcasting like binary ops, exact bool results, no Partial input (a 0-dim one
is all-reduced first)."""

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dtorch import Replicate, Shard
from test_ops_support import Batch, dt, illegal, make, no_comm, placements_1d
from ledgers import counted

R = Replicate()
OPS = {"eq": lambda a, b: a == b, "ne": torch.ne, "lt": lambda a, b: a < b,
       "le": torch.le, "gt": lambda a, b: a.gt(b), "ge": lambda a, b: a >= b,
       "isclose": torch.isclose}


def oracle(pa, pb, sa, sb, so):
    if pa.is_partial() or pb.is_partial():
        return None
    n = len(so)
    sh = [(p.dim + n - len(s), s[p.dim]) for p, s in ((pa, sa), (pb, sb)) if p.is_shard()]
    if not sh:
        return R
    dims = {d for d, _ in sh}
    if len(dims) > 1 or any(size != so[d] for d, size in sh):
        return None
    return Shard(dims.pop())


@settings(max_examples=10, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(shape=st.lists(st.integers(1, 5), min_size=1, max_size=3).map(tuple),
       bshape=st.integers(0, 2), name=st.sampled_from(sorted(OPS)), seed=st.integers(0, 99))
def test_every_placement_pair_1d(mesh1d, shape, bshape, name, seed):
    g = torch.Generator().manual_seed(seed)
    sb = shape[len(shape) - min(bshape + 1, len(shape)):]
    a = torch.randint(0, 3, shape, generator=g).double()
    b = torch.randint(0, 3, sb, generator=g).double()
    fn = OPS[name]
    expected = fn(a, b)
    batch = Batch()
    for pa in placements_1d(len(shape)):
        for pb in placements_1d(len(sb)):
            da, db = make(a, mesh1d, pa, 1), make(b, mesh1d, pb, 2)
            want = oracle(pa[0], pb[0], shape, sb, tuple(expected.shape))
            if want is None:
                illegal(lambda: fn(da, db))
            else:
                batch.add(no_comm(lambda: fn(da, db)), expected, (want,))
    batch.check()


def test_compare_2d_with_scalars(mesh2d):
    x = torch.randint(-3, 3, (4, 6))
    xs = dt(x, mesh2d, [Shard(1), Shard(0)])
    batch = Batch()
    batch.add(no_comm(lambda: xs > 0), x > 0, [Shard(1), Shard(0)])
    batch.add(no_comm(lambda: xs.eq(1)), x.eq(1), [Shard(1), Shard(0)])
    batch.add(no_comm(lambda: 1 <= xs), 1 <= x, [Shard(1), Shard(0)])
    batch.check()
    ys = dt(x, mesh2d, [Shard(0), Shard(1)])
    illegal(lambda: xs == ys)


def test_a_zero_dim_partial_compared_is_all_reduced_first(mesh2d):
    """The documented exception (dtorch/ops/scalar_partials.py): ``t.max() == 0`` on a sharded
    ``t`` (transformers' stop check) all-reduces the one element, then compares; the result is
    Replicate. Values from torch, counts by the three ledgers."""
    u = torch.tensor([1, 0, 1, 1, 0, 0])
    d = dt(u, mesh2d, [Shard(0), R])
    cases = [(lambda t: t.max() == 0, {"all_reduce": 1}),
             (lambda t: 0 < t.sum(), {"all_reduce": 1}),
             (lambda t: torch.ne(t.min(), t.max()), {"all_reduce": 2}),
             (lambda t: t.amax() >= t.float().mean(), {"all_reduce": 2})]
    for fn, counts in cases:
        out, got = counted(lambda: fn(d))
        assert got == counts
        assert out.placements == (R, R)
        assert torch.equal(out.to_torch(), fn(u))
    both = dt(u.reshape(2, 3), mesh2d, [Shard(0), Shard(1)])
    out, got = counted(lambda: both.any() == 1)  # Partial("max") on both mesh dims
    assert got == {"all_reduce": 2} and bool(out)


def test_a_partial_with_dims_is_still_refused_in_a_comparison(mesh2d):
    x = torch.randint(0, 3, (4, 6))
    pending = dt(x, mesh2d, [Shard(0), R]).amax(0)  # Partial("max"), 6 elements
    err = illegal(lambda: pending == 0)
    assert "Tensor.__eq__" in str(err) and "redistribute" in str(err)
