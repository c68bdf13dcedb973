"""DistributedDataParallel and bucketed gradient reduction on the real cluster: gradients
and an optimizer step equal torch's on one device, the bucket counts of a 20-parameter
model, buckets issued during the backward (before collectives of earlier layers), no_sync,
DDP over the dp dim of a tensor-parallel model, refusals."""

from __future__ import annotations

import copy

import pytest
import torch

import dtorch
from dtorch import ColwiseParallel, RowwiseParallel, Shard, init_device_mesh
from ledgers import counted
from test_ops_support import illegal


def _mlp(layers=10, width=16, seed=0):
    torch.manual_seed(seed)
    mods = []
    for _ in range(layers):
        mods += [torch.nn.Linear(width, width), torch.nn.Tanh()]
    return torch.nn.Sequential(*mods)


def _check_grads(model, ref):
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad.to_torch(), q.grad, atol=1e-6, rtol=1e-5, msg=name)


LAYER_BYTES = (16 * 16 + 16) * 4


@pytest.mark.parametrize("cap_layers, buckets", [(None, 1), (4, 3), (1, 10)])
def test_a_20_parameter_model_reduces_in_buckets(live, cap_layers, buckets):
    ref = _mlp()
    cap = None if cap_layers is None else cap_layers * LAYER_BYTES / 2**20
    model = dtorch.DistributedDataParallel(copy.deepcopy(ref), device_mesh=init_device_mesh(
        "cpu", 4), bucket_cap_mb=cap)
    x = torch.randn(8, 16)
    with dtorch.CommDebugMode() as mode:
        model(x).square().mean().backward()
    assert mode.get_comm_counts() == {"all_reduce": buckets}
    per_bucket = mode.get_gradient_comm_counts()
    assert len(per_bucket) == buckets and all(k.startswith("bucket of ") for k in per_bucket)
    assert sum(int(k.split()[2].rstrip(":")) for k in per_bucket) == 20  # every parameter once
    ref(x).square().mean().backward()
    _check_grads(model.module, ref)
    assert model.module[0].weight.grad.placements == (dtorch.Replicate(),)


def test_an_optimizer_step_and_state_dict_are_torch_s(live):
    ref = _mlp(4)
    model = dtorch.DistributedDataParallel(copy.deepcopy(ref), device_mesh=init_device_mesh(
        "cpu", 4))
    assert list(model.state_dict()) == ["module." + k for k in ref.state_dict()]
    opt = dtorch.optim.AdamW(model.parameters(), lr=0.01)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.01)
    for step in range(3):
        x = torch.randn(12, 16, generator=torch.Generator().manual_seed(step))
        model(x).square().mean().backward()
        ref(x).square().mean().backward()
        opt.step(), ref_opt.step()
        opt.zero_grad(), ref_opt.zero_grad()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.to_torch(), q.detach(), atol=1e-6, rtol=1e-5)


class _AllToAllAndBack(torch.nn.Module):
    """Moves the activation to Shard(1) and back: two all_to_alls in forward and in backward,
    between the layers before it and those after."""

    def forward(self, h):
        if not isinstance(h, dtorch.DTensor):
            return h
        return h.redistribute(placements=[Shard(1)]).redistribute(placements=[Shard(0)])


def test_a_full_bucket_is_reduced_during_the_backward(live):
    """With a bucket of two layers, the last two layers' bucket is reduced before the
    backward reaches the all_to_alls in the middle, not after the whole backward."""
    torch.manual_seed(1)
    lin = [torch.nn.Linear(16, 16) for _ in range(4)]
    ref = torch.nn.Sequential(lin[0], torch.nn.Tanh(), lin[1], _AllToAllAndBack(), lin[2],
                              torch.nn.Tanh(), lin[3])
    model = dtorch.DistributedDataParallel(copy.deepcopy(ref), device_mesh=init_device_mesh(
        "cpu", 4), bucket_cap_mb=2 * LAYER_BYTES / 2**20)
    x = torch.randn(8, 16)
    beside = _beside_reductions()
    mode = {}

    def step():
        with dtorch.CommDebugMode() as mode["m"]:
            model(x).square().mean().backward()
        return model.module[0].weight.grad
    counted(step)  # the three ledgers agree: a started all_reduce is counted once everywhere
    backward = [(r.kind, r.gradient_of) for r in mode["m"].get_comm_records()
                if r.phase == "backward"]
    assert backward == [("all_reduce", "bucket of 4: 6.weight, 6.bias, 4.weight, 4.bias"),
                        ("all_to_all", None), ("all_to_all", None),
                        ("all_reduce", "bucket of 4: 2.weight, 2.bias, 0.weight, 0.bias")]
    # the first bucket's all_reduce was in flight while each rank ran the rest of the
    # backward (the all_to_alls and the first layers' gradients), not waited for at once
    overlapped = [n - b for n, b in zip(_beside_reductions(), beside)]
    assert all(n >= 4 for n in overlapped), overlapped
    ref(x).square().mean().backward()
    _check_grads(model.module, ref)


