"""dtorch.nn modules against torch.nn on one device, after ``load_state_dict(torch.state_dict())``
(real 4-rank cluster; meshes (4,), (2, 2) dp x tp and (2, 2) pp x tp; uneven feature counts):
values, parameter placements, exact collective counts, input checks and clear errors."""

import pytest
import torch

import dtorch
import dtorch.nn as nn
from dtorch import DeviceMesh, Graph, Partial, PlacementError, Replicate, Shard, init_device_mesh
from dtorch.runtime import session

R = Replicate()
ATOL = 1e-5


@pytest.fixture
def dp_tp(live):
    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))


@pytest.fixture
def tp4(live):
    return init_device_mesh("cpu", 4, mesh_dim_names=("tp",))


def counts(fn):
    with dtorch.CommDebugMode() as mode:
        out = fn()
    return out, mode.get_comm_counts()


def close(d, t, atol=ATOL):
    got = d.to_torch()
    assert got.shape == t.shape, (got.shape, t.shape)
    assert torch.allclose(got, t.detach(), atol=atol), (got - t).abs().max()


# parameters, names and state_dicts match torch.nn ------------------------------------------------
PRESETS = [
    (nn.Linear, "col", R, Shard(-1)),
    (nn.ColumnParallelLinear, "col", R, Shard(-1)),
    (nn.ColumnParallelLinearWithReplicateOutput, "col", R, R),
    (nn.ColumnParallelLinearWithReplicateInputOutput, "col", Shard(-1), R),
    (nn.RowParallelLinear, "row", Shard(-1), Partial()),
    (nn.RowParallelLinearWithReplicateOutput, "row", Shard(-1), R),
    (nn.ReplicateParallelLinear, None, R, R),
]
COLLECTIVES = {  # what the preset's own input/output conversion costs on tp
    nn.ColumnParallelLinearWithReplicateOutput: {"all_gather": 1},
    nn.ColumnParallelLinearWithReplicateInputOutput: {"all_gather": 2},
    nn.RowParallelLinearWithReplicateOutput: {"all_reduce": 1},
}


MESHES = {"tp4": ((4,), ("tp",)), "dp2xtp2": ((2, 2), ("dp", "tp")),
          "pp2xtp2": ((2, 2), ("pp", "tp"))}


@pytest.mark.parametrize("cls, shard_type, given, out_placement", PRESETS,
                         ids=[p[0].__name__ for p in PRESETS])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("mesh_name", sorted(MESHES))
def test_linear_presets_match_torch(live, mesh_name, cls, shard_type, given, out_placement,
                                    bias):
    shape, names = MESHES[mesh_name]
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    if names[0] == "pp":  # a pipeline stage of the pp x tp mesh: a 1-D tp mesh of 2 ranks
        mesh = mesh.unbind("pp")[1]
    lead = [Shard(0)] if names[0] == "dp" else [R] * (mesh.ndim - 1)
    torch.manual_seed(1)
    ref = torch.nn.Linear(11, 7, bias=bias)  # 11 and 7 features over tp=2 or 4: uneven
    mod = cls(11, 7, bias=bias, device_mesh=mesh)
    assert [k for k, _ in mod.named_parameters()] == [k for k, _ in ref.named_parameters()]
    tp_w = {"col": Shard(0), "row": Shard(1), None: R}[shard_type if cls is not
                                                         nn.ReplicateParallelLinear else None]
    others = (R,) * (mesh.ndim - 1)
    assert mod.weight.placements == others + (tp_w,)
    if bias:
        assert mod.bias.placements == others + ({"col": Shard(0), "row": Partial(), None: R}[
            shard_type if cls is not nn.ReplicateParallelLinear else None],)
    mod.load_state_dict(ref.state_dict())
    x = torch.randn(6, 11)
    dx = dtorch.distribute_tensor(x, mesh, lead + [given])
    y, comms = counts(lambda: mod(dx))
    assert comms == COLLECTIVES.get(cls, {}), comms
    expected_out = Shard(1) if out_placement == Shard(-1) else out_placement
    assert y.placements == tuple(lead) + (expected_out,)
    assert y.device_mesh == mesh
    close(y, ref(x))
    for key, value in nn.full_state_dict(mod).items():
        assert torch.equal(value, ref.state_dict()[key])


