"""Norms, embedding_bag, distances, cdist, bilinear, prelu, glu, grid_sample on sharded
DTensors: torch's values, no collective, uneven and empty shards, gradients, refusals."""

import pytest
import torch
import torch.nn.functional as F

from dtorch import Replicate, Shard
from nn_local_support import grad_check, local
from test_ops_support import Batch, dt, illegal

R = Replicate()
S0, S1, S2 = Shard(0), Shard(1), Shard(2)


@pytest.mark.parametrize("n", [5, 3])
def test_norms(mesh1d, mesh2d, n):
    torch.manual_seed(n)
    x, w, b = torch.randn(n, 6, 4, 3), torch.randn(6), torch.randn(6)
    batch = Batch()
    local(batch, F.group_norm, (x, 3, w, b), [[S0]], mesh1d, [S0])
    local(batch, F.group_norm, (x, 2), [[S0, R]], mesh2d, [S0, R])
    local(batch, torch.native_group_norm, (x, w, b, n, 6, 12, 3, 1e-5), [[S0]], mesh1d, [S0])
    local(batch, F.instance_norm, (x,), [[S0]], mesh1d, [S0])
    local(batch, lambda t, ww, bb: F.instance_norm(t, weight=ww, bias=bb), (x, w, b), [[S1]],
          mesh1d, [S1])  # the channel weight is narrowed on each rank
    rm, rv = torch.randn(6), torch.rand(6) + 0.5
    local(batch, lambda t, m, v: F.instance_norm(t, m, v, use_input_stats=False), (x, rm, rv),
          [[S0, S1]], mesh2d, [S0, S1])
    local(batch, F.local_response_norm, (x, 3), [[S0]], mesh1d, [S0])
    local(batch, F.local_response_norm, (x, 3), [[S2]], mesh1d, [S2])
    batch.check()
    xs1 = dt(x, mesh1d, [S1])
    xs0, rmr, rvr = dt(x, mesh1d, [S0]), dt(rm, mesh1d, [R]), dt(rv, mesh1d, [R])
    illegal(lambda: F.group_norm(xs1, 3), match="combines values along dim 1")
    illegal(lambda: F.local_response_norm(xs1, 3))
    illegal(lambda: F.instance_norm(xs0, rmr, rvr), match="running_mean")


def test_embedding_bag(mesh1d):
    weight = torch.randn(10, 4)
    batch = Batch()
    for n in (5, 3):
        idx = torch.randint(0, 10, (n, 3))
        psw = torch.randn(n, 3)
        for mode in ("sum", "mean", "max"):
            local(batch, lambda i, w: F.embedding_bag(i, w, mode=mode), (idx, weight), [[S0]],
                  mesh1d, [S0])
        local(batch, lambda i, w, p: F.embedding_bag(i, w, mode="sum", per_sample_weights=p),
              (idx, weight, psw), [[S0], None, [S0]], mesh1d, [S0])
    batch.check()
    flat, offsets = dt(torch.randint(0, 10, (8,)), mesh1d, [S0]), torch.tensor([0, 3, 5])
    wr, ws = dt(weight, mesh1d, [R]), dt(weight, mesh1d, [S0])
    off = dt(offsets, mesh1d, [R])
    illegal(lambda: F.embedding_bag(flat, wr, off), match="offsets form")
    idx = dt(torch.randint(0, 10, (4, 3)), mesh1d, [S0])
    illegal(lambda: F.embedding_bag(idx, wr, max_norm=1.0), match="max_norm")
    idx_r = idx.redistribute(placements=[R])
    idx_r.to_torch()
    illegal(lambda: F.embedding_bag(idx_r, ws), match="weight")


