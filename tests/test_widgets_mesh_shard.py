"""Widgets: the mesh view and the shard view (which rank holds which block), built headless
and their state read without a frontend; views of real DTensors use the session cluster."""

from __future__ import annotations

import math
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import dtorch
from dtorch import DeviceMesh, MeshError, Partial, Replicate, Shard, init_device_mesh
from dtorch.layout import rank_blocks, shard_of
from dtorch_widgets import MeshView, ShardView
from widget_support import FakeDTensor, svgs_parse

@pytest.fixture
def mesh22():
    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))


# ---------------------------------------------------------------------------------------------
# mesh view
# ---------------------------------------------------------------------------------------------
def test_mesh_view_grid_and_no_selection(mesh22):
    v = MeshView(mesh22)
    assert v.grid == [[0, 1], [2, 3]]
    assert v.selected_dim is None and v.highlighted_groups == ()
    assert v.group_of(0) is None
    assert [label for label, _ in v.buttons.options] == ["none", "dp", "tp"]


@pytest.mark.parametrize("dim, name, groups", [
    (0, "dp", ((0, 2), (1, 3))),
    (1, "tp", ((0, 1), (2, 3))),
])
def test_mesh_view_selecting_a_dim_highlights_its_groups(mesh22, dim, name, groups):
    by_name = MeshView(mesh22).select(name)
    by_index = MeshView(mesh22).select(dim)
    clicked = MeshView(mesh22)
    clicked.buttons.value = dim  # what a click does
    for v in (by_name, by_index, clicked):
        assert v.selected_dim == dim and v.selected_dim_name == name
        assert v.highlighted_groups == groups == mesh22.groups(dim)
        assert f"groups along {name}" in v.html
        for g in groups:
            assert str(g) in v.html
            assert all(v.group_of(r) == g for r in g)
    by_name.select(None)
    assert by_name.highlighted_groups == () and "groups along" not in by_name.html


def test_mesh_view_initial_highlight_and_bad_dim(mesh22):
    assert MeshView(mesh22, highlight_dim="tp").selected_dim == 1
    with pytest.raises(MeshError):
        MeshView(mesh22).select("pp")


def test_mesh_view_odd_meshes():
    v = MeshView(DeviceMesh("cpu", [[4, 5, 6], [7, 8, 9]]))
    assert v.grid == [[4, 5, 6], [7, 8, 9]]
    assert v.select(1).highlighted_groups == ((4, 5, 6), (7, 8, 9))
    assert v.selected_dim_name == "dim1"
    one = MeshView(init_device_mesh("cpu", 3))
    assert one.grid == [0, 1, 2] and one.select(0).highlighted_groups == ((0, 1, 2),)
    three = MeshView(init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("pp", "dp", "tp")))
    assert three.select("pp").highlighted_groups == ((0, 4), (1, 5), (2, 6), (3, 7))
    assert "pp=0" in three.html and "pp=1" in three.html
    for r in range(8):
        assert f"<title>rank {r} " in three.html


# ---------------------------------------------------------------------------------------------
# shard view: block-to-rank assignment
# ---------------------------------------------------------------------------------------------
def test_shard_view_even(mesh22):
    v = ShardView((4, 6), mesh22, [Shard(0), Shard(1)])
    assert v.block_owners == {
        ((0, 2), (0, 3)): (0,), ((0, 2), (3, 6)): (1,),
        ((2, 4), (0, 3)): (2,), ((2, 4), (3, 6)): (3,),
    }
    assert not v.uneven and v.empty_ranks == () and v.shard_dims == {0: 0, 1: 1}
    assert v.partial_dims == () and v.replicate_dims == ()
    assert v.owners_of((3, 5)) == (3,) and v.owners_of((1, 2)) == (0,)
    assert set(v.local_shapes.values()) == {(2, 3)}


def test_shard_view_uneven():
    v = ShardView((5,), init_device_mesh("cpu", 2), [Shard(0)])
    assert v.block_owners == {((0, 3),): (0,), ((3, 5),): (1,)}
    assert v.uneven and v.local_shapes == {0: (3,), 1: (2,)}
    assert "uneven shards" in v.html

    empty = ShardView((3, 2), init_device_mesh("cpu", 4), [Shard(0)])
    assert empty.block_owners == {((0, 1), (0, 2)): (0,), ((1, 2), (0, 2)): (1,),
                                  ((2, 3), (0, 2)): (2,)}
    assert empty.empty_ranks == (3,) and empty.local_shapes[3] == (0, 2)
    assert "empty blocks on ranks 3" in empty.html

    # nested uneven: tensor dim 0 split by both mesh dims
    m = init_device_mesh("cpu", (2, 2))
    nested = ShardView((7, 2), m, [Shard(0), Shard(0)])
    assert [b[0] for b in nested.block_owners] == [(0, 2), (2, 4), (4, 6), (6, 7)]
    assert list(nested.block_owners.values()) == [(0,), (1,), (2,), (3,)]