def test_plain_linear_on_a_mesh_without_tp_is_replicated(live):
    mesh = init_device_mesh("cpu", 4, mesh_dim_names=("dp",))
    mod = nn.Linear(5, 3, device_mesh=mesh)
    assert mod.tp_dim is None and mod.weight.placements == (R,)
    ref = torch.nn.Linear(5, 3)
    mod.load_state_dict(ref.state_dict())
    x = torch.randn(8, 5)
    y, comms = counts(lambda: mod(dtorch.distribute_tensor(x, mesh, [Shard(0)])))
    assert comms == {} and y.placements == (Shard(0),)  # data parallel: nothing moves
    close(y, ref(x))


@pytest.mark.parametrize("tp_dim, expected", [("tp", 1), (1, 1), (-1, 1), (0, 0), (None, None),
                                              ("cp", None)])
def test_tp_dim_by_name_index_or_none(dp_tp, tp_dim, expected):
    assert nn.Linear(4, 4, device_mesh=dp_tp, tp_dim=tp_dim).tp_dim == expected


def test_mlp_column_then_row_is_one_all_reduce(dp_tp):
    torch.manual_seed(2)
    ref = torch.nn.Sequential(torch.nn.Linear(8, 11), torch.nn.GELU(), torch.nn.Linear(11, 8))
    mlp = nn.Sequential(nn.ColumnParallelLinear(8, 11, device_mesh=dp_tp), nn.GELU(),
                        nn.RowParallelLinearWithReplicateOutput(11, 8, device_mesh=dp_tp))
    assert list(mlp.state_dict()) == list(ref.state_dict())
    mlp.load_state_dict(ref.state_dict())
    x = torch.randn(4, 3, 8)
    y, comms = counts(lambda: mlp(dtorch.distribute_tensor(x, dp_tp, [Shard(0), R])))
    assert comms == {"all_reduce": 1}
    assert y.placements == (Shard(0), R)
    close(y, ref(x))


def test_embeddings_match_torch(dp_tp):
    torch.manual_seed(3)
    ref = torch.nn.Embedding(13, 6, padding_idx=4)
    ids = torch.randint(0, 13, (4, 5))
    cases = [(nn.Embedding, (R, R), {}, (Shard(0), R)),
             (nn.EmbeddingWithReplicateOutput, (R, Shard(1)), {"all_gather": 1}, (Shard(0), R)),
             (nn.VocabParallelEmbedding, (R, Shard(0)), {}, (Shard(0), Partial()))]
    for cls, weight_placements, comms_expected, out_placements in cases:
        mod = cls(13, 6, padding_idx=4, device_mesh=dp_tp)
        assert mod.weight.placements == weight_placements
        assert torch.equal(mod.weight.to_torch()[4], torch.zeros(6))  # torch.nn's init rule
        mod.load_state_dict(ref.state_dict())
        out, comms = counts(lambda: mod(dtorch.distribute_tensor(ids, dp_tp, [Shard(0), R])))
        assert comms == comms_expected and out.placements == out_placements, (cls, comms)
        close(out, ref(ids))
    reduced = nn.VocabParallelEmbedding(13, 6, device_mesh=dp_tp, reduce_output=True)
    reduced.load_state_dict(ref.state_dict())
    out, comms = counts(lambda: reduced(dtorch.distribute_tensor(ids, dp_tp, [Shard(0), R])))
    assert comms == {"all_reduce": 1} and out.placements == (Shard(0), R)
    close(out, ref(ids))


def test_norms_and_activations_match_torch(dp_tp):
    torch.manual_seed(4)
    x = torch.randn(4, 3, 10)
    dx = dtorch.distribute_tensor(x, dp_tp, [Shard(0), R])
    pairs = [(nn.RMSNorm(10, eps=1e-6, device_mesh=dp_tp), torch.nn.RMSNorm(10, eps=1e-6)),
             (nn.LayerNorm(10, device_mesh=dp_tp), torch.nn.LayerNorm(10)),
             (nn.LayerNorm(10, bias=False, device_mesh=dp_tp), torch.nn.LayerNorm(10, bias=False)),
             (nn.SiLU(), torch.nn.SiLU()), (nn.GELU(approximate="tanh"),
                                            torch.nn.GELU(approximate="tanh")),
             (nn.ReLU(), torch.nn.ReLU()), (nn.Identity(), torch.nn.Identity()),
             (nn.Dropout(0.3).eval(), torch.nn.Dropout(0.3).eval())]
    for mod, ref in pairs:
        with torch.no_grad():
            for p in ref.parameters():
                p.uniform_(0.5, 1.5)
        assert list(mod.state_dict()) == list(ref.state_dict()), type(mod)
        assert repr(mod) == repr(ref), (mod, ref)
        mod.load_state_dict(ref.state_dict())
        y, comms = counts(lambda: mod(dx))
        assert comms == {} and y.placements == (Shard(0), R)
        close(y, ref(x))
    dtorch.manual_seed(0)  # training mode: the counter-based stream's mask (test_dropout.py)
    assert torch.equal(nn.Dropout(0.3)(dx).to_torch(),
                       dtorch.random.dropout(x, 0.3, seed=0, counter=0))
    assert torch.equal(nn.Dropout(0.0)(dx).to_torch(), x)


