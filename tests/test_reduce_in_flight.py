"""All_reduces left in flight (``StartReduce`` ... ``FinishReduce``, what gradient buckets
use) on the real cluster: the value equals the synchronous redistribute's, a failure on one
rank poisons every rank's result and reaches the user where it is read, a handle dropped
before its finish is harmless, and the cluster stays usable after each."""

from __future__ import annotations

import copy
import gc

import pytest
import torch

import dtorch
from dtorch import Partial, Replicate, Shard
from dtorch.autograd import buckets
from dtorch.redistribute import plan_redistribute
from dtorch.runtime import messages as m
from dtorch.tensor import DTensor
from ledgers import counted


def _start(x: DTensor) -> DTensor:
    """``x`` (Partial on a 1-D mesh) with its all_reduce started, not finished."""
    spec = x._spec
    step, = plan_redistribute(spec.mesh, spec.shape, spec.placements, (Replicate(),),
                              spec.dtype.itemsize)
    return buckets._start_all_reduce(x, step, (Replicate(),))


def _finish(x: DTensor) -> DTensor:
    x._live().issue(m.FinishReduce(x._tid, x._spec.mesh.ranks))
    return x


def test_a_started_all_reduce_gives_the_sum_and_is_counted_once(mesh1d):
    parts = [torch.full((3,), float(r + 1)) for r in range(4)]
    x = dtorch.from_local(parts, mesh1d, [Partial()])
    out, counts = counted(lambda: _finish(_start(x)))
    assert counts == {"all_reduce": 1}
    assert torch.equal(out.to_local(2), torch.full((3,), 10.0))


def test_a_failure_on_one_rank_poisons_every_rank_s_reduction(mesh1d):
    """Rank 3's input failed (index 99): it still joins the started all_reduce with its flag
    set, so no rank hangs and every rank's result is poisoned."""
    import torch.nn.functional as F
    idx = dtorch.tensor(torch.tensor([0, 1, 2, 99]), device_mesh=mesh1d, placements=[Shard(0)])
    emb = dtorch.tensor(torch.randn(10, 3), device_mesh=mesh1d, placements=[Replicate()])
    rows = F.embedding(idx, emb)                               # rank 3 poisoned
    partial = dtorch.from_local([torch.zeros(3)] * 4, mesh1d, [Partial()]) + rows.sum(0)
    reduced = _finish(_start(partial))
    for rank in (0, 3):
        with pytest.raises(dtorch.RemoteError):
            reduced.to_local(rank)
    with pytest.raises(dtorch.RemoteError, match="rank 3"):
        dtorch.synchronize()
    ok = _finish(_start(dtorch.from_local([torch.ones(2)] * 4, mesh1d, [Partial()])))
    assert torch.equal(ok.to_local(1), torch.full((2,), 4.0))


def test_a_handle_dropped_before_its_finish_leaves_the_cluster_usable(mesh1d):
    x = dtorch.from_local([torch.ones(4)] * 4, mesh1d, [Partial()])
    started = _start(x)
    del started
    gc.collect()
    dtorch.synchronize()
    again = _finish(_start(x))
    assert torch.equal(again.to_torch(), torch.full((4,), 4.0))


def test_a_rank_that_failed_in_backward_poisons_the_bucket_not_the_cluster(mesh1d):
    """A DDP step whose rank 3 fails in forward (an index out of range in its rows): the
    bucketed gradients read raise on every rank; the next good step gives torch's."""
    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Embedding(10, 8), torch.nn.Linear(8, 8))
    model = dtorch.DistributedDataParallel(copy.deepcopy(ref), device_mesh=mesh1d)
    model(torch.tensor([0, 1, 2, 99])).square().mean().backward()
    for name, p in model.named_parameters():
        with pytest.raises(dtorch.RemoteError):
            print(name, p.grad.to_torch())
    with pytest.raises(dtorch.RemoteError) as failed:
        dtorch.synchronize()
    assert "rank 3" in str(failed.value), str(failed.value)
    model.zero_grad()
    ids = torch.tensor([0, 1, 2, 3])
    model(ids).square().mean().backward()
    ref(ids).square().mean().backward()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad.to_torch(), q.grad, atol=1e-6, rtol=1e-5)
