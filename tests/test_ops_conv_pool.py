"""conv / conv_transpose, pooling, interpolate, shuffles, fold/unfold, constant_pad_nd on
batch- and channel-sharded DTensors: torch's values, no collective, uneven and empty shards,
gradients, and PlacementError with the fix on a spatial shard."""

import pytest
import torch
import torch.nn.functional as F

from dtorch import Replicate, Shard
from nn_local_support import grad_check, local
from test_ops_support import Batch, dt, illegal

R = Replicate()
S0, S1, S2 = Shard(0), Shard(1), Shard(2)


@pytest.mark.parametrize("n", [5, 3])
def test_conv_batch_and_out_channels(mesh1d, mesh2d, n):
    torch.manual_seed(n)
    x, w, b = torch.randn(n, 3, 6, 6), torch.randn(4, 3, 3, 3), torch.randn(4)
    w3, b3 = torch.randn(3, 3, 3, 3), torch.randn(3)  # 3 out channels: one rank holds none
    batch = Batch()
    local(batch, F.conv2d, (x, w, b), [[S0]], mesh1d, [S0], padding=1)
    local(batch, torch.conv2d, (x, w, b), [[R], [S0]], mesh1d, [S1])
    local(batch, F.conv2d, (x, w3, b3), [[R], [S0], [S0]], mesh1d, [S1], stride=2)
    local(batch, F.conv2d, (x, w, b), [[S0, R], [R, S0]], mesh2d, [S0, S1])
    local(batch, F.conv1d, (x[:, :, 0], w[..., 0], b), [[S0]], mesh1d, [S0])
    local(batch, F.conv3d, (x[:, :, None], w[:, :, None], None), [[S0]], mesh1d, [S0])
    wt = torch.randn(3, 4, 3, 3)
    local(batch, F.conv_transpose2d, (x, wt, b), [[S0]], mesh1d, [S0], stride=2)
    local(batch, F.conv_transpose2d, (x, wt, b), [[R], [S1]], mesh1d, [S1])
    local(batch, F.conv_transpose1d, (x[:, :, 0], wt[..., 0]), [[S0]], mesh1d, [S0])
    local(batch, F.conv_transpose3d, (x[:, :, None], wt[:, :, None]), [[S0]], mesh1d, [S0])
    xg, wg = torch.randn(n, 4, 5, 5), torch.randn(4, 2, 3, 3)
    local(batch, F.conv2d, (xg, wg), [[S0]], mesh1d, [S0], groups=2)
    batch.check()


def test_conv_refusals(mesh1d):
    x, w = torch.randn(4, 4, 6, 6), torch.randn(4, 2, 3, 3)
    xs2, xs1, xr = dt(x, mesh1d, [S2]), dt(x, mesh1d, [S1]), dt(x, mesh1d, [R])
    wr, ws, wfull = dt(w, mesh1d, [R]), dt(w, mesh1d, [S0]), dt(w.repeat(1, 2, 1, 1), mesh1d, [R])
    err = illegal(lambda: F.conv2d(xs2, wr, groups=2), match="combines values along dim 2")
    assert "Shard(0)" in str(err)  # the fix: shard the batch instead
    illegal(lambda: F.conv2d(xr, ws, groups=2), match="weight")
    illegal(lambda: F.conv2d(xs1, wfull), match="dim 1")


@pytest.mark.parametrize("pl", [S0, S1], ids=["batch", "channel"])
def test_pooling(mesh1d, mesh2d, pl):
    x = torch.randn(5, 3, 8, 8)
    batch = Batch()
    for fn, kw in ((F.max_pool2d, dict(kernel_size=2)),
                   (F.max_pool2d, dict(kernel_size=3, stride=2, padding=1,
                                       return_indices=True)),
                   (F.avg_pool2d, dict(kernel_size=2, ceil_mode=True)),
                   (F.adaptive_avg_pool2d, dict(output_size=3)),
                   (F.adaptive_max_pool2d, dict(output_size=3, return_indices=True)),
                   (F.lp_pool2d, dict(norm_type=2, kernel_size=2))):
        local(batch, fn, (x,), [[pl]], mesh1d, [pl], **kw)
    local(batch, F.max_pool1d, (x[..., 0],), [[pl]], mesh1d, [pl], kernel_size=2)
    local(batch, F.avg_pool1d, (x[..., 0],), [[pl]], mesh1d, [pl], kernel_size=3)
    local(batch, F.adaptive_max_pool1d, (x[..., 0],), [[pl]], mesh1d, [pl], output_size=2)
    x3 = torch.randn(3, 2, 4, 4, 4)
    local(batch, F.max_pool3d, (x3,), [[pl]], mesh1d, [pl], kernel_size=2)
    local(batch, F.avg_pool3d, (x3,), [[pl]], mesh1d, [pl], kernel_size=2)
    local(batch, F.adaptive_avg_pool3d, (x3,), [[pl]], mesh1d, [pl], output_size=2)
    local(batch, F.max_pool2d, (x,), [[S0, S1]], mesh2d, [S0, S1], kernel_size=2)
    out, idx = F.max_pool2d(x, 2, return_indices=True)
    local(batch, F.max_unpool2d, (out, idx), [[pl], [pl]], mesh1d, [pl], kernel_size=2)
    batch.check()


