"""Widgets: state of the mesh, shard and collective views, and the static HTML reprs.

Everything here runs headless: widgets are built and their state read without a frontend.
Views of real DTensors use the session cluster; ``CommView()`` (the previous cell's
collectives) runs in a real dtorch kernel.
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from html import escape
import xml.etree.ElementTree as ET

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import dtorch
import dtorch_kernel
from dtorch import DeviceMesh, MeshError, Partial, Replicate, Shard, init_device_mesh
from dtorch.comm_debug import CommDebugMode, CommRecord, record_steps
from dtorch.layout import rank_blocks, shard_of
from dtorch.redistribute import plan_redistribute
from dtorch_widgets import (CommView, MeshView, ShardView, comm_html, dtensor_html, mesh_html,
                            shard_html)
from dtorch_widgets import display as wdisplay
from dtorch_widgets.comm_view import NO_CELLS
from dtorch_widgets.svg import MAX_HTML_CHARS, cap_html

WIDGET_MIME = "application/vnd.jupyter.widget-view+json"


@pytest.fixture
def mesh22():
    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))


def svgs_parse(html: str) -> int:
    """Every <svg> in ``html`` is well-formed XML; returns how many there are."""
    found = re.findall(r"<svg.*?</svg>", html, re.S)
    for s in found:
        ET.fromstring(s)
    return len(found)


class FakeDTensor:
    """A stand-in with the attributes ShardView.of and dtensor_html read (the real DTensor
    lives elsewhere); ``to_local`` slices a full tensor the way dtorch's layout math says."""

    def __init__(self, full, mesh, placements):
        self.full = full
        self.shape = full.shape
        self.dtype = full.dtype
        self.device_mesh = mesh
        self.placements = tuple(placements)
        self.fetched = []

    def to_local(self, rank):
        self.fetched.append(rank)
        return shard_of(self.full, self.device_mesh, self.placements,
                        self.device_mesh.get_coordinate(rank))


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
    assert v.block_owners == ShardView.of(d).block_owners
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


# ---------------------------------------------------------------------------------------------
# collective view
# ---------------------------------------------------------------------------------------------
def _records(mesh22):
    with CommDebugMode() as mode:
        record_steps(plan_redistribute(mesh22, (4, 4), [Shard(0), Shard(1)],
                                       [Replicate(), Replicate()]))
        record_steps(plan_redistribute(mesh22, (4, 4), [Partial(), Replicate()],
                                       [Replicate(), Replicate()]))
    return mode


def test_comm_view_counts_bytes_and_filter(mesh22):
    mode = _records(mesh22)
    v = CommView(mode, title="cell 3")
    assert v.counts == mode.get_comm_counts() == {"all_gather": 2, "all_reduce": 1}
    dims = {(k, d): (c, b) for k, d, c, b, _ in v.rows}
    assert set(dims) == {("all_gather", "tp"), ("all_gather", "dp"), ("all_reduce", "dp")}
    rec = {(r.kind, r.mesh_dim_name): r for r in mode.records}
    assert dims[("all_reduce", "dp")] == (1, rec[("all_reduce", "dp")].bytes_per_rank)
    assert v.total_bytes == sum(r.total_bytes for r in mode.records)
    order = list(dict.fromkeys(r.mesh_dim_name for r in mode.records))
    assert list(v.dim_buttons.options) == ["all"] + order and set(order) == {"dp", "tp"}
    v.select_dim("dp")
    assert v.counts == {"all_gather": 1, "all_reduce": 1}
    assert all(r.mesh_dim_name == "dp" for r in v.records)
    assert "cell 3" in v.html and "all_reduce" in v.html
    assert v.timeline.value[:8] == b"\x89PNG\r\n\x1a\n"
    v.dim_buttons.value = "all"
    assert v.selected_dim is None and len(v.records) == 3


