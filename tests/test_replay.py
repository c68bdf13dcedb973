"""Runs that repeat are prepared once on the ranks and replayed: same values, same
collectives, errors that travel exactly as without replay."""

import pytest
import torch
import torch.nn.functional as F

import dtorch
from dtorch import Replicate, Shard
from dtorch.runtime import batches
from dtorch.runtime.session import get_controller
from ledgers import counted

pytestmark = pytest.mark.timeout(180)


def _stats(key):
    """Each rank's ``key`` once it ran everything issued (and freed what was dropped)."""
    dtorch.synchronize()
    return [s[key] for s in dtorch.rank_stats()]


def _replayed():
    return _stats("replayed")


def _tanh_chain(t, n: int):
    for _ in range(n):
        t = torch.tanh(t * 1.01 + 0.5)
    return t


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
        return _tanh_chain(t, 20)

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
    """cholesky fails on the first replayed instance only (data-dependent): its error
    reaches the read, the run's later ops carry it, and the next instance computes again."""
    before = _replayed()
    _cholesky_fails_at(mesh1d, 4, failing=2)
    assert all(a > b for a, b in zip(_replayed(), before))


def _cholesky_fails_at(mesh, n: int, failing: int) -> None:
    """``cholesky(a) * 2 + 1`` five times; the ``failing``-th ``a`` is not positive definite
    (the third instance is the first replayed one: the second's flush also frees the
    first's handles)."""
    spd = torch.eye(n) * 2.0

    def body(a):
        return torch.linalg.cholesky(a) * 2.0 + 1.0

    for i in range(5):
        a0 = -spd if i == failing else spd * (i + 1)
        a = dtorch.tensor(a0, device_mesh=mesh, placements=[Replicate()])
        if i == failing:
            with pytest.raises(dtorch.RemoteError, match="cholesky"):
                body(a).to_torch()
            with pytest.raises(dtorch.RemoteError, match="cholesky"):
                dtorch.synchronize()
        else:
            torch.testing.assert_close(body(a).to_torch(), body(a0))


def test_a_poisoned_input_from_outside_a_replayed_run_travels_through_it(mesh1d):
    def body(t):
        return (t * 2.0 + 1.0).exp()

    good = dtorch.tensor(torch.eye(4), device_mesh=mesh1d, placements=[Replicate()])
    for _ in range(3):  # body's run becomes a program
        torch.testing.assert_close(body(good).to_torch(), body(torch.eye(4)))
    before = _replayed()
    bad = torch.linalg.cholesky(dtorch.tensor(-torch.eye(4), device_mesh=mesh1d,
                                              placements=[Replicate()]))
    get_controller().flush()  # bad's failure in its own flush: body's run stays the program
    with pytest.raises(dtorch.RemoteError, match="cholesky"):
        body(bad).to_torch()
    with pytest.raises(dtorch.RemoteError):
        dtorch.synchronize()
    assert all(a > b for a, b in zip(_replayed(), before))  # the poisoned instance replayed
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
        return _tanh_chain(t, 3)

    for _ in range(3):  # sent whole, then the program defined, prepared and compiled
        torch.testing.assert_close(body(x).to_torch(), body(x0))
    assert all(f > 0 for f in _stats("fused"))
    fused = _stats("fused")
    _cholesky_fails_at(mesh, 3, failing=3)  # fused from the third, failing in the fourth
    assert all(after > before for after, before in zip(_stats("fused"), fused))
