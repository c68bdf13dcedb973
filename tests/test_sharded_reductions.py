"""Reductions and scans along a sharded dim on a real cluster (dtorch.ops.sharded_*):
values, indices (ties, NaN, empty shards), collectives counted by every ledger, the moved
data (the candidates, not the input), gradients, and the refusals."""

import pytest
import torch

import dtorch
from dtorch import Partial, Replicate, Shard
from ledgers import counted
from test_ops_support import Batch, illegal, make

R = Replicate()


def dist(x, mesh, placements):
    return dtorch.distribute_tensor(x, mesh, list(placements))


# (mesh fixture, placements as a function of the reduced dim d and another dim e)
LAYOUTS = {
    "1d": ("mesh1d", lambda d, e: (Shard(d),)),
    "2d_same_dim": ("mesh2d", lambda d, e: (Shard(d), Shard(d))),
    "2d_with_other": ("mesh2d", lambda d, e: (Shard(e), Shard(d))),
    "2d_one_mesh_dim": ("mesh2d", lambda d, e: (Shard(d), R)),
}
SIZES = [8, 10, 3, 2, 1]  # even; uneven; some ranks empty (2 on 2x2: empty blocks between)


def _gathers(placements, dims, tensors):
    """The all_gathers a candidate composite issues: one per mesh dim sharding a reduced dim,
    per gathered tensor."""
    n = sum(1 for p in placements if isinstance(p, Shard) and p.dim in dims)
    return {"all_gather": n * tensors} if n else {}


def _data(n, dtype, seed, ties=True):
    g = torch.Generator().manual_seed(seed)
    if ties:  # few distinct values: ties inside and across ranks
        return torch.randint(-2, 3, (3, n), generator=g).to(dtype)
    return torch.randn(3, n, generator=g, dtype=dtype)


def _layout(request, name, d, e):
    fixture, placements = LAYOUTS[name]
    return request.getfixturevalue(fixture), placements(d, e)