def test_comm_view_empty_and_plain_list():
    empty = CommView([])
    assert empty.counts == {} and empty.rows == [] and "no collectives" in empty.html
    recs = [CommRecord("all_to_all", 0, None, ((0, 1),), 8)] * 3
    v = CommView(recs)
    assert v.rows == [("all_to_all", "0", 3, 24, 48)]


def test_comm_view_says_what_to_pass(mesh22):
    for wrong in (CommRecord("all_gather", 0, None, ((0, 1),), 8), "all_gather", 3,
                  FakeDTensor(torch.zeros(4), mesh22, [Shard(0), Replicate()])):
        with pytest.raises(TypeError, match="CommView takes a dtorch.CommDebugMode, a "
                                            "CommLedger or a list of CommRecords"):
            CommView(wrong)


def test_comm_view_with_no_argument_outside_the_kernel():
    v = CommView()
    assert v.records == [] and v.counts == {} and v.title == "Collectives of the previous cell"
    assert v.note == NO_CELLS and "dtorch.CommDebugMode() as mode" in v.note
    assert escape(NO_CELLS) in v.html and escape(NO_CELLS) in v.static_html()
    assert dtorch_kernel.last_cell_records() is None


def test_comm_html_table_and_timeline(mesh22):
    mode = _records(mesh22)
    h = comm_html(mode, title="block")
    assert "block" in h and "all_gather" in h and "all_reduce" in h and "dp" in h
    assert svgs_parse(h) == 1
    assert h.count("<title>#") == 3  # one timeline mark per collective, in order
    assert h.index("#0 all_gather") < h.index("#2 all_reduce")


# ---------------------------------------------------------------------------------------------
# HTML reprs and display hooks
# ---------------------------------------------------------------------------------------------
def test_device_mesh_repr_html(mesh22):
    h = mesh22._repr_html_()
    assert h == mesh_html(mesh22)
    assert "<b>DeviceMesh</b> cpu · 2×2 = 4 ranks · dims dp × tp" in h
    assert svgs_parse(h) == 1 and "<script" not in h and "<style" not in h
    for r in mesh22.ranks:
        assert f"<title>rank {r} " in h


def test_device_mesh_mimebundle(mesh22, monkeypatch):
    assert set(mesh22._repr_mimebundle_()) == {"text/html"}
    from IPython.core.formatters import DisplayFormatter
    data, _ = DisplayFormatter().format(mesh22)
    assert data["text/plain"] == repr(mesh22) and data["text/html"] == mesh_html(mesh22)
    monkeypatch.setattr(wdisplay, "in_kernel", lambda: True)
    bundle = mesh22._repr_mimebundle_()
    assert set(bundle) == {"text/html", WIDGET_MIME} and bundle[WIDGET_MIME]["model_id"]
    assert set(mesh22._repr_mimebundle_(exclude={WIDGET_MIME})) == {"text/html"}
    assert set(mesh22._repr_mimebundle_(include={WIDGET_MIME})) == {WIDGET_MIME}


def test_views_carry_their_static_picture(mesh22):
    views = [MeshView(mesh22, highlight_dim="tp"), ShardView((4,), mesh22, [Shard(0), Partial()]),
             CommView([CommRecord("all_gather", 0, "dp", ((0, 2), (1, 3)), 8)])]
    for v in views:
        data = v._repr_mimebundle_()
        assert data[WIDGET_MIME]["model_id"] == v.model_id
        assert data["text/html"] == v.static_html() and "<svg" in data["text/html"]


def test_dtensor_html_and_bundle(mesh22, monkeypatch):
    x = FakeDTensor(torch.zeros(4, 4), mesh22, [Shard(0), Partial()])
    h = dtensor_html(x)
    assert "DTensor float32" in h and "[S(0), P(sum)]" in h and x.fetched == []
    broken = FakeDTensor(torch.zeros(4), mesh22, [Shard(0)])  # 1 placement, 2-D mesh
    assert "could not draw" in dtensor_html(broken)
    monkeypatch.setattr(wdisplay, "in_kernel", lambda: True)
    bundle = wdisplay.dtensor_mimebundle(x)
    assert set(bundle) == {"text/html", WIDGET_MIME} and x.fetched == []


