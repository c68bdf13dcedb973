"""The last ops without a rule (dtorch.ops.remaining_local, remaining_refusals) on sharded
DTensors: torch's values, no collective for the local ones (uneven and empty shards, 1-D and
2x2 meshes), gradients, the planned collectives of the re-expressed ones, and refusals that
name the fix and send nothing."""

import pytest
import torch
import torch.nn.functional as F

import dtorch
from dtorch import Partial, Replicate, Shard
from nn_local_support import grad_check, local
from test_ops_support import Batch, dt, illegal, make, no_comm

R = Replicate()
S0, S1, S2 = Shard(0), Shard(1), Shard(2)
aten = torch.ops.aten


# copies and factories ----------------------------------------------------------------------------
def test_alias_copy_keeps_every_placement(mesh1d, mesh2d):
    x = torch.randn(5, 3)
    batch = Batch()
    for pl in ([R], [S0], [S1], [Partial("sum")], [Partial("max")]):
        got = no_comm(lambda: torch.alias_copy(make(x, mesh1d, pl)))
        batch.add(got, x, pl)
    local(batch, torch.alias_copy, (torch.randn(3, 2),), [[S0, S1]], mesh2d, [S0, S1])
    batch.check()
    grad_check(torch.alias_copy, (torch.randn(3, 4),), [[S0]], mesh1d)


def test_fill_gives_the_value_whatever_the_input(mesh1d, mesh2d):
    x = torch.randn(6, 3)
    batch = Batch()
    for pl, want in (([S0], [S0]), ([S1], [S1]), ([Partial("sum")], [R]),
                     ([Partial("avg")], [R]), ([R], [R])):
        got = no_comm(lambda: torch.fill(make(x, mesh1d, pl), 2.5))
        batch.add(got, torch.full_like(x, 2.5), want)
    v = torch.tensor(-1.5)
    xs, vr = dt(torch.randn(3, 2), mesh2d, [S0, S1]), dt(v, mesh2d, [R, R])
    got = no_comm(lambda: torch.fill(xs, vr))
    batch.add(got, torch.full((3, 2), -1.5), [S0, S1])
    batch.check()
    pv = make(v, mesh1d, [Partial("sum")])
    xs = dt(x, mesh1d, [S0])
    illegal(lambda: torch.fill(xs, pv), match="whole value")


def test_new_empty_strided_is_replicate(mesh1d):
    out = no_comm(lambda: dt(torch.randn(5, 3), mesh1d, [S0]).new_empty_strided((2, 3), (3, 1)))
    assert out.shape == (2, 3) and out.placements == (R,)


# softmax and layer norm kernels ------------------------------------------------------------------
@pytest.mark.parametrize("n", [6, 3])
def test_aten_softmax_kernels(mesh1d, mesh2d, n):
    x, g = torch.randn(n, 5, 4), torch.randn(n, 5, 4)
    y = torch.softmax(x, -1)
    batch = Batch()
    for pl in ([S0], [S1]):
        local(batch, lambda t: aten._softmax(t, -1, False), (x,), [pl], mesh1d, pl)
        local(batch, lambda t: aten._log_softmax.default(t, 2, False), (x,), [pl], mesh1d, pl)
        local(batch, lambda t: aten._safe_softmax.default(t, -1), (x,), [pl], mesh1d, pl)
        local(batch, lambda a, b: aten._softmax_backward_data(a, b, -1, torch.float32), (g, y),
              [pl, pl], mesh1d, pl)
        local(batch, lambda a, b: aten._softmax_backward_data.default(a, b, -1, torch.float32),
              (g, y), [pl], mesh1d, pl)  # the output Replicate: narrowed on each rank
        local(batch, lambda a, b: aten._log_softmax_backward_data(a, b, 2, torch.float32),
              (g, y.log()), [pl, pl], mesh1d, pl)
    local(batch, lambda t: aten._safe_softmax.default(t, 0), (x,), [[S1, S2]], mesh2d, [S1, S2])
    batch.check()
    xs = dt(x, mesh1d, [S2])
    illegal(lambda: aten._safe_softmax.default(xs, -1), match="combines values along dim 2")
    illegal(lambda: aten._softmax_backward_data(xs, xs, 2, torch.float32))
    xp = make(x, mesh1d, [Partial("sum")])
    illegal(lambda: aten._softmax(xp, 0, False), match="Partial")