def test_shard_view_replicate(mesh22):
    full = ShardView((3, 4), init_device_mesh("cpu", 4), [Replicate()])
    assert full.block_owners == {((0, 3), (0, 4)): (0, 1, 2, 3)}
    assert full.block_layers == {((0, 3), (0, 4)): ((0, 1, 2, 3),)}
    assert full.replicate_dims == (0,) and not full.uneven

    half = ShardView((4, 4), mesh22, [Shard(0), Replicate()])
    assert half.block_owners == {((0, 2), (0, 4)): (0, 1), ((2, 4), (0, 4)): (2, 3)}
    assert half.replicate_dims == (1,)
    assert "Replicate on tp" in half.html and "r0,1" in half.html


def test_shard_view_partial(mesh22):
    v = ShardView((4, 4), mesh22, [Shard(0), Partial()])
    assert v.partial_dims == (1,)
    assert v.block_owners == {((0, 2), (0, 4)): (0, 1), ((2, 4), (0, 4)): (2, 3)}
    # each block is a stack of two partial values, one per tp rank
    assert v.block_layers == {((0, 2), (0, 4)): ((0,), (1,)), ((2, 4), (0, 4)): ((2,), (3,))}
    assert "Partial(sum) on tp" in v.html and "r0+r1" in v.html

    both = ShardView((4,), mesh22, [Partial("max"), Replicate()])
    assert both.block_layers == {((0, 4),): ((0, 1), (2, 3))}
    assert both.partial_dims == (0,) and both.replicate_dims == (1,)
    assert "Partial(max)" in both.html

    four = ShardView((2, 2), mesh22, [Partial(), Partial()])
    assert four.block_layers[((0, 2), (0, 2))] == ((0,), (1,), (2,), (3,))


def test_shard_view_scalar_empty_and_high_rank(mesh22):
    scalar = ShardView((), mesh22, [Replicate(), Partial()])
    assert scalar.block_owners == {(): (0, 1, 2, 3)} and scalar.owners_of(()) == (0, 1, 2, 3)
    assert svgs_parse(scalar.html) == 1
    empty = ShardView((0, 3), mesh22, [Shard(0), Replicate()])
    assert empty.block_owners == {} and "empty tensor" in empty.html
    four_d = ShardView((2, 2, 2, 2), mesh22, [Shard(0), Shard(3)])
    assert len(four_d.block_owners) == 4 and "4-D tensors are not drawn" in four_d.html


def test_shard_view_3d_is_a_row_of_slices(mesh22):
    v = ShardView((3, 4, 6), mesh22, [Shard(2), Shard(0)])
    assert svgs_parse(v.html) == 3
    assert all(f"[{i}]" in v.html for i in range(3))
    assert v.owners_of((2, 1, 5)) == (3,)  # dim 0 rows 2: tp coord 1; dim 2 col 5: dp coord 1
    many = ShardView((20, 4, 4), init_device_mesh("cpu", 4), [Shard(0)])
    assert svgs_parse(many.html) == 4 and "[0:5]" in many.html  # one panel per block of slices


@settings(max_examples=60, deadline=None)
@given(shape=st.lists(st.integers(0, 6), min_size=0, max_size=3),
       mesh_shape=st.lists(st.integers(1, 3), min_size=1, max_size=3),
       data=st.data())
def test_block_owners_match_layout_math(shape, mesh_shape, data):
    mesh = init_device_mesh("cpu", tuple(mesh_shape))
    kinds = [Replicate(), Partial()] + [Shard(d) for d in range(len(shape))]
    placements = [data.draw(st.sampled_from(kinds)) for _ in mesh_shape]
    v = ShardView(tuple(shape), mesh, placements)
    blocks = rank_blocks(tuple(shape), mesh, v.placements)
    owners = v.element_owners()
    assert len(owners) == math.prod(shape)
    for index, ranks in owners.items():
        expect = tuple(r for r in mesh.ranks
                       if all(o <= i < o + s for i, o, s in
                              zip(index, blocks[r].offset, blocks[r].shape)))
        assert ranks == expect and ranks
    # blocks tile the tensor exactly
    assert sum(math.prod(b - a for a, b in blk) for blk in v.block_owners) == math.prod(shape)


