"""assign_layers_to_stages. Pure."""

import pytest

import dtorch
from dtorch.pipeline import assign_layers_to_stages


def test_exported():
    assert dtorch.assign_layers_to_stages is assign_layers_to_stages


@pytest.mark.parametrize("layers, stages, expected", [
    (4, 2, [0, 0, 1, 1]),
    (5, 2, [0, 0, 0, 1, 1]),
    (1, 1, [0]),
    (3, 3, [0, 1, 2]),
    (7, 3, [0, 0, 0, 1, 1, 2, 2]),
    (8, 3, [0, 0, 0, 1, 1, 1, 2, 2]),
    (6, 1, [0] * 6),
])
def test_examples(layers, stages, expected):
    assert assign_layers_to_stages(layers, stages) == expected


@pytest.mark.parametrize("layers", range(1, 20))
@pytest.mark.parametrize("stages", range(1, 8))
def test_balanced_sorted_earlier_stages_take_extra(layers, stages):
    if stages > layers:
        with pytest.raises(ValueError, match="at most"):
            assign_layers_to_stages(layers, stages)
        return
    out = assign_layers_to_stages(layers, stages)
    assert len(out) == layers
    assert out == sorted(out)
    counts = [out.count(s) for s in range(stages)]
    assert all(c >= 1 for c in counts)
    assert max(counts) - min(counts) <= 1
    assert counts == sorted(counts, reverse=True)


@pytest.mark.parametrize("layers, stages", [(0, 1), (4, 0), (-1, 2), (4, -2), (3, 4),
                                            (2.0, 1), (4, "2"), (True, 1), (4, None)])
def test_bad_counts_raise_value_error(layers, stages):
    with pytest.raises(ValueError):
        assign_layers_to_stages(layers, stages)


@pytest.mark.parametrize("micro", range(1, 7))
@pytest.mark.parametrize("stages", range(1, 5))
@pytest.mark.parametrize("schedule", ["1F1B", "GPipe"])
def test_issue_order_keeps_each_stage_order_and_every_dependency(micro, stages, schedule):
    from dtorch.pipeline import issue_order, stage_order
    events = issue_order(micro, stages, schedule)
    for s in range(stages):
        order = stage_order(micro, stages, s, schedule)
        assert [(kind, k) for kind, k, t in events if t == s] == order
        assert sorted(order) == sorted([("F", k) for k in range(micro)] +
                                       [("B", k) for k in range(micro)])
        in_flight = max(sum(1 if kind == "F" else -1 for kind, _ in order[:i + 1])
                        for i in range(len(order)))
        # activations kept: 1F1B at most one per later stage (and this one), GPipe all
        assert in_flight == (min(stages - s, micro) if schedule == "1F1B" else micro)
    seen = set()
    for kind, k, s in events:
        needs = [("F", k, s - 1)] if kind == "F" and s else []
        if kind == "B":
            needs = [("F", k, s)] + ([("B", k, s + 1)] if s < stages - 1 else [])
        assert all(n in seen for n in needs), (kind, k, s)
        seen.add((kind, k, s))


def test_one_f_one_b_overlaps_the_stages():
    """Stage 1 runs micro-batch 0's backward before micro-batch 1's forward (it does not
    wait for the whole batch): the last stage alternates from the start."""
    from dtorch.pipeline import stage_order
    assert stage_order(3, 2, 1) == [("F", 0), ("B", 0), ("F", 1), ("B", 1), ("F", 2), ("B", 2)]
    assert stage_order(4, 3, 0) == [("F", 0), ("F", 1), ("F", 2), ("B", 0), ("F", 3), ("B", 1),
                                    ("B", 2), ("B", 3)]  # two forwards fill stages 1 and 2