@pytest.mark.parametrize("n", [6, 3])
def test_native_layer_norm(mesh1d, mesh2d, n):
    x, w, b = torch.randn(n, 5, 4), torch.randn(4), torch.randn(4)
    batch = Batch()
    local(batch, lambda t, ww, bb: torch.native_layer_norm(t, (4,), ww, bb, 1e-5), (x, w, b),
          [[S0]], mesh1d, [S0])
    local(batch, lambda t: torch.native_layer_norm(t, (4,), None, None, 1e-5), (x,), [[S1]],
          mesh1d, [S1])
    local(batch, lambda t: torch.native_layer_norm(t, (5, 4), None, None, 1e-5), (x,),
          [[S0, R]], mesh2d, [S0, R])
    batch.check()
    grad_check(lambda t, ww: torch.native_layer_norm(t, (4,), ww, None, 1e-5)[0], (x, w), [[S0]],
               mesh1d)
    xs = dt(x, mesh1d, [S2])
    illegal(lambda: torch.native_layer_norm(xs, (4,), None, None, 1e-5), match="dim 2")
    ws = dt(torch.randn(5, 4), mesh1d, [S0])
    x1 = dt(x, mesh1d, [S1])
    illegal(lambda: torch.native_layer_norm(x1, (5, 4), ws, None, 1e-5), match="Replicate")


# pooling backward --------------------------------------------------------------------------------
def _max_pool_backward(t):
    out, idx = F.max_pool2d_with_indices(t, 2, 2, return_indices=True)
    return aten.max_pool2d_with_indices_backward.default(torch.ones_like(out), t, [2, 2], [2, 2],
                                                         [0, 0], [1, 1], False, idx)


@pytest.mark.parametrize("n", [5, 2])
def test_pool_backward_kernels(mesh1d, mesh2d, n):
    x = torch.randn(n, 3, 6, 4)
    batch = Batch()
    local(batch, _max_pool_backward, (x,), [[S0]], mesh1d, [S0])
    local(batch, _max_pool_backward, (x,), [[S1]], mesh1d, [S1])
    local(batch, _max_pool_backward, (x,), [[S0, S1]], mesh2d, [S0, S1])
    local(batch, _max_pool_backward, (torch.randn(3, 6, 4),), [[S0]], mesh1d, [S0])  # unbatched
    g = torch.randn(n, 3, 3, 2)
    local(batch, lambda gg, t: aten.avg_pool2d_backward(gg, t, [2, 2], [2, 2], [0, 0], False,
                                                        True, None), (g, x), [[S0], [S0]],
          mesh1d, [S0])
    x3 = torch.randn(n, 2, 4, 4, 4)

    def pool3d_backward(t):
        out, idx = F.max_pool3d(t, 2, return_indices=True)
        return aten.max_pool3d_with_indices_backward(torch.ones_like(out), t, [2, 2, 2],
                                                     [2, 2, 2], [0, 0, 0], [1, 1, 1], False, idx)
    local(batch, pool3d_backward, (x3,), [[S1]], mesh1d, [S1])
    batch.check()
    xs = dt(x, mesh1d, [R])
    out, idx = F.max_pool2d_with_indices(xs, 2, 2, return_indices=True)
    gs = dt(torch.ones(out.shape), mesh1d, [S2])
    illegal(lambda: aten.max_pool2d_with_indices_backward(gs, xs, [2, 2], [2, 2], [0, 0],
                                                          [1, 1], False, idx),
            match="combines values along dim 2")


# signals and segments ----------------------------------------------------------------------------
@pytest.mark.parametrize("n", [5, 3])
def test_stft_istft_on_a_batch_of_signals(mesh1d, n):
    x, win = torch.randn(n, 64), torch.hann_window(16)
    batch = Batch()
    local(batch, lambda t, w: torch.stft(t, 16, 4, window=w, return_complex=True), (x, win),
          [[S0]], mesh1d, [S0])
    local(batch, lambda t: torch.stft(t, 8, center=False, return_complex=True), (x,), [[S0]],
          mesh1d, [S0])
    spec = torch.stft(x, 16, 4, window=win, return_complex=True)
    local(batch, lambda s, w: torch.istft(s, 16, 4, window=w, length=64), (spec, win), [[S0]],
          mesh1d, [S0])
    batch.check()
    grad_check(lambda t, w: torch.view_as_real(torch.stft(t, 16, 4, window=w,
                                                          return_complex=True)),
               (x, win), [[S0]], mesh1d, grad_of=(0,))
    x0, x1 = dt(x[0], mesh1d, [S0]), dt(x, mesh1d, [S1])
    illegal(lambda: torch.stft(x0, 16, return_complex=True),
            match="combines values along dim 0")
    illegal(lambda: torch.stft(x1, 16, return_complex=True))


