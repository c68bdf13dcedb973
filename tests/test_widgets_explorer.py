"""The explorers without a browser: PlacementExplorer's plan, layouts, predicted time and
animation frames, OpExplorer's outputs and fixes, both driven through their traitlets; and
one run of PlacementExplorer on the session cluster.

Mutations each test catches are named in its docstring."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from dtorch import Partial, PlacementValueError, Replicate, Shard, init_device_mesh
from dtorch import plan_redistribute
from dtorch.cost import LinkFit, LinkModel, predict
from dtorch.layout import normalize_placements
from dtorch_widgets import OpExplorer, PlacementExplorer
from dtorch_widgets.explorer_model import Transfer, explore

R = Replicate()
LINKS = LinkModel((LinkFit("all_gather", 4, 1, 1e-4, 1e-9), LinkFit("all_to_all", 4, 1, 2e-4, 2e-9),
                   LinkFit("all_reduce", 4, 1, 3e-4, 1e-9),
                   LinkFit("reduce_scatter", 4, 1, 1e-4, 3e-9),
                   LinkFit("all_gather", 2, 2, 5e-5, 1e-9)))  # synthetic (alpha s, beta s/B)


def explorer(shape, mesh, src=None, dst=None) -> PlacementExplorer:
    """A PlacementExplorer predicting from the synthetic LINKS: no cluster to measure on, even
    where the session's cluster runs."""
    return PlacementExplorer(shape, mesh, src, dst, links=LINKS)


def transfers(frames) -> set:
    """A step's frames as a set of ``(src, dst, offset, shape, reduces)``."""
    return {(f["src"], f["dst"], tuple(f["offset"]), tuple(f["shape"]), f["reduces"])
            for f in frames}


def others(rank, ranks=range(4)):
    return [s for s in ranks if s != rank]


# ---------------------------------------------------------------------------------------------
# the plan
# ---------------------------------------------------------------------------------------------
CASES = [((4, 4), (4,), ["S(0)"], ["R"]), ((4, 4), (4,), ["S(0)"], ["S(1)"]),
         ((4, 4), (4,), ["P(sum)"], ["R"]), ((4, 4), (4,), ["P(sum)"], ["S(0)"]),
         ((5, 3), (4,), ["S(0)"], ["S(1)"]), ((3,), (4,), ["P(max)"], ["S(0)"]),
         ((4, 4), (2, 2), ["S(0)", "S(0)"], ["R", "R"]),
         ((6, 4), (2, 2), ["S(0)", "S(1)"], ["S(1)", "P(sum)"])]


@pytest.mark.parametrize("shape, mesh_shape, src, dst", CASES, ids=str)
def test_setting_src_and_dst_gives_the_planners_steps(shape, mesh_shape, src, dst):
    """Set through the traitlets (as the pickers do) from an all-Replicate start.
    Mutations: observing only ``src`` in ``__init__``; ``step_row`` writing
    ``s.groups[:1]``."""
    mesh = init_device_mesh("cpu", mesh_shape)
    e = PlacementExplorer(shape, mesh, links=LINKS)
    assert e.steps == []
    e.src = src
    e.dst = dst
    planned = plan_redistribute(mesh, shape, [_p(p) for p in src], [_p(p) for p in dst], 4)
    got = [(s["kind"], s["mesh_dim"], s["groups"], s["bytes_per_rank"], s["padded"])
           for s in e.steps]
    assert got == [(s.kind, s.mesh_dim, [list(g) for g in s.groups], s.bytes_per_rank, s.padded)
                   for s in planned]
    assert len(e.frames) == len(e.steps) and e.error == ""


def _p(text):
    from dtorch_widgets.explorer_model import parse_placement
    return parse_placement(text)


