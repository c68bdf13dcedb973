"""Placements: Shard / Replicate / Partial values, strings, errors. Pure."""

import copy
import dataclasses
import pickle

import pytest

import dtorch
from dtorch import Partial, Placement, PlacementValueError, Replicate, Shard
from dtorch.placement import REDUCE_OPS, format_placements


def test_str():
    assert [str(p) for p in (Shard(0), Shard(2), Replicate(), Partial())] == \
        ["S(0)", "S(2)", "R", "P(sum)"]
    assert [str(Partial(op)) for op in REDUCE_OPS] == ["P(sum)", "P(avg)", "P(max)", "P(min)"]


def test_repr():
    assert repr(Shard(1)) == "Shard(dim=1)"
    assert repr(Replicate()) == "Replicate()"
    assert repr(Partial()) == "Partial(reduce_op='sum')"
    assert repr(Partial("max")) == "Partial(reduce_op='max')"
    # the repr is valid Python that rebuilds the value
    for p in (Shard(1), Replicate(), Partial("avg")):
        assert eval(repr(p)) == p


def test_format_placements():
    assert format_placements([Shard(0), Replicate(), Partial("min")]) == "[S(0), R, P(min)]"
    assert format_placements(()) == "[]"


def test_equality_and_hash():
    assert Shard(0) == Shard(0) and hash(Shard(0)) == hash(Shard(0))
    assert Shard(0) != Shard(1)
    assert Replicate() == Replicate() and hash(Replicate()) == hash(Replicate())
    assert Partial() == Partial("sum") and hash(Partial()) == hash(Partial("sum"))
    assert Partial("sum") != Partial("avg")
    assert Shard(0) != Replicate() and Replicate() != Partial() and Shard(0) != Partial()
    assert len({Shard(0), Shard(0), Replicate(), Replicate(), Partial(), Partial("sum"),
                Partial("max")}) == 4


def test_kind_predicates():
    assert Shard(1).is_shard() and Shard(1).is_shard(1) and not Shard(1).is_shard(0)
    assert not Shard(1).is_replicate() and not Shard(1).is_partial()
    assert Replicate().is_replicate() and not Replicate().is_shard()
    assert not Replicate().is_partial()
    assert Partial("max").is_partial() and Partial("max").is_partial("max")
    assert not Partial("max").is_partial("sum")
    assert not Partial().is_shard() and not Partial().is_replicate()
    assert all(isinstance(p, Placement) for p in (Shard(0), Replicate(), Partial()))


@pytest.mark.parametrize("p", [Shard(0), Shard(3), Replicate(), Partial(), Partial("avg"),
                               Partial("max"), Partial("min")])
def test_pickle_and_copy(p):
    for q in (pickle.loads(pickle.dumps(p)), copy.copy(p), copy.deepcopy(p)):
        assert q == p and hash(q) == hash(p) and type(q) is type(p) and str(q) == str(p)


def test_immutable():
    s = Shard(0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.dim = 1
    with pytest.raises((AttributeError, TypeError)):
        s.other = 1
    p = Partial()
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.reduce_op = "max"
    assert s == Shard(0) and p == Partial("sum")


def test_placement_value_error_is_value_error():
    assert issubclass(PlacementValueError, ValueError)
    assert issubclass(PlacementValueError, dtorch.DTorchError)


@pytest.mark.parametrize("op", ["SUM", "product", "mean", "", None, 1])
def test_partial_unknown_reduce_op(op):
    with pytest.raises(PlacementValueError, match="sum, avg, max, min"):
        Partial(op)


@pytest.mark.parametrize("dim", ["0", 0.0, None, True, [0]])
def test_shard_needs_int_dim(dim):
    with pytest.raises(PlacementValueError, match="int tensor dim"):
        Shard(dim)


def test_shard_string_message_says_what_to_pass():
    with pytest.raises(PlacementValueError) as e:
        Shard("0")
    assert "Shard(0)" in str(e.value)


def test_shard_negative_dim_is_kept_until_normalized():
    # a negative dim is legal here; normalize_placements makes it non-negative
    assert Shard(-1).dim == -1 and str(Shard(-1)) == "S(-1)"