# a model: containers, buffers, train/eval, _apply -------------------------------------------------
class Block(nn.Module):
    def __init__(self, mesh, d=8, hidden=11):
        super().__init__()
        self.norm = nn.RMSNorm(d, device_mesh=mesh)
        self.up = nn.ColumnParallelLinear(d, hidden, device_mesh=mesh)
        self.act = nn.SiLU()
        self.down = nn.RowParallelLinearWithReplicateOutput(hidden, d, device_mesh=mesh)
        self.register_buffer("scale", dtorch.full((d,), 0.5, device_mesh=mesh))
        self.register_buffer("cache", dtorch.zeros(2, device_mesh=mesh), persistent=False)

    def forward(self, x):
        return x + self.down(self.act(self.up(self.norm(x)))) * self.scale


class TorchBlock(torch.nn.Module):
    def __init__(self, d=8, hidden=11):
        super().__init__()
        self.norm = torch.nn.RMSNorm(d)
        self.up = torch.nn.Linear(d, hidden)
        self.act = torch.nn.SiLU()
        self.down = torch.nn.Linear(hidden, d)
        self.register_buffer("scale", torch.full((d,), 0.5))
        self.register_buffer("cache", torch.zeros(2), persistent=False)

    def forward(self, x):
        return x + self.down(self.act(self.up(self.norm(x)))) * self.scale


@pytest.mark.parametrize("mesh_shape, names", [((4,), ("tp",)), ((2, 2), ("dp", "tp"))])
def test_a_model_has_torch_nn_names_and_values(live, mesh_shape, names):
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
    torch.manual_seed(5)
    ref = torch.nn.ModuleList([TorchBlock() for _ in range(2)])
    model = nn.ModuleList([Block(mesh) for _ in range(2)])
    assert list(model.state_dict()) == list(ref.state_dict())
    assert [k for k, _ in model.named_parameters()] == [k for k, _ in ref.named_parameters()]
    assert [k for k, _ in model.named_buffers()] == [k for k, _ in ref.named_buffers()]
    assert [k for k, _ in model.named_modules()] == [k for k, _ in ref.named_modules()]
    assert all(isinstance(v, dtorch.DTensor) for v in model.state_dict().values())
    model.load_state_dict(ref.state_dict())
    x = torch.randn(2, 8)
    batch = [Shard(0) if n == "dp" else R for n in names]
    h = dtorch.distribute_tensor(x, mesh, batch)
    href = x
    for block, rblock in zip(model, ref):
        h, href = block(h), rblock(href)
    close(h, href)
    assert model.eval() is model and not model[0].up.training
    model.train()
    assert model[1].down.training
    doubled = model.double()
    assert doubled[0].up.weight.dtype == torch.float64 and doubled[0].scale.dtype == torch.float64
    assert doubled[0].up.weight.placements == model[0].up.weight.placements


def test_torch_tensors_as_inputs_are_distributed(dp_tp):
    ref = torch.nn.Linear(4, 6)
    col = nn.ColumnParallelLinearWithReplicateOutput(4, 6, device_mesh=dp_tp)
    col.load_state_dict(ref.state_dict())
    x = torch.randn(3, 4)
    close(col(x), ref(x))


