"""Redistribute on a real cluster: values, collective counts, and the workers' own ledger."""

import pytest
import torch

import dtorch
from dtorch import DeviceMesh, Partial, Replicate, Shard, init_device_mesh
from ledgers import counted


TABLE = [
    ([Shard(0)], [Replicate()], {"all_gather": 1}),
    ([Replicate()], [Shard(0)], {}),
    ([Shard(0)], [Shard(1)], {"all_to_all": 1}),
    ([Partial()], [Replicate()], {"all_reduce": 1}),
    ([Partial()], [Shard(0)], {"reduce_scatter": 1}),
    ([Replicate()], [Partial()], {}),
    ([Shard(1)], [Shard(1)], {}),
]


@pytest.mark.parametrize("shape", [(4, 4), (6, 11), (3, 2)])
@pytest.mark.parametrize("src,dst,counts", TABLE, ids=lambda v: str(v))
def test_transition_table_values_and_counts(mesh1d, src, dst, counts, shape):
    value = torch.randn(shape, dtype=torch.float64)
    x = dtorch.tensor(value, device_mesh=mesh1d, placements=src)
    y, got = counted(lambda: x.redistribute(mesh1d, dst))
    assert got == counts
    assert y.placements == tuple(dst)
    assert torch.allclose(y.to_torch(), value)
    for rank in range(4):
        expect = dtorch.layout.shard_of(value, mesh1d, y.placements, (rank,))
        assert torch.allclose(y.to_local(rank), expect)


@pytest.mark.parametrize("op", ["sum", "avg", "max", "min"])
@pytest.mark.parametrize("dst", [[Replicate()], [Shard(0)], [Shard(1)]], ids=str)
def test_partial_reductions(mesh1d, op, dst):
    parts = [torch.randn(5, 3, dtype=torch.float64) for _ in range(4)]
    stacked = torch.stack(parts)
    expect = {"sum": stacked.sum(0), "avg": stacked.mean(0), "max": stacked.amax(0),
              "min": stacked.amin(0)}[op]
    p = dtorch.from_local(parts, mesh1d, [Partial(op)])
    assert torch.equal(p.to_local(2), parts[2])
    y, got = counted(lambda: p.redistribute(mesh1d, dst))
    assert got == ({"all_reduce": 1} if dst == [Replicate()] else {"reduce_scatter": 1})
    assert torch.allclose(y.to_torch(), expect)


def test_partial_to_torch_costs_one_all_reduce(mesh1d):
    p = dtorch.tensor(torch.full((4, 4), 6.0), device_mesh=mesh1d, placements=[Partial()])
    value, got = counted(lambda: p.to_torch())
    assert got == {"all_reduce": 1}
    assert value[0].tolist() == [6.0, 6.0, 6.0, 6.0]


def test_uneven_shards_gather_and_all_to_all(mesh1d):
    value = torch.arange(44.).reshape(4, 11)
    x = dtorch.tensor(value, device_mesh=mesh1d, placements=[Shard(1)])
    assert [s[1] for s in x.local_shapes().values()] == [3, 3, 3, 2]
    r, got = counted(lambda: x.redistribute(placements=[Replicate()]))
    assert got == {"all_gather": 1} and torch.equal(r.to_local(3), value)
    s0, got = counted(lambda: x.redistribute(placements=[Shard(0)]))
    assert got == {"all_to_all": 1} and torch.equal(s0.to_local(2), value[2:3])
    few = dtorch.tensor(torch.arange(3.), device_mesh=mesh1d, placements=[Shard(0)])
    assert [s[0] for s in few.local_shapes().values()] == [1, 1, 1, 0]
    assert torch.equal(few.redistribute(placements=[Replicate()]).to_local(3), torch.arange(3.))


# Counts derived by hand from the placement table (one collective per mesh dim that changes),
# not from the planner under test:
TABLE_2D = [
    # both mesh dims gather: one all_gather each
    ([Shard(0), Shard(0)], [Replicate(), Replicate()], {"all_gather": 2}),
    # mesh dim 1's Shard(1) is nested in the tensor dim mesh dim 0 moves to: dim 1 is gathered
    # first, dim 0 exchanges (all_to_all), then dim 1 slices its Shard(0) locally
    ([Shard(0), Shard(1)], [Shard(1), Shard(0)], {"all_gather": 1, "all_to_all": 1}),
    # dim 0 reduces (all_reduce), dim 1 exchanges Shard(0) for Shard(1) (all_to_all)
    ([Partial(), Shard(0)], [Replicate(), Shard(1)], {"all_reduce": 1, "all_to_all": 1}),
    # a local slice and a local "keep the value" (max): nothing moves
    ([Replicate(), Replicate()], [Shard(0), Partial("max")], {}),
    # dim 0 exchanges Shard(1) for Shard(0), dim 1 reduces into Shard(0) (reduce_scatter)
    ([Shard(1), Partial("min")], [Shard(0), Shard(0)], {"all_to_all": 1, "reduce_scatter": 1}),
]