@pytest.mark.parametrize("n", [7, 3])
def test_segment_reduce(mesh1d, mesh2d, n):
    data = torch.randn(6, n)
    lengths, offsets = torch.tensor([2, 0, 3, 1]), torch.tensor([0, 2, 2, 5, 6])
    batch = Batch()
    for red in ("sum", "max", "mean"):
        local(batch, lambda d, l: torch.segment_reduce(d, red, lengths=l, axis=0, initial=0),
              (data, lengths), [[S1]], mesh1d, [S1])
        local(batch, lambda d, o: torch.segment_reduce(d, red, offsets=o, axis=0, initial=0),
              (data, offsets), [[S1]], mesh1d, [S1])
    rows = torch.randn(n, 6)  # segments along dim 1, per row lengths: sharded alike or narrowed
    lens = torch.tensor([[2, 4]] * n)
    for pl in ([S0], [R]):
        local(batch, lambda d, l: torch.segment_reduce(d, "sum", lengths=l, axis=1), (rows, lens),
              [[S0], pl], mesh1d, [S0])
    local(batch, lambda d, l: torch.segment_reduce(d, "sum", lengths=l, axis=0),
          (torch.randn(6, n, 2), lengths), [[S1, S2]], mesh2d, [S1, S2])
    batch.check()
    grad_check(lambda d, l: torch.segment_reduce(d, "sum", lengths=l, axis=0), (data, lengths),
               [[S1]], mesh1d, grad_of=(0,))
    ds, lr = dt(data, mesh1d, [S0]), dt(lengths, mesh1d, [R])
    illegal(lambda: torch.segment_reduce(ds, "sum", lengths=lr), match="dim 0")


# tensor lists: _chunk_cat, masked index ----------------------------------------------------------
@pytest.mark.parametrize("n", [5, 3])
def test_chunk_cat(mesh1d, mesh2d, n):
    a, b = torch.randn(n, 4, 5), torch.randn(n, 4, 7)
    batch = Batch()
    for pl in ([S0], [S1]):
        local(batch, lambda x, y: torch._chunk_cat([x, y], 2, 3), (a, b), [pl, pl], mesh1d, pl)
    local(batch, lambda x, y: torch._chunk_cat([x, y], 2, 3), (a, b), [[S0]], mesh1d, [S0])
    local(batch, lambda x, y: torch._chunk_cat([x, y], -1, 2), (a, b), [[S0, S1], [S0, S1]],
          mesh2d, [S0, S1])
    batch.check()
    # no gradient check: torch has no derivative for _chunk_cat
    a2, b2, a0, b1 = (dt(a, mesh1d, [S2]), dt(b, mesh1d, [S2]), dt(a, mesh1d, [S0]),
                      dt(b, mesh1d, [S1]))
    illegal(lambda: torch._chunk_cat([a2, b2], 2, 3),
            match="combines values along dim 2")
    illegal(lambda: torch._chunk_cat([a0, b1], 2, 3),
            match="do not match")


@pytest.mark.parametrize("n", [6, 3])
def test_unsafe_masked_index(mesh1d, mesh2d, n):
    x = torch.randn(5, 4, 3)
    i0, i1 = torch.randint(0, 5, (n, 1)), torch.randint(0, 4, (1, 7))
    mask = torch.rand(n, 7, 1) > 0.3
    batch = Batch()

    def gather(t, m, a, c):
        return torch._unsafe_masked_index(t, m, [a, c], -2.0)
    local(batch, gather, (x, mask, i0, i1), [None, [S0], [S0]], mesh1d, [S0])
    local(batch, gather, (x, mask, i0, i1), [None, [S1], None, [S1]], mesh1d, [S1])
    local(batch, gather, (x, mask, i0, i1), [[S2]], mesh1d, [S2])  # x's unindexed dim
    local(batch, gather, (x, mask, i0, i1), [[R, S2], [S0, R], [S0, R]], mesh2d, [S0, S2])
    batch.check()
    grad_check(gather, (x, mask, i0, i1), [[S2]], mesh1d, grad_of=(0,))
    grad_check(gather, (x, mask, i0, i1), [None, [S0], [S0]], mesh1d, grad_of=(0,))
    args = (dt(x, mesh1d, [S0]), dt(mask, mesh1d, [R]), dt(i0, mesh1d, [R]), dt(i1, mesh1d, [R]))
    illegal(lambda: gather(*args), match="combines values along dim 0")