def test_distances(mesh1d, mesh2d):
    torch.manual_seed(1)
    batch = Batch()
    for n in (5, 3):
        a, b = torch.randn(n, 6), torch.randn(n, 6)
        local(batch, F.cosine_similarity, (a, b), [[S0], [S0]], mesh1d, [S0])
        local(batch, F.cosine_similarity, (a, b[:1]), [[S0]], mesh1d, [S0])  # broadcast row
        local(batch, F.cosine_similarity, (a, b), [[S1]], mesh1d, [S0], dim=0)
        local(batch, F.pairwise_distance, (a, b), [[S0]], mesh1d, [S0])
        local(batch, F.pairwise_distance, (a, b), [[S0]], mesh1d, [S0], keepdim=True)
        x1, x2 = torch.randn(n, 30, 4), torch.randn(n, 7, 4)  # > 25 rows: torch's mm path
        local(batch, torch.cdist, (x1, x2), [[S1]], mesh1d, [S1])
        local(batch, torch.cdist, (x1, x2), [[S0], [S0]], mesh1d, [S0])
        local(batch, torch.cdist, (x1, x2), [[R], [S1]], mesh1d, [S2])
        local(batch, torch.cdist, (x1, x2), [[S0, S1]], mesh2d, [S0, S1], p=1.0)
        local(batch, torch.cdist, (x1[0], x2[0]), [[S0]], mesh1d, [S0])
    batch.check()
    a = dt(torch.randn(4, 6), mesh1d, [S1])
    c = dt(torch.randn(4, 6), mesh1d, [R])
    illegal(lambda: F.cosine_similarity(a, c), match="combines values along dim 1")
    illegal(lambda: F.pairwise_distance(a, c))
    x1 = dt(torch.randn(4, 5, 3), mesh1d, [S2])
    illegal(lambda: torch.cdist(x1, x1))


def test_bilinear_prelu_glu_grid(mesh1d, mesh2d):
    torch.manual_seed(2)
    batch = Batch()
    for n in (5, 3):
        x1, x2, w, b = torch.randn(n, 3), torch.randn(n, 4), torch.randn(6, 3, 4), torch.randn(6)
        local(batch, F.bilinear, (x1, x2, w, b), [[S0], [S0]], mesh1d, [S0])
        local(batch, F.bilinear, (x1, x2, w, b), [[R], [R], [S0]], mesh1d, [S1])
        x, pw = torch.randn(n, 3, 4), torch.rand(3)
        local(batch, F.prelu, (x, pw), [[S0]], mesh1d, [S0])
        local(batch, F.prelu, (x, pw), [[S1]], mesh1d, [S1])  # the weight is narrowed
        local(batch, F.prelu, (x, torch.rand(1)), [[S2]], mesh1d, [S2])
        local(batch, F.glu, (x, 2), [[S0, S1]], mesh2d, [S0, S1])
        inp, grid = torch.randn(n, 2, 5, 5), torch.rand(n, 3, 4, 2) * 2 - 1
        local(batch, F.grid_sample, (inp, grid), [[S0], [S0]], mesh1d, [S0],
              align_corners=False)
        local(batch, F.grid_sample, (inp, grid), [[S1]], mesh1d, [S1], align_corners=True)
        local(batch, F.grid_sample, (inp, grid), [None, [S1]], mesh1d, [S2],
              align_corners=False)
        local(batch, torch.grid_sampler_2d, (inp, grid, 0, 0, False), [[S0], [S0]], mesh1d,
              [S0])
        inp3, grid3 = torch.randn(n, 2, 3, 3, 3), torch.rand(n, 2, 2, 2, 3) * 2 - 1
        local(batch, torch.grid_sampler_3d, (inp3, grid3, 0, 0, False), [[S0], [S0]], mesh1d,
              [S0])
    batch.check()
    xs = dt(torch.randn(4, 6), mesh1d, [S1])
    illegal(lambda: F.glu(xs, 1), match="combines values along dim 1")
    inp, grid = dt(torch.randn(4, 2, 5, 5), mesh1d, [S2]), dt(torch.rand(4, 3, 4, 2), mesh1d,
                                                              [R])
    illegal(lambda: F.grid_sample(inp, grid, align_corners=False), match="dim 2")


def test_gradients(mesh1d, mesh2d):
    torch.manual_seed(3)
    x, w, b = torch.randn(5, 6, 4), torch.randn(6), torch.randn(6)
    grad_check(lambda t, ww, bb: F.group_norm(t, 3, ww, bb), (x, w, b), [[S0]], mesh1d)
    grad_check(lambda t: F.instance_norm(t), (x,), [[S0, S1]], mesh2d)
    a, c = torch.randn(5, 6), torch.randn(7, 6)
    grad_check(torch.cdist, (a, c), [[S0]], mesh1d)
    inp, grid = torch.randn(3, 2, 5, 5), torch.rand(3, 3, 4, 2) * 2 - 1
    grad_check(lambda i, g: F.grid_sample(i, g, align_corners=False), (inp, grid),
               [[S0], [S0]], mesh1d)
    grad_check(F.prelu, (x, torch.rand(6)), [[S1]], mesh1d)
