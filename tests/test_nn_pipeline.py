"""Pipeline parallelism in the seed's style: ``mesh.unbind("pp")``, ``assign_layers_to_stages``,
``device_mesh_guard`` binding submodules to stage meshes, activations moved with
``h.redistribute(device_mesh=stage)`` (point to point only; nothing when the stage is the same),
compared with torch.nn on one device (real 4-rank cluster, pp x tp and pp4 meshes)."""

import pytest
import torch

import dtorch
import dtorch.nn as nn
from dtorch import Graph, Replicate, Shard, assign_layers_to_stages, init_device_mesh

R = Replicate()


class MLPBlock(nn.Module):
    def __init__(self, d, hidden):
        super().__init__()
        self.norm = nn.RMSNorm(d)
        self.up = nn.ColumnParallelLinear(d, hidden)
        self.down = nn.RowParallelLinearWithReplicateOutput(hidden, d)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(self.norm(x))))


class Staged(nn.Module):
    """The seed's Transformer skeleton: embedding on the first stage, blocks spread over the
    stages, the head on the last one."""

    def __init__(self, mesh, vocab=17, d=8, hidden=11, layers=4):
        super().__init__()
        self.stages = mesh.unbind("pp")
        self.stage_of = assign_layers_to_stages(layers, len(self.stages))
        with Graph.default_graph().device_mesh_guard(self.stages[0]):
            self.embed = nn.EmbeddingWithReplicateOutput(vocab, d)
        self.layers = nn.ModuleList()
        for i in range(layers):
            with Graph.default_graph().device_mesh_guard(self.stages[self.stage_of[i]]):
                self.layers.append(MLPBlock(d, hidden))
        with Graph.default_graph().device_mesh_guard(self.stages[-1]):
            self.head = nn.ColumnParallelLinearWithReplicateOutput(d, vocab)

    def forward(self, tokens):
        h = self.embed(tokens)
        for i, layer in enumerate(self.layers):
            h = h.redistribute(device_mesh=self.stages[self.stage_of[i]])
            h = layer(h)
        return self.head(h)


class TorchStaged(torch.nn.Module):
    def __init__(self, vocab=17, d=8, hidden=11, layers=4):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, d)
        self.layers = torch.nn.ModuleList()
        for _ in range(layers):
            block = torch.nn.Module()
            block.norm, block.up = torch.nn.RMSNorm(d), torch.nn.Linear(d, hidden)
            block.down = torch.nn.Linear(hidden, d)
            self.layers.append(block)
        self.head = torch.nn.Linear(d, vocab)

    def forward(self, tokens):
        h = self.embed(tokens)
        for b in self.layers:
            h = h + b.down(torch.relu(b.up(b.norm(h))))
        return self.head(h)


@pytest.mark.parametrize("shape, names", [((2, 2), ("pp", "tp")), ((4,), ("pp",)),
                                          ((2, 2), ("dp", "tp"))])
def test_a_staged_model_matches_torch_and_moves_only_between_stages(live, shape, names):
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    torch.manual_seed(7)
    ref = TorchStaged()
    model = Staged(mesh)
    assert list(model.state_dict()) == list(ref.state_dict())
    model.load_state_dict(ref.state_dict())
    stages = mesh.unbind("pp")
    assert model.embed.weight.device_mesh == stages[0]
    assert model.head.weight.device_mesh == stages[-1]
    assert [model.layers[i].up.weight.device_mesh for i in range(4)] == [
        stages[s] for s in assign_layers_to_stages(4, len(stages))]
    tokens = torch.randint(0, 17, (4, 6))
    names0 = stages[0].mesh_dim_names or ("",) * stages[0].ndim
    dp = [Shard(0) if n == "dp" else R for n in names0]
    x = dtorch.distribute_tensor(tokens, stages[0], dp)
    with dtorch.CommDebugMode() as mode:
        out = model(x)
    comms = mode.get_comm_counts()
    n_stages = len(stages)
    tp = "tp" in names
    expected = {"send_recv": n_stages - 1} if n_stages > 1 else {}
    if tp:  # one all_gather (embedding) + one all_reduce per block + one all_gather (head)
        expected.update(all_gather=2, all_reduce=4)
    assert comms == expected
    assert out.device_mesh == stages[-1]
    assert torch.allclose(out.to_torch(), ref(tokens), atol=1e-5)


def test_micro_batches_flow_through_the_stages_without_the_controller_waiting(live):
    """Eight micro-batches issued back to back: each stage's ranks run only their own work
    (the workers' counts: stage 0 ranks did no stage-1 matmul), results match torch."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    torch.manual_seed(8)
    ref = TorchStaged()
    model = Staged(mesh)
    model.load_state_dict(ref.state_dict())
    tokens = torch.randint(0, 17, (8, 2, 5))
    stage0 = mesh.unbind("pp")[0]
    with dtorch.CommDebugMode() as mode:
        outs = [model(dtorch.distribute_tensor(t, stage0, [R])) for t in tokens]
    assert mode.get_comm_counts()["send_recv"] == 8
    for out, t in zip(outs, tokens):
        assert torch.allclose(out.to_torch(), ref(t), atol=1e-5)


def test_a_move_to_the_same_stage_moves_nothing(live):
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    stage = mesh.unbind("pp")[1]
    h = dtorch.ones(2, 3, device_mesh=stage)
    with dtorch.CommDebugMode() as mode:
        same = h.redistribute(device_mesh=stage)
    assert same is h and mode.get_total_counts() == 0