def test_pool_refuses_spatial_shard(mesh1d):
    x = dt(torch.randn(2, 3, 8, 8), mesh1d, [S2])
    x.to_torch()
    err = illegal(lambda: F.max_pool2d(x, 2), match="combines values along dim 2")
    assert "redistribute" in str(err)


@pytest.mark.parametrize("pl", [S0, S1], ids=["batch", "channel"])
def test_interpolate(mesh1d, pl):
    x1, x2, x3 = torch.randn(5, 3, 6), torch.randn(5, 3, 4, 5), torch.randn(3, 3, 2, 3, 4)
    batch = Batch()
    for x, mode in ((x1, "nearest"), (x1, "linear"), (x2, "bilinear"), (x2, "bicubic"),
                    (x2, "nearest-exact"), (x1, "area"), (x3, "trilinear")):
        local(batch, F.interpolate, (x,), [[pl]], mesh1d, [pl], scale_factor=2, mode=mode)
    local(batch, F.interpolate, (x2,), [[pl]], mesh1d, [pl], size=(3, 7), mode="bilinear",
          align_corners=True, antialias=True)
    local(batch, F.upsample_bilinear, (x2,), [[pl]], mesh1d, [pl], scale_factor=2)
    local(batch, F.upsample_nearest, (x1,), [[pl]], mesh1d, [pl], size=9)
    local(batch, torch.ops.aten._upsample_bilinear2d_aa, (x2, [2, 3], False), [[pl]], mesh1d,
          [pl])
    batch.check()
    x2s = dt(x2, mesh1d, [Shard(3)])
    illegal(lambda: F.interpolate(x2s, scale_factor=2))


def test_shuffles_fold_pad(mesh1d, mesh2d):
    batch = Batch()
    for n in (5, 3):
        x = torch.randn(n, 8, 4, 4)
        local(batch, F.pixel_shuffle, (x, 2), [[S0]], mesh1d, [S0])
        local(batch, F.pixel_unshuffle, (x, 2), [[S0]], mesh1d, [S0])  # torch errs on empty
        local(batch, F.channel_shuffle, (x, 2), [[S0]], mesh1d, [S0])
        local(batch, F.channel_shuffle, (x, 2), [[S2]], mesh1d, [S2])
        cols = local(batch, F.unfold, (x,), [[S0]], mesh1d, [S0], kernel_size=2, stride=2)
        local(batch, F.fold, (F.unfold(x, 2, stride=2),), [[S0]], mesh1d, [S0],
              output_size=(4, 4), kernel_size=2, stride=2)
        assert cols.placements == (S0,)
        local(batch, torch.constant_pad_nd, (x, (1, 2), 3.0), [[S0]], mesh1d, [S0])
        local(batch, torch.constant_pad_nd, (x, (1, 2)), [[S0, S2]], mesh2d, [S0, S2])
        local(batch, lambda t, *a: t.unfold(*a), (x, 3, 2, 1), [[S0]], mesh1d, [S0])
    batch.check()
    x = torch.randn(5, 8, 4, 4)
    xs1, xs3 = dt(x, mesh1d, [S1]), dt(x, mesh1d, [Shard(3)])
    illegal(lambda: F.pixel_shuffle(xs1, 2))
    illegal(lambda: torch.constant_pad_nd(xs3, (1, 1)))
    illegal(lambda: xs3.unfold(3, 2, 1))


def test_gradients(mesh1d, mesh2d):
    torch.manual_seed(0)
    x, w, b = torch.randn(5, 3, 6, 6), torch.randn(4, 3, 3, 3), torch.randn(4)
    grad_check(lambda a, k, c: F.conv2d(a, k, c, padding=1), (x, w, b), [[S0]], mesh1d)
    grad_check(lambda a, k, c: F.conv2d(a, k, c), (x, w, b), [[R], [S0], [S0]], mesh1d)
    grad_check(lambda a: F.max_pool2d(a, 2), (x,), [[S1]], mesh1d)
    grad_check(lambda a: F.avg_pool2d(a, 3, stride=1), (x[:3],), [[S0, S1]], mesh2d)
    grad_check(lambda a: F.interpolate(a, scale_factor=2, mode="bilinear"), (x[:3],), [[S0]],
               mesh1d)
    grad_check(lambda a: F.pixel_unshuffle(a, 2), (x[:3],), [[S0]], mesh1d)
