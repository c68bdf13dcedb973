"""Runs that repeat are prepared once on the ranks and replayed: same values, same
collectives, errors that travel exactly as without replay."""

import pytest
import torch
import torch.nn.functional as F

import dtorch
from dtorch import Replicate, Shard
from dtorch.runtime import batches
from ledgers import counted

pytestmark = pytest.mark.timeout(180)


def _stats(key):
    """Each rank's ``key`` once it ran everything issued (and freed what was dropped)."""
    dtorch.synchronize()
    return [s[key] for s in dtorch.rank_stats()]


def _replayed():
    return _stats("replayed")


def _tp_mlp(mesh):
    g = torch.Generator().manual_seed(0)
    x, w1, w2 = (torch.randn(8, 16, generator=g), torch.randn(32, 16, generator=g),
                 torch.randn(16, 32, generator=g))
    dx = dtorch.tensor(x, device_mesh=mesh, placements=[Replicate()])
    dw1 = dtorch.tensor(w1, device_mesh=mesh, placements=[Shard(0)])
    dw2 = dtorch.tensor(w2, device_mesh=mesh, placements=[Shard(1)])
    want = F.linear(F.relu(F.linear(x, w1)), w2)

    def forward():
        return F.linear(F.relu(F.linear(dx, dw1)), dw2).redistribute(placements=[Replicate()])
    return forward, want


def test_a_repeated_loop_body_is_replayed_with_torch_s_values_and_collectives(mesh1d):
    forward, want = _tp_mlp(mesh1d)
    before = _replayed()
    for _ in range(5):  # the three ledgers agree on every instance, replayed or not
        out, counts = counted(forward)
        torch.testing.assert_close(out.to_torch(), want, rtol=1e-5, atol=1e-5)
        assert sum(counts.values()) == 1  # the one all_reduce of the row-parallel output
    replayed = [a - b for a, b in zip(_replayed(), before)]
    assert all(r > 0 for r in replayed), replayed  # from the second or third instance on


def test_replay_on_and_off_give_identical_values_and_instruction_counts(mesh1d):
    x0 = torch.randn(64, 16)
    x = dtorch.tensor(x0, device_mesh=mesh1d, placements=[Shard(0)])

    def body(t):
        for _ in range(20):
            t = torch.tanh(t * 1.01 + 0.5)
        return t

    got, counts = {}, {}
    for replay in (True, False):
        batches.REPLAY = replay
        try:
            start = _stats("instructions")
            got[replay] = [body(x).to_torch() for _ in range(4)]
            counts[replay] = [s - b for s, b in zip(_stats("instructions"), start)]
        finally:
            batches.REPLAY = True
    for a, b in zip(got[True], got[False]):
        assert torch.equal(a, b)
    torch.testing.assert_close(got[True][0], body(x0))
    assert counts[True] == counts[False]


def test_an_op_failing_inside_a_replayed_run_poisons_what_follows_with_its_own_error(mesh1d):
    """cholesky fails on the third instance only (data-dependent): its error reaches the
    read, the run's later ops carry it, and the next instance computes again."""
    spd = torch.eye(4) * 2.0
    inputs = [spd, spd * 3, -spd, spd * 5]

    def body(a):
        return torch.linalg.cholesky(a) * 2.0 + 1.0

    for i, a0 in enumerate(inputs):
        a = dtorch.tensor(a0, device_mesh=mesh1d, placements=[Replicate()])
        if i == 2:
            with pytest.raises(dtorch.RemoteError, match="cholesky"):
                body(a).to_torch()
            with pytest.raises(dtorch.RemoteError, match="cholesky"):
                dtorch.synchronize()
        else:
            torch.testing.assert_close(body(a).to_torch(), body(a0))
    assert all(r > 0 for r in _replayed())


def test_a_poisoned_input_from_outside_a_replayed_run_travels_through_it(mesh1d):
    def body(t):
        return (t * 2.0 + 1.0).exp()

    good = dtorch.tensor(torch.eye(4), device_mesh=mesh1d, placements=[Replicate()])
    for _ in range(3):  # body's run becomes a program
        torch.testing.assert_close(body(good).to_torch(), body(torch.eye(4)))
    bad = torch.linalg.cholesky(dtorch.tensor(-torch.eye(4), device_mesh=mesh1d,
                                              placements=[Replicate()]))
    with pytest.raises(dtorch.RemoteError, match="cholesky"):
        body(bad).to_torch()
    with pytest.raises(dtorch.RemoteError):
        dtorch.synchronize()
    torch.testing.assert_close(body(good).to_torch(), body(torch.eye(4)))


def test_a_replayed_instance_sends_its_ids_not_its_instructions(other_cluster):
    other_cluster(n_workers=64, dry_run=True)
    mesh = dtorch.init_device_mesh("cpu", 64)
    x = dtorch.ones(64, 8, device_mesh=mesh, placements=[Shard(0)])
    sent = []
    for _ in range(4):
        before = dtorch.rank_stats()[5]["bytes"]
        y = x
        for _ in range(50):
            y = torch.relu(y * 2.0 - 1.0)
        dtorch.synchronize()
        sent.append(dtorch.rank_stats()[5]["bytes"] - before)
    # the first instance whole, the second defines the program, then ids only
    assert sent[3] * 3 < sent[0], sent


def test_fused_stretches_give_the_unfused_values_and_errors(other_cluster, monkeypatch):
    """DTORCH_FUSE=1 on the ranks: a replayed program's stretches of calls run as one
    compiled function, within float tolerance of unfused execution; an op failing inside a
    fused stretch still reads as its own error."""
    monkeypatch.setenv("DTORCH_FUSE", "1")
    other_cluster(n_workers=2)
    mesh = dtorch.init_device_mesh("cpu", 2)
    x0 = torch.randn(8, 4)
    x = dtorch.tensor(x0, device_mesh=mesh, placements=[Shard(0)])

    def body(t):
        for _ in range(3):
            t = torch.tanh(t * 1.5 + 0.25)
        return t

    for _ in range(3):  # sent whole, then the program defined, prepared and compiled
        torch.testing.assert_close(body(x).to_torch(), body(x0))
    assert all(f > 0 for f in _stats("fused"))

    def factor(a):
        return torch.linalg.cholesky(a) * 2.0 + 1.0

    spd = torch.eye(3) * 2.0
    for i, a0 in enumerate([spd, spd * 3, -spd, spd * 5]):
        a = dtorch.tensor(a0, device_mesh=mesh, placements=[Replicate()])
        if i == 2:
            with pytest.raises(dtorch.RemoteError, match="cholesky"):
                factor(a).to_torch()
            with pytest.raises(dtorch.RemoteError, match="cholesky"):
                dtorch.synchronize()
        else:
            torch.testing.assert_close(factor(a).to_torch(), factor(a0))
