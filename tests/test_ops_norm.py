"""layer_norm / rms_norm / normalize: batch and sequence dims may be sharded (unevenly too)."""

import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dtorch import Partial, Replicate, Shard
from test_ops_support import Batch, dt, illegal, make, no_comm, placements_1d

R = Replicate()


def test_layer_norm_and_rms_norm(mesh1d, mesh2d):
    x, w, b = torch.randn(3, 5, 8), torch.randn(8), torch.randn(8)
    batch = Batch()
    for mesh, pl in ((mesh1d, [Shard(0)]), (mesh1d, [Shard(1)]), (mesh1d, [R]),
                     (mesh2d, [Shard(0), Shard(1)]), (mesh2d, [Shard(1), R])):
        rr = [R] * mesh.ndim
        xs, ws, bs = dt(x, mesh, pl), dt(w, mesh, rr), dt(b, mesh, rr)
        batch.add(no_comm(lambda: F.layer_norm(xs, (8,), ws, bs)), F.layer_norm(x, (8,), w, b),
                  pl)
        batch.add(no_comm(lambda: F.layer_norm(xs, (5, 8))), F.layer_norm(x, (5, 8)), pl) \
            if Shard(1) not in pl else None
        batch.add(no_comm(lambda: F.rms_norm(xs, (8,), ws, eps=1e-6)),
                  F.rms_norm(x, (8,), w, eps=1e-6), pl)
        batch.add(no_comm(lambda: F.normalize(xs, dim=-1)), F.normalize(x, dim=-1), pl)
    batch.check()


def test_illegal_norms(mesh1d, mesh2d):
    x, w = torch.randn(3, 5, 8), torch.randn(8)
    xs2 = dt(x, mesh1d, [Shard(2)])
    xs1 = dt(x, mesh1d, [Shard(1)])
    xp = dt(x, mesh1d, [Partial()])
    wr, ws = dt(w, mesh1d, [R]), dt(w, mesh1d, [Shard(0)])
    illegal(lambda: F.layer_norm(xs2, (8,), wr), match="normalizes over dim 2")
    illegal(lambda: F.layer_norm(xs1, (5, 8)))
    illegal(lambda: F.rms_norm(xp, (8,)))
    xs0 = dt(x, mesh1d, [Shard(0)])
    illegal(lambda: F.layer_norm(xs0, (8,), ws), match="weight")
    illegal(lambda: F.normalize(xs2, dim=2))


@settings(max_examples=10, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(shape=st.lists(st.integers(1, 6), min_size=1, max_size=3).map(tuple),
       k=st.integers(1, 2), rms=st.booleans())
def test_every_placement_1d(mesh1d, shape, k, rms):
    k = min(k, len(shape))
    norm_shape = shape[len(shape) - k:]
    x = torch.randn(shape, dtype=torch.float64)
    w = torch.randn(norm_shape, dtype=torch.float64)
    fn = (lambda t, wt: F.rms_norm(t, norm_shape, wt)) if rms else (
        lambda t, wt: F.layer_norm(t, norm_shape, wt))
    expected = fn(x, w)
    wr = dt(w, mesh1d, [R])
    batch = Batch()
    for pl in placements_1d(len(shape)):
        d = make(x, mesh1d, pl, 1)
        ok = not pl[0].is_partial() and not (isinstance(pl[0], Shard) and
                                             pl[0].dim >= len(shape) - k)
        if ok:
            batch.add(no_comm(lambda: fn(d, wr)), expected, pl)
        else:
            illegal(lambda: fn(d, wr))
    batch.check()


def test_batch_norm_in_eval_keeps_a_sharded_batch_or_spatial_dim(mesh1d, mesh2d):
    """Eval mode normalizes with the running statistics: each rank's rows alone suffice."""
    x = torch.randn(6, 3, 5)
    stats = [torch.randn(3), torch.rand(3) + 0.5, torch.randn(3), torch.randn(3)]
    want = F.batch_norm(x, stats[0], stats[1], stats[2], stats[3], training=False)
    batch = Batch()
    for mesh, pl in ((mesh1d, [Shard(0)]), (mesh1d, [Shard(2)]), (mesh1d, [R]),
                     (mesh2d, [Shard(0), Shard(2)])):
        rm, rv, w, b = (dt(t, mesh, [R] * mesh.ndim) for t in stats)
        got = no_comm(lambda: F.batch_norm(dt(x, mesh, pl), rm, rv, w, b, training=False))
        batch.add(got, want, pl)
    batch.check()
    xs = dt(x, mesh1d, [Shard(1)])  # the channel dim: each rank would need its own stats slice
    rm, rv = dt(stats[0], mesh1d, [R]), dt(stats[1], mesh1d, [R])
    illegal(lambda: F.batch_norm(xs, rm, rv, training=False))
