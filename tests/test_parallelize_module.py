"""PyTorch's ``parallelize_module`` on plain torch.nn modules (real 4-rank cluster), each against
a ``copy.deepcopy`` of the module on one device taken before converting: values, gradients,
state_dict keys, parameter placements, exact collective counts (the workers' ledgers too), a
dp x tp meshes, wildcard keys, and the refusals
(raised before anything is sent). Uneven sizes: hidden 10 and 3 on tp 4 (a rank's shard empty).
"""

import copy

import pytest
import torch
import torch.nn.functional as F

import dtorch
from dtorch import (ColwiseParallel, MeshError, Partial, PlacementError, PrepareModuleInput,
                    PrepareModuleOutput, Replicate, RowwiseParallel, SequenceParallel, Shard,
                    init_device_mesh, parallelize_module)
from dtorch.runtime import session
from ledgers import counted
from parallelize_support import (MLP, MLP_PLAN, Tied, check_grads, check_sum_backward, close,
                                  forward_counts)

R = Replicate()


@pytest.fixture
def tp4(live):
    return init_device_mesh("cpu", 4, mesh_dim_names=("tp",))


# (a) seed 002's MLP ------------------------------------------------------------------------------
@pytest.mark.parametrize("hidden", [8, 10, 3])
@pytest.mark.parametrize("bias", [True, False])
def test_mlp_colwise_rowwise_matches_torch_with_one_all_reduce(mesh1d, hidden, bias):
    torch.manual_seed(0)
    model = MLP(5, hidden, bias)
    ref = copy.deepcopy(model)
    assert parallelize_module(model, mesh1d, MLP_PLAN) is model
    assert isinstance(model.up, torch.nn.Linear) and type(model.up).__name__ == "DTorchLinear"
    assert model.up.weight.placements == (Shard(0),) and model.down.weight.placements == (
        Shard(1),)
    if bias:
        assert model.up.bias.placements == (Shard(0),)
        assert model.down.bias.placements == (Partial(),)
    assert list(model.state_dict()) == list(ref.state_dict())
    for key, value in model.state_dict().items():
        assert torch.equal(value.to_torch(), ref.state_dict()[key])
    x = torch.randn(3, 5)
    xd = dtorch.distribute_tensor(x, mesh1d, [R]).requires_grad_()
    y, counts = forward_counts(model, xd)
    assert counts == {"all_reduce": 1}
    assert y.placements == (R,)
    xt = x.clone().requires_grad_()
    want = ref(xt)
    close(y, want)
    loss = (y * y).sum()
    _, back = counted(lambda: loss.backward())
    assert back == {"all_reduce": 1}  # x.grad: the column-parallel input's Partial gradient
    (want * want).sum().backward()
    check_grads(model, ref, xd, xt)


def test_sequential_keys_and_torch_inputs(mesh1d):
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(6, 10), torch.nn.ReLU(), torch.nn.Linear(10, 6))
    ref = copy.deepcopy(model)
    parallelize_module(model, mesh1d, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    x = torch.randn(2, 6)
    y, counts = forward_counts(model, x)  # a torch input is the global value: Replicate
    assert counts == {"all_reduce": 1}
    close(y, ref(x))
    model.load_state_dict(ref.state_dict())  # torch's state_dict loads shard by shard
    close(model(x), ref(x))


def test_output_layouts_shard_and_use_local_output_accepted(tp4):
    torch.manual_seed(2)
    model = MLP(5, 10)
    ref = copy.deepcopy(model)
    parallelize_module(model, tp4, {"up": ColwiseParallel(use_local_output=False),
                                    "down": RowwiseParallel(output_layouts=Shard(0),
                                                            use_local_output=True)})
    x = torch.randn(6, 5)
    y, counts = forward_counts(model, x)
    assert y.placements == (Shard(0),)  # outputs stay DTensors: one controller
    assert counts == {"reduce_scatter": 1}
    close(y, ref(x))


def test_embedding_rowwise_and_colwise(tp4):
    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Embedding(10, 6), torch.nn.Linear(6, 3))
    ref = copy.deepcopy(model)
    parallelize_module(model, tp4, {"0": RowwiseParallel()})
    assert model[0].weight.placements == (Shard(0),) and model[1].weight.placements == (R,)
    ids = torch.tensor([[1, 9, 0], [4, 4, 7]])
    y, counts = forward_counts(model, ids)
    assert counts == {"all_reduce": 1}
    close(y, ref(ids))
    emb = torch.nn.Embedding(7, 6)
    ref_emb = copy.deepcopy(emb)
    parallelize_module(emb, tp4, ColwiseParallel(output_layouts=R))
    assert emb.weight.placements == (Shard(1),)
    out, counts = forward_counts(emb, ids % 7)
    assert counts == {"all_gather": 1}
    close(out, ref_emb(ids % 7))


