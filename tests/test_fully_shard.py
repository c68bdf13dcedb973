"""``dtorch.fully_shard`` (PyTorch's FSDP2 API) on plain torch.nn modules, real 4-rank cluster:
a 4-layer MLP and transformers' Llama against a copy on one device (values and every
gradient), the collectives by the three ledgers (per layer one all_gather in forward, one more
in backward with ``reshard_after_forward=True``, none with ``False``, one reduce_scatter),
``.grad`` ``Shard(0)``, the ranks' memory after a forward (the whole weights freed, also where
the local graphs saved them), training steps, gradient accumulation, and the refusals (raised
before anything is sent)."""

import copy
import gc

import pytest
import torch

import dtorch
from dtorch import MeshError, PlacementError, Replicate, Shard, init_device_mesh
from ledgers import counted
from test_ops_support import illegal

R = Replicate()
DIMS = (6, 48, 3, 40, 5)  # 3 rows on 4 ranks: one rank holds no rows of layer 1


class MLP(torch.nn.Module):
    def __init__(self, dims=DIMS):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(a, b) for a, b in zip(dims, dims[1:]))

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = torch.relu(x)
        return x


@pytest.fixture
def dp4(live):
    return init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))


def sharded_mlp(mesh, reshard):
    torch.manual_seed(0)
    model = MLP()
    ref = copy.deepcopy(model)
    for layer in model.layers:
        dtorch.fully_shard(layer, mesh, reshard_after_forward=reshard)
    assert dtorch.fully_shard(model, mesh, reshard_after_forward=reshard) is model
    return model, ref


def batch(mesh, seed=1):
    x = torch.randn(8, DIMS[0], generator=torch.Generator().manual_seed(seed))
    return x, dtorch.distribute_tensor(x, mesh, [Shard(0)])


def check_grads(model, ref):
    grads = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        assert p.placements == (Shard(0),), name
        assert p.grad is not None and p.grad.placements == (Shard(0),), name
        torch.testing.assert_close(p.grad.to_torch(), grads[name].grad, atol=1e-5, rtol=1e-5)


def storage_bytes():
    gc.collect()
    dtorch.synchronize()
    return [s["storage_bytes"] for s in dtorch.rank_stats()]


@pytest.mark.parametrize("reshard", [True, False])
def test_mlp_forward_backward_and_counts(dp4, reshard):
    model, ref = sharded_mlp(dp4, reshard)
    assert type(model.layers[0]).__name__ == "DTorchLinear"
    assert list(model.state_dict()) == list(ref.state_dict())
    x, xd = batch(dp4)
    y, forward = counted(lambda: model(xd))
    assert forward == {"all_gather": 4}  # one per layer: weight and bias in one buffer
    assert y.placements == (Shard(0),)
    torch.testing.assert_close(y.to_torch(), ref(x), atol=1e-5, rtol=1e-5)
    loss = (y ** 2).sum()
    _, backward = counted(lambda: loss.backward())
    assert backward == ({"all_gather": 4, "reduce_scatter": 4} if reshard
                        else {"reduce_scatter": 4})
    (ref(x) ** 2).sum().backward()
    check_grads(model, ref)
    named = {f"layers.{i}.weight+layers.{i}.bias": {"reduce_scatter": 1} for i in range(4)}
    with dtorch.CommDebugMode() as mode:
        (model(xd) ** 2).sum().backward()
    assert mode.get_gradient_comm_counts() == named  # the per-cell table's names


def test_the_whole_weights_are_freed_after_the_forward(dp4):
    """After a forward with grad, the ranks hold the shards and the activations: the whole
    weights are gone with True (the graphs saved them), kept with False."""
    whole = sum(p.numel() * 4 for p in MLP().parameters())
    grown = {}
    for reshard in (True, False):
        model, _ = sharded_mlp(dp4, reshard)
        _, xd = batch(dp4)
        before = storage_bytes()
        y = model(xd)
        after = storage_bytes()
        grown[reshard] = max(a - b for a, b in zip(after, before))
        y.sum().backward()
        del model, y, xd
    assert grown[False] - grown[True] == whole, grown  # False: every rank keeps them all
    assert grown[True] < whole, grown  # True: the activations only


def test_no_grad_forward_gathers_and_keeps_nothing(dp4):
    model, ref = sharded_mlp(dp4, True)
    x, xd = batch(dp4)
    before = storage_bytes()
    with torch.no_grad():
        y, counts = counted(lambda: model(xd))
    assert counts == {"all_gather": 4}
    torch.testing.assert_close(y.to_torch(), ref(x), atol=1e-5, rtol=1e-5)
    del y
    assert storage_bytes() == before


