"""What backward keeps on the ranks, on a real 4-rank cluster: a node's local graph lives
until its backward ran or the controller dropped the node; a training loop does not grow; a
no_grad forward keeps nothing; the buffer pool never recycles memory a kept graph holds; a
failed op's poison flows through backward (every rank in every collective), no hang."""

import gc

import pytest
import torch

import dtorch
from dtorch import Replicate, Shard, init_device_mesh

R = Replicate()


def held():
    """Per rank: (tensors stored, their bytes, local graphs kept), once every rank ran
    everything issued (``dtorch.rank_stats()``)."""
    gc.collect()
    dtorch.synchronize()
    return [(s["tensors"], s["bytes"], s["graphs"]) for s in dtorch.rank_stats()]


class MLP(dtorch.nn.Module):
    def __init__(self, mesh):
        super().__init__()
        self.up = dtorch.nn.ColumnParallelLinear(8, 16, device_mesh=mesh)
        self.down = dtorch.nn.RowParallelLinearWithReplicateOutput(16, 8, device_mesh=mesh)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


def _step(model, x, t):
    loss = ((model(x) - t) ** 2).mean()
    loss.backward()
    model.zero_grad()


def test_training_loop_does_not_grow(mesh2d):
    model = MLP(mesh2d)
    x = dtorch.randn(6, 8, device_mesh=mesh2d, placements=[Shard(0), R])
    t = dtorch.randn(6, 8, device_mesh=mesh2d, placements=[Shard(0), R])
    _step(model, x, t)
    first = held()
    assert all(graphs == 0 for _, _, graphs in first)
    for _ in range(200):
        _step(model, x, t)
    assert held() == first


def test_graphs_are_dropped_with_their_handles(mesh2d):
    model = MLP(mesh2d)
    x = dtorch.randn(6, 8, device_mesh=mesh2d, placements=[Shard(0), R])
    before = held()
    outs = [model(x) for _ in range(5)]  # forwards with grad, no backward
    kept = held()
    assert all(graphs > 0 for _, _, graphs in kept)
    del outs
    assert held() == before
    loss = model(x).sum()
    loss.backward(retain_graph=True)  # retained: kept until the handle goes
    assert all(graphs > 0 for _, _, graphs in held())
    del loss
    model.zero_grad()
    assert held() == before


def test_no_grad_forward_keeps_nothing(mesh2d):
    model = MLP(mesh2d)
    x = dtorch.randn(6, 8, device_mesh=mesh2d, placements=[Shard(0), R])
    before = held()
    with torch.no_grad():
        y = model(x)
        assert not y.requires_grad
        assert all(graphs == 0 for _, _, graphs in held())
    del y
    assert held() == before


def test_the_pool_never_recycles_memory_a_kept_graph_holds(mesh1d):
    """exp saves its output; the output's handle is dropped (its shard "freed") while the
    graph still needs it; buffers of the same size are then taken from the pool and written
    by collectives. The gradient must still be exp(x)."""
    rows = 4 * 512  # 512 x 512 float32 per rank: 1 MiB, what the pool takes back
    value = torch.randn(rows, 512) * 0.1
    x = dtorch.tensor(value, device_mesh=mesh1d, placements=[Shard(0)], requires_grad=True)
    y = x.exp()
    loss = y.sum()
    del y
    noise = [dtorch.randn(rows, 512, device_mesh=mesh1d, placements=[Shard(0)])
             .redistribute(placements=[Shard(1)]).redistribute(placements=[Shard(0)])
             for _ in range(3)]
    dtorch.synchronize()
    loss.backward()
    torch.testing.assert_close(x.grad.to_torch(), value.exp())
    assert sum(s["pool_reused"] for s in dtorch.rank_stats()) > 0, "the pool was not used"
    del noise


def test_a_failed_forward_poisons_backward_without_a_hang(mesh1d):
    """Rank 2's token ids are out of range: the embedding lookup fails there only (torch's
    IndexError). Backward still runs every collective (the weight's all_reduce) on every
    rank; the error reaches the controller where the gradient is read, and the cluster stays
    usable."""
    ids = torch.tensor([0, 1, 2, 3, 99, 1, 0, 2])  # 99 sits in rank 2's shard
    w = dtorch.randn(5, 3, device_mesh=mesh1d, requires_grad=True)
    tokens = dtorch.tensor(ids, device_mesh=mesh1d, placements=[Shard(0)])
    loss = (torch.nn.functional.embedding(tokens, w) ** 2).sum()
    with dtorch.CommDebugMode() as mode:
        loss.backward()
    assert mode.get_comm_counts() == {"all_reduce": 1}
    with pytest.raises(dtorch.RemoteError, match="failed op"):
        w.grad.to_torch()  # on the ranks in step with rank 2: a peer's input failed
    with pytest.raises(dtorch.RemoteError, match="rank 2 failed.*index out of range"):
        dtorch.synchronize()  # the failure itself, with its remote traceback
    v = dtorch.arange(8.0, device_mesh=mesh1d, placements=[Shard(0)], requires_grad=True)
    (v * v).sum().backward()
    torch.testing.assert_close(v.grad.to_torch(), 2 * torch.arange(8.0))
