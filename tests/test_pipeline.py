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