def test_tied_weights_stay_one_dtensor(tp4):
    torch.manual_seed(12)
    model = Tied()
    ref = copy.deepcopy(model)
    parallelize_module(model, tp4, {"emb": RowwiseParallel(),
                                    "head": ColwiseParallel(output_layouts=R)})
    assert model.head.weight is model.emb.weight and model.emb.weight.placements == (Shard(0),)
    assert list(model.state_dict()) == list(ref.state_dict())
    ids = torch.tensor([[1, 9, 0], [4, 4, 7]])
    y, counts = forward_counts(model, ids)
    assert counts == {"all_reduce": 1, "all_gather": 1}
    want = ref(ids)
    close(y, want)
    (y * y).sum().backward()
    (want * want).sum().backward()
    close(model.emb.weight.grad, ref.emb.weight.grad)  # both uses' gradients, summed


def test_tied_weights_placed_two_ways_are_refused(tp4):
    _refused(Tied(), tp4, {"emb": ColwiseParallel(), "head": ColwiseParallel()}, PlacementError,
             r"head.weight is the same tensor as emb.weight \(tied\), but the plan places it "
             r"Shard\(dim=1\) as emb.weight and Shard\(dim=0\) as head.weight\. Fix")


# (b) a transformer block: heads on tp -------------------------------------------------------------
class Attention(torch.nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.q_proj = torch.nn.Linear(dim, dim)
        self.k_proj = torch.nn.Linear(dim, dim)
        self.v_proj = torch.nn.Linear(dim, dim)
        self.o_proj = torch.nn.Linear(dim, dim)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = (p(x).view(b, s, self.heads, -1).transpose(1, 2)
                   for p in (self.q_proj, self.k_proj, self.v_proj))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, d))


class Block(torch.nn.Module):
    def __init__(self, dim=8, heads=4, hidden=12, norm=torch.nn.LayerNorm):
        super().__init__()
        self.attn_norm = norm(dim)
        self.self_attn = Attention(dim, heads)
        self.mlp_norm = norm(dim)
        self.mlp = MLP(dim, hidden)

    def forward(self, x):
        x = x + self.self_attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


BLOCK_PLAN = {"self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
              "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(),
              "mlp.up": ColwiseParallel(), "mlp.down": RowwiseParallel()}


@pytest.mark.parametrize("heads", [4, 8])
def test_transformer_block_two_all_reduces(tp4, heads):
    torch.manual_seed(4)
    model = Block(dim=16, heads=heads, hidden=10)
    ref = copy.deepcopy(model)
    parallelize_module(model, tp4, BLOCK_PLAN)
    assert model.attn_norm.weight.placements == (R,)  # no plan entry: replicated
    x = torch.randn(2, 5, 16)
    xd = dtorch.distribute_tensor(x, tp4, [R]).requires_grad_()
    y, counts = forward_counts(model, xd)
    assert counts == {"all_reduce": 2}
    check_sum_backward(model, ref, y, xd, x)


def test_transformer_block_on_dp_tp(mesh2d):
    torch.manual_seed(13)
    model = Block(dim=8, heads=2, hidden=6)
    ref = copy.deepcopy(model)
    parallelize_module(model, mesh2d, BLOCK_PLAN)
    parallelize_module(model, mesh2d["dp"], PrepareModuleInput(input_layouts=R,
                                                               desired_input_layouts=Shard(0)))
    x = torch.randn(3, 5, 8)  # batch 3 on dp 2: shards of 2 and 1
    dtorch.synchronize()
    with dtorch.CommDebugMode() as mode:
        y = model(x)
    assert [(r.kind, r.mesh_dim_name) for r in mode.get_comm_records()] == [
        ("all_reduce", "tp")] * 2
    assert y.placements == (Shard(0), R)
    close(y, ref(x))


