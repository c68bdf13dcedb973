"""Index ops along a dim other than the sharded one (dtorch/ops/index_local.py): results equal
torch's on 1-D and 2x2 meshes, even, uneven and empty shards, with no collective; a Shard on
the op's dim (or on a dim where torch reads only a prefix) raises PlacementError with a fix."""

import pytest
import torch

import dtorch
from dtorch import Replicate, Shard
from test_ops_support import Batch, dt, illegal, no_comm

R = Replicate()
SHAPES = [(6, 5), (3, 5), (2, 3)]  # uneven over 4 ranks; 3 and 2 rows leave ranks empty


def _idx(shape, high, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, high, shape, generator=g)


@pytest.mark.parametrize("shape", SHAPES)
def test_gather_scatter_along_the_unsharded_dim(mesh1d, shape):
    x = torch.randn(shape)
    n, k = shape
    idx = _idx((n, 4), k)
    src = torch.randn(n, 4)
    xs, ids, srcs = dt(x, mesh1d, [Shard(0)]), dt(idx, mesh1d, [Shard(0)]), dt(src, mesh1d, [R])
    idr = dt(idx, mesh1d, [R])
    b = Batch()
    b.add(no_comm(lambda: torch.gather(xs, 1, ids)), torch.gather(x, 1, idx), [Shard(0)])
    b.add(no_comm(lambda: xs.gather(1, idr)), x.gather(1, idx), [Shard(0)])  # R index narrowed
    full = _idx((n, k), k, 1)
    fr = dt(full, mesh1d, [R])
    b.add(no_comm(lambda: torch.take_along_dim(xs, fr, 1)), torch.take_along_dim(x, full, 1),
          [Shard(0)])
    b.add(no_comm(lambda: torch.scatter_add(xs, 1, idr, srcs)), torch.scatter_add(x, 1, idx, src),
          [Shard(0)])
    b.add(no_comm(lambda: xs.scatter(1, idr, 2.5)), x.scatter(1, idx, 2.5), [Shard(0)])
    b.add(no_comm(lambda: xs.scatter(1, ids, srcs)), x.scatter(1, idx, src), [Shard(0)])
    for how in ("sum", "prod", "mean", "amax", "amin"):
        for inc in (True, False):
            b.add(no_comm(lambda: xs.scatter_reduce(1, idr, srcs, how, include_self=inc)),
                  x.scatter_reduce(1, idx, src, how, include_self=inc), [Shard(0)])
    y = dt(x.clone(), mesh1d, [Shard(0)])
    y.scatter_add_(1, idr, srcs)
    b.add(y, x.clone().scatter_add_(1, idx, src), [Shard(0)])
    b.check()


def test_sharded_index_with_replicate_input_keeps_its_layout(mesh1d):
    x = torch.randn(4, 7)
    idx = _idx((5, 7), 4)
    b = Batch()
    b.add(no_comm(lambda: torch.gather(dt(x, mesh1d, [R]), 0, dt(idx, mesh1d, [Shard(0)]))),
          torch.gather(x, 0, idx), [Shard(0)])
    i1 = _idx((6,), 7)
    b.add(no_comm(lambda: dt(x, mesh1d, [R]).index_select(1, dt(i1, mesh1d, [Shard(0)]))),
          x.index_select(1, i1), [Shard(1)])
    b.add(no_comm(lambda: torch.take(dt(x, mesh1d, [R]), dt(i1, mesh1d, [Shard(0)]))),
          torch.take(x, i1), [Shard(0)])
    b.check()


@pytest.mark.parametrize("shape", SHAPES)
def test_index_family_on_a_sharded_input(mesh1d, shape):
    x = torch.randn(shape)
    n, k = shape
    i = torch.tensor([k - 1, 0, k - 1])
    src = torch.randn(n, 3)
    xs, ir, sr = dt(x, mesh1d, [Shard(0)]), dt(i, mesh1d, [R]), dt(src, mesh1d, [R])
    b = Batch()
    b.add(no_comm(lambda: xs.index_select(1, ir)), x.index_select(1, i), [Shard(0)])
    b.add(no_comm(lambda: xs.index_add(1, ir, sr, alpha=2)), x.index_add(1, i, src, alpha=2),
          [Shard(0)])
    u = torch.tensor([k - 1, 0])
    b.add(no_comm(lambda: xs.index_copy(1, dt(u, mesh1d, [R]), dt(src[:, :2], mesh1d, [R]))),
          x.index_copy(1, u, src[:, :2]), [Shard(0)])
    b.add(no_comm(lambda: xs.index_fill(1, ir, -3.0)), x.index_fill(1, i, -3.0), [Shard(0)])
    for how in ("prod", "mean", "amax", "amin"):
        b.add(no_comm(lambda: xs.index_reduce(1, ir, sr, how, include_self=False)),
              x.index_reduce(1, i, src, how, include_self=False), [Shard(0)])
    xt = dt(x.t().contiguous(), mesh1d, [Shard(1)])  # sharded on the last dim, index dim 0
    vals = torch.randn(2, n)
    rows = torch.tensor([0, k - 1])
    b.add(no_comm(lambda: torch.index_put(xt, (dt(rows, mesh1d, [R]),), dt(vals, mesh1d, [R]),
                                          accumulate=True)),
          torch.index_put(x.t().contiguous(), (rows,), vals, accumulate=True), [Shard(1)])
    b.check()


