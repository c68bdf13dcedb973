"""``meta``-device modules through ``parallelize_module`` (real 4-rank cluster): each tensor
drawn on the ranks from the distribution its module's own ``reset_parameters()`` uses (kaiming
bounds, N(0, 1) with the padding row zeroed, norms' ones and zeros, BatchNorm's buffers), tied
tensors once, and a meta tensor with no init refused before anything is sent."""

import math

import pytest
import torch

from dtorch import (ColwiseParallel, Partial, Replicate, RowwiseParallel, Shard,
                    init_device_mesh, parallelize_module)
from dtorch.parallel import MetaInitError
from dtorch.runtime import session
from parallelize_support import MLP, Tied

R = Replicate()


@pytest.fixture
def tp4(live):
    return init_device_mesh("cpu", 4, mesh_dim_names=("tp",))


# (d) a meta-device module initialised on the ranks ----------------------------------------------
def test_meta_module_initialised_with_torch_nn_distributions(tp4):
    with torch.device("meta"):
        model = torch.nn.ModuleDict({"mlp": MLP(64, 256), "norm": torch.nn.LayerNorm(64),
                                     "emb": torch.nn.Embedding(50, 64, padding_idx=3)})
    parallelize_module(model, tp4, {"mlp.up": ColwiseParallel(), "mlp.down": RowwiseParallel(),
                                    "emb": ColwiseParallel()})
    up, down = model["mlp"].up, model["mlp"].down
    assert (up.weight.shape, up.weight.placements) == ((256, 64), (Shard(0),))
    assert (down.weight.shape, down.weight.placements) == ((64, 256), (Shard(1),))
    assert down.bias.placements == (Partial(),) and model["norm"].weight.placements == (R,)
    for lin, fan_in in ((up, 64), (down, 256)):
        w = lin.weight.to_torch()
        bound = 1 / math.sqrt(fan_in)  # kaiming_uniform_(a=sqrt(5)) on (out, in)
        assert torch.isfinite(w).all() and w.abs().max() <= bound
        assert abs(w.std().item() - bound / math.sqrt(3)) < 0.05 * bound
        assert abs(w.mean().item()) < 0.05 * bound
        assert w.unique().numel() > 0.99 * w.numel()  # the shards are not copies of each other
        b = lin.bias.to_torch()
        assert b.abs().max() <= bound and b.std() > 0.3 * bound
    assert torch.equal(model["norm"].weight.to_torch(), torch.ones(64))
    assert torch.equal(model["norm"].bias.to_torch(), torch.zeros(64))
    e = model["emb"].weight.to_torch()
    assert torch.equal(e[3], torch.zeros(64))  # padding_idx's row, as torch.nn zeroes it
    rest = torch.cat([e[:3], e[4:]])
    assert abs(rest.std().item() - 1) < 0.05 and abs(rest.mean().item()) < 0.05
    y = model["mlp"](torch.randn(3, 64))
    assert y.shape == (3, 64) and torch.isfinite(y.to_torch()).all()


def test_meta_buffers_follow_reset_parameters(tp4):
    with torch.device("meta"):
        bn = torch.nn.BatchNorm1d(6)
    parallelize_module(bn, tp4, {})
    state = {k: v.to_torch() for k, v in bn.state_dict().items()}
    want = torch.nn.BatchNorm1d(6).state_dict()
    assert list(state) == list(want)
    for key, value in want.items():
        assert state[key].dtype == value.dtype and torch.equal(state[key], value), key


def test_meta_tied_weight_keeps_its_first_owners_init(tp4):
    with torch.device("meta"):
        model = Tied(vocab=64, dim=128)
    parallelize_module(model, tp4, {"emb": RowwiseParallel(), "head": ColwiseParallel()})
    w = model.head.weight.to_torch()
    assert model.head.weight is model.emb.weight
    assert abs(w.std().item() - 1) < 0.05  # the Embedding's N(0, 1), not the Linear's bound
    assert w.abs().max() > 1


def test_meta_parameter_without_an_init_is_refused(tp4):
    class Scale(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(4))

    with torch.device("meta"):
        model = Scale()
    before = session.get_controller().issued
    with pytest.raises(MetaInitError, match=r"w is on the meta device and Scale has no "
                                            r"reset_parameters\(\).*Fix"):
        parallelize_module(model, tp4, {})
    assert session.get_controller().issued == before and type(model) is Scale


def test_a_parents_init_of_its_childrens_tensors_wins(tp4):
    """torch builds MultiheadAttention's out_proj (kaiming uniform, bias uniform) and then its
    own _reset_parameters zeroes out_proj.bias and xavier-inits in_proj_weight: the replay
    keeps that order."""
    embed = 8
    with torch.device("meta"):
        mha = torch.nn.MultiheadAttention(embed, 2)
    parallelize_module(mha, tp4, {})
    assert torch.equal(mha.out_proj.bias.to_torch(), torch.zeros(embed))
    assert torch.equal(mha.in_proj_bias.to_torch(), torch.zeros(3 * embed))
    weight = mha.in_proj_weight.to_torch()
    xavier = math.sqrt(6.0 / (embed + 3 * embed))
    assert weight.abs().max() <= xavier and weight.abs().max() > xavier / 2
    kaiming = 1 / math.sqrt(embed)  # out_proj.weight keeps Linear's own init
    assert 0 < mha.out_proj.weight.to_torch().abs().max() <= kaiming