def test_training_steps_and_gradient_accumulation_match_torch(dp4):
    """Two SGD steps, the second accumulating two micro-batches into one backward."""
    model, ref = sharded_mlp(dp4, None)  # PyTorch's default: the root keeps its weights
    for step in range(2):
        xs = [batch(dp4, seed=10 * step + k) for k in range(1 + step)]
        loss = sum(((model(xd) - 1) ** 2).mean() for _, xd in xs)
        want = sum(((ref(x) - 1) ** 2).mean() for x, _ in xs)
        torch.testing.assert_close(loss.to_torch(), want.detach(), atol=1e-5, rtol=1e-5)
        loss.backward()
        want.backward()
        check_grads(model, ref)
        with torch.no_grad():
            for p, q in zip(model.parameters(), ref.parameters()):
                p -= 0.1 * p.grad
                q -= 0.1 * q.grad
        model.zero_grad()
        ref.zero_grad()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.to_torch(), q.detach(), atol=1e-5, rtol=1e-5)


def mlp_with_head(mesh):
    """The MLP's layers each fully_shard'ed, under a root that owns a head of its own."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(MLP(), torch.nn.Linear(DIMS[-1], 2))
    ref = copy.deepcopy(model)
    for layer in model[0].layers:
        dtorch.fully_shard(layer, mesh)
    dtorch.fully_shard(model, mesh)
    return model, ref


def test_root_default_keeps_its_weights_for_the_backward(dp4):
    """``reshard_after_forward=None`` (PyTorch's default): the layers reshard, the root (here
    the one that owns the head) does not, so its gather runs once."""
    model, ref = mlp_with_head(dp4)
    x, xd = batch(dp4)
    y, forward = counted(lambda: model(xd))
    assert forward == {"all_gather": 5}
    _, backward = counted(lambda: y.sum().backward())
    assert backward == {"all_gather": 4, "reduce_scatter": 5}
    ref(x).sum().backward()
    check_grads(model, ref)


def test_transformers_llama_layer_by_layer(dp4):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4)
    ref = transformers.LlamaForCausalLM(config)
    model = copy.deepcopy(ref)
    for layer in model.model.layers:
        dtorch.fully_shard(layer, dp4)
    dtorch.fully_shard(model, dp4)
    ids = torch.randint(0, 64, (4, 7), generator=torch.Generator().manual_seed(2))
    d_ids = dtorch.distribute_tensor(ids, dp4, [Shard(0)])
    out, counts = counted(lambda: model(input_ids=d_ids, labels=d_ids))
    assert counts == {"all_gather": 3, "all_reduce": 1}  # 2 layers + the root; token count
    want = ref(input_ids=ids, labels=ids)
    torch.testing.assert_close(out.loss.to_torch(), want.loss.detach(), atol=1e-5, rtol=1e-5)
    _, counts = counted(lambda: out.loss.backward())
    assert counts == {"all_gather": 2, "reduce_scatter": 3}
    want.loss.backward()
    check_grads(model, ref)


def _refused(fn, error, match):
    illegal(fn, match, error)


def test_refusals_name_the_fix(dp4, mesh2d):
    _refused(lambda: dtorch.fully_shard(MLP(), mesh2d), MeshError, "1-D mesh")
    _refused(lambda: dtorch.fully_shard([MLP(), MLP()], dp4), TypeError, "one module")
    _refused(lambda: dtorch.fully_shard(MLP(), dp4, reshard_after_forward=2), TypeError,
             "True, False or None")
    _refused(lambda: dtorch.fully_shard(MLP(), dp4, mp_policy=object()), NotImplementedError,
             "mp_policy")
    once = dtorch.fully_shard(MLP(), dp4)
    _refused(lambda: dtorch.fully_shard(once, dp4), ValueError, "already")
    mixed = MLP()
    mixed.layers[1].double()
    _refused(lambda: dtorch.fully_shard(mixed, dp4), TypeError, "share a dtype")
    frozen = MLP()
    frozen.layers[2].bias.requires_grad_(False)
    _refused(lambda: dtorch.fully_shard(frozen, dp4), ValueError, "frozen: layers.2.bias")
    model, _ = sharded_mlp(dp4, True)
    _refused(lambda: dtorch.fully_shard(model.layers[0], dp4), ValueError, "already")
    late = MLP()
    dtorch.fully_shard(late, dp4)  # the root first: its layers are taken
    _refused(lambda: dtorch.fully_shard(late.layers[1], dp4), PlacementError,
             "innermost first")
    model.layers[0].bias.requires_grad_(False)
    _, xd = batch(dp4)
    _refused(lambda: model(xd), ValueError, "ignored_params")
    model.layers[0].bias.requires_grad_(True)
    assert model(xd).shape == (8, DIMS[-1])  # the module and the cluster stay usable
    wrong = dtorch.distribute_tensor(torch.randn(8, DIMS[0] + 1), dp4, [Shard(0)])
    with pytest.raises(RuntimeError):
        model(wrong)  # torch's shape error, inside layer 0's forward
    assert model.layers[0].weight.placements == (Shard(0),)  # the shards are back
    _, counts = counted(lambda: model(xd).sum().backward())
    assert counts == {"all_gather": 8, "reduce_scatter": 4}


def test_default_reshards_the_layers_under_a_root_without_parameters(dp4):
    """The root is the outermost fully_shard module, parameters or not: under it every layer
    reshards by default (None), so the backward gathers each layer again."""
    model, ref = sharded_mlp(dp4, None)
    x, xd = batch(dp4)
    y = model(xd)
    _, counts = counted(lambda: y.sum().backward())
    assert counts == {"all_gather": 4, "reduce_scatter": 4}
    ref(x).sum().backward()
    check_grads(model, ref)


class Tied(torch.nn.Module):
    def __init__(self, vocab=10, dim=6):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, dim)
        self.mid = torch.nn.Linear(dim, dim)
        self.head = torch.nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids):
        return self.head(torch.tanh(self.mid(self.emb(ids))))


def test_tied_parameters_in_one_group_stay_one(dp4):
    torch.manual_seed(0)
    model = Tied()
    ref = copy.deepcopy(model)
    dtorch.fully_shard(model.mid, dp4)
    dtorch.fully_shard(model, dp4)  # emb and head, tied: one parameter of the root's group
    assert model.head.weight is model.emb.weight
    ids = torch.randint(0, 10, (8, 3), generator=torch.Generator().manual_seed(3))
    y, counts = counted(lambda: model(dtorch.distribute_tensor(ids, dp4, [Shard(0)])))
    assert counts == {"all_gather": 2}
    torch.testing.assert_close(y.to_torch(), ref(ids), atol=1e-5, rtol=1e-5)
    y.sum().backward()
    ref(ids).sum().backward()
    check_grads(model, ref)
    split = Tied()
    dtorch.fully_shard(split.emb, dp4)
    _refused(lambda: dtorch.fully_shard(split, dp4), PlacementError, "tied parameters")


def test_an_interrupted_forward_is_undone_by_the_next_one(dp4):
    """Ctrl-C inside a layer's forward (torch runs no forward hook for a KeyboardInterrupt):
    the next forward finds the shards in place and the root is the root again."""
    model, ref = mlp_with_head(dp4)
    x, xd = batch(dp4)
    hook = model[0].layers[2].register_forward_pre_hook(lambda m, a: (_ for _ in ()).throw(
        KeyboardInterrupt()))
    with pytest.raises(KeyboardInterrupt):
        model(xd)
    hook.remove()
    assert model[0].layers[1].weight.placements == (Shard(0),)  # its forward had finished
    assert model[0].layers[2].weight.placements == (R,)  # left whole by the interrupt
    y, forward = counted(lambda: model(xd))
    assert forward == {"all_gather": 5}
    assert model[0].layers[2].weight.placements == (Shard(0),)
    _, backward = counted(lambda: y.sum().backward())
    assert backward == {"all_gather": 4, "reduce_scatter": 5}  # the root keeps its weights
    ref(x).sum().backward()
    check_grads(model, ref)


def test_a_frozen_layer_reshards_too_and_gets_no_gradient(dp4):
    """Frozen weights under an input that needs grad: the local graphs save them for that
    gradient, so they are freed after the forward and gathered again as well."""
    model, ref = sharded_mlp(dp4, True)
    for p in list(model.layers[2].parameters()) + list(ref.layers[2].parameters()):
        p.requires_grad_(False)
    x, xd = batch(dp4)
    y = model(xd)
    _, counts = counted(lambda: y.sum().backward())
    assert counts == {"all_gather": 4, "reduce_scatter": 3}
    ref(x).sum().backward()
    assert model.layers[2].weight.grad is None
    grads = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        if p.requires_grad:
            torch.testing.assert_close(p.grad.to_torch(), grads[name].grad, atol=1e-5, rtol=1e-5)


class Table(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.pos = torch.nn.Parameter(torch.randn(5, 4))

    def forward(self, n):
        return self.pos[:n]  # a view of the gathered weight: it must survive the reshard


def test_an_output_that_views_a_weight_keeps_it(dp4):
    torch.manual_seed(0)
    model = torch.nn.Sequential()
    model.table = Table()
    ref = copy.deepcopy(model)
    dtorch.fully_shard(model.table, dp4, reshard_after_forward=True)
    out = model.table(3)
    torch.testing.assert_close(out.to_torch(), ref.table(3))
    (out * 2).sum().backward()
    (ref.table(3) * 2).sum().backward()
    torch.testing.assert_close(model.table.pos.grad.to_torch(), ref.table.pos.grad)


def test_mesh_dim_of_a_one_dim_mesh_is_taken(dp4):
    model = dtorch.fully_shard(MLP(), dp4["dp"])
    assert model.layers[0].weight.device_mesh == dp4