@pytest.mark.parametrize("src,dst,counts", TABLE_2D, ids=str)
def test_2d_mesh_transitions(mesh2d, src, dst, counts):
    value = torch.randn(7, 5, dtype=torch.float64)
    x = dtorch.tensor(value, device_mesh=mesh2d, placements=src)
    y, got = counted(lambda: x.redistribute(mesh2d, dst))
    assert got == counts
    assert y.placements == tuple(dst)
    assert torch.allclose(y.to_torch(), value, rtol=0, atol=1e-12)


def test_same_placements_move_nothing(mesh1d):
    x = dtorch.ones(4, device_mesh=mesh1d, placements=[Shard(0)])
    y, got = counted(lambda: x.redistribute(mesh1d, [Shard(0)]))
    assert y is x and got == {}


def test_move_between_meshes_point_to_point(live):
    a = DeviceMesh("cpu", [0, 1])
    b = DeviceMesh("cpu", [2, 3])
    value = torch.arange(10.).reshape(5, 2)
    x = dtorch.tensor(value, device_mesh=a, placements=[Shard(0)])
    y, got = counted(lambda: x.redistribute(device_mesh=b))
    assert got == {"send_recv": 1}
    assert y.device_mesh == b and torch.equal(y.to_local(2), value[:3])
    assert torch.equal(y.to_torch(), value)
    swapped = DeviceMesh("cpu", [1, 0])
    z, got = counted(lambda: x.redistribute(device_mesh=swapped, placements=[Replicate()]))
    assert got == {"all_gather": 1, "send_recv": 1} and torch.equal(z.to_local(1), value)
    same_coords = DeviceMesh("cpu", [0, 1], mesh_dim_names=["pp"])
    w, got = counted(lambda: x.redistribute(device_mesh=same_coords))
    assert got == {} and torch.equal(w.to_torch(), value)


def test_pipeline_stage_meshes_move(live):
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    stage0, stage1 = mesh.unbind("pp")
    h = dtorch.tensor(torch.arange(8.).reshape(2, 4), device_mesh=stage0, placements=[Shard(1)])
    moved = h.redistribute(device_mesh=stage1)
    assert moved.device_mesh.ranks == (2, 3)
    assert torch.equal(moved.to_local(3), torch.tensor([[2., 3.], [6., 7.]]))


def test_redistribute_by_dict_modes(mesh2d):
    value = torch.randn(4, 6)
    x = dtorch.tensor(value, device_mesh=mesh2d, placements=[Shard(0), Shard(1)])
    keep = x.redistribute_by_dict({"tp": Replicate(), "cp": Shard(0)})
    assert keep.placements == (Shard(0), Replicate())
    rep = x.redistribute_by_dict({"dp": Shard(1)}, default_placement_mode="replicate")
    assert rep.placements == (Shard(1), Replicate())
    seed_style = x.redistribute_by_dict(mesh2d, placements_dict={"dp": Replicate()})
    assert seed_style.placements == (Replicate(), Shard(1))
    with pytest.raises(dtorch.PlacementValueError, match="'tp'"):
        x.redistribute_by_dict({"dp": Replicate()}, default_placement_mode="raise_error")
    like = dtorch.zeros(4, 6, device_mesh=mesh2d, placements=[Replicate(), Shard(0)])
    assert x.redistribute_like(like).placements == like.placements
    assert torch.allclose(x.redistribute_like(like).to_torch(), value)
    assert x.check_placement("dp", Shard(0)) and x.check_placement(1, Shard(-1))
    assert not x.check_placement("tp", Replicate())
    with pytest.raises(dtorch.MeshError, match="no dim named 'cp'"):
        x.check_placement("cp", Replicate())


def test_four_transitions_of_seed_002(mesh1d):
    x = dtorch.tensor(torch.arange(16.).reshape(4, 4), device_mesh=mesh1d, placements=[Shard(0)])
    r, c1 = counted(lambda: x.redistribute(mesh1d, [Replicate()]))
    s, c2 = counted(lambda: r.redistribute(mesh1d, [Shard(0)]))
    _, c3 = counted(lambda: s.redistribute(mesh1d, [Shard(1)]))
    p = dtorch.tensor(torch.arange(16.).reshape(4, 4), device_mesh=mesh1d, placements=[Partial()])
    _, c4 = counted(lambda: p.redistribute(mesh1d, [Replicate()]))
    assert (c1, c2, c3, c4) == ({"all_gather": 1}, {}, {"all_to_all": 1}, {"all_reduce": 1})