def test_drawings_are_well_formed(mesh22):
    cases = [
        mesh_html(init_device_mesh("cpu", 5)),
        mesh_html(init_device_mesh("cpu", (2, 3, 2)), highlight_dim=2),
        shard_html((7,), init_device_mesh("cpu", 3), [Shard(0)]),
        shard_html((5, 7), mesh22, [Shard(1), Shard(0)], highlight_rank=2),
        shard_html((4, 3, 2), mesh22, [Partial("avg"), Shard(1)]),
        shard_html((9,), mesh22, [Replicate(), Replicate()]),
    ]
    for h in cases:
        assert svgs_parse(h) >= 1 and "<script" not in h and "<style" not in h


# ---------------------------------------------------------------------------------------------
# size caps
# ---------------------------------------------------------------------------------------------
def test_big_mesh_is_capped():
    h = mesh_html(init_device_mesh("cpu", (128, 128)), highlight_dim=1)
    assert len(h) <= MAX_HTML_CHARS and svgs_parse(h) == 1
    drawn = h.count("<title>rank ")
    assert f"({128 * 128 - drawn} more ranks not drawn)" in h
    assert "(96 more groups not drawn)" in h
    five = mesh_html(init_device_mesh("cpu", (4, 4, 4, 4, 4)))
    assert len(five) <= MAX_HTML_CHARS and "more ranks not drawn" in five


def test_big_layouts_are_capped():
    # the dask lesson: 16,000 chunks must not make a 1.4 MB repr
    h = shard_html((16000,), init_device_mesh("cpu", (128, 125)), [Shard(0), Shard(0)])
    assert len(h) <= MAX_HTML_CHARS and "more blocks not drawn" in h
    assert "more ranks not drawn" in h and "more rows not drawn" in h
    h2 = shard_html((4096, 4096), init_device_mesh("cpu", (64, 64)), [Shard(0), Shard(1)])
    assert len(h2) <= MAX_HTML_CHARS and "more blocks not drawn" in h2
    h3 = shard_html((100, 512, 512), init_device_mesh("cpu", (16, 16)), [Shard(2), Shard(1)])
    assert len(h3) <= MAX_HTML_CHARS and svgs_parse(h3) >= 1
    h4 = shard_html((4000,), init_device_mesh("cpu", 16), [Partial()])
    assert len(h4) <= MAX_HTML_CHARS


def test_big_values_and_timelines_are_capped():
    mesh = init_device_mesh("cpu", 4)
    full = torch.randn(8, 40, 40)
    vals = {r: shard_of(full, mesh, (Shard(2),), mesh.get_coordinate(r)) for r in mesh.ranks}
    h = shard_html(full.shape, mesh, [Shard(2)], values=vals)
    assert len(h) <= MAX_HTML_CHARS
    recs = [CommRecord("all_gather", i % 2, "dp" if i % 2 else "tp", ((0, 1),), 64)
            for i in range(5000)]
    c = comm_html(recs)
    assert len(c) <= MAX_HTML_CHARS and "(4800 more collectives not drawn)" in c
    many_kinds = [CommRecord("send_recv", 0, f"d{i}", ((0, 1),), 8) for i in range(100)]
    assert "more rows not drawn" in comm_html(many_kinds)


def test_shard_view_on_a_big_mesh_uses_a_number_box():
    v = ShardView((600,), init_device_mesh("cpu", 300), [Shard(0)])
    assert v.select_rank(299).highlighted_blocks == (((598, 600),),)
    v.rank_picker.value = 1000  # not a rank: nothing highlighted, nothing raised
    assert v.selected_rank is None and len(v.highlighted_blocks) == 300
    assert v.html.count('<g opacity="0.2">') == 0 and len(v.html) <= MAX_HTML_CHARS