def test_placement_objects_work_in_the_constructor_and_setters():
    """Mutation: ``placement_texts`` returning ``repr(v)`` (``Shard(dim=0)``, which the pickers
    do not offer)."""
    e = explorer((4, 4), init_device_mesh("cpu", 4), [Shard(0)], [Partial("max")])
    assert (e.src, e.dst) == (["S(0)"], ["P(max)"])
    e.dst = [Shard(1)]
    assert e.dst == ["S(1)"] and [s["kind"] for s in e.steps] == ["all_to_all"]
    assert set(e.src + e.dst) <= set(e.choices)


def test_the_layouts_say_who_holds_which_block():
    """Mutation: ``layouts`` flagging ``partial`` from the first placement only."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    e = explorer((4, 4), mesh, [Shard(0), Shard(1)], [R, Partial()])
    src = {b["rank"]: (b["offset"], b["shape"], b["partial"]) for b in e.layouts["src"]}
    assert src == {0: ([0, 0], [2, 2], False), 1: ([0, 2], [2, 2], False),
                   2: ([2, 0], [2, 2], False), 3: ([2, 2], [2, 2], False)}
    assert all(b["offset"] == [0, 0] and b["shape"] == [4, 4] and b["partial"]
               for b in e.layouts["dst"])


@pytest.mark.parametrize("dst, message_from", [
    (["S(2)"], [Shard(2)]),
    (["S(0)", "R"], [Shard(0), R]),
])
def test_a_placement_that_does_not_fit_is_an_error_not_an_exception(dst, message_from):
    """The observer shows dtorch's own PlacementValueError text and clears the plan.
    Mutation: ``_replan`` letting the exception propagate (the setter raises)."""
    mesh = init_device_mesh("cpu", 4)
    e = explorer((4, 4), mesh, ["S(0)"], ["R"])
    e.dst = dst
    with pytest.raises(PlacementValueError) as err:
        normalize_placements(message_from, mesh, 2)
    assert e.error == str(err.value)
    assert e.steps == [] and e.frames == [] and e.predicted_s is None
    e.dst = ["R"]
    assert e.error == "" and [s["kind"] for s in e.steps] == ["all_gather"]


def test_unreadable_placement_text_says_what_to_write():
    """Mutation: ``parse_placement`` reading unknown text as Replicate (no error)."""
    e = explorer((4,), init_device_mesh("cpu", 4))
    e.src = ["Q(1)"]
    assert "cannot read 'Q(1)' as a placement; write S(d)" in e.error


def test_predicted_seconds_are_the_cost_models():
    """Per step and in all, from the given links. Mutation: ``_predicted`` pairing each step
    with the total (or the first step's seconds)."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    e = PlacementExplorer((64, 64), mesh, ["S(0)", "S(0)"], ["R", "R"], links=LINKS)
    p = predict(plan_redistribute(mesh, (64, 64), [Shard(0)] * 2, [R, R]), LINKS)
    assert [s["predicted_s"] for s in e.steps] == [c.seconds for c in p.steps]
    assert e.predicted_s == pytest.approx(p.total_s) and e.prediction_note == ""
    assert e.steps[0]["predicted_s"] == pytest.approx(5e-5 + 1e-9 * 1 * 64 * 64 * 4 / 4)


# ---------------------------------------------------------------------------------------------
# the frames: who sends which block to whom
# ---------------------------------------------------------------------------------------------
ROW = (1, 4)
SEED_TRANSITIONS = {  # seed 002's four transitions on a 1-D mesh of 4, tensor (4, 4)
    ("S(0)", "R"): ("all_gather",
                    {(s, r, (s, 0), ROW, False) for r in range(4) for s in others(r)}),
    ("S(0)", "S(1)"): ("all_to_all",
                       {(s, r, (s, r), (1, 1), False) for r in range(4) for s in others(r)}),
    ("P(sum)", "R"): ("all_reduce",
                      {(s, r, (0, 0), (4, 4), True) for r in range(4) for s in others(r)}),
    ("P(sum)", "S(0)"): ("reduce_scatter",
                         {(s, r, (r, 0), ROW, True) for r in range(4) for s in others(r)}),
}


@pytest.mark.parametrize("src, dst", list(SEED_TRANSITIONS), ids=str)
def test_seed_transitions_move_the_right_blocks(src, dst):
    """Mutations: ``_pieces`` using ``box_minus`` for reducing steps too (all_reduce sends
    nothing: the receiver held the whole block), ``step_frames`` passing the receiver's block
    after as the sent one and the sender's before as the wanted one, or ``reduces`` always
    False."""
    kind, expected = SEED_TRANSITIONS[(src, dst)]
    e = explorer((4, 4), init_device_mesh("cpu", 4), [src], [dst])
    assert [s["kind"] for s in e.steps] == [kind]
    assert transfers(e.frames[0]) == expected
    assert len(e.frames[0]) == len(expected)  # no transfer listed twice


def test_uneven_shards_send_their_own_sizes():
    """(5, 3) on 4 ranks: rows 2, 2, 1, 0. Rank 3 holds nothing, so it sends nothing and gets
    all 5 rows. Mutation: ``intersect`` keeping empty overlaps (``hi < lo`` for ``hi <= lo``:
    0-row transfers from rank 3)."""
    e = explorer((5, 3), init_device_mesh("cpu", 4), ["S(0)"], ["R"])
    rows = {0: ((0, 0), (2, 3)), 1: ((2, 0), (2, 3)), 2: ((4, 0), (1, 3))}
    assert transfers(e.frames[0]) == {(s, r, *rows[s], False) for r in range(4)
                                      for s in rows if s != r}
    e.dst = ["S(1)"]  # all_to_all: each sender's rows, each receiver's column (3 cols: 1,1,1,0)
    assert [s["kind"] for s in e.steps] == ["all_to_all"]
    assert transfers(e.frames[0]) == {(s, r, (rows[s][0][0], r), (rows[s][1][0], 1), False)
                                      for r in range(3) for s in rows if s != r}


def test_empty_shards_take_no_part_in_the_transfers():
    """(3,) on 4 ranks: rank 3's block is empty. Mutation: ``intersect`` keeping empty
    overlaps (``hi < lo`` for ``hi <= lo``)."""
    mesh = init_device_mesh("cpu", 4)
    e = explorer((3,), mesh, ["S(0)"], ["R"])
    assert transfers(e.frames[0]) == {(s, r, (s,), (1,), False) for r in range(4)
                                      for s in range(3) if s != r}
    e.src, e.dst = ["P(sum)"], ["S(0)"]  # reduce_scatter: rank 3 receives nothing but sends
    assert transfers(e.frames[0]) == {(s, r, (r,), (1,), True) for r in range(3)
                                      for s in others(r)}


def test_a_nested_shard_on_a_2d_mesh_gathers_inner_first():
    """[S(0), S(0)] -> [R, R] on dp x tp: tp's all_gather inside each dp half (one row each
    way), then dp's (two rows each way). Mutation: ``step_frames`` reading the groups of mesh
    dim 0 for every step (``mesh.groups(0)`` in place of ``step.groups``)."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    e = explorer((4, 4), mesh, ["S(0)", "S(0)"], ["R", "R"])
    assert [(s["kind"], s["mesh_dim_name"]) for s in e.steps] == [("all_gather", "tp"),
                                                                  ("all_gather", "dp")]
    assert transfers(e.frames[0]) == {(1, 0, (1, 0), ROW, False), (0, 1, (0, 0), ROW, False),
                                      (3, 2, (3, 0), ROW, False), (2, 3, (2, 0), ROW, False)}
    half = (2, 4)
    assert transfers(e.frames[1]) == {(2, 0, (2, 0), half, False), (0, 2, (0, 0), half, False),
                                      (3, 1, (2, 0), half, False), (1, 3, (0, 0), half, False)}
    assert e.steps[0]["layout_after"] == e.steps[1]["layout_before"]


def test_local_steps_move_nothing():
    """R -> S(0) is a slice, S(0) -> P(max) an all_gather then a local to_partial: the rule
    sends nothing a receiver already held. Mutation: ``_pieces`` sending the whole overlap
    for every step (``boxes = [region]``: a slice's ranks would "receive" their own rows)."""
    e = explorer((4, 4), init_device_mesh("cpu", 4), ["R"], ["S(0)"])
    assert [s["kind"] for s in e.steps] == ["slice"] and e.frames == [[]]
    e.src, e.dst = ["S(0)"], ["P(max)"]
    assert [s["kind"] for s in e.steps] == ["all_gather", "to_partial"]
    assert len(e.frames[0]) == 12 and e.frames[1] == []


@pytest.mark.parametrize("shape, mesh_shape, src, dst", CASES, ids=str)
def test_gathering_steps_fill_exactly_what_each_receiver_lacked(shape, mesh_shape, src, dst):
    """For every gathering step, what a rank held before (and keeps) plus what it receives is
    its block after, element for element, with nothing received twice. Mutation: ``intersect``
    taking the larger end (``max(ao + an, bo + bn)``: regions beyond the receiver's block)."""
    mesh = init_device_mesh("cpu", mesh_shape)
    for view in explore(shape, mesh, src, dst).steps:
        if view.step.kind not in ("all_gather", "all_to_all"):
            continue
        for before, after in zip(view.before, view.after):
            got = Counter(_cells(before.offset, before.shape) & _cells(after.offset, after.shape))
            for t in view.frames:
                if t.dst == after.rank:
                    got.update(_cells(t.offset, t.shape))
            assert got == Counter(_cells(after.offset, after.shape)), (view.step, after.rank)


def _cells(offset, shape) -> set:
    import itertools
    return set(itertools.product(*(range(o, o + n) for o, n in zip(offset, shape))))


def test_a_move_to_another_mesh_sends_each_block_to_its_pair():
    """Mutation: ``step_frames`` reading a send_recv pair as ``(dst, src)``."""
    from dtorch import DeviceMesh
    from dtorch_widgets.explorer_model import step_frames
    a, b = DeviceMesh("cpu", [0, 1]), DeviceMesh("cpu", [2, 3])
    step, = plan_redistribute(a, (4,), [Shard(0)], [Shard(0)], 4, dst_mesh=b)
    assert step_frames((4,), a, step) == (Transfer(0, 2, (0,), (2,), False),
                                          Transfer(1, 3, (2,), (2,), False))


# ---------------------------------------------------------------------------------------------
# OpExplorer
# ---------------------------------------------------------------------------------------------
def test_op_explorer_shows_the_rules_output_placements():
    """Mutation: ``_explain`` writing the inputs' placements as the outputs."""
    m = init_device_mesh("cpu", 4)
    v = OpExplorer(torch.matmul, ((4, 8), m, [Shard(1)]), ((8, 4), m, [Shard(0)]))
    assert v.op == "torch.matmul" and v.error == "" and v.fixes == []
    assert v.outputs == [{"shape": [4, 4], "placements": ["P(sum)"]}]
    v.placements = [["R"], ["S(1)"]]  # a picker change: R @ S(col) -> S(col)
    assert v.outputs == [{"shape": [4, 4], "placements": ["S(1)"]}]


def test_op_explorer_lists_the_errors_fixes_cheapest_first():
    """x - p with x Shard(0), p Partial('avg') of the same shape (10, 3): three fixes, as
    test_fix_ranking lists them, each with its plan, bytes, predicted time and the output once
    applied. Mutations: ``fixes_of`` joining the alternatives into one fix (one fix of three
    changes), ``_fix`` leaving the fixed input's placements unchanged (outputs None)."""
    m = init_device_mesh("cpu", 4)
    v = OpExplorer(torch.sub, ((10, 3), m, [Shard(0)]), ((10, 3), m, [Partial("avg")]),
                   links=LINKS)
    assert v.outputs == [] and "no placement rule fits" in v.error
    got = [([(c["label"], c["placements"]) for c in f["changes"]], f["kinds"],
            f["bytes_per_rank"], f["outputs"]) for f in v.fixes]
    assert got == [([("input", ["R"])], ["all_gather"], 36, [["P(avg)"]]),
                   ([("other", ["R"])], ["all_reduce"], 120, [["S(0)"]]),
                   ([("other", ["S(0)"])], ["reduce_scatter"], 144, [["S(0)"]])]
    steps = plan_redistribute(m, (10, 3), [Partial("avg")], [R])
    assert v.fixes[1]["changes"][0]["steps"][0]["groups"] == [[0, 1, 2, 3]]
    assert v.fixes[1]["predicted_s"] == pytest.approx(predict(steps, LINKS).total_s)


def test_op_explorer_switching_a_picker_updates_it_live():
    """Refused, then fixed from the picker, then refused again. Mutation: not observing
    ``placements``."""
    m = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    v = OpExplorer(torch.relu, ((4, 4), m, [R, Partial()]), links=LINKS)
    assert v.outputs == [] and [f["kinds"] for f in v.fixes] == [["all_reduce"]]
    assert v.fixes[0]["changes"][0]["steps"][0]["mesh_dim_name"] == "tp"
    v.placements = [["S(0)", "R"]]
    assert v.outputs == [{"shape": [4, 4], "placements": ["S(0)", "R"]}] and v.error == ""
    v.placements = [["S(7)", "R"]]
    assert "Shard(7) is out of range" in v.error and v.outputs == []


def test_op_explorer_says_how_to_give_the_inputs():
    """Mutation: ``as_spec`` raising without ``USAGE``."""
    with pytest.raises(TypeError, match=r"\(shape, mesh, placements\[, dtype\]\)"):
        OpExplorer(torch.relu, torch.ones(3))


# ---------------------------------------------------------------------------------------------
# on the cluster
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("shape, src, dst", [((8, 6), ["S(0)"], ["S(1)"]),
                                             ((5, 3), ["P(sum)"], ["S(0)"]),
                                             ((4, 4), ["S(0)", "S(0)"], ["R", "R"])], ids=str)
def test_run_measures_the_plans_collectives_and_torchs_value(live, shape, src, dst):
    """Mutations: ``run`` redistributing to ``src`` (no collective counted), or building the
    tensor with ``dst`` placements (counts differ), or comparing with ``full + 1``."""
    mesh = init_device_mesh("cpu", (4,) if len(src) == 1 else (2, 2))
    e = PlacementExplorer(shape, mesh, src, dst, links=LINKS)
    e._on_message(e, {"type": "run"}, [])  # what the "run it" button sends
    m = e.measured
    assert "error" not in m, m
    planned = Counter(s.kind for s in e_plan(e) if s.is_collective)
    assert m["counts"] == dict(planned)
    assert m["matches_torch"] is True
    assert m["seconds"] > 0 and m["predicted_s"] == e.predicted_s and not e.running
    e.dst = src  # a new plan forgets the old measurement
    assert e.measured == {}


def test_without_links_the_running_clusters_fits_predict(live):
    """Mutation: ``predictor`` ignoring ``dtorch.predict`` (no prediction without links)."""
    import dtorch
    mesh = init_device_mesh("cpu", 4)
    e = PlacementExplorer((64, 64), mesh, ["S(0)"], ["R"])
    expected = dtorch.predict(plan_redistribute(mesh, (64, 64), [Shard(0)], [R]))
    assert e.prediction_note == "" and e.predicted_s == pytest.approx(expected.total_s)
    assert e.steps[0]["predicted_s"] == pytest.approx(expected.steps[0].seconds)


def e_plan(e):
    return plan_redistribute(e.mesh, tuple(e.shape), [_p(p) for p in e.src],
                             [_p(p) for p in e.dst], 4)
