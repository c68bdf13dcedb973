"""The losses of dtorch.ops.losses_more on batch-sharded DTensors: reduction "none" keeps the
batch's Shard with no collective, "mean"/"sum" are torch's values (a pending sum), uneven and
empty shards, gradients, and refusals with the fix."""

import pytest
import torch
import torch.nn.functional as F

from dtorch import Replicate, Shard
from nn_local_support import dist, grad_check, local
from test_ops_support import Batch, dt, illegal

R = Replicate()
S0, S1 = Shard(0), Shard(1)


def cases(n):
    """``(name, fn, tensors)``: every loss on a batch of ``n``."""
    g = torch.Generator().manual_seed(n)
    x, y, z = (torch.randn(n, 5, generator=g) for _ in range(3))
    sign = torch.randint(0, 2, (n,), generator=g) * 2 - 1.0
    cls = torch.randint(0, 5, (n,), generator=g)
    multi = torch.full((n, 5), -1)
    multi[:, 0], multi[:, 1] = 2, 4
    probs = torch.rand(n, 5, generator=g)
    var = torch.rand(n, 5, generator=g) + 0.1
    e1, e2 = torch.randn(n, generator=g), torch.randn(n, generator=g)
    return [
        ("cosine_embedding", F.cosine_embedding_loss, (x, y, sign)),
        ("gaussian_nll", F.gaussian_nll_loss, (x, y, var)),
        ("gaussian_nll-homosc", F.gaussian_nll_loss, (x, y, var[:, 0])),
        ("hinge_embedding", F.hinge_embedding_loss, (x, sign[:, None].expand(n, 5))),
        ("margin_ranking", F.margin_ranking_loss, (e1, e2, sign)),
        ("multi_margin", F.multi_margin_loss, (x, cls)),
        ("multilabel_margin", F.multilabel_margin_loss, (x, multi)),
        ("multilabel_soft_margin", F.multilabel_soft_margin_loss, (x, probs)),
        ("poisson_nll", F.poisson_nll_loss, (x, probs)),
        ("soft_margin", F.soft_margin_loss, (x, sign[:, None].expand(n, 5).contiguous())),
        ("triplet_margin", F.triplet_margin_loss, (x, y, z)),
        ("triplet_distance", F.triplet_margin_with_distance_loss, (x, y, z)),
    ]


@pytest.mark.parametrize("n", [5, 3])
def test_none_keeps_the_batch(mesh1d, mesh2d, n):
    batch = Batch()
    for name, fn, ts in cases(n):
        pls = [[S0]] * len(ts)
        local(batch, fn, ts, pls, mesh1d, [S0], reduction="none")
        local(batch, fn, ts, [[S0, R]] * len(ts), mesh2d, [S0, R], reduction="none")
    batch.check()


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_mean_and_sum(mesh1d, reduction):
    for name, fn, ts in cases(5):
        ds = dist(ts, [[S0]] * len(ts), mesh1d)
        out = fn(*ds, reduction=reduction)
        assert out.placements[0].is_partial(), name  # the sum of the per-sample losses
        torch.testing.assert_close(out.to_torch(), fn(*ts, reduction=reduction), rtol=1e-5,
                                   atol=1e-6, msg=lambda m: f"{name}: {m}")


def test_legacy_reduce_and_custom_distance(mesh1d):
    x, y, z = torch.randn(5, 4), torch.randn(5, 4), torch.randn(5, 4)
    xs, ys, zs = dist((x, y, z), [[S0]] * 3, mesh1d)
    got = F.soft_margin_loss(xs, ys.sign(), size_average=False)
    torch.testing.assert_close(got.to_torch(), F.soft_margin_loss(x, y.sign(), reduction="sum"))
    cos = lambda a, b: 1 - F.cosine_similarity(a, b)  # noqa: E731 - the user's distance
    got = F.triplet_margin_with_distance_loss(xs, ys, zs, distance_function=cos, swap=True,
                                              reduction="none")
    assert got.placements == (S0,)
    torch.testing.assert_close(got.to_torch(), F.triplet_margin_with_distance_loss(
        x, y, z, distance_function=cos, swap=True, reduction="none"))


def test_gradients(mesh1d, mesh2d):
    x, y, z = torch.randn(5, 4), torch.randn(5, 4), torch.randn(5, 4)
    grad_check(lambda a, b, c: F.triplet_margin_loss(a, b, c, reduction="none"), (x, y, z),
               [[S0]] * 3, mesh1d, grad_of=(0,))
    grad_check(lambda a, b: F.multilabel_soft_margin_loss(a, b, reduction="none"),
               (x, torch.rand(5, 4)), [[S0, R]] * 2, mesh2d, grad_of=(0,))
    xs = dt(x, mesh1d, [S0]).requires_grad_()
    t = torch.randint(0, 4, (5,))
    loss = F.multi_margin_loss(xs, dt(t, mesh1d, [S0]))
    loss.backward()
    xt = x.clone().requires_grad_()
    F.multi_margin_loss(xt, t).backward()
    torch.testing.assert_close(xs.grad.to_torch(), xt.grad)


def test_refusals(mesh1d):
    x, t = dt(torch.randn(4, 5), mesh1d, [S1]), dt(torch.randint(0, 5, (4,)), mesh1d, [R])
    illegal(lambda: F.multi_margin_loss(x, t, reduction="none"), match="combines values")
    y = dt(torch.randn(4, 5), mesh1d, [R])
    illegal(lambda: F.triplet_margin_loss(x, y, y, reduction="none"))
    lp = dt(torch.randn(6, 4, 5).log_softmax(2), mesh1d, [S1])
    tg = dt(torch.randint(1, 5, (4, 3)), mesh1d, [S0])
    lens, tlens = torch.full((4,), 6), torch.full((4,), 3)
    illegal(lambda: F.ctc_loss(lp, tg, lens, tlens), match="Replicate its inputs")