@pytest.mark.parametrize("n", [6, 3])
def test_unsafe_masked_index_put_accumulate(mesh1d, n):
    x, v = torch.randn(5, 4, n), torch.randn(3, 7, n)
    i0, i1 = torch.randint(0, 5, (3, 1)), torch.randint(0, 4, (1, 7))
    mask = torch.rand(3, 7, 1) > 0.3

    def put(t, m, a, c, vv):
        return torch._unsafe_masked_index_put_accumulate(t, m, [a, c], vv)
    batch = Batch()
    local(batch, put, (x, mask, i0, i1, v), [[S2], None, None, None, [S2]], mesh1d, [S2])
    local(batch, put, (x, mask, i0, i1, v), [[S2]], mesh1d, [S2])  # values narrowed
    batch.check()
    grad_check(put, (x, mask, i0, i1, v), [[S2], None, None, None, [S2]], mesh1d, grad_of=(0, 4))
    args = [dt(t, mesh1d, [R]) for t in (x, mask, i0, i1, v)]
    xs, vs = dt(x, mesh1d, [S0]), dt(v, mesh1d, [S0])
    illegal(lambda: put(xs, *args[1:]), match="dim 0")
    illegal(lambda: put(*args[:4], vs), match="combines values along dim 0")  # positions collide


# vander, quantile, histc -------------------------------------------------------------------------
@pytest.mark.parametrize("n", [6, 3])
def test_vander(mesh1d, n):
    x = torch.randn(n)
    batch = Batch()
    local(batch, torch.vander, (x,), [[S0]], mesh1d, [S0])  # N is the global length
    local(batch, lambda t: torch.vander(t, 4, increasing=True), (x,), [[S0]], mesh1d, [S0])
    local(batch, lambda t: torch.vander(t, N=2), (x,), [[S0]], mesh1d, [S0])
    batch.check()  # no gradient check: torch's own vander backward fails (an in-place op)


@pytest.mark.parametrize("n", [7, 3])
def test_quantile_along_another_dim(mesh1d, mesh2d, n):
    x = torch.randn(n, 9)
    x[0, 2] = float("nan")
    q = torch.tensor([0.1, 0.5, 0.9])
    batch = Batch()
    for fn in (torch.quantile, torch.nanquantile):
        local(batch, lambda t: fn(t, 0.3, dim=1), (x,), [[S0]], mesh1d, [S0])
        local(batch, lambda t: fn(t, 0.3, 1, True, interpolation="midpoint"), (x,), [[S0]],
              mesh1d, [S0])
        local(batch, lambda t, qq: fn(t, qq, dim=-1), (x, q), [[S0]], mesh1d, [S1])
        local(batch, lambda t: fn(t, 0.7, dim=0), (x.T.contiguous(),), [[S1]], mesh1d, [S0])
    local(batch, lambda t: torch.quantile(t, 0.5, dim=2), (torch.randn(n, 3, 5),), [[S0, S1]],
          mesh2d, [S0, S1])
    batch.check()
    grad_check(lambda t: torch.quantile(t, 0.3, dim=1), (torch.randn(n, 9),), [[S0]], mesh1d)
    xs = dt(x, mesh1d, [S0])
    illegal(lambda: torch.quantile(xs, 0.5, dim=0), match="combines values along dim 0")
    illegal(lambda: torch.quantile(xs, 0.5), match="combines values along dim 0")
    qs = dt(q, mesh1d, [S0])
    illegal(lambda: torch.nanquantile(xs, qs, dim=1))


