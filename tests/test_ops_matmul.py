"""The matmul family on a real cluster: seed 002, every placement pair, batches, bias, einsum."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import dtorch
from dtorch import Partial, Replicate, Shard
from test_ops_support import PARTIALS, Batch, dt, illegal, make, no_comm, placements_1d

R = Replicate()
SETTINGS = settings(max_examples=20, deadline=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture,
                                           HealthCheck.too_slow])


# seed 002 -----------------------------------------------------------------------------------------
def test_seed_002_shard1_at_shard0_is_partial_sum_without_collective(mesh1d):
    x = torch.arange(16.).reshape(4, 4)
    w = torch.ones(4, 4)
    xs = dtorch.distribute_tensor(x, mesh1d, [Shard(1)])
    ws = dtorch.distribute_tensor(w, mesh1d, [Shard(0)])
    with dtorch.CommDebugMode() as mode:
        out = torch.matmul(xs, ws)
    assert mode.get_total_counts() == 0
    assert out.placements == (Partial("sum"),)
    with dtorch.CommDebugMode() as mode:
        full = out.full_tensor()
    assert mode.get_comm_counts() == {"all_reduce": 1}
    assert full[0].tolist() == [6.0, 6.0, 6.0, 6.0]
    assert torch.equal(full, x @ w)


def test_seed_002_replicate_at_shard1_is_shard1_without_collective(mesh1d):
    x = torch.arange(16.).reshape(4, 4)
    xr = dtorch.distribute_tensor(x, mesh1d, [Replicate()])
    ws = dtorch.distribute_tensor(torch.ones(4, 4), mesh1d, [Shard(1)])
    with dtorch.CommDebugMode() as mode:
        out = xr @ ws
    assert mode.get_total_counts() == 0
    assert out.placements == (Shard(1),)
    with dtorch.CommDebugMode() as mode:
        full = out.to_torch()
    assert mode.get_total_counts() == 0  # a Shard result gathers without a collective count
    assert torch.equal(full, x @ torch.ones(4, 4))


def test_design_examples(mesh1d):
    a, b = torch.randn(6, 5), torch.randn(5, 3)
    batch = Batch()
    batch.add(no_comm(lambda: dt(a, mesh1d, [Shard(0)]) @ dt(b, mesh1d, [R])), a @ b,
              [Shard(0)])
    batch.add(no_comm(lambda: dt(a, mesh1d, [R]) @ dt(b, mesh1d, [Shard(1)])), a @ b,
              [Shard(1)])
    batch.add(no_comm(lambda: dt(a, mesh1d, [Shard(1)]) @ dt(b, mesh1d, [Shard(0)])), a @ b,
              [Partial()])
    batch.check()


# every placement pair ------------------------------------------------------------------------------
def mm_oracle(pa, pb, la, lb, lo):
    """Per mesh dim, from einsum labels: output placement or None."""
    if pa.is_partial() or pb.is_partial():
        p, other = (pa, pb) if pa.is_partial() else (pb, pa)
        ok = p.reduce_op in ("sum", "avg") and other == R
        return p if ok else None
    labels = {la[p.dim] if x == 0 else lb[p.dim] for x, p in ((0, pa), (1, pb)) if p.is_shard()}
    if not labels:
        return R
    if len(labels) > 1:
        return None
    lab = labels.pop()
    for p, lbl in ((pa, la), (pb, lb)):
        if lab in lbl and p not in (Shard(lbl.index(lab)), R):  # a Replicate one is narrowed
            return None
    return Shard(lo.index(lab)) if lab in lo else Partial("sum")


def narrowing_misordered(pls, labels, shapes) -> bool:
    """A Replicate operand narrowed on mesh dim m to a dim (of size >= 2) it is already sharded
    on at a later mesh dim: its blocks do not contain the nested blocks it needs."""
    for m in range(len(pls[0])):
        sharded = {lbl[p[m].dim] for p, lbl in zip(pls, labels) if p[m].is_shard()}
        for p, lbl, shape in zip(pls, labels, shapes):
            for lab in sharded & set(lbl):
                d = lbl.index(lab)
                later = [q for q in p[m + 1:] if q == Shard(d)]
                if p[m] == R and later and shape[d] >= 2:
                    return True
    return False


def _mm_case(mesh, fn, a, b, la, lb, lo, pairs, seed=0):
    expected = fn(a, b)
    batch = Batch()
    for pla, plb in pairs:
        want = tuple(mm_oracle(x, y, la, lb, lo) for x, y in zip(pla, plb))
        if None not in want and narrowing_misordered([pla, plb], [la, lb], [a.shape, b.shape]):
            want = (None,)
        da, db = make(a, mesh, pla, seed), make(b, mesh, plb, seed + 1)
        if None in want:
            illegal(lambda: fn(da, db))
        else:
            batch.add(no_comm(lambda: fn(da, db)), expected, want, rtol=1e-4, atol=1e-4)
    batch.check()


CASES = {
    "mm": (torch.mm, 2, 2, "nk", "km", "nm"),
    "matmul-batched": (torch.matmul, 3, 3, "bnk", "bkm", "bnm"),
    "bmm": (torch.bmm, 3, 3, "bnk", "bkm", "bnm"),
    "matmul-broadcast": (lambda a, b: a @ b, 3, 2, "bnk", "km", "bnm"),
    "mv": (torch.mv, 2, 1, "nk", "k", "n"),
    "vec@mat": (torch.matmul, 1, 2, "k", "km", "m"),
    "dot": (torch.dot, 1, 1, "k", "k", ""),
    "outer": (torch.outer, 1, 1, "i", "j", "ij"),
}


def _operands(case, sizes, seed):
    fn, na, nb, la, lb, lo = CASES[case]
    g = torch.Generator().manual_seed(seed)
    a = torch.randn([sizes[c] for c in la], generator=g, dtype=torch.float64)
    b = torch.randn([sizes[c] for c in lb], generator=g, dtype=torch.float64)
    return fn, a, b, la, lb, lo


sizes_st = st.fixed_dictionaries({c: st.integers(1, 6) for c in "bnkmij"})


@SETTINGS
@given(case=st.sampled_from(sorted(CASES)), sizes=sizes_st, seed=st.integers(0, 99))
def test_every_placement_pair_1d(mesh1d, case, sizes, seed):
    fn, a, b, la, lb, lo = _operands(case, sizes, seed)
    pairs = [(x, y) for x in placements_1d(a.ndim) for y in placements_1d(b.ndim)]
    _mm_case(mesh1d, fn, a, b, la, lb, lo, pairs, seed)


@SETTINGS
@given(case=st.sampled_from(sorted(CASES)), sizes=sizes_st, data=st.data())
def test_sampled_placements_2d(mesh2d, case, sizes, data):
    fn, a, b, la, lb, lo = _operands(case, sizes, 0)

    def pl(nd):
        choices = ([R] + [Shard(d) for d in range(nd)]) * 3 + PARTIALS[:2]
        return tuple(data.draw(st.sampled_from(choices)) for _ in range(2))
    _mm_case(mesh2d, fn, a, b, la, lb, lo, [(pl(a.ndim), pl(b.ndim)) for _ in range(8)])


def test_nested_contraction_on_both_mesh_dims(mesh2d):
    a, b = torch.randn(3, 10), torch.randn(10, 5)
    batch = Batch()
    a11, b00 = dt(a, mesh2d, [Shard(1), Shard(1)]), dt(b, mesh2d, [Shard(0), Shard(0)])
    out = no_comm(lambda: a11 @ b00)
    batch.add(out, a @ b, [Partial(), Partial()])
    out2 = no_comm(lambda: dt(a, mesh2d, [Shard(0), Shard(1)]) @ dt(b, mesh2d, [R, Shard(0)]))
    batch.add(out2, a @ b, [Shard(0), Partial()])
    batch.check()


# linear / addmm / einsum -------------------------------------------------------------------------
def test_linear_column_and_row_parallel(mesh1d, mesh2d):
    x, w, b = torch.randn(2, 3, 8), torch.randn(6, 8), torch.randn(6)
    batch = Batch()
    col = no_comm(lambda: F.linear(dt(x, mesh1d, [R]), dt(w, mesh1d, [Shard(0)]),
                                   dt(b, mesh1d, [Shard(0)])))
    batch.add(col, F.linear(x, w, b), [Shard(2)])
    col_r = no_comm(lambda: F.linear(dt(x, mesh1d, [R]), dt(w, mesh1d, [Shard(0)]),
                                     dt(b, mesh1d, [R])))  # a Replicate bias is narrowed
    batch.add(col_r, F.linear(x, w, b), [Shard(2)])
    row = no_comm(lambda: F.linear(dt(x, mesh1d, [Shard(2)]), dt(w, mesh1d, [Shard(1)]),
                                   dt(b, mesh1d, [Partial()])))
    batch.add(row, F.linear(x, w, b), [Partial()])
    dp_tp = no_comm(lambda: F.linear(dt(x, mesh2d, [Shard(0), R]),
                                     dt(w, mesh2d, [R, Shard(0)]), dt(b, mesh2d, [R, Shard(0)])))
    batch.add(dp_tp, F.linear(x, w, b), [Shard(0), Shard(2)])
    batch.add(no_comm(lambda: F.linear(dt(x, mesh1d, [Shard(1)]), dt(w, mesh1d, [R]))),
              F.linear(x, w), [Shard(1)])
    batch.check()
    xs, ws, br = dt(x, mesh1d, [Shard(2)]), dt(w, mesh1d, [Shard(1)]), dt(b, mesh1d, [R])
    batch = Batch()  # a Replicate bias beside a Partial('sum') product is made Partial locally
    batch.add(no_comm(lambda: F.linear(xs, ws, br)), F.linear(x, w, b), [Partial()])
    batch.add(no_comm(lambda: F.linear(xs, dt(w, mesh1d, [R]), br)), F.linear(x, w, b),
              [Partial()])
    x2 = dt(x, mesh2d, [Shard(2), Shard(0)])
    batch.add(no_comm(lambda: F.linear(x2, dt(w, mesh2d, [R, R]), dt(b, mesh2d, [R, R]))),
              F.linear(x, w, b), [Partial(), Shard(0)])
    batch.check()
    bmax = make(b.double(), mesh1d, [Partial("max")], 1)
    xd, wd = dt(x.double(), mesh1d, [Shard(2)]), dt(w.double(), mesh1d, [Shard(1)])
    err = illegal(lambda: F.linear(xd, wd, bmax))
    assert "bias.redistribute(placements=[Partial('sum')])" in str(err)


def test_a_replicate_bias_beside_a_partial_product_keeps_torchs_gradients(mesh1d):
    x, w, b = (torch.randn(*s, dtype=torch.float64, requires_grad=True)
               for s in ((2, 6, 5), (3, 5), (3,)))
    (F.linear(x, w, b) ** 2).sum().backward()
    dx, dw, db = (dt(t.detach(), mesh1d, p).requires_grad_()
                  for t, p in ((x, [Shard(2)]), (w, [R]), (b, [R])))
    y = F.linear(dx, dw, db)
    assert y.placements == (Partial(),)
    (y.redistribute(placements=[R]) ** 2).sum().backward()
    for d, t in ((dx, x), (dw, w), (db, b)):
        torch.testing.assert_close(d.grad.to_torch(), t.grad)


def test_addmm_and_einsum(mesh1d, mesh2d):
    bias, m1, m2 = torch.randn(5), torch.randn(4, 3), torch.randn(3, 5)
    batch = Batch()
    batch.add(no_comm(lambda: torch.addmm(dt(bias, mesh1d, [R]), dt(m1, mesh1d, [R]),
                                          dt(m2, mesh1d, [Shard(1)]))),
              torch.addmm(bias, m1, m2), [Shard(1)])
    batch.add(no_comm(lambda: torch.addmm(dt(bias, mesh1d, [Partial()]), dt(m1, mesh1d, [Shard(1)]),
                                          dt(m2, mesh1d, [Shard(0)]), beta=0.5, alpha=2.0)),
              torch.addmm(bias, m1, m2, beta=0.5, alpha=2.0), [Partial()])
    q, k = torch.randn(2, 4, 5, 3), torch.randn(2, 4, 6, 3)
    eq = "bhqd,bhkd->bhqk"
    batch.add(no_comm(lambda: torch.einsum(eq, dt(q, mesh2d, [Shard(0), Shard(1)]),
                                           dt(k, mesh2d, [Shard(0), Shard(1)]))),
              torch.einsum(eq, q, k), [Shard(0), Shard(1)])
    batch.add(no_comm(lambda: torch.einsum("...d,...d->...", dt(q, mesh1d, [Shard(3)]),
                                           dt(q, mesh1d, [Shard(3)]))),
              torch.einsum("...d,...d->...", q, q), [Partial()])
    batch.add(no_comm(lambda: torch.einsum("ij,kj->ik", dt(m1, mesh1d, [Shard(0)]),
                                           dt(m2.t().contiguous(), mesh1d, [R]))),
              m1 @ m2, [Shard(0)])
    batch.check()
    qa, ka = dt(q, mesh1d, [Shard(1)]), dt(k, mesh1d, [Shard(2)])
    illegal(lambda: torch.einsum(eq, qa, ka), match="matching dim")


@pytest.mark.parametrize("dtype", [torch.int64, torch.float32])
def test_matmul_dtypes(mesh1d, dtype):
    a = torch.randint(-5, 5, (5, 7)).to(dtype)
    b = torch.randint(-5, 5, (7, 3)).to(dtype)
    batch = Batch()
    batch.add(no_comm(lambda: dt(a, mesh1d, [Shard(1)]) @ dt(b, mesh1d, [Shard(0)])), a @ b,
              [Partial()])
    batch.add(no_comm(lambda: dt(a, mesh1d, [Shard(0)]) @ dt(b, mesh1d, [R])), a @ b, [Shard(0)])
    batch.check()


# a batch label sharded on one operand, the other Replicate; the biased products -----------------
def _g(*shape, seed=0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


@pytest.mark.parametrize("b", [8, 5, 3])
def test_batch_sharded_beside_replicate(mesh1d, b):
    x, y = _g(b, 3, 4), _g(b, 4, 2, seed=1)
    batch = Batch()
    for fn in (torch.bmm, torch.matmul, lambda p, q: torch.einsum("bnk,bkm->bnm", p, q)):
        batch.add(no_comm(lambda: fn(dt(x, mesh1d, [Shard(0)]), dt(y, mesh1d, [R]))), fn(x, y),
                  [Shard(0)])
        batch.add(no_comm(lambda: fn(dt(x, mesh1d, [R]), dt(y, mesh1d, [Shard(0)]))), fn(x, y),
                  [Shard(0)])
    v, w = _g(b), _g(b, seed=1)
    for fn in (torch.dot, torch.inner, torch.vdot):  # a contracted label: each rank's share
        batch.add(no_comm(lambda: fn(dt(v, mesh1d, [Shard(0)]), dt(w, mesh1d, [R]))), fn(v, w),
                  [Partial()])
    batch.check()


PRODUCTS = {  # name -> (fn, (bias, first, second) shapes for a batch b, out placement)
    "baddbmm": (lambda i, p, q: torch.baddbmm(i, p, q, beta=0.5, alpha=2.0),
                lambda b: [(b, 3, 2), (b, 3, 4), (b, 4, 2)], Shard(0)),
    "baddbmm-broadcast-bias": (torch.baddbmm, lambda b: [(7, 2), (b, 7, 4), (b, 4, 2)],
                               Shard(0)),
    "addbmm": (torch.addbmm, lambda b: [(b, 2), (6, b, 4), (6, 4, 2)], Shard(0)),
    "addmv": (torch.addmv, lambda b: [(b,), (b, 4), (4,)], Shard(0)),
    "addr": (lambda i, p, q: torch.addr(i, p, q, alpha=3.0), lambda b: [(b, 2), (b,), (2,)],
             Shard(0)),
    "addmm": (torch.addmm, lambda b: [(b, 2), (b, 4), (4, 2)], Shard(0)),
}


@pytest.mark.parametrize("name", sorted(PRODUCTS))
@pytest.mark.parametrize("b", [8, 5, 3])
def test_biased_products_first_input_sharded(mesh1d, name, b):
    fn, shapes, out = PRODUCTS[name]
    vals = [_g(*s, seed=i) for i, s in enumerate(shapes(b))]
    batch = Batch()
    for k in range(3):  # the bias sharded (the others narrowed), then each factor
        if vals[k].shape[0] != b:
            continue
        ds = [dt(v, mesh1d, [Shard(0)] if i == k else [R]) for i, v in enumerate(vals)]
        batch.add(no_comm(lambda: fn(*ds)), fn(*vals), [out])
    batch.check()


def test_addbmm_batch_sharded_is_partial(mesh1d):
    bias, x, y = _g(3, 2), _g(5, 3, 4, seed=1), _g(5, 4, 2, seed=2)
    dx, dy = dt(x, mesh1d, [Shard(0)]), dt(y, mesh1d, [Shard(0)])
    batch = Batch()
    batch.add(no_comm(lambda: torch.addbmm(dt(bias, mesh1d, [Partial()]), dx, dy)),
              torch.addbmm(bias, x, y), [Partial()])
    batch.add(no_comm(lambda: torch.addbmm(dt(bias, mesh1d, [Partial()]), dx, dt(y, mesh1d, [R]))),
              torch.addbmm(bias, x, y), [Partial()])
    batch.check()
    br = dt(bias, mesh1d, [R])  # made Partial('sum') locally: the first rank keeps it
    batch.add(no_comm(lambda: torch.addbmm(br, dx, dy)), torch.addbmm(bias, x, y), [Partial()])
    batch.check()


def test_tensordot(mesh1d, mesh2d):
    a, b = _g(5, 3, 4), _g(3, 4, 2, seed=1)
    batch = Batch()
    batch.add(no_comm(lambda: torch.tensordot(dt(a, mesh1d, [Shard(0)]), dt(b, mesh1d, [R]))),
              torch.tensordot(a, b), [Shard(0)])
    batch.add(no_comm(lambda: torch.tensordot(dt(a, mesh1d, [Shard(2)]), dt(b, mesh1d, [R]))),
              torch.tensordot(a, b), [Partial()])  # contracted: b narrowed, a Partial sum
    c = _g(4, 5, 6, seed=2)
    dims = ([0, 2], [1, 0])
    batch.add(no_comm(lambda: torch.tensordot(dt(a, mesh2d, [Shard(1), R]),
                                              dt(c, mesh2d, [R, Shard(2)]), dims=dims)),
              torch.tensordot(a, c, dims=dims), [Shard(0), Shard(1)])
    batch.check()


def test_kron(mesh1d):
    batch = Batch()
    a, b = _g(8, 3), _g(2, 5, seed=1)
    batch.add(no_comm(lambda: torch.kron(dt(a, mesh1d, [Shard(0)]), dt(b, mesh1d, [R]))),
              torch.kron(a, b), [Shard(0)])  # 8 rows on 4 ranks: blocks of 2 * 2 rows
    a1, b1 = _g(5, 3), _g(1, 4, seed=1)
    batch.add(no_comm(lambda: torch.kron(dt(a1, mesh1d, [Shard(0)]), dt(b1, mesh1d, [R]))),
              torch.kron(a1, b1), [Shard(0)])  # b's size 1 there: uneven is fine
    c, d = _g(1, 3), _g(6, 2, seed=1)
    batch.add(no_comm(lambda: torch.kron(dt(c, mesh1d, [R]), dt(d, mesh1d, [Shard(0)]))),
              torch.kron(c, d), [Shard(0)])
    batch.check()
    a5, bb, bs = dt(_g(5, 3), mesh1d, [Shard(0)]), dt(b, mesh1d, [R]), dt(b, mesh1d, [Shard(0)])
    illegal(lambda: torch.kron(a5, bb), match="not the output's blocks")  # 5 rows: misaligned
    ar = dt(a, mesh1d, [R])
    illegal(lambda: torch.kron(a5, bs), match="two sharded")
    illegal(lambda: torch.kron(ar, bs), match="spread")  # b's rows interleave in the output


def test_baddbmm_gradient(mesh1d):
    bias, x, y = _g(5, 3, 2), _g(5, 3, 4, seed=1), _g(5, 4, 2, seed=2)
    ts = [v.clone().requires_grad_() for v in (bias, x, y)]
    want_out = torch.baddbmm(*ts, alpha=2.0)
    g = _g(5, 3, 2, seed=3)
    want = torch.autograd.grad(want_out, ts, g)
    ds = [dt(v, mesh1d, [Shard(0)] if i == 1 else [R]).requires_grad_()
          for i, v in enumerate((bias, x, y))]
    out = torch.baddbmm(*ds, alpha=2.0)
    got = dtorch.autograd.grad(out, ds, dt(g, mesh1d, [Shard(0)]))
    for d, w in zip(got, want):
        torch.testing.assert_close(d.to_torch(), w)