# (c) SequenceParallel norms between tensor-parallel regions ---------------------------------------
SP_PLAN = {"attn_norm": SequenceParallel(), "mlp_norm": SequenceParallel(),
           "self_attn.q_proj": ColwiseParallel(input_layouts=Shard(1)),
           "self_attn.k_proj": ColwiseParallel(input_layouts=Shard(1)),
           "self_attn.v_proj": ColwiseParallel(input_layouts=Shard(1)),
           "self_attn.o_proj": RowwiseParallel(output_layouts=Shard(1)),
           "mlp.up": ColwiseParallel(input_layouts=Shard(1)),
           "mlp.down": RowwiseParallel(output_layouts=Shard(1))}
# torchtitan's way: gather the attention input once, for q, k and v together
SP_PLAN_ONE_GATHER = {**SP_PLAN, "self_attn": PrepareModuleInput(input_layouts=(Shard(1),),
                                                                 desired_input_layouts=(R,)),
                      **{f"self_attn.{p}_proj": ColwiseParallel() for p in "qkv"}}


@pytest.mark.parametrize("norm", [torch.nn.LayerNorm, torch.nn.RMSNorm])
@pytest.mark.parametrize("seq", [6, 3])
@pytest.mark.parametrize("plan, gathers", [(SP_PLAN, 4), (SP_PLAN_ONE_GATHER, 2)])
def test_sequence_parallel_norms(tp4, norm, seq, plan, gathers):
    torch.manual_seed(5)
    model = Block(dim=8, heads=4, hidden=12, norm=norm)
    ref = copy.deepcopy(model)
    parallelize_module(model, tp4, plan)
    assert model.mlp_norm.weight.placements == (R,)
    x = torch.randn(2, seq, 8)
    xd = dtorch.distribute_tensor(x, tp4, [Shard(1)]).requires_grad_()
    y, counts = forward_counts(model, xd)
    assert y.placements == (Shard(1),)
    # each tp region gathers the sequence in (q, k and v each, as in PyTorch, unless the
    # attention's input is gathered once) and reduce-scatters it out
    assert counts == {"all_gather": gathers, "reduce_scatter": 2}, counts
    check_sum_backward(model, ref, y, xd, x)


def test_sequence_parallel_takes_a_torch_input_as_the_global_value(tp4):
    norm = torch.nn.LayerNorm(4)
    ref = copy.deepcopy(norm)
    parallelize_module(norm, tp4, SequenceParallel(sequence_dim=0))
    x = torch.randn(5, 4)
    y, counts = forward_counts(norm, x)
    assert counts == {} and y.placements == (Shard(0),)
    close(y, ref(x))


# (e) dp x tp ------------------------------------------------------------------------------------
@pytest.mark.parametrize("how", ["named", "sliced"])
def test_dp_tp_mesh_with_prepare_module_input_on_dp(mesh2d, how):
    torch.manual_seed(6)
    model = MLP(5, 10)
    ref = copy.deepcopy(model)
    tp = mesh2d if how == "named" else mesh2d["tp"]
    parallelize_module(model, tp, MLP_PLAN)
    parallelize_module(model, mesh2d["dp"], PrepareModuleInput(input_layouts=R,
                                                               desired_input_layouts=Shard(0)))
    assert model.up.weight.placements == (R, Shard(0))
    assert model.down.weight.placements == (R, Shard(1))
    x = torch.randn(5, 5)
    y, counts = forward_counts(model, x)
    assert counts == {"all_reduce": 1}
    with dtorch.CommDebugMode() as mode:
        model(x)
    assert [(r.kind, r.mesh_dim_name) for r in mode.get_comm_records()] == [("all_reduce", "tp")]
    assert y.placements == (Shard(0), R)
    close(y, ref(x))
    y.sum().backward()
    ref(x).sum().backward()
    for name, p in ref.named_parameters():
        close(dict(model.named_parameters())[name].grad, p.grad)


def test_prepare_module_output_and_kwargs(mesh2d):
    torch.manual_seed(7)

    class Two(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 6)

        def forward(self, x, *, scale):
            return self.lin(x) * scale, scale

    model = Two()
    ref = copy.deepcopy(model)
    parallelize_module(model, mesh2d, {
        "": PrepareModuleInput(input_layouts=(R,), desired_input_layouts=(R,),
                               input_kwarg_layouts={"scale": R},
                               desired_input_kwarg_layouts={"scale": R}),
        "lin": ColwiseParallel()})
    parallelize_module(model, mesh2d, PrepareModuleOutput(output_layouts=(Shard(-1), None),
                                                          desired_output_layouts=(R, None)))
    x, scale = torch.randn(3, 4), torch.randn(6)
    (y, s), counts = counted(lambda: model(x, scale=scale))
    assert counts == {"all_gather": 1} and y.placements == (R, R)
    assert isinstance(s, dtorch.DTensor)
    close(y, ref(x, scale=scale)[0])