@pytest.mark.parametrize("n", [10, 3])
def test_histc_with_a_range_is_a_partial_sum(mesh1d, mesh2d, n):
    x = torch.randn(n, 3)
    batch = Batch()
    for pl in ([S0], [S1]):
        got = no_comm(lambda: torch.histc(dt(x, mesh1d, pl), bins=5, min=-1, max=1))
        batch.add(got, torch.histc(x, bins=5, min=-1, max=1), [Partial("sum")])
    got = no_comm(lambda: dt(x, mesh2d, [S0, S1]).histc(4, -2, 2))
    batch.add(got, x.histc(4, -2, 2), [Partial("sum"), Partial("sum")])
    got = no_comm(lambda: torch.histc(dt(x, mesh2d, [S0, R]), 4, -2, 2))
    batch.add(got, x.histc(4, -2, 2), [Partial("sum"), R])
    batch.check()
    xs = dt(x, mesh1d, [S0])
    illegal(lambda: torch.histc(xs, bins=4), match="pass min= and max=")
    xp = make(x, mesh1d, [Partial("sum")])
    illegal(lambda: torch.histc(xp, 4, -1, 1), match="Partial")


# re-expressed: dist, equal, linear_cross_entropy -------------------------------------------------
@pytest.mark.parametrize("n", [6, 3])
def test_dist_is_a_norm_with_planned_collectives(mesh1d, mesh2d, n):
    x, y = torch.randn(n, 4), torch.randn(n, 4)
    batch = Batch()
    # a root of a sum of powers: one all_reduce; p = 0, inf, -inf: a Partial, reduced when read
    for p, counts, pl in ((2, 1, R), (1, 1, R), (3.5, 1, R), (0, 0, Partial("sum")),
                          (float("inf"), 0, Partial("max")), (float("-inf"), 0, Partial("min"))):
        xs, yr = dt(x, mesh1d, [S0]), dt(y, mesh1d, [R])
        with dtorch.CommDebugMode() as mode:
            got = torch.dist(xs, yr, p)
        batch.add(got, torch.dist(x, y, p), [pl], rtol=1e-5, atol=1e-5)
        assert mode.get_comm_counts() == ({"all_reduce": 1} if counts else {}), p
    got = dt(x, mesh2d, [S0, S1]).dist(dt(y[0], mesh2d, [R, S0]))
    batch.add(got, x.dist(y[0]), rtol=1e-5, atol=1e-5)
    batch.check()
    xr = dt(x, mesh1d, [S0]).redistribute(placements=[R])
    assert torch.equal(no_comm(lambda: torch.dist(xr, xr)).to_torch(), torch.tensor(0.))
    xg, yg = x.clone().requires_grad_(), y.clone()
    torch.dist(xg, yg, 3).backward()
    dx = dt(x, mesh1d, [S0]).requires_grad_()
    torch.dist(dx, dt(y, mesh1d, [S0]), 3).backward()
    torch.testing.assert_close(dx.grad.to_torch(), xg.grad)


def test_equal_returns_torch_bool(mesh1d, mesh2d):
    x = torch.randn(5, 3)
    for a, b, pa, pb, mesh in ((x, x.clone(), [S0], [R], mesh1d), (x, x * 2, [S0], [S0], mesh1d),
                               (x, x[:1], [S1], [R], mesh1d), (x, x.clone(), [S0, S1], [R, S1],
                                                                mesh2d)):
        y = b.clone()
        got = torch.equal(dt(a, mesh, pa), dt(y, mesh, pb))
        assert got is torch.equal(a, y), (pa, pb)
    x2 = x.clone()
    x2[4, 2] += 1  # differs on the last rank only
    a, b = dt(x, mesh1d, [S0]), dt(x2, mesh1d, [S0])
    with dtorch.CommDebugMode() as mode:
        assert a.equal(b) is False
    assert mode.get_comm_counts() == {"all_reduce": 1}  # the count of differences
    xp, xs = make(x, mesh1d, [Partial("sum")]), dt(x, mesh1d, [S0])
    illegal(lambda: torch.equal(xp, xs))


