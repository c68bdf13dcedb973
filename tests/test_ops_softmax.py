"""softmax / log_softmax: placements kept; over a sharded dim (or on Partial) they raise."""

import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import dtorch
from dtorch import Replicate, Shard
from test_ops_support import Batch, dt, illegal, make, no_comm, placements_1d

R = Replicate()
OPS = {"F.softmax": lambda x, d: F.softmax(x, d), "torch.softmax": lambda x, d: torch.softmax(x, d),
       "method": lambda x, d: x.softmax(dim=d), "log_softmax": lambda x, d: F.log_softmax(x, d),
       "softmin": lambda x, d: F.softmin(x, dim=d)}


@settings(max_examples=10, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(shape=st.lists(st.integers(1, 6), min_size=1, max_size=3).map(tuple), data=st.data(),
       name=st.sampled_from(sorted(OPS)))
def test_every_placement(mesh1d, mesh2d, shape, data, name):
    fn = OPS[name]
    dim = data.draw(st.integers(-len(shape), len(shape) - 1))
    x = torch.randn(shape, dtype=torch.float64)
    expected = fn(x, dim)
    batch = Batch()
    cases = [(mesh1d, pl) for pl in placements_1d(len(shape))]
    cases += [(mesh2d, (p[0], q[0])) for p in placements_1d(len(shape))[:len(shape) + 1]
              for q in placements_1d(len(shape))[:len(shape) + 2]]
    for mesh, pl in cases:
        d = make(x, mesh, pl, 1)
        legal = all(not p.is_partial() and p != Shard(dim % len(shape)) for p in pl)
        if legal:
            batch.add(no_comm(lambda: fn(d, dim)), expected, pl)
        else:
            illegal(lambda: fn(d, dim))
    batch.check()


def test_message_suggests_a_redistribute(mesh2d):
    x = dt(torch.randn(4, 6), mesh2d, [Shard(0), Shard(1)])
    err = illegal(lambda: F.softmax(x, -1))
    text = str(err)
    assert "F.softmax" in text and "mesh dim 1 ('tp')" in text
    assert "input [S(0), S(1)]" in text
    assert "fix: input.redistribute(placements=[Shard(0), Shard(0)])   # all_to_all" in text
    assert "or: input.redistribute(placements=[Shard(0), Replicate()])   # all_gather" in text
    assert isinstance(err, dtorch.PlacementError)
