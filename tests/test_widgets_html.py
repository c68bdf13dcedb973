"""Widgets: the static HTML reprs and display hooks, and the size caps that keep big meshes,
layouts and timelines small."""

from __future__ import annotations

import pytest
import torch

from dtorch import Partial, Replicate, Shard, init_device_mesh
from dtorch.comm_debug import CommRecord
from dtorch.layout import shard_of
from dtorch_widgets import (CommView, MeshView, ShardView, comm_html, dtensor_html, mesh_html,
                            shard_html)
from dtorch_widgets import display as wdisplay
from dtorch_widgets.svg import MAX_HTML_CHARS, cap_html
from widget_support import WIDGET_MIME, FakeDTensor, svgs_parse

@pytest.fixture
def mesh22():
    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))


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


def test_widgets_build_again_and_again(mesh22):
    views = [(MeshView(mesh22, highlight_dim="dp"), ShardView((16, 16), mesh22,
                                                               [Shard(0), Partial()]))
             for _ in range(20)]
    assert len({v.html for _, v in views}) == 1  # the same picture every time
