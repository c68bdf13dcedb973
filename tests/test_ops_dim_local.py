"""Ops along a dim other than the sharded one (dtorch/ops/dim_local.py, and the shape ops it
touched): results equal torch's on 1-D and 2x2 meshes, even, uneven and empty shards, with no
collective; a Shard on a dim the op works along raises PlacementError with a fix."""

import pytest
import torch

from dtorch import Replicate, Shard
from test_ops_support import Batch, dt, illegal, no_comm

R = Replicate()
ROWS = [8, 5, 3]  # even, uneven, and some rank empty over 4 ranks

UNARY = {  # name: (fn on a (rows, 4, 3) tensor sharded on dim 0, output Shard dim)
    "fliplr": (torch.fliplr, 0), "flip": (lambda x: torch.flip(x, (1, 2)), 0),
    "rot90": (lambda x: torch.rot90(x, 1, (1, 2)), 0),
    "roll": (lambda x: torch.roll(x, (2, x.shape[0]), (1, 0)), 0),  # a whole turn on dim 0
    "diff": (lambda x: torch.diff(x, 2, dim=1), 0),
    "diag_embed": (lambda x: torch.diag_embed(x, 1, 1, 3), 0),
    "renorm": (lambda x: torch.renorm(x, 2, 0, 1.0), 0),
    "mode": (lambda x: torch.mode(x.round(), 2)[0], 0),
    "mode_indices": (lambda x: torch.mode(x.round(), 2, keepdim=True)[1], 0),
    "aminmax": (lambda x: torch.aminmax(x, dim=1)[1], 0),
    "gradient": (lambda x: torch.gradient(x, dim=(1, 2), edge_order=1)[1], 0),
    "trapezoid": (lambda x: torch.trapezoid(x, dx=0.5, dim=1), 0),
    "cumulative_trapezoid": (lambda x: torch.cumulative_trapezoid(x, dim=2), 0),
    "tile": (lambda x: torch.tile(x, (2, 1, 1, 3)), 1),
    "unfold": (lambda x: x.unfold(1, 2, 1), 0),
    "narrow_copy": (lambda x: torch.narrow_copy(x, 2, 1, 2), 0),
    "atleast_3d": (torch.atleast_3d, 0),
    "dsplit": (lambda x: torch.dsplit(x, [1])[1], 0),
    "unsafe_split": (lambda x: torch.unsafe_split(x, 3, 1)[1], 0),
}


@pytest.mark.parametrize("rows", ROWS)
def test_unary_ops_along_other_dims(mesh1d, rows):
    x = torch.randn(rows, 4, 3)
    xs = dt(x, mesh1d, [Shard(0)])
    b = Batch()
    for name, (fn, out_dim) in UNARY.items():
        b.add(no_comm(lambda: fn(xs)), fn(x), [Shard(out_dim)])
    b.check()


def test_last_dim_sharded(mesh1d):
    x = torch.randn(4, 3, 6)
    xs = dt(x, mesh1d, [Shard(2)])
    b = Batch()
    for fn in (torch.flipud, lambda t: torch.rot90(t, 3, (0, 1)), lambda t: torch.diff(t, dim=0),
               lambda t: t.sum_to_size(1, 1, 6), lambda t: torch.atleast_2d(t),
               lambda t: torch.trapezoid(t, dim=1)):
        expected = fn(x)
        b.add(no_comm(lambda: fn(xs)), expected, [Shard(expected.ndim - 1)])
    b.add(no_comm(lambda: torch.mode(xs, 1)[1]), torch.mode(x, 1)[1], [Shard(1)])
    b.check()


@pytest.mark.parametrize("rows", ROWS)
def test_ops_with_more_operands(mesh1d, rows):
    x = torch.randn(rows, 5)
    xs = dt(x, mesh1d, [Shard(0)])
    b = Batch()
    pre, app = torch.randn(rows, 2), torch.randn(rows, 1)
    b.add(no_comm(lambda: torch.diff(xs, dim=1, prepend=dt(pre, mesh1d, [R]),
                                     append=dt(app, mesh1d, [Shard(0)]))),
          torch.diff(x, dim=1, prepend=pre, append=app), [Shard(0)])
    b.add(no_comm(lambda: torch.select_scatter(xs, dt(torch.ones(rows), mesh1d, [R]), 1, 2)),
          torch.select_scatter(x, torch.ones(rows), 1, 2), [Shard(0)])
    b.add(no_comm(lambda: torch.slice_scatter(xs, dt(torch.ones(rows, 2), mesh1d, [Shard(0)]),
                                              1, 1, 5, 2)),
          torch.slice_scatter(x, torch.ones(rows, 2), 1, 1, 5, 2), [Shard(0)])
    x3 = torch.randn(rows, 4, 4)
    d = torch.randn(rows, 3)
    b.add(no_comm(lambda: torch.diagonal_scatter(dt(x3, mesh1d, [Shard(0)]), dt(d, mesh1d, [R]),
                                                 1, 1, 2)),
          torch.diagonal_scatter(x3, d, 1, 1, 2), [Shard(0)])
    seq = torch.randn(rows, 6).sort(-1).values
    v = torch.randn(rows, 4)
    b.add(no_comm(lambda: torch.searchsorted(dt(seq, mesh1d, [Shard(0)]), dt(v, mesh1d, [R]))),
          torch.searchsorted(seq, v), [Shard(0)])
    edges = torch.tensor([-1.0, 0.0, 0.5])
    b.add(no_comm(lambda: torch.searchsorted(dt(edges, mesh1d, [R]), xs, right=True)),
          torch.searchsorted(edges, x, right=True), [Shard(0)])
    b.add(no_comm(lambda: torch.bucketize(xs, dt(edges, mesh1d, [R]))),
          torch.bucketize(x, edges), [Shard(0)])
    test = x.flatten()[::3].clone()
    b.add(no_comm(lambda: torch.isin(xs, dt(test, mesh1d, [R]))), torch.isin(x, test),
          [Shard(0)])
    yx = torch.randn(rows, 5).cumsum(1)
    b.add(no_comm(lambda: torch.trapezoid(xs, dt(yx, mesh1d, [R]))), torch.trapezoid(x, yx),
          [Shard(0)])
    b.check()