def test_cap_html_fallback():
    assert cap_html("x" * MAX_HTML_CHARS, "short") == "x" * MAX_HTML_CHARS
    assert cap_html("x" * (MAX_HTML_CHARS + 1), "short") == "short"


def test_widgets_are_fast_to_build(mesh22):
    import time
    t = time.perf_counter()
    for _ in range(20):
        MeshView(mesh22, highlight_dim="dp")
        ShardView((16, 16), mesh22, [Shard(0), Partial()])
    assert time.perf_counter() - t < 2.0


# ---------------------------------------------------------------------------------------------
# CommView() in a real dtorch kernel: the previous cell's collectives
# ---------------------------------------------------------------------------------------------
MOVE_CELL = """
import torch, dtorch, dtorch_kernel
from dtorch import init_device_mesh, Shard, Replicate, CommDebugMode
from dtorch_widgets import CommView
mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
d = dtorch.distribute_tensor(torch.arange(16.).reshape(4, 4), mesh, [Shard(0), Shard(1)])
with CommDebugMode() as m:
    r = d.redistribute(placements=[Replicate(), Replicate()])
"""
VIEW_CELL = """
assert dtorch_kernel.last_cell_records() == m.get_comm_records()
v = CommView()
v
"""
STATE_CELL = """
import json
quiet = CommView()   # the previous cell ran nothing
print(json.dumps({"counts": v.counts, "expected": m.get_comm_counts(), "title": v.title,
                  "dims": sorted(v.dim_buttons.options), "quiet": quiet.counts,
                  "quiet_note": quiet.note}))
"""


@pytest.fixture(scope="module")
def dtorch_kernel_client(tmp_path_factory):
    """A started dtorch kernel (kernelspec installed into a temp prefix); its client."""
    jupyter_client = pytest.importorskip("jupyter_client")
    prefix = tmp_path_factory.mktemp("jupyter-prefix")
    subprocess.run([sys.executable, "-m", "dtorch_kernel", "install", "--prefix", str(prefix)],
                   check=True, capture_output=True, text=True, timeout=120)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("JUPYTER_PATH", str(prefix / "share" / "jupyter"))
        mp.setenv("DTORCH_WORKERS", "4")
        km = jupyter_client.KernelManager(kernel_name="dtorch")
        km.shutdown_wait_time = 30
        km.start_kernel()
        kc = km.client()
        kc.start_channels()
        try:
            kc.wait_for_ready(timeout=120)
            yield kc
        finally:
            kc.stop_channels()
            km.shutdown_kernel(now=False)


def run_cell(kc, code: str) -> list[tuple[str, dict]]:
    """Execute ``code``; its (msg_type, content) outputs. Fails on a cell error."""
    outputs = []
    reply = kc.execute_interactive(code, timeout=180, output_hook=lambda msg: outputs.append(
        (msg["msg_type"], msg["content"])))
    assert reply["content"]["status"] == "ok", outputs
    return outputs


@pytest.mark.timeout(300)
def test_comm_view_with_no_argument_shows_the_previous_cell(dtorch_kernel_client):
    kc = dtorch_kernel_client
    run_cell(kc, MOVE_CELL)
    shown = [c["data"] for t, c in run_cell(kc, VIEW_CELL) if t == "execute_result"]
    assert len(shown) == 1 and WIDGET_MIME in shown[0]
    assert "Collectives of the previous cell" in shown[0]["text/html"]
    assert "all_gather" in shown[0]["text/html"]
    out = run_cell(kc, STATE_CELL)
    state = json.loads("".join(c["text"] for t, c in out if t == "stream"
                               and c["name"] == "stdout"))
    assert state["counts"] == state["expected"] == {"all_gather": 2}
    assert state["title"] == "Collectives of the previous cell"
    assert state["dims"] == ["all", "dp", "tp"]
    assert state["quiet"] == {} and state["quiet_note"] == "the previous cell ran no collectives"