# (call, gathered tensors, whether the data has ties, whether the sharded dim is dim 1 / -1)
EXTREMES = {
    "max_dim": (lambda x: torch.max(x, 1), 2),
    "max_keepdim_neg": (lambda x: x.max(-1, keepdim=True), 2),
    "min_dim": (lambda x: x.min(dim=1), 2),
    "min_keepdim": (lambda x: torch.min(x, -1, True), 2),
    "argmax": (lambda x: x.argmax(1), 2),
    "argmin_keepdim": (lambda x: torch.argmin(x, -1, keepdim=True), 2),
    "argmax_all": (lambda x: torch.argmax(x), 2),
    "argmin_all_keepdim": (lambda x: x.argmin(keepdim=True), 2),
    "logsumexp": (lambda x: torch.logsumexp(x, 1), 1),
    "logsumexp_keepdim": (lambda x: x.logsumexp((-1,), keepdim=True), 1),
    "var": (lambda x: torch.var(x, 1), 2),
    "std_keepdim_c0": (lambda x: x.std(-1, correction=0, keepdim=True), 2),
    "var_unbiased_false": (lambda x: torch.var(x, 1, False, True), 2),
    "var_mean_all": (lambda x: torch.var_mean(x), 2),
    "std_mean": (lambda x: torch.std_mean(x, 1, correction=2), 2),
    "cumsum": (lambda x: x.cumsum(1), 1),
    "cumprod_neg": (lambda x: torch.cumprod(x, -1), 1),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("name", sorted(EXTREMES))
def test_against_torch_and_counted(request, name, layout, dtype):
    """Every composite, every layout, even / uneven / empty shards, ties: torch's values and
    indices (first occurrence), and the collectives of its plan (all three ledgers)."""
    fn, tensors = EXTREMES[name]
    mesh, placements = _layout(request, layout, 1, 0)
    dims = (0, 1) if name.endswith(("_all", "_all_keepdim")) or name == "var_mean_all" else (1,)
    batch = Batch()
    for n in SIZES:
        x = _data(n, dtype, n, ties=not name.startswith(("var", "std", "cum")))
        if name.startswith("cumprod"):
            x = x / 2 + 1
        if n < 3 and name.startswith(("var", "std")):
            continue  # torch's own nan / warning
        out, counts = counted(lambda: fn(dist(x, mesh, placements)))
        assert counts == _gathers(placements, dims, tensors), (n, counts)
        expected = fn(x)
        if isinstance(expected, tuple):
            batch.add(list(out), list(expected))
        else:
            batch.add(out, expected)
    batch.check()


def test_nan_and_integers(mesh1d, mesh2d):
    """NaN wins max/min at its first occurrence, from any rank; integer inputs (an empty rank's
    candidate is iinfo's bound, which never wins); an integer cumsum promotes to int64."""
    x = torch.tensor([[1., 2., 3., float("nan"), 5., float("nan")],
                      [9., 9., 0., 9., 0., 1.],
                      [float("-inf")] * 6])
    xi = torch.tensor([[torch.iinfo(torch.int64).min] * 3, [4, -2, 4]])
    batch = Batch()
    for mesh, placements in ((mesh1d, (Shard(1),)), (mesh2d, (Shard(1), Shard(1)))):
        d = dist(x, mesh, placements)
        for fn in (lambda t: t.max(1), lambda t: t.min(1), lambda t: t.argmax(),
                   lambda t: t.argmin(1), lambda t: t.logsumexp(1)):
            batch.add(fn(d), fn(x))
        di = dist(xi, mesh, placements)
        for fn in (lambda t: t.max(1), lambda t: t.argmin(), lambda t: t.cumsum(1)):
            batch.add(fn(di), fn(xi))
        batch.add(dist(xi.int(), mesh, placements).cumsum(1), xi.int().cumsum(1))
    batch.check()


# topk / kthvalue: k per rank, lexicographic (value, index) pick --------------------------------
def _lex_topk(x, k, d, largest):
    """torch's values; among ties the smallest indices (what the composite promises)."""
    order = torch.sort(x, dim=d, descending=largest, stable=True).indices.narrow(d, 0, k)
    return x.gather(d, order), order


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_topk_kthvalue(request, layout, dtype):
    mesh, placements = _layout(request, layout, 1, 0)
    batch = Batch()
    for n, k in ((40, 3), (41, 4), (23, 2), (17, 1)):
        x = _data(n, dtype, n, ties=True)
        d = dist(x, mesh, placements)
        for largest in (True, False):
            out, counts = counted(lambda: torch.topk(d, k, -1, largest=largest))
            assert counts == _gathers(placements, (1,), 2)
            assert torch.equal(out.values.to_torch(), torch.topk(x, k, 1, largest).values)
            batch.add(list(out), list(_lex_topk(x, k, 1, largest)))
        out, counts = counted(lambda: d.kthvalue(k, 1, keepdim=True))
        assert counts == _gathers(placements, (1,), 2)
        values, indices = _lex_topk(x, k, 1, False)
        batch.add(list(out), [values.narrow(1, k - 1, 1), indices.narrow(1, k - 1, 1)])
        batch.add(d.kthvalue(k, 1).values, x.kthvalue(k, 1).values)
    batch.check()


def test_topk_moves_the_candidates_only(mesh1d):
    """One all_gather of k values and one of k indices per rank and row, not the input."""
    x = torch.randn(6, 80)
    d = dist(x, mesh1d, [Shard(1)])
    with dtorch.CommDebugMode() as mode:
        out = d.topk(5, dim=1)
    records = mode.get_comm_records()
    assert [r.kind for r in records] == ["all_gather", "all_gather"]
    assert sorted(r.bytes_per_rank for r in records) == [6 * 5 * 4, 6 * 5 * 8]
    with dtorch.CommDebugMode() as gather:
        d.redistribute(placements=[R])
    assert gather.get_comm_records()[0].bytes_per_rank == 6 * 20 * 4  # what the fix moves
    assert torch.equal(out.values.to_torch(), x.topk(5, 1).values)


def test_refusals_before_anything_is_sent(mesh1d, mesh2d):
    x = torch.randn(4, 12)
    d = dist(x, mesh1d, [Shard(1)])
    err = illegal(lambda: d.topk(2, 1))  # 2 x 4 >= 12 / 2
    assert "redistribute(placements=[Replicate()])" in str(err) and "k x blocks" in str(err)
    d2 = dist(x, mesh2d, [Shard(1), Shard(1)])
    illegal(lambda: torch.kthvalue(d2, 2, 1))
    illegal(lambda: d.sort(1))  # sorting a sharded dim: still the gather's job
    p = make(x, mesh2d, [Shard(1), Partial("sum")], 1)
    for fn in (lambda t: t.max(1), lambda t: t.argmax(), lambda t: t.var(1),
               lambda t: t.logsumexp(1), lambda t: t.cumsum(1), lambda t: t.norm(dim=1)):
        illegal(lambda: fn(p))


# norms --------------------------------------------------------------------------------------------
NORMS = {
    "2": (lambda x: torch.linalg.vector_norm(x, dim=1), {"all_reduce": 1}),
    "fro_all": (lambda x: torch.norm(x), {"all_reduce": 1}),
    "1_keepdim": (lambda x: x.norm(1, -1, True), {"all_reduce": 1}),
    "3": (lambda x: torch.linalg.vector_norm(x, 3, (1,)), {"all_reduce": 1}),
    "0.5": (lambda x: torch.norm(x, 0.5, 1), {"all_reduce": 1}),
    "-2": (lambda x: torch.linalg.vector_norm(x, -2, 1), {"all_reduce": 1}),
    "inf": (lambda x: torch.linalg.vector_norm(x, float("inf"), 1), {}),
    "-inf": (lambda x: torch.linalg.vector_norm(x, float("-inf"), 1), {}),
    "0": (lambda x: torch.linalg.vector_norm(x, 0, 1), {}),
    "2_dtype": (lambda x: torch.linalg.vector_norm(x, 2, 1, dtype=torch.float64),
                {"all_reduce": 1}),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("name", sorted(NORMS))
def test_norms(request, name, layout, dtype):
    """A Partial of |x|^p, one all_reduce per mesh dim sharding the dim, then the root;
    inf / -inf / 0 stay Partial (max / min / sum), nothing moves."""
    fn, per_dim = NORMS[name]
    mesh, placements = _layout(request, layout, 1, 0)
    n_dims = sum(1 for p in placements if p == Shard(1)) if name != "fro_all" else sum(
        1 for p in placements if p.is_shard())
    batch = Batch()
    for n in SIZES:
        x = _data(n, dtype, n, ties=False)
        x[0, 0] = 0.0
        out, counts = counted(lambda: fn(dist(x, mesh, placements)))
        assert counts == {k: v * n_dims for k, v in per_dim.items()}, counts
        batch.add(out, fn(x))
    batch.check()


# gradients ----------------------------------------------------------------------------------------
GRADS = {
    "max_values": lambda x: x.max(1).values,
    "min_keepdim": lambda x: torch.min(x, -1, keepdim=True).values,
    "topk": lambda x: x.topk(2, 1).values,
    "logsumexp": lambda x: torch.logsumexp(x, 1),
    "var": lambda x: torch.var(x, 1),
    "std_all": lambda x: x.std(),
    "std_mean": lambda x: torch.std_mean(x, 1, correction=0)[0] + torch.std_mean(x, 1)[1],
    "norm2": lambda x: torch.linalg.vector_norm(x, dim=1),
    "norm3": lambda x: x.norm(3, 1),
    "cumsum": lambda x: x.cumsum(1),
    "cumprod": lambda x: torch.cumprod(x, 1),
}


def _weights(out):
    return torch.randn(out.shape, generator=torch.Generator().manual_seed(7), dtype=out.dtype)


@pytest.mark.parametrize("layout", ["1d", "2d_same_dim", "2d_with_other"])
@pytest.mark.parametrize("name", sorted(GRADS))
def test_gradients_match_torch(request, name, layout):
    """x.requires_grad_(); (out * w).sum().backward(): x.grad against torch's (distinct
    values, so the extremum's gradient has one place to go), uneven and empty shards."""
    fn = GRADS[name]
    mesh, placements = _layout(request, layout, 1, 0)
    for n in (18, 3):
        if name == "topk" and n < 17:
            continue
        x = torch.randn(3, n, generator=torch.Generator().manual_seed(n), dtype=torch.float64)
        x.requires_grad_(True)
        expected = fn(x)
        w = _weights(expected)
        (expected * w).sum().backward()
        d = dist(x.detach(), mesh, placements).requires_grad_(True)
        out = fn(d)
        wd = dist(w, mesh, [R if p.is_partial() else p for p in out.placements])
        (out * wd).sum().backward()
        torch.testing.assert_close(d.grad.to_torch(), x.grad)