def test_shard_view_values_highlight_and_toggle(mesh22):
    full = torch.arange(24).reshape(4, 6)
    vals = {r: shard_of(full, mesh22, (Shard(0), Shard(1)), mesh22.get_coordinate(r))
            for r in mesh22.ranks}
    v = ShardView((4, 6), mesh22, [Shard(0), Shard(1)], values=vals)
    assert v.show_values
    texts = set(re.findall(r">(\d+)</text>", v.html))
    assert {str(i) for i in range(24)} <= texts  # every element written in its cell
    assert "local values" in v.html
    v.values_box.value = False
    assert not v.show_values and "local values" not in v.html
    v.select_rank(3)
    assert v.selected_rank == 3 and v.highlighted_blocks == (((2, 4), (3, 6)),)
    assert v.html.count('<g opacity="0.2">') == 3  # the other ranks' blocks fade
    v.rank_picker.value = -1
    assert v.selected_rank is None and len(v.highlighted_blocks) == 4
    with pytest.raises(ValueError):
        v.select_rank(7)


def test_shard_view_partial_values_are_stacked(mesh22):
    vals = {r: torch.full((2, 3), float(r)) for r in mesh22.ranks}
    v = ShardView((4, 3), mesh22, [Shard(0), Partial()], values=vals)
    assert "0+1" in v.html and "2+3" in v.html


def test_shard_view_of_duck_typed_dtensor(mesh22):
    x = FakeDTensor(torch.arange(10.0).reshape(5, 2), mesh22, [Shard(0), Replicate()])
    v = ShardView.of(x)
    assert x.fetched == []  # no values unless asked
    assert v.shape == (5, 2) and v.mesh == mesh22 and v.uneven
    assert v.block_owners == {((0, 3), (0, 2)): (0, 1), ((3, 5), (0, 2)): (2, 3)}
    assert "DTensor float32" in v.html
    shown = ShardView.of(x, show_values=True)
    assert x.fetched == [0, 1, 2, 3] and shown.show_values
    assert torch.equal(shown.values[2], x.full[3:5])
    assert ">9</text>" in shown.html


def test_shard_view_takes_a_real_dtensor(mesh2d):
    full = torch.arange(20.0).reshape(5, 4)
    d = dtorch.distribute_tensor(full, mesh2d, [Shard(0), Shard(1)])
    v = ShardView(d)  # what a user types first
    assert v.values is None and v.title == "DTensor float32"
    assert (v.shape, v.mesh, v.placements) == ((5, 4), mesh2d, (Shard(0), Shard(1)))
    assert v.local_shapes == d.local_shapes() == {0: (3, 2), 1: (3, 2), 2: (2, 2), 3: (2, 2)}
    assert v.block_owners == {((0, 3), (0, 2)): (0,), ((0, 3), (2, 4)): (1,),
                              ((3, 5), (0, 2)): (2,), ((3, 5), (2, 4)): (3,)}  # by hand
    shown = ShardView(d, show_values=True)
    assert shown.show_values and all(torch.equal(shown.values[r], d.to_local(r))
                                     for r in mesh2d.ranks)
    assert ">19</text>" in shown.html  # the last element, drawn in rank 3's block


@pytest.mark.parametrize("args, says", [
    (lambda m, x: (torch.zeros(4, 4),), "got ShardView(torch.Tensor) with no mesh and placements"),
    (lambda m, x: ((4, 4),), "got ShardView(tuple) with no mesh and placements"),
    (lambda m, x: ((4, 4), m), "placements=None"),
    (lambda m, x: (x, m, [Shard(0), Shard(1)]), "FakeDTensor, mesh=DeviceMesh("),
], ids=["tensor", "shape alone", "no placements", "dtensor and a mesh"])
def test_shard_view_says_what_to_pass(mesh22, args, says):
    x = FakeDTensor(torch.zeros(4, 4), mesh22, [Shard(0), Shard(1)])
    with pytest.raises(TypeError) as err:
        ShardView(*args(mesh22, x))
    assert "ShardView(dtensor, show_values=False)" in str(err.value)
    assert "ShardView(shape, mesh, placements, values=None)" in str(err.value)
    assert says in str(err.value)


def test_shard_view_of_takes_only_a_dtensor():
    with pytest.raises(TypeError, match="ShardView.of takes a DTensor; got tuple"):
        ShardView.of((4, 4))


def test_mesh_view_takes_a_mesh_or_a_dtensor(mesh2d):
    d = dtorch.distribute_tensor(torch.zeros(4, 4), mesh2d, [Shard(0), Replicate()])
    from_tensor = MeshView(d, highlight_dim="tp")
    assert from_tensor.mesh == mesh2d and from_tensor.grid == [[0, 1], [2, 3]]
    assert from_tensor.highlighted_groups == ((0, 1), (2, 3))
    assert from_tensor.html == MeshView(mesh2d, highlight_dim="tp").html
    for wrong, name in ((torch.zeros(2), "torch.Tensor"), ((2, 2), "tuple")):
        with pytest.raises(TypeError, match=rf"MeshView takes a dtorch DeviceMesh .*got {name}"):
            MeshView(wrong)
