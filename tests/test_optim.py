"""``dtorch.optim`` (SGD, Adam, AdamW) on a real 4-rank cluster, each against torch.optim on a
copy of the model on one device: 5 steps with an ``OneCycleLR`` schedule on a dp x tp model
(parameters within 1e-5), the state in the parameters' placements, a step that runs no
collective and one instruction per rank per mesh, ``fully_shard`` parameters, parameters on
two pipeline stages in one optimizer, ``state_dict`` round trips (dtorch -> dtorch, dtorch ->
torch.optim on one device -> dtorch), and the refusals."""

import copy

import pytest
import torch

import dtorch
from dtorch import ColwiseParallel, Replicate, RowwiseParallel, Shard, init_device_mesh
from dtorch.optim import full_state_dict
from dtorch.runtime import session
from ledgers import counted
from test_ops_support import illegal

R = Replicate()
CASES = [("SGD", dict(lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01)),
         ("SGD", dict(lr=0.1, momentum=0.9, dampening=0.3, maximize=True)),
         ("SGD", dict(lr=0.1)),
         ("Adam", dict(lr=0.01, amsgrad=True, weight_decay=0.1)),
         ("Adam", dict(lr=0.02, betas=(0.8, 0.9), eps=1e-6)),
         ("AdamW", dict(lr=0.01, weight_decay=0.1, amsgrad=True)),
         ("AdamW", dict(lr=0.01, maximize=True))]


class MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(6, 10)
        self.down = torch.nn.Linear(10, 6)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


@pytest.fixture
def dp_tp(live):
    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))


def tp_model(mesh):
    torch.manual_seed(0)
    model = MLP()
    ref = copy.deepcopy(model)
    dtorch.parallelize_module(model, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    return model, ref


def train(model, ref, opt, topt, mesh, placements, steps, scheds=(), first=0):
    for step in range(first, first + steps):
        x = torch.randn(8, 6, generator=torch.Generator().manual_seed(step))
        ((model(dtorch.distribute_tensor(x, mesh, placements)) - 1) ** 2).mean().backward()
        ((ref(x) - 1) ** 2).mean().backward()
        opt.step()
        topt.step()
        opt.zero_grad()
        topt.zero_grad()
        for sched in scheds:
            sched.step()


def check_params(model, ref):
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.to_torch(), q.detach(), atol=1e-5, rtol=1e-5, msg=name)


@pytest.mark.parametrize("name, kwargs", CASES, ids=[f"{n}-{'-'.join(k)}" for n, k in CASES])
def test_steps_match_torch_optim_with_a_schedule(dp_tp, name, kwargs):
    model, ref = tp_model(dp_tp)
    opt = getattr(dtorch.optim, name)(model.parameters(), **kwargs)
    topt = getattr(torch.optim, name)(ref.parameters(), **kwargs)
    assert isinstance(opt, getattr(torch.optim, name))
    scheds = [torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.05, total_steps=6,
                                                  cycle_momentum=False)  # keep the momentum
              for o in (opt, topt)]
    train(model, ref, opt, topt, dp_tp, [Shard(0), R], 5, scheds)
    check_params(model, ref)
    assert opt.param_groups[0]["lr"] == topt.param_groups[0]["lr"]
    for p in model.parameters():
        for key, value in opt.state[p].items():
            want = (R, R) if key == "step" else p.placements
            assert value.placements == want, (key, value.placements)
    # a step with its state made: no collective, one instruction on the ranks
    ((model(dtorch.distribute_tensor(torch.ones(8, 6), dp_tp, [Shard(0), R])) - 1) ** 2
     ).mean().backward()
    dtorch.synchronize()
    c = session.get_controller()
    before = c.issued
    _, counts = counted(lambda: opt.step())
    assert counts == {}
    assert c.issued - before == 1
    # zero_grad: set_to_none=False zeroes each gradient in place, in its placements; the
    # default (torch's) drops them
    opt.zero_grad(set_to_none=False)
    for p in model.parameters():
        assert p.grad.placements == p.placements and not p.grad.to_torch().any()
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())


def test_fully_shard_parameters_train_like_torch(live):
    mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
    torch.manual_seed(0)
    model = MLP()
    ref = copy.deepcopy(model)
    dtorch.fully_shard(model.up, mesh)
    dtorch.fully_shard(model, mesh)
    opt = dtorch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
    topt = torch.optim.AdamW(ref.parameters(), lr=0.01, weight_decay=0.1)
    train(model, ref, opt, topt, mesh, [Shard(0)], 3)
    check_params(model, ref)
    assert opt.state[model.up.weight]["exp_avg"].placements == (Shard(0),)


