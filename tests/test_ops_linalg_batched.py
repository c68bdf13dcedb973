"""Batched matrix functions and the dim-local linalg ops on a real cluster: a batch-sharded
input runs each rank's block with no collective (even, uneven and empty shards, 1-D and 2x2
meshes), a Replicate operand beside it is narrowed, outputs keep the batch Shard, values equal
torch's; a sharded matrix dim raises PlacementError with the fix; gradients match torch's."""

import pytest
import torch

import dtorch
from dtorch import Replicate, Shard
from test_ops_support import Batch, dt, illegal, make, no_comm

R = Replicate()
N = 4


def gen(*shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=torch.float64)


def well(*batch, n=N, seed=0):
    """Well-conditioned square matrices."""
    return gen(*batch, n, n, seed=seed) + n * torch.eye(n, dtype=torch.float64)


def spd(*batch, n=N, seed=0):
    a = gen(*batch, n, n, seed=seed)
    return a @ a.mT + n * torch.eye(n, dtype=torch.float64)


def _lu(*batch):
    return torch.linalg.lu_factor(well(*batch))


def _qr(*batch):
    return torch.geqrf(gen(*batch, 5, 3))


# name -> (fn, inputs for a batch shape)
CASES = {
    "inv": (torch.linalg.inv, lambda *b: [well(*b)]),
    "inv_ex": (torch.linalg.inv_ex, lambda *b: [well(*b)]),
    "inverse": (torch.inverse, lambda *b: [well(*b)]),
    "det": (torch.linalg.det, lambda *b: [well(*b)]),
    "torch.det": (torch.det, lambda *b: [well(*b)]),
    "logdet": (torch.logdet, lambda *b: [spd(*b)]),
    "slogdet": (torch.linalg.slogdet, lambda *b: [well(*b)]),
    "matrix_exp": (torch.matrix_exp, lambda *b: [gen(*b, N, N)]),
    "cholesky": (torch.linalg.cholesky, lambda *b: [spd(*b)]),
    "cholesky_ex": (torch.linalg.cholesky_ex, lambda *b: [spd(*b)]),
    "torch.cholesky": (torch.cholesky, lambda *b: [spd(*b)]),
    "cholesky_inverse": (torch.cholesky_inverse, lambda *b: [torch.linalg.cholesky(spd(*b))]),
    "qr": (torch.linalg.qr, lambda *b: [gen(*b, 5, 3)]),
    "torch.qr": (torch.qr, lambda *b: [gen(*b, 5, 3)]),
    "svd": (lambda a: torch.linalg.svd(a, full_matrices=False), lambda *b: [gen(*b, 5, 3)]),
    "torch.svd": (torch.svd, lambda *b: [gen(*b, 5, 3)]),
    "svdvals": (torch.linalg.svdvals, lambda *b: [gen(*b, 5, 3)]),
    "eig": (torch.linalg.eig, lambda *b: [gen(*b, N, N)]),
    "eigvals": (torch.linalg.eigvals, lambda *b: [gen(*b, N, N)]),
    "eigh": (torch.linalg.eigh, lambda *b: [spd(*b)]),
    "eigvalsh": (torch.linalg.eigvalsh, lambda *b: [spd(*b)]),
    "pinv": (torch.linalg.pinv, lambda *b: [gen(*b, 5, 3)]),
    "pinverse": (torch.pinverse, lambda *b: [gen(*b, 5, 3)]),
    "matrix_power": (lambda a: torch.linalg.matrix_power(a, 3), lambda *b: [gen(*b, N, N)]),
    "matrix_rank": (torch.linalg.matrix_rank, lambda *b: [gen(*b, 5, 3)]),
    "cond": (torch.linalg.cond, lambda *b: [well(*b)]),
    "matrix_norm": (lambda a: torch.linalg.matrix_norm(a, ord=2), lambda *b: [gen(*b, 5, 3)]),
    "norm-fro": (lambda a: torch.linalg.norm(a, dim=(-2, -1)), lambda *b: [gen(*b, 5, 3)]),
    "lu": (torch.linalg.lu, lambda *b: [gen(*b, 5, 3)]),
    "torch.lu": (torch.lu, lambda *b: [well(*b)]),
    "lu_factor": (torch.linalg.lu_factor, lambda *b: [well(*b)]),
    "lu_factor_ex": (torch.linalg.lu_factor_ex, lambda *b: [well(*b)]),
    "ldl_factor": (torch.linalg.ldl_factor, lambda *b: [spd(*b)]),
    "geqrf": (torch.geqrf, lambda *b: [gen(*b, 5, 3)]),
    "solve": (torch.linalg.solve, lambda *b: [well(*b), gen(*b, N, 2, seed=1)]),
    "solve-vector": (torch.linalg.solve, lambda *b: [well(*b), gen(*b, N, seed=1)]),
    "solve_ex": (torch.linalg.solve_ex, lambda *b: [well(*b), gen(*b, N, 2, seed=1)]),
    "solve_triangular": (lambda a, b: torch.linalg.solve_triangular(a, b, upper=True),
                         lambda *b: [well(*b).triu(), gen(*b, N, 2, seed=1)]),
    "triangular_solve": (torch.triangular_solve,
                         lambda *b: [gen(*b, N, 2, seed=1), well(*b).triu()]),
    "cholesky_solve": (torch.cholesky_solve,
                       lambda *b: [gen(*b, N, 2, seed=1), torch.linalg.cholesky(spd(*b))]),
    "lstsq": (torch.linalg.lstsq, lambda *b: [gen(*b, 5, 3), gen(*b, 5, 2, seed=1)]),
    "lu_solve": (torch.linalg.lu_solve, lambda *b: [*_lu(*b), gen(*b, N, 2, seed=1)]),
    "torch.lu_solve": (torch.lu_solve, lambda *b: [gen(*b, N, 2, seed=1), *_lu(*b)]),
    "lu_unpack": (torch.lu_unpack, lambda *b: [*_lu(*b)]),
    "householder_product": (torch.linalg.householder_product, lambda *b: [*_qr(*b)]),
    "ormqr": (torch.ormqr, lambda *b: [*_qr(*b), gen(*b, 5, 2, seed=1)]),
    "ldl_solve": (torch.linalg.ldl_solve,
                  lambda *b: [*torch.linalg.ldl_factor(spd(*b)), gen(*b, N, 2, seed=1)]),
}