# checks and clear errors, cluster still usable ----------------------------------------------------
def test_input_placement_checks_name_the_expected_placement(dp_tp):
    col = nn.ColumnParallelLinear(4, 6, device_mesh=dp_tp)
    row = nn.RowParallelLinear(6, 4, device_mesh=dp_tp)
    emb = nn.EmbeddingWithReplicateOutput(5, 4, device_mesh=dp_tp)
    x = dtorch.distribute_tensor(torch.randn(2, 6), dp_tp, [R, R])
    s = dtorch.distribute_tensor(torch.randn(2, 4), dp_tp, [R, Shard(1)])
    ids = dtorch.distribute_tensor(torch.arange(4), dp_tp, [R, Shard(0)])
    c = session.get_controller()
    before = c.issued
    with pytest.raises(PlacementError, match=r"RowParallelLinear expects its input to be "
                                             r"Shard\(1\) on mesh dim 'tp'.*but it is Replicate"):
        row(x)
    with pytest.raises(PlacementError, match=r"Replicate\(\) on mesh dim 'tp'.*"
                                             r"redistribute_by_dict.*WithReplicateInputOutput"):
        col(s)
    with pytest.raises(PlacementError, match="indices to be Replicate on mesh dim 'tp'"):
        emb(ids)
    assert c.issued == before  # nothing was sent for the refused calls
    y = nn.ColumnParallelLinearWithReplicateInputOutput(4, 6, device_mesh=dp_tp)(s)
    assert y.placements == (R, R)


@pytest.mark.parametrize("make, words", [
    (lambda m: nn.Linear(4, 4, device_mesh=m, tp_shard_type="diagonal"), "'col', 'row' or None"),
    (lambda m: nn.Linear(4, 4, device_mesh=m, tp_dim=2), "out of range for a 2-D mesh"),
    (lambda m: nn.Linear(4, 4, device_mesh=m, tp_dim=1.5), "name, an int or None"),
    (lambda m: nn.Linear(0, 4, device_mesh=m), "in_features must be a positive int"),
    (lambda m: nn.Embedding(5, 4, padding_idx=7, device_mesh=m), "padding_idx"),
])
def test_bad_module_arguments_raise_clearly(dp_tp, make, words):
    with pytest.raises(nn.ModuleError, match=words):
        make(dp_tp)


def test_bad_state_dicts_name_the_key_and_the_cluster_stays_usable(dp_tp):
    mod = nn.Sequential(nn.Linear(4, 6, device_mesh=dp_tp), nn.ReLU())
    good = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.ReLU()).state_dict()
    with pytest.raises(RuntimeError, match=r'Missing key\(s\) in state_dict: "0.bias"'):
        mod.load_state_dict({"0.weight": good["0.weight"]})
    with pytest.raises(RuntimeError, match=r'Unexpected key\(s\) in state_dict: "0.extra"'):
        mod.load_state_dict({**good, "0.extra": torch.zeros(1)})
    with pytest.raises(RuntimeError, match=r"size mismatch for 0.weight: copying a param with "
                                           r"shape \(6, 5\)"):
        mod.load_state_dict({**good, "0.weight": torch.zeros(6, 5)})
    result = mod.load_state_dict({"0.weight": good["0.weight"]}, strict=False)
    assert result.missing_keys == ["0.bias"]
    mod.load_state_dict(good)
    assert torch.equal(mod[0].weight.to_torch(), good["0.weight"])


def test_device_mesh_guard_binds_modules_and_the_default_is_the_whole_cluster(live):
    assert nn.Linear(2, 2).device_mesh == DeviceMesh("cpu")
    stage = DeviceMesh("cpu", [2, 3], mesh_dim_names=["tp"])
    with Graph.default_graph().device_mesh_guard(stage):
        inner = nn.ColumnParallelLinear(2, 4)
    assert inner.device_mesh == stage and inner.weight.device_mesh == stage
    assert inner.weight.local_shapes() == {2: (2, 2), 3: (2, 2)}


def test_parameters_are_initialised_shard_by_shard(dp_tp):
    """Ranks holding the same block agree; values follow torch.nn's init distribution."""
    torch.manual_seed(6)
    mod = nn.ColumnParallelLinear(64, 32, device_mesh=dp_tp)
    w = mod.weight
    assert torch.equal(w.to_local(0), w.to_local(2)) and torch.equal(w.to_local(1), w.to_local(3))
    full = w.to_torch()
    bound = 1 / 64 ** 0.5
    assert full.abs().max() <= bound and full.std() > bound / 3
    assert not torch.equal(w.to_local(0), w.to_local(1))
    emb = nn.Embedding(100, 16, device_mesh=dp_tp).weight.to_torch()
    assert abs(emb.mean()) < 0.1 and 0.9 < emb.std() < 1.1
