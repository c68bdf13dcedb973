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


@pytest.mark.parametrize("schedule", ["1F1B", "GPipe"])
def test_pipeline_training_on_micro_batches_gives_the_whole_batch_gradients(live, schedule):
    """pp2 x tp2, 4 micro-batches of 2 rows through ``dtorch.pipeline_backward``: the
    accumulated gradients and the AdamW step equal torch's on the whole batch of 8 rows on one
    device; one send and one receive per micro-batch each way."""
    import torch.nn.functional as F
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    torch.manual_seed(9)
    ref = TorchStaged()
    model = Staged(mesh)
    model.load_state_dict(ref.state_dict())
    tokens = torch.randint(0, 17, (8, 5))
    targets = torch.randint(0, 17, (8, 5))
    stage0, stage1 = mesh.unbind("pp")
    batches = [(dtorch.distribute_tensor(t, stage0, [R]), dtorch.distribute_tensor(y, stage1, [R]))
               for t, y in zip(tokens.chunk(4), targets.chunk(4))]

    def first(mb):
        h = model.embed(mb[0])
        return model.layers[1](model.layers[0](h))

    def second(h):
        h = h.redistribute(device_mesh=stage1)
        return model.head(model.layers[3](model.layers[2](h)))

    def loss_fn(out, mb):
        return F.cross_entropy(out.flatten(0, 1), mb[1].flatten())

    opt = dtorch.optim.AdamW(model.parameters(), lr=0.01)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.01)
    with dtorch.CommDebugMode() as mode:
        losses = dtorch.pipeline_backward([first, second], batches, loss_fn, schedule=schedule)
    assert mode.get_comm_counts()["send_recv"] == 4 * 2
    whole = F.cross_entropy(ref(tokens).flatten(0, 1), targets.flatten())
    whole.backward()
    assert torch.allclose(torch.stack([l.to_torch() for l in losses]).mean(), whole.detach(),
                          atol=1e-5)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad.to_torch(), q.grad, atol=1e-5, rtol=1e-4, msg=name)
    opt.step(), ref_opt.step()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.to_torch(), q.detach(), atol=1e-5, rtol=1e-4)


def test_pipeline_backward_refuses_a_loss_or_stage_output_it_cannot_run(live):
    mesh = init_device_mesh("cpu", 4, mesh_dim_names=("pp",))
    w = dtorch.distribute_tensor(torch.ones(3), mesh.unbind("pp")[0], [R]).requires_grad_()
    with pytest.raises(TypeError, match="0-dim loss DTensor.*shape \\(3,\\)"):
        dtorch.pipeline_backward([lambda mb: w * mb], [1.0, 2.0], lambda out, mb: out)
    with torch.no_grad(), pytest.raises(RuntimeError, match="does not require grad"):
        dtorch.pipeline_backward([lambda mb: w * mb], [1.0], lambda out, mb: out.sum())
    with pytest.raises(TypeError, match="stage 0 gave micro-batch 0 a float"):
        dtorch.pipeline_backward([lambda mb: 1.0, lambda h: w * h], [1.0],
                                 lambda out, mb: out.sum())
    with pytest.raises(ValueError, match="choose one of"):
        dtorch.pipeline_backward([lambda mb: w * mb], [1.0], lambda out, mb: out.sum(), "zb")
