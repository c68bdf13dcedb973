"""Widgets: the collective view, headless, and ``CommView()`` (the previous cell's
collectives) in a real dtorch kernel."""

from __future__ import annotations

import json
import subprocess
import sys
from html import escape

import pytest
import torch

import dtorch_kernel
from dtorch import Partial, Replicate, Shard, init_device_mesh
from dtorch.comm_debug import CommDebugMode, CommRecord, record_steps
from dtorch.redistribute import plan_redistribute
from dtorch_widgets import CommView, comm_html
from dtorch_widgets.comm_view import NO_CELLS
from widget_support import WIDGET_MIME, FakeDTensor, svgs_parse

@pytest.fixture
def mesh22():
    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))


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
