"""``distribute_module`` (PyTorch's semantics), ``loss_parallel`` and the README's
parallelize_module example, on the real 4-rank cluster against torch on one device."""

import copy
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import dtorch
from dtorch import ColwiseParallel, Replicate, Shard, init_device_mesh, parallelize_module
from dtorch.parallel import distribute_module, loss_parallel
from ledgers import counted
from parallelize_support import MLP, MLP_PLAN, close

R = Replicate()


@pytest.fixture
def tp4(live):
    return init_device_mesh("cpu", 4, mesh_dim_names=("tp",))


# distribute_module and loss_parallel -------------------------------------------------------------
def test_distribute_module_default_replicates_and_hooks_run(mesh2d):
    torch.manual_seed(9)
    model = MLP(4, 6)
    ref = copy.deepcopy(model)
    seen = []

    def input_fn(mod, inputs, mesh):
        seen.append(mesh)
        return tuple(dtorch.distribute_tensor(x, mesh, [Shard(0), R]) for x in inputs)

    def output_fn(mod, out, mesh):
        return out.redistribute(mesh, [R, R])

    distribute_module(model, mesh2d, input_fn=input_fn, output_fn=output_fn)
    assert all(p.placements == (R, R) for p in model.parameters())
    x = torch.randn(4, 4)
    y, counts = counted(lambda: model(x))
    assert seen == [mesh2d] and counts == {"all_gather": 1} and y.placements == (R, R)
    close(y, ref(x))


def test_distribute_module_partition_fn(tp4):
    torch.manual_seed(10)
    model = MLP(4, 6)
    ref = copy.deepcopy(model)

    def shard_rows(name, sub, mesh):
        if name == "up":
            sub.weight = dtorch.distribute_tensor(sub.weight.detach(), mesh, [Shard(0)])

    distribute_module(model, tp4, shard_rows)
    assert model.up.weight.placements == (Shard(0),) and model.up.bias.placements == (R,)
    assert model.up.weight.requires_grad
    x = torch.randn(2, 4)
    close(model.up(dtorch.distribute_tensor(x, tp4, [R])), ref.up(x))


def test_loss_parallel_is_accepted(tp4):
    torch.manual_seed(11)
    head = torch.nn.Linear(4, 10)
    ref = copy.deepcopy(head)
    parallelize_module(head, tp4, ColwiseParallel(use_local_output=False))
    x, target = torch.randn(3, 4), torch.tensor([1, 9, 4])
    with loss_parallel():
        logits = head(x)
        assert logits.placements == (Shard(1),)
        loss = F.cross_entropy(logits, dtorch.distribute_tensor(target, tp4, [R]))
    close(loss, F.cross_entropy(ref(x), target))


# the README's example runs as written ----------------------------------------------------------
def test_readme_parallelize_example_runs(live):
    text = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    block = next(b for b in re.findall(r"```python\n(.*?)```", text, re.S)
                 if "parallelize_module" in b)
    scope: dict = {}
    exec(compile(block, "README.md", "exec"), scope)
    assert scope["mode"].get_comm_counts() == {"all_reduce": 1}
    assert scope["model"].up.weight.placements == (R, Shard(0))
    assert list(scope["model"].state_dict()) == list(scope["reference"].state_dict())


def test_a_converted_model_frees_its_shards(tp4):
    """Nothing keeps a converted module alive: not its generated class (a class defined in a
    function, like the README's in its exec scope, is freed with it), not its hooks."""
    import gc

    def rank_bytes():
        gc.collect()
        dtorch.synchronize()
        return [s["bytes"] for s in dtorch.rank_stats()]

    before = rank_bytes()

    def build():  # as the README's example runs: its class's methods see the model
        scope = {"MLP": MLP, "torch": torch, "tp4": tp4, "plan": MLP_PLAN,
                 "parallelize_module": parallelize_module}
        exec("class Local(MLP):\n    def forward(self, x):\n        return super().forward(x)\n"
             "model = parallelize_module(Local(5, 10), tp4, plan)\n"
             "model(torch.randn(2, 5))\n", scope)
        return sum(s["bytes"] for s in dtorch.rank_stats())

    assert build() > sum(before)
    assert rank_bytes() == before