def _check(mesh, fn, values, placements, out_placements=None):
    """``fn`` on DTensors (the first ``placements``, the rest Replicate) vs torch, no
    collective; every output ``out_placements`` (default: the first input's)."""
    expected = fn(*values)
    ds = [dt(v, mesh, placements if i == 0 else [R] * mesh.ndim) for i, v in enumerate(values)]
    out = no_comm(lambda: fn(*ds))
    batch = Batch()
    outs = out if isinstance(out, tuple) else (out,)
    exps = expected if isinstance(expected, tuple) else (expected,)
    assert len(outs) == len(exps)
    for o, e in zip(outs, exps):
        want = out_placements or tuple(placements)
        if e.numel() == 0 and e.ndim == 1 and len(values[0].shape) > 1:
            want = (R,) * mesh.ndim  # lstsq's empty residuals: the same on every rank
        batch.add(o, e, want, rtol=1e-6, atol=1e-8)
    batch.check()


@pytest.mark.parametrize("name", sorted(CASES))
def test_batch_sharded_1d_even_uneven_empty(mesh1d, name):
    fn, inputs = CASES[name]
    for b in (8, 5, 3):  # even, uneven, and a rank with an empty block
        _check(mesh1d, fn, inputs(b), [Shard(0)])


@pytest.mark.parametrize("name", ["inv", "det", "slogdet", "qr", "svd", "eigh", "solve",
                                  "lu_solve", "lstsq", "ormqr"])
def test_two_batch_dims_on_2x2_mesh(mesh2d, name):
    fn, inputs = CASES[name]
    _check(mesh2d, fn, inputs(3, 5), [Shard(0), Shard(1)])
    _check(mesh2d, fn, inputs(4, 2), [Shard(1), Shard(0)])
    _check(mesh2d, fn, inputs(5, 2), [Shard(0), R])


def test_operands_sharded_alike_and_broadcast(mesh1d):
    a, b = well(6), gen(6, N, 2, seed=1)
    batch = Batch()
    both = no_comm(lambda: torch.linalg.solve(dt(a, mesh1d, [Shard(0)]),
                                              dt(b, mesh1d, [Shard(0)])))
    batch.add(both, torch.linalg.solve(a, b), [Shard(0)])
    rb = no_comm(lambda: torch.linalg.solve(dt(a, mesh1d, [R]), dt(b, mesh1d, [Shard(0)])))
    batch.add(rb, torch.linalg.solve(a, b), [Shard(0)])  # A narrowed to B's blocks
    a1 = well(1)  # a broadcast batch dim: A stays whole on every rank
    bc = no_comm(lambda: torch.linalg.solve(dt(a1, mesh1d, [R]), dt(b, mesh1d, [Shard(0)])))
    batch.add(bc, torch.linalg.solve(a1, b), [Shard(0)])
    batch.check()
    a1s, br, a0, b2 = (dt(a1, mesh1d, [Shard(0)]), dt(b, mesh1d, [R]), dt(a, mesh1d, [Shard(0)]),
                       dt(b, mesh1d, [Shard(2)]))
    illegal(lambda: torch.linalg.solve(a1s, br), match="broadcast")
    illegal(lambda: torch.linalg.solve(a0, b2), match="Shard")