def test_masked_scatter_on_a_sharded_input_counts_the_mask_before_each_block(mesh1d):
    x = torch.randn(7, 3)
    mask = torch.rand(7, 3) > 0.4
    source = torch.randn(25)
    b = Batch()
    for pl in ([Shard(0)], [Shard(1)]):
        b.add(no_comm(lambda: torch.masked_scatter(dt(x, mesh1d, pl), dt(mask, mesh1d, [R]),
                                                   dt(source, mesh1d, [R]))),
              torch.masked_scatter(x, mask, source), pl)
    row = torch.tensor([True, False, True])  # broadcast mask
    b.add(no_comm(lambda: dt(x, mesh1d, [Shard(0)]).masked_scatter(dt(row, mesh1d, [R]),
                                                                 dt(source, mesh1d, [R]))),
          x.masked_scatter(row, source), [Shard(0)])
    b.check()
    xs, ms, sr = dt(x, mesh1d, [Shard(0)]), dt(mask, mesh1d, [Shard(0)]), dt(source, mesh1d, [R])
    err = illegal(lambda: torch.masked_scatter(xs, ms, sr))
    assert "mask order" in str(err) and "redistribute" in str(err)


def test_2d_mesh_index_ops(mesh2d):
    x = torch.randn(5, 6, 3)
    idx = _idx((5, 6, 2), 3)
    b = Batch()
    xs = dt(x, mesh2d, [Shard(0), Shard(1)])
    b.add(no_comm(lambda: torch.gather(xs, 2, dt(idx, mesh2d, [R, R]))), torch.gather(x, 2, idx),
          [Shard(0), Shard(1)])
    b.add(no_comm(lambda: torch.gather(xs, 2, dt(idx, mesh2d, [Shard(0), R]))),
          torch.gather(x, 2, idx), [Shard(0), Shard(1)])
    i = torch.tensor([2, 0])
    b.add(no_comm(lambda: xs.index_select(2, dt(i, mesh2d, [R, R]))), x.index_select(2, i),
          [Shard(0), Shard(1)])
    b.check()


def test_op_dim_sharded_refuses_with_a_fix(mesh1d, mesh2d):
    x = torch.randn(6, 5)
    idx = _idx((6, 5), 5)
    xs, ir, xr = dt(x, mesh1d, [Shard(0)]), dt(idx, mesh1d, [R]), dt(x, mesh1d, [R])
    one = dt(torch.tensor([1]), mesh1d, [R])
    for fn in (lambda: torch.gather(xs, 0, ir), lambda: xs.scatter_add(0, ir, xr),
               lambda: xs.index_select(0, one), lambda: torch.take(xs, one),
               lambda: torch.take_along_dim(xs, ir)):  # dim=None: flat
        err = illegal(fn)
        assert "fix:" in str(err) and "Replicate()" in str(err)
    # torch reads only the first 3 columns of x: the column blocks would not line up
    x1, i3 = dt(x, mesh1d, [Shard(1)]), dt(_idx((6, 3), 6), mesh1d, [R])
    err = illegal(lambda: torch.gather(x1, 0, i3))
    assert "first entries" in str(err)
    mr = dt(x > 0, mesh1d, [R])
    err = illegal(lambda: torch.masked_select(xs, mr))
    assert "masked_fill" in str(err)
    assert torch.equal(torch.masked_select(xr, mr).to_torch(), x[x > 0])  # Replicate runs
    x2, i2 = dt(x, mesh2d, [R, Shard(0)]), dt(idx, mesh2d, [R, R])
    illegal(lambda: torch.gather(x2, 0, i2))


def test_gradients_of_gather_scatter_add_index_select(mesh1d):
    x = torch.randn(5, 4, requires_grad=True)
    src = torch.randn(5, 3, requires_grad=True)
    idx = _idx((5, 3), 4)
    i = torch.tensor([3, 1, 3])
    (torch.gather(x, 1, idx).sin().sum() + torch.scatter_add(x, 1, idx, src).pow(2).sum()
     + x.index_select(1, i).exp().sum()).backward()
    xd = dt(x.detach(), mesh1d, [Shard(0)]).requires_grad_()
    sd = dt(src.detach(), mesh1d, [R]).requires_grad_()
    ir, iir = dt(idx, mesh1d, [R]), dt(i, mesh1d, [R])
    (torch.gather(xd, 1, ir).sin().sum() + torch.scatter_add(xd, 1, ir, sd).pow(2).sum()
     + xd.index_select(1, iir).exp().sum()).backward()
    assert torch.allclose(xd.grad.to_torch(), x.grad, atol=1e-5)
    assert torch.allclose(sd.grad.to_torch(), src.grad, atol=1e-5)
