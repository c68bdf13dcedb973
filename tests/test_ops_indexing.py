"""Indexing: basic indices on unsharded dims (a sharded dim only taken whole), one DTensor
index among full slices, and ``x[...] = value`` in place."""

import pytest
import torch

from dtorch import Partial, Replicate, Shard
from test_ops_support import Batch, dt, illegal, make, no_comm

R = Replicate()
X = torch.randn(6, 5, 4, dtype=torch.float64)

# index -> output placements for input placements [Shard(0)], [Shard(2)], or None when illegal
CASES = [
    ((slice(None), 1), ((Shard(0),), (Shard(1),))),
    ((slice(None), slice(1, 4)), ((Shard(0),), (Shard(2),))),
    ((Ellipsis, None), ((Shard(0),), (Shard(2),))),
    ((None, Ellipsis, 2), ((Shard(1),), None)),
    ((slice(None), slice(None, None, 2), slice(None)), ((Shard(0),), (Shard(2),))),
    ((slice(0, 100),), ((Shard(0),), (Shard(2),))),
    ((0,), (None, (Shard(1),))),
    ((slice(1, 3),), (None, (Shard(2),))),
    ((Ellipsis, slice(0, 2)), ((Shard(0),), None)),
    ((-1, Ellipsis, None), (None, (Shard(1),))),
]


@pytest.mark.parametrize("index,wants", CASES, ids=lambda v: str(v)[:30])
def test_basic_indexing(mesh1d, index, wants):
    batch = Batch()
    for pl, want in zip(([Shard(0)], [Shard(2)]), wants):
        x = dt(X, mesh1d, pl)
        if want is None:
            illegal(lambda: x[index])
        else:
            batch.add(no_comm(lambda: x[index]), X[index], want)
    p = make(X, mesh1d, [Partial("max")], 1)
    batch.add(no_comm(lambda: p[index]), X[index], [Partial("max")])
    batch.check()


def test_indexing_on_2d_mesh(mesh2d):
    x = dt(X, mesh2d, [Shard(0), Shard(2)])
    batch = Batch()
    batch.add(no_comm(lambda: x[:, 2]), X[:, 2], [Shard(0), Shard(1)])
    batch.add(no_comm(lambda: x[:, None, 1:3, :]), X[:, None, 1:3, :], [Shard(0), Shard(3)])
    batch.check()
    illegal(lambda: x[..., 0])


def test_gather_with_a_dtensor_index(mesh1d, mesh2d):
    idx = torch.tensor([[4, 0, 3], [1, 1, 5]])
    batch = Batch()
    batch.add(no_comm(lambda: dt(X, mesh1d, [R])[dt(idx, mesh1d, [Shard(1)])]), X[idx],
              [Shard(1)])
    batch.add(no_comm(lambda: dt(X, mesh1d, [Shard(2)])[dt(idx, mesh1d, [R])]), X[idx],
              [Shard(3)])
    i1 = torch.tensor([3, 0])
    batch.add(no_comm(lambda: dt(X, mesh2d, [Shard(0), R])[:, dt(i1, mesh2d, [R, Shard(0)])]),
              X[:, i1], [Shard(0), Shard(1)])
    batch.add(no_comm(lambda: make(X, mesh1d, [Partial()], 2)[dt(idx, mesh1d, [R])]), X[idx],
              [Partial()])
    batch.check()
    xs, ir = dt(X, mesh1d, [Shard(0)]), dt(idx, mesh1d, [R])
    illegal(lambda: xs[ir])
    i0 = dt(idx, mesh1d, [Shard(0)])
    illegal(lambda: xs[:, i0])


def test_setitem(mesh1d, mesh2d):
    expected = X.clone()
    x = dt(X, mesh1d, [Shard(0)])
    no_comm(lambda: x.__setitem__((slice(None), 1), 7.0))
    expected[:, 1] = 7.0
    row = torch.arange(4.).double()
    no_comm(lambda: x.__setitem__((slice(None), 2), dt(row, mesh1d, [R])))
    expected[:, 2] = row
    block = torch.randn(6, 4, dtype=torch.float64)
    x[:, 3] = dt(block, mesh1d, [Shard(0)])
    expected[:, 3] = block
    y = dt(X, mesh2d, [Shard(0), Shard(2)])
    y[..., 0:2, :] = 0.0
    ey = X.clone()
    ey[..., 0:2, :] = 0.0
    batch = Batch()
    batch.add(x, expected, [Shard(0)])
    batch.add(y, ey, [Shard(0), Shard(2)])
    batch.check()
    p = make(X, mesh1d, [Partial()], 3)
    illegal(lambda: p.__setitem__(0, 1.0))
    bs1 = dt(block, mesh1d, [Shard(1)])
    illegal(lambda: x.__setitem__((slice(None), 0), bs1))
    illegal(lambda: x.__setitem__(0, 1.0))