@pytest.mark.parametrize("rows", ROWS)
def test_stacks_broadcast_and_meshgrid(mesh1d, rows):
    a, c = torch.randn(rows, 2), torch.randn(rows)
    sa, rc = dt(a, mesh1d, [Shard(0)]), dt(c, mesh1d, [R])
    b = Batch()
    b.add(no_comm(lambda: torch.column_stack([sa, rc])), torch.column_stack([a, c]), [Shard(0)])
    b.add(no_comm(lambda: torch.hstack([sa, dt(a, mesh1d, [R])])), torch.hstack([a, a]),
          [Shard(0)])
    b.add(no_comm(lambda: torch.dstack([sa, sa])), torch.dstack([a, a]), [Shard(0)])
    b.add(no_comm(lambda: torch.vstack([dt(c, mesh1d, [Shard(0)]), rc])), torch.vstack([c, c]),
          [Shard(1)])
    one = torch.randn(1, 3)
    outs = no_comm(lambda: torch.broadcast_tensors(dt(torch.randn(rows, 1), mesh1d, [R]),
                                                   dt(one, mesh1d, [R]),
                                                   dt(torch.ones(rows, 3), mesh1d, [Shard(0)])))
    assert all(o.placements == (Shard(0),) for o in outs)
    b.add(outs[1], one.expand(rows, 3).clone())
    g = torch.arange(4.)
    for indexing, dim in (("ij", 0), ("xy", 1)):
        got = no_comm(lambda: torch.meshgrid(dt(c, mesh1d, [Shard(0)]), dt(g, mesh1d, [R]),
                                             indexing=indexing))
        for o, e in zip(got, torch.meshgrid(c, g, indexing=indexing)):
            b.add(o, e, [Shard(dim)])
    b.check()


def test_2d_mesh(mesh2d):
    x = torch.randn(5, 3, 6)
    xs = dt(x, mesh2d, [Shard(0), Shard(2)])
    b = Batch()
    b.add(no_comm(lambda: torch.diff(xs, dim=1)), torch.diff(x, dim=1), [Shard(0), Shard(2)])
    b.add(no_comm(lambda: torch.flip(xs, (1,))), torch.flip(x, (1,)), [Shard(0), Shard(2)])
    src = torch.randn(5, 6)
    b.add(no_comm(lambda: torch.select_scatter(xs, dt(src, mesh2d, [R, R]), 1, 0)),
          torch.select_scatter(x, src, 1, 0), [Shard(0), Shard(2)])
    u, v = torch.randn(5), torch.randn(6)
    got = no_comm(lambda: torch.meshgrid(dt(u, mesh2d, [Shard(0), R]),
                                         dt(v, mesh2d, [R, Shard(0)]), indexing="ij"))
    for o, e in zip(got, torch.meshgrid(u, v, indexing="ij")):
        b.add(o, e, [Shard(0), Shard(1)])
    b.check()


def test_op_dim_sharded_refuses_with_a_fix(mesh1d):
    x = torch.randn(6, 5)
    xs, x1 = dt(x, mesh1d, [Shard(0)]), dt(x, mesh1d, [Shard(1)])
    r1, a6 = dt(torch.randn(6), mesh1d, [R]), dt(torch.arange(6.), mesh1d, [Shard(0)])
    cases = [lambda: torch.flipud(xs), lambda: torch.rot90(xs), lambda: torch.diff(xs, dim=0),
             lambda: torch.renorm(x1, 2, 0, 1.0), lambda: torch.mode(x1),
             lambda: torch.aminmax(xs), lambda: torch.gradient(xs),
             lambda: torch.trapezoid(x1), lambda: torch.tile(xs, (2, 1)),
             lambda: xs.unfold(0, 2, 1), lambda: torch.vstack([xs, xs]),
             lambda: torch.searchsorted(a6, r1), lambda: torch.isin(r1, a6),
             lambda: torch.diag(xs), lambda: torch.cartesian_prod(a6),
             lambda: torch.as_strided(xs, (2, 2), (1, 2)), lambda: torch.roll(xs, 1, 0),
             lambda: xs.sum_to_size(1, 5)]
    for fn in cases:
        err = illegal(fn)
        assert "fix:" in str(err), str(err)


def test_gradients_of_diff_and_flip(mesh1d):
    x = torch.randn(5, 4, requires_grad=True)
    pre = torch.randn(5, 1, requires_grad=True)
    (torch.diff(x, dim=1, prepend=pre).pow(2).sum() + torch.flip(x, (1,)).sin().mul(
        torch.arange(4.)).sum()).backward()
    xd = dt(x.detach(), mesh1d, [Shard(0)]).requires_grad_()
    pd = dt(pre.detach(), mesh1d, [R]).requires_grad_()
    w = dt(torch.arange(4.), mesh1d, [R])
    (torch.diff(xd, dim=1, prepend=pd).pow(2).sum() + torch.flip(xd, (1,)).sin().mul(w).sum()
     ).backward()
    assert torch.allclose(xd.grad.to_torch(), x.grad, atol=1e-5)
    assert torch.allclose(pd.grad.to_torch(), pre.grad, atol=1e-5)
