"""``dtorch.nn.utils.clip_grad_norm_`` / ``clip_grad_value_`` on a real 4-rank cluster against
torch.nn.utils on a copy of the model on one device: tensor-sharded (dp x tp, a Partial
row-parallel bias among them), data-parallel replicated, ``fully_shard`` and pipeline-staged
parameters; orders 2, 1, 3 and inf; the total norm's value and placements, the clipped
gradients, the collective counts, the epsilon added once (tiny gradients make it visible),
``error_if_nonfinite``, and the refusals."""

import copy

import pytest
import torch

import dtorch
from dtorch import ColwiseParallel, Replicate, RowwiseParallel, Shard, init_device_mesh
from dtorch.nn.utils import clip_grad_norm_, clip_grad_value_
from ledgers import counted

R = Replicate()
INF = float("inf")


def mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 10), torch.nn.ReLU(), torch.nn.Linear(10, 6))


def backward(model, ref, mesh, placements, scale=1.0):
    x = torch.randn(8, 6, generator=torch.Generator().manual_seed(1))
    (model(dtorch.distribute_tensor(x, mesh, placements)).square().sum() * scale).backward()
    (ref(x).square().sum() * scale).backward()


def check(model, ref, total, want, rtol=1e-5):
    assert total.placements == (R,) * total.device_mesh.ndim and total.shape == ()
    torch.testing.assert_close(total.to_torch(), want, rtol=rtol, atol=0)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad.to_torch(), q.grad, rtol=rtol, atol=1e-9)


def tp_model(mesh):
    model = mlp()
    ref = copy.deepcopy(model)
    dtorch.parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    return model, ref


@pytest.mark.parametrize("norm_type", [2.0, 1.0, 3.0, INF])
def test_tensor_parallel_gradients(mesh2d, norm_type):
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model, ref = tp_model(mesh)
    backward(model, ref, mesh, [Shard(0), R])
    assert model[2].bias.grad.placements == (R, dtorch.Partial())
    total, counts = counted(lambda: clip_grad_norm_(model.parameters(), 0.5, norm_type))
    # the Partial bias's gradient reduced first; then one all_reduce per mesh dim
    assert counts == {"all_reduce": 3}
    want = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5, norm_type)
    check(model, ref, total, want)


def test_replicated_and_fully_sharded_gradients(live):
    dp = init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
    model = mlp()
    ref = copy.deepcopy(model)
    dtorch.parallelize_module(model, dp, {})  # every parameter Replicate: data parallel
    backward(model, ref, dp, [Shard(0)])
    total, counts = counted(lambda: clip_grad_norm_(model.parameters(), 1.0))
    assert counts == {"all_reduce": 1}  # a replicated gradient counted once, not 4 times
    check(model, ref, total, torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0))
    model = mlp()
    ref = copy.deepcopy(model)
    dtorch.fully_shard(model, dp)
    backward(model, ref, dp, [Shard(0)])
    total = clip_grad_norm_(model.parameters(), 1.0, norm_type=INF)
    check(model, ref, total, torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0, INF))


@pytest.mark.parametrize("norm_type", [2.0, INF])
def test_pipeline_staged_gradients(live, norm_type):
    """Two stages: each mesh reduces its own total, the second stage's goes to the first
    (point to point), and the coefficient comes back the same way."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    stages = mesh.unbind("pp")
    ref = mlp()
    w0 = dtorch.distribute_tensor(ref[0].weight.detach(), stages[0], [Shard(0)]).requires_grad_()
    w1 = dtorch.distribute_tensor(ref[2].weight.detach(), stages[1], [R]).requires_grad_()
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(2))
    h = torch.relu(dtorch.distribute_tensor(x, stages[0], [R]) @ w0.T)
    (h.redistribute(device_mesh=stages[1], placements=[R]) @ w1.T).sum().backward()
    (torch.relu(x @ ref[0].weight.T) @ ref[2].weight.T).sum().backward()
    total, counts = counted(lambda: clip_grad_norm_([w0, w1], 0.5, norm_type))
    assert counts == {"all_reduce": 2, "send_recv": 2}
    assert total.device_mesh == stages[0]
    want = torch.nn.utils.clip_grad_norm_([ref[0].weight, ref[2].weight], 0.5, norm_type)
    torch.testing.assert_close(total.to_torch(), want, rtol=1e-5, atol=0)
    torch.testing.assert_close(w0.grad.to_torch(), ref[0].weight.grad, rtol=1e-5, atol=1e-9)
    torch.testing.assert_close(w1.grad.to_torch(), ref[2].weight.grad, rtol=1e-5, atol=1e-9)


def test_the_epsilon_is_added_once(live):
    """Gradients whose total norm is about 1e-6: torch's coefficient max_norm / (total +
    1e-6); an epsilon added per rank (4e-6) would halve the clipped gradients."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model, ref = tp_model(mesh)
    backward(model, ref, mesh, [Shard(0), R], scale=5e-8)
    want = torch.nn.utils.get_total_norm([q.grad for q in ref.parameters()])
    assert 1e-7 < float(want) < 1e-5
    total = clip_grad_norm_(model.parameters(), float(want) / 10)
    torch.nn.utils.clip_grad_norm_(ref.parameters(), float(want) / 10)
    check(model, ref, total, want, rtol=1e-4)


def test_clip_grad_value_and_nonfinite(mesh1d):
    w = dtorch.distribute_tensor(torch.linspace(-3, 3, 8), mesh1d, [Shard(0)]).requires_grad_()
    (w * w).sum().backward()
    _, counts = counted(lambda: clip_grad_value_(w, 1.5))
    assert counts == {}
    torch.testing.assert_close(w.grad.to_torch(), (2 * torch.linspace(-3, 3, 8)).clamp(-1.5, 1.5))
    w.grad = None
    (w * float("inf")).sum().backward()
    with pytest.raises(RuntimeError, match="non-finite"):
        clip_grad_norm_(w, 1.0, error_if_nonfinite=True)
    with pytest.raises(TypeError, match="torch.nn.utils"):
        clip_grad_norm_([torch.zeros(2, requires_grad=True)], 1.0)
    with pytest.raises(NotImplementedError, match="norm_type=0"):
        clip_grad_norm_(w, 1.0, norm_type=0)


def test_half_precision_gradients_are_summed_in_float32(mesh1d):
    """1e5 fp16 ones: their squares summed in fp16 overflow (the norm would be inf and every
    gradient clipped to zero); torch accumulates in float32 and so does dtorch."""
    w = dtorch.distribute_tensor(torch.ones(100_000, dtype=torch.float16), mesh1d,
                                 [Shard(0)]).requires_grad_()
    w.sum().backward()
    t = torch.ones(100_000, dtype=torch.float16, requires_grad=True)
    t.sum().backward()
    total = clip_grad_norm_(w, 1.0)
    want = torch.nn.utils.clip_grad_norm_(t, 1.0)
    assert total.dtype == torch.float16 and torch.equal(total.to_torch(), want)
    torch.testing.assert_close(w.grad.to_torch(), t.grad)
    none = dtorch.distribute_tensor(torch.ones(4), mesh1d, [Shard(0)]).requires_grad_()
    assert torch.equal(clip_grad_norm_(none, 1.0), torch.tensor(0.0))  # no gradient: torch's