def _beside_reductions() -> list[int]:
    dtorch.synchronize()
    return [s["beside_reductions"] for s in dtorch.rank_stats()]


def test_buckets_in_the_stream_when_overlap_is_off(live, monkeypatch):
    """``buckets.OVERLAP = False`` (the bench's comparison): the same gradients and counts,
    nothing runs beside a reduction."""
    from dtorch.autograd import buckets
    monkeypatch.setattr(buckets, "OVERLAP", False)
    ref = _mlp(4)
    model = dtorch.DistributedDataParallel(copy.deepcopy(ref), device_mesh=init_device_mesh(
        "cpu", 4), bucket_cap_mb=2 * LAYER_BYTES / 2**20)
    x = torch.randn(8, 16)
    beside = _beside_reductions()
    with dtorch.CommDebugMode() as mode:
        model(x).square().mean().backward()
    assert mode.get_comm_counts() == {"all_reduce": 2}
    assert _beside_reductions() == beside
    ref(x).square().mean().backward()
    _check_grads(model.module, ref)


def test_no_sync_accumulates_unreduced_then_reduces_in_buckets(live):
    ref = _mlp(3)
    model = dtorch.DistributedDataParallel(copy.deepcopy(ref), device_mesh=init_device_mesh(
        "cpu", 4))
    xs = [torch.randn(8, 16, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    with dtorch.CommDebugMode() as mode:
        with model.no_sync():
            for x in xs[:2]:
                model(x).square().mean().backward()
        assert mode.get_comm_counts() == {}
        assert model.module[0].weight.grad.placements == (dtorch.Partial(),)
        model(xs[2]).square().mean().backward()
    assert mode.get_comm_counts() == {"all_reduce": 1}
    for x in xs:
        ref(x).square().mean().backward()
    _check_grads(model.module, ref)


def test_ddp_over_the_dp_dim_of_a_tensor_parallel_model(live):
    """dp2 x tp2: parallelize_module on tp, DDP on mesh['dp']: the dp reductions share
    buckets by placements (fewer all_reduces than parameters); gradients are torch's."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(2)
    ref = torch.nn.Sequential(torch.nn.Linear(8, 12), torch.nn.ReLU(), torch.nn.Linear(12, 8),
                              torch.nn.ReLU(), torch.nn.Linear(8, 12), torch.nn.ReLU(),
                              torch.nn.Linear(12, 8))
    tp = dtorch.parallelize_module(copy.deepcopy(ref), mesh, {
        "0": ColwiseParallel(), "2": RowwiseParallel(), "4": ColwiseParallel(),
        "6": RowwiseParallel()})
    model = dtorch.DistributedDataParallel(tp, device_mesh=mesh["dp"])
    x = torch.randn(6, 8)
    with dtorch.CommDebugMode() as mode:
        model(x).square().mean().backward()
    # a bucket per gradient placement: colwise weights and biases Shard(0) on tp, rowwise
    # weights Shard(1); a rowwise bias (Partial on tp, its gradient Replicate there) reduces
    # on its own
    assert mode.get_gradient_comm_counts() == {
        "bucket of 2: 6.weight, 2.weight": {"all_reduce": 1},
        "bucket of 4: 4.weight, 4.bias, 0.weight, 0.bias": {"all_reduce": 1},
        "6.bias": {"all_reduce": 1}, "2.bias": {"all_reduce": 1}}
    ref(x).square().mean().backward()
    _check_grads(model.module, ref)


def test_what_ddp_refuses(live):
    mesh = init_device_mesh("cpu", 4)
    illegal(lambda: dtorch.DistributedDataParallel(_mlp(1), process_group=object()),
            "device_mesh=", ValueError)
    illegal(lambda: dtorch.DistributedDataParallel(_mlp(1), device_ids=[0]), "device", ValueError)
    illegal(lambda: dtorch.DistributedDataParallel(_mlp(1), device_mesh=mesh, bucket_cap_mb=0),
            "positive", ValueError)
    m22 = init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "b"))
    illegal(lambda: dtorch.DistributedDataParallel(_mlp(1), device_mesh=m22), r"mesh\['",
            ValueError)
    sharded = dtorch.parallelize_module(_mlp(1), mesh, {"0": ColwiseParallel()})
    with pytest.raises(ValueError, match="DDP replicates parameters"):
        dtorch.DistributedDataParallel(sharded, device_mesh=mesh)


def test_a_layer_used_twice_a_hook_and_clipping_on_bucketed_gradients(live):
    """Two edges into one weight (the same Linear twice), a hook on a bucketed parameter
    (it sees the reduced gradient), then clip_grad_norm_ in place on the bucket's views."""
    torch.manual_seed(3)
    shared, head = torch.nn.Linear(16, 16), torch.nn.Linear(16, 4)

    class Twice(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.shared, self.head = shared, head

        def forward(self, x):
            return self.head(torch.tanh(self.shared(torch.tanh(self.shared(x)))))

    ref = Twice()
    model = dtorch.DistributedDataParallel(copy.deepcopy(ref), device_mesh=init_device_mesh(
        "cpu", 4))
    seen = []
    model.module.head.weight.register_hook(lambda g: seen.append(g.placements))
    x = torch.randn(8, 16)
    with dtorch.CommDebugMode() as mode:
        model(x).square().mean().backward()
    assert mode.get_comm_counts() == {"all_reduce": 1}  # one bucket for all four
    assert seen == [(dtorch.Replicate(),)]
    ref(x).square().mean().backward()
    _check_grads(model.module, ref)
    total = dtorch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
    ref_total = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.1)
    torch.testing.assert_close(total.to_torch(), ref_total)
    _check_grads(model.module, ref)


class _Raising(torch.nn.Module):
    """Registers a hook on the activation between the layers that raises in backward."""

    def forward(self, h):
        if isinstance(h, dtorch.DTensor) and h.requires_grad:
            h.register_hook(lambda g: (_ for _ in ()).throw(RuntimeError("hook failed")))
        return h


def test_a_backward_that_fails_after_a_bucket_started_leaves_nothing_in_flight(live):
    """The last two layers' bucket is posted, then a hook in the middle raises: the posted
    all_reduce is finished on the ranks (none left in flight, no rank waiting), and the next
    step (the hook gone) gives torch's gradients."""
    torch.manual_seed(2)
    lin = [torch.nn.Linear(16, 16) for _ in range(4)]
    ref = torch.nn.Sequential(lin[0], torch.nn.Tanh(), lin[1], torch.nn.Identity(), lin[2],
                              torch.nn.Tanh(), lin[3])
    raising = copy.deepcopy(ref)
    raising[3] = _Raising()
    model = dtorch.DistributedDataParallel(raising, device_mesh=init_device_mesh("cpu", 4),
                                           bucket_cap_mb=2 * LAYER_BYTES / 2**20)
    x = torch.randn(8, 16)
    with dtorch.CommDebugMode() as mode, pytest.raises(RuntimeError, match="hook failed") \
            as failed:
        model(x).square().mean().backward()
    assert mode.get_comm_counts() == {"all_reduce": 1}  # the first bucket had started
    dtorch.synchronize()
    # finished though the traceback (kept here, as a notebook keeps the last one) still
    # holds the backward's buckets
    assert [s["in_flight"] for s in dtorch.rank_stats()] == [0, 0, 0, 0]
    del failed
    model.module[3] = torch.nn.Identity()
    model.zero_grad()
    model(x).square().mean().backward()
    ref(x).square().mean().backward()
    _check_grads(model.module, ref)