def test_parameters_on_two_pipeline_stages_in_one_optimizer(live):
    """One parameter group, two meshes: one instruction per mesh, each on its own ranks."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    stages = mesh.unbind("pp")
    torch.manual_seed(0)
    ref = MLP()
    w0 = dtorch.distribute_tensor(ref.up.weight.detach(), stages[0], [Shard(0)]).requires_grad_()
    w1 = dtorch.distribute_tensor(ref.down.weight.detach(), stages[1], [Shard(1)]).requires_grad_()
    opt = dtorch.optim.SGD([w0, w1], lr=0.1, momentum=0.9)
    topt = torch.optim.SGD([ref.up.weight, ref.down.weight], lr=0.1, momentum=0.9)
    c = session.get_controller()
    for step in range(3):
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(step))
        h = torch.relu(dtorch.distribute_tensor(x, stages[0], [R]) @ w0.T)
        (h.redistribute(device_mesh=stages[1], placements=[R]) @ w1.T).sum().backward()
        (torch.relu(x @ ref.up.weight.T) @ ref.down.weight.T).sum().backward()
        dtorch.synchronize()
        before = c.issued
        opt.step()
        if step > 0:
            assert c.issued - before == 2
        topt.step()
        opt.zero_grad()
        topt.zero_grad()
    torch.testing.assert_close(w0.to_torch(), ref.up.weight.detach(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(w1.to_torch(), ref.down.weight.detach(), atol=1e-5, rtol=1e-5)


def test_state_dict_round_trips(dp_tp):
    """dtorch -> a fresh dtorch optimizer (copied, placed), and the gathered form ->
    torch.optim.AdamW on one device -> back: training goes on equal everywhere."""
    model, ref = tp_model(dp_tp)
    kwargs = dict(lr=0.01, weight_decay=0.1, amsgrad=True)
    opt = dtorch.optim.AdamW(model.parameters(), **kwargs)
    topt = torch.optim.AdamW(ref.parameters(), **kwargs)
    train(model, ref, opt, topt, dp_tp, [Shard(0), R], 2)
    again = dtorch.optim.AdamW(model.parameters(), **kwargs)
    again.load_state_dict(opt.state_dict())
    p = model.up.weight
    assert again.state[p]["exp_avg"] is not opt.state[p]["exp_avg"]
    assert again.state[p]["exp_avg"].placements == p.placements
    torch.testing.assert_close(again.state[p]["exp_avg"].to_torch(),
                               topt.state[ref.up.weight]["exp_avg"])
    with torch.no_grad():  # a copy on the ranks too: changing it leaves the source alone
        again.state[p]["exp_avg"].mul_(0)
    torch.testing.assert_close(opt.state[p]["exp_avg"].to_torch(),
                               topt.state[ref.up.weight]["exp_avg"])
    again.load_state_dict(opt.state_dict())
    plain = torch.optim.AdamW(ref.parameters(), **kwargs)
    plain.load_state_dict(full_state_dict(again))  # the gathered form on one device
    torch.testing.assert_close(plain.state[ref.up.weight]["exp_avg_sq"],
                               topt.state[ref.up.weight]["exp_avg_sq"])
    back = dtorch.optim.AdamW(model.parameters(), **kwargs)
    back.load_state_dict(plain.state_dict())  # torch tensors, sent shard by shard
    train(model, ref, back, topt, dp_tp, [Shard(0), R], 2, first=2)
    check_params(model, ref)


def _refused(fn, error, match):
    illegal(fn, match, error)


def test_refusals(dp_tp):
    model, ref = tp_model(dp_tp)
    _refused(lambda: dtorch.optim.SGD(ref.parameters(), lr=0.1), TypeError,
             "torch.optim.SGD for torch tensors")
    _refused(lambda: dtorch.optim.Adam([{"params": set(model.parameters())}]), TypeError,
             "ordered")
    _refused(lambda: dtorch.optim.Adam(model.parameters(), lr=-1.0), ValueError,
             "Invalid learning rate")  # torch's own check
    _refused(lambda: dtorch.optim.Adam(model.parameters(), capturable=True),
             NotImplementedError, "capturable")
    doubled = model.up.weight * 2
    _refused(lambda: dtorch.optim.SGD([doubled], lr=0.1), ValueError, "non-leaf")
    _refused(lambda: dtorch.optim.SGD(model.up.weight, lr=0.1), TypeError, "pass \\[tensor\\]")
    _refused(lambda: dtorch.optim.Adam(model.parameters(), fused=True), NotImplementedError,
             "fused")
    opt = dtorch.optim.AdamW([{"params": model.up.parameters()},
                              {"params": model.down.parameters(), "lr": 0.1}])
    ((model(torch.ones(2, 6)) - 1) ** 2).mean().backward()
    opt.step()
    before = model.up.weight.to_torch()
    opt.param_groups[1]["lr"] = torch.tensor(0.1)  # as a capturable scheduler would
    _refused(lambda: opt.step(), TypeError, "lr must be a Python number")
    assert torch.equal(model.up.weight.to_torch(), before)  # group 0 did not step either
    opt.param_groups[1]["lr"] = 0.1
    state = opt.state_dict()
    kept = opt.state[model.up.weight]["exp_avg"].to_torch()
    state["state"][0]["exp_avg"] = torch.zeros(3, 3)
    _refused(lambda: opt.load_state_dict(state), ValueError, "another model's")
    assert torch.equal(opt.state[model.up.weight]["exp_avg"].to_torch(), kept)  # unchanged


def test_loading_torch_states_and_hooks(dp_tp):
    """An Adam state dict loads into AdamW as AdamW (torch's __setstate__ fix-up), an old
    float ``step`` becomes a count, and torch's state_dict hooks run."""
    model, ref = tp_model(dp_tp)
    topt = torch.optim.Adam(ref.parameters(), lr=0.01, weight_decay=0.1)
    ((ref(torch.ones(2, 6)) - 1) ** 2).mean().backward()
    topt.step()
    state = topt.state_dict()
    for entry in state["state"].values():
        entry["step"] = float(entry["step"])
    opt = dtorch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
    calls = []
    opt.register_load_state_dict_post_hook(lambda o: calls.append("load"))
    opt.register_state_dict_post_hook(lambda o, sd: calls.append("save"))
    opt.load_state_dict(state)
    assert opt.param_groups[0]["decoupled_weight_decay"] is True
    step = opt.state[model.up.weight]["step"]
    assert step.placements == (R, R) and float(step.to_torch()) == 1.0
    opt.state_dict()
    assert calls == ["load", "save"]