def test_batch_dims_of_fewer_dims_line_up_from_the_right(mesh1d):
    """B's one batch dim is A's second (torch broadcasts from the right): A sharded there
    narrows B on that dim, not on its first."""
    a, b = well(3, 5), gen(5, N, 2, seed=1)
    batch = Batch()
    got = no_comm(lambda: torch.linalg.solve(dt(a, mesh1d, [Shard(1)]), dt(b, mesh1d, [R])))
    batch.add(got, torch.linalg.solve(a, b), [Shard(1)])
    batch.check()


@pytest.mark.parametrize("name", ["inv", "det", "qr", "svd", "solve", "cholesky", "eig"])
def test_sharded_matrix_dim_refuses_with_fix(mesh1d, name):
    fn, inputs = CASES[name]
    unbatched = [v[0] for v in inputs(1)]
    ds = [dt(v, mesh1d, [Shard(0)] if i == 0 else [R]) for i, v in enumerate(unbatched)]
    err = illegal(lambda: fn(*ds), match="mixes its matrix")
    assert "redistribute(placements=[Replicate()])" in str(err)
    batched = inputs(4)
    ds = [dt(v, mesh1d, [Shard(v.ndim - 1)] if i == 0 else [R]) for i, v in enumerate(batched)]
    err = illegal(lambda: fn(*ds))
    assert "redistribute(placements=[Shard(0)])" in str(err)  # the batch dim


def test_lstsq_tall_with_a_rank_revealing_driver_refuses(mesh1d):
    a, b = gen(4, 5, 3), gen(4, 5, 2, seed=1)
    da, db = dt(a, mesh1d, [Shard(0)]), dt(b, mesh1d, [R])
    illegal(lambda: torch.linalg.lstsq(da, db, driver="gelsd"), match="gelsy")
    ra, rb = dt(a, mesh1d, [R]), dt(b, mesh1d, [R])  # all Replicate: runs (eagerly)
    got = torch.linalg.lstsq(ra, rb, driver="gelsd")
    want = torch.linalg.lstsq(a, b, driver="gelsd")
    for g, w in zip(got, want):
        torch.testing.assert_close(g.to_torch(), w)


# dim-local linalg ops ---------------------------------------------------------------------------
DIMS = {  # name -> (fn, inputs, first input's placement, output placement)
    "vecdot-rows": (lambda x, y: torch.linalg.vecdot(x, y), [gen(5, 3), gen(5, 3, seed=1)],
                    Shard(0), Shard(0)),
    "vecdot-dim0": (lambda x, y: torch.linalg.vecdot(x, y, dim=0),
                    [gen(3, 5), gen(3, 5, seed=1)], Shard(1), Shard(0)),
    "cross": (lambda x, y: torch.linalg.cross(x, y), [gen(5, 3), gen(5, 3, seed=1)],
              Shard(0), Shard(0)),
    "torch.cross-default-dim": (torch.cross, [gen(5, 3, 2), gen(5, 3, 2, seed=1)], Shard(2),
                                Shard(2)),
    "cross-broadcast": (lambda x, y: torch.linalg.cross(x, y), [gen(5, 3), gen(1, 3, seed=1)],
                        Shard(0), Shard(0)),
    "diagonal": (lambda x: torch.linalg.diagonal(x), [gen(5, 3, 3)], Shard(0), Shard(0)),
    "diagonal-dims": (lambda x: torch.linalg.diagonal(x, offset=1, dim1=0, dim2=2),
                      [gen(3, 5, 3)], Shard(1), Shard(0)),
    "diag_embed": (torch.diag_embed, [gen(5, 3)], Shard(0), Shard(0)),
    "diag_embed-dims": (lambda x: torch.diag_embed(x, dim1=0, dim2=2), [gen(5, 3)], Shard(0),
                        Shard(1)),
    "vander-last": (torch.linalg.vander, [gen(2, 5)], Shard(1), Shard(1)),
    "vander-N": (lambda x: torch.linalg.vander(x, N=3), [gen(5)], Shard(0), Shard(0)),
    "multi_dot-rows": (lambda a, b, c: torch.linalg.multi_dot([a, b, c]),
                       [gen(5, 3), gen(3, 4, seed=1), gen(4, 2, seed=2)], Shard(0), Shard(0)),
    "chain_matmul": (torch.chain_matmul, [gen(5, 3), gen(3, 4, seed=1)], Shard(0), Shard(0)),
    "norm-vector-dim": (lambda x: torch.linalg.norm(x, dim=1), [gen(5, 3)], Shard(0),
                        Shard(0)),
    "norm-keepdim": (lambda x: torch.linalg.norm(x, ord=1, dim=(0, 2), keepdim=True),
                     [gen(3, 5, 2)], Shard(1), Shard(1)),
}