# (f) wildcard keys ------------------------------------------------------------------------------
class Stack(torch.nn.Module):
    def __init__(self, n=3):
        super().__init__()
        self.layers = torch.nn.ModuleList(Block(dim=8, heads=4, hidden=6) for _ in range(n))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def test_wildcard_keys(tp4):
    torch.manual_seed(8)
    model = Stack()
    ref = copy.deepcopy(model)
    parallelize_module(model, tp4, {
        "layers.*.self_attn.[qkv]_proj": ColwiseParallel(),
        "layers.*.self_attn.o_proj": RowwiseParallel(),
        "layers.*.mlp.up": ColwiseParallel(), "layers.*.mlp.down": RowwiseParallel()})
    for layer in model.layers:
        assert layer.self_attn.k_proj.weight.placements == (Shard(0),)
        assert layer.self_attn.o_proj.weight.placements == (Shard(1),)
    x = torch.randn(2, 3, 8)
    y, counts = forward_counts(model, x)
    assert counts == {"all_reduce": 6}
    close(y, ref(x))


# (g) refusals, raised before anything is sent -----------------------------------------------------
def _refused(model, mesh, plan, error, match):
    c = session.get_controller()
    before, cls = c.issued, type(model)
    with pytest.raises(error, match=match):
        parallelize_module(model, mesh, plan)
    assert c.issued == before and type(model) is cls
    assert all(type(p) is torch.nn.Parameter for p in model.parameters())


def test_key_matching_nothing_is_refused(tp4):
    _refused(MLP(), tp4, {"up": ColwiseParallel(), "mlp.gate": ColwiseParallel()},
             PlacementError, r"plan key 'mlp.gate' matches no module: the root module \(MLP\) "
                             r"has no child matching 'mlp' \(its children: \['up', 'relu', "
                             r"'down'\]\)\. Fix")
    _refused(Stack(1), tp4, {"layers.*.attn.q_proj": ColwiseParallel()}, PlacementError,
             r"submodule 'layers.0' \(Block\) has no child matching 'attn'")


def test_style_on_an_unsupported_module_is_refused(tp4):
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.Linear(4, 4))
    _refused(model, tp4, {"1": RowwiseParallel(), "0": ColwiseParallel()}, PlacementError,
             r"ColwiseParallel cannot shard 0 \(Conv2d\): it supports torch.nn.Linear and "
             r"torch.nn.Embedding\. Fix")


def test_mesh_without_tp_is_refused(live):
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))
    _refused(MLP(), mesh, MLP_PLAN, MeshError,
             r"has no dim named 'tp' \(its names: \('dp', 'pp'\)\)\. Fix: name a dim 'tp'.*"
             r"mesh\['<name>'\]")
    _refused(MLP(), init_device_mesh("cpu", (2, 2)), MLP_PLAN, MeshError, "no dim named 'tp'")
    with pytest.raises(MeshError, match="no dim named 'tp'"):
        mesh["tp"]


def test_mesh_getitem_by_name(m22):
    sub = m22["tp"]
    assert (sub.mesh, sub.dim, sub.ndim, sub.size(), sub.mesh_dim_names) == (m22, 1, 1, 2,
                                                                               ("tp",))
    assert m22["dp"] != sub and m22["dp", "tp"].dim is None and sub == m22["tp"]
    with pytest.raises(MeshError, match="one dim by name"):
        m22["tp", "dp"]


def test_a_plain_input_that_requires_grad_is_refused(live):
    """Sent as a new DTensor its gradient would not reach the caller's graph: refused."""
    mesh = dtorch.init_device_mesh("cpu", 4, mesh_dim_names=("tp",))
    layer = torch.nn.Linear(4, 8)
    dtorch.parallelize_module(layer, mesh, ColwiseParallel())
    w0 = torch.randn(4, 4, requires_grad=True)
    with pytest.raises(dtorch.MixedTensorError, match="requires grad"):
        layer(torch.randn(3, 4) @ w0)
    assert layer(torch.randn(3, 4)).shape == (3, 8)  # a plain input without grad is sent