@pytest.mark.parametrize("n", [6, 3])
def test_linear_cross_entropy_on_a_sharded_batch(mesh1d, n):
    x, w, b = torch.randn(n, 5), torch.randn(4, 5), torch.randn(4)
    t = torch.tensor([0, 3, -100, 1, 2, 3][:n])
    for tp in ([S0], [R]):
        for red in ("mean", "sum", "none"):
            got = F.linear_cross_entropy(dt(x, mesh1d, [S0]), dt(w, mesh1d, [R]),
                                         dt(t, mesh1d, tp), linear_bias=dt(b, mesh1d, [R]),
                                         reduction=red)
            want = F.linear_cross_entropy(x, w, t, linear_bias=b, reduction=red)
            torch.testing.assert_close(got.to_torch(), want, rtol=1e-5, atol=1e-5)
    w3 = torch.randn(3, 2, 5)  # K-dimensional: logits (n, 3, 2)
    t3 = torch.randint(0, 3, (n, 2))
    got = F.linear_cross_entropy(dt(x, mesh1d, [S0]), dt(w3, mesh1d, [R]), dt(t3, mesh1d, [S0]))
    torch.testing.assert_close(got.to_torch(), F.linear_cross_entropy(x, w3, t3))
    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
    F.linear_cross_entropy(xg, wg, t).backward()
    dx, dw = dt(x, mesh1d, [S0]).requires_grad_(), dt(w, mesh1d, [R]).requires_grad_()
    F.linear_cross_entropy(dx, dw, dt(t, mesh1d, [S0])).backward()
    torch.testing.assert_close(dx.grad.to_torch(), xg.grad)
    torch.testing.assert_close(dw.grad.to_torch(), wg.grad)
    xl, wr, tr = dt(x, mesh1d, [S1]), dt(w, mesh1d, [R]), dt(t, mesh1d, [R])
    illegal(lambda: F.linear_cross_entropy(xl, wr, tr),
            match=r"(?s)F\.linear_cross_entropy.*in_features.*Shard\(0\)\]\)   # all_to_all")


# refused: the fix and its collective -------------------------------------------------------------
STATS = []  # other operands, made before the call (illegal counts what is sent)


@pytest.mark.parametrize("call", [
    lambda x: torch.cov(x), lambda x: torch.corrcoef(x), lambda x: x.cov(correction=0),
    lambda x: F.pdist(x), lambda x: torch.histogramdd(x, [2, 2, 2]),
    lambda x: aten._batch_norm_with_update(x, None, None, STATS[0], STATS[3], 0.1, 1e-5),
    lambda x: torch.as_strided_scatter(x, STATS[1], (2, 2), (1, 2)),
    lambda x: x.resize_(9, 2), lambda x: x.resize_as_(STATS[2])])
@pytest.mark.parametrize("pl", [[S0], [S1], [Partial("sum")]])
def test_refusals_name_the_fix_and_its_collective(mesh1d, call, pl):
    x = make(torch.randn(6, 3), mesh1d, pl)
    STATS[:] = [dt(torch.zeros(3), mesh1d, [R]), dt(torch.ones(2, 2), mesh1d, [R]),
                dt(torch.ones(9, 2), mesh1d, [R]), dt(torch.ones(3), mesh1d, [R])]
    err = illegal(lambda: call(x), match=r"fix: input\.redistribute\(placements=\[Replicate\(\)\]")
    assert ("all_gather" if pl[0].is_shard() else "all_reduce") in str(err), str(err)


def test_refused_ops_still_run_on_replicate_inputs(mesh1d):
    x, w = torch.randn(3, 6), torch.rand(6) + 0.5
    batch = Batch()
    xr = dt(x, mesh1d, [R])
    batch.add(no_comm(lambda: torch.cov(xr)), torch.cov(x), [R])
    batch.add(no_comm(lambda: torch.cov(xr, aweights=dt(w, mesh1d, [R]))),
              torch.cov(x, aweights=w), [R], atol=1e-6)
    batch.add(no_comm(lambda: F.pdist(xr)), F.pdist(x), [R])
    hist, edges = no_comm(lambda: torch.histogramdd(dt(x.T.contiguous(), mesh1d, [R]), [2, 2, 2]))
    want = torch.histogramdd(x.T.contiguous(), [2, 2, 2])
    batch.add(hist, want.hist, [R])
    batch.add(list(edges), list(want.bin_edges), [R])
    batch.check()


@pytest.mark.parametrize("convert", ["to_sparse", "to_sparse_csr"])
@pytest.mark.parametrize("pl", [[Shard(0)], [R]], ids=["shard0", "replicate"])
def test_sparse_conversions_refuse_as_on_replicate_inputs(mesh1d, convert, pl):
    x = dt(torch.randn(5, 4), mesh1d, pl)
    c = dtorch.runtime.session.get_controller()
    before = c.issued
    with pytest.raises(dtorch.UnsupportedOpError, match="DTensors are dense"):
        getattr(x, convert)()
    if pl != [R]:  # refused on the controller: nothing sent (Replicate finds out on a rank)
        assert c.issued == before