@pytest.mark.parametrize("name", sorted(DIMS))
def test_dim_local_linalg(mesh1d, name):
    fn, values, p, out = DIMS[name]
    _check(mesh1d, fn, values, [p], (out,))


def test_multi_dot_last_columns_on_2x2_mesh(mesh2d):
    a, b, c = gen(5, 3), gen(3, 4, seed=1), gen(4, 6, seed=2)
    da, db, dc = dt(a, mesh2d, [Shard(0), R]), dt(b, mesh2d, [R, R]), dt(c, mesh2d, [R, Shard(1)])
    out = no_comm(lambda: torch.linalg.multi_dot([da, db, dc]))
    batch = Batch()
    batch.add(out, torch.linalg.multi_dot([a, b, c]), [Shard(0), Shard(1)])
    batch.check()
    a1 = dt(a, mesh2d, [Shard(1), R])
    illegal(lambda: torch.linalg.multi_dot([a1, db, dc]))


def test_mixing_every_dim_refuses(mesh1d):
    sq, t3, d3 = (dt(gen(5, 5), mesh1d, [Shard(0)]), dt(gen(4, 2, 2), mesh1d, [Shard(0)]),
                  dt(gen(3, 5, 5), mesh1d, [Shard(2)]))
    x, y = dt(gen(5, 3), mesh1d, [Shard(1)]), dt(gen(5, 3), mesh1d, [R])
    err = illegal(lambda: torch.trace(sq), match="sums the diag")
    assert "redistribute(placements=[Replicate()])" in str(err)
    illegal(lambda: torch.linalg.tensorinv(t3, ind=1))
    illegal(lambda: torch.linalg.diagonal(d3), match="Shard\\(0\\)")
    illegal(lambda: torch.linalg.vecdot(x, y))


# gradients ---------------------------------------------------------------------------------------
def grad_check(mesh, fn, values, placements):
    """``fn``'s input gradients on DTensors (``placements`` per input) vs torch's."""
    ts = [v.clone().requires_grad_() for v in values]
    want_out = fn(*ts)
    g = gen(*want_out.shape, seed=100)
    want = torch.autograd.grad(want_out, ts, g)
    ds = [make(v, mesh, p).requires_grad_() for v, p in zip(values, placements)]
    out = fn(*ds)
    dg = dtorch.tensor(g, device_mesh=mesh, placements=list(out.placements))
    got = dtorch.autograd.grad(out, ds, dg)
    torch.testing.assert_close(out.to_torch(), want_out.detach())
    for d, w in zip(got, want):
        torch.testing.assert_close(d.to_torch(), w)


@pytest.mark.parametrize("b", [8, 3])
def test_gradients(mesh1d, b):
    grad_check(mesh1d, torch.linalg.inv, [well(b)], [[Shard(0)]])
    grad_check(mesh1d, torch.linalg.det, [well(b)], [[Shard(0)]])
    grad_check(mesh1d, torch.linalg.solve, [well(b), gen(b, N, 2, seed=1)],
               [[Shard(0)], [Shard(0)]])
    grad_check(mesh1d, torch.linalg.solve, [well(b), gen(b, N, 2, seed=1)],
               [[Shard(0)], [R]])  # B narrowed: its gradient gathers the blocks


def test_backward_of_a_loss(mesh1d):
    a = well(5)
    x = dt(a, mesh1d, [Shard(0)]).requires_grad_()
    loss = torch.linalg.inv(x).sum()
    loss.backward()
    t = a.clone().requires_grad_()
    torch.linalg.inv(t).sum().backward()
    torch.testing.assert_close(x.grad.to_torch(), t.grad)
