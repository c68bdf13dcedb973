"""A PlacementError offering several fixes lists them cheapest first by the planner's bytes
(dtorch/ops/explain.py), each with its collectives, and the first keeps the ``fix: ...   #
<collective>`` line the op_db report reads. Every listed fix, applied, makes the op legal and
gives torch's numbers, for the collectives it names."""

import re

import pytest
import torch

from dtorch import Partial, Replicate, Shard, plan_redistribute
from dtorch.ops import explain
from ledgers import counted
from op_db_report import _generic_reason
from test_op_db import Outcome, fix_collective
from test_ops_support import illegal, make

R = Replicate()


def fix_lines(err) -> list[str]:
    return [line.strip() for line in str(err).splitlines()
            if line.strip().startswith(("fix:", "or:"))]


def listed_bytes(err) -> list[int]:
    line = next(line for line in str(err).splitlines() if "bytes per rank" in line)
    return [int(b.replace(",", "")) for b in re.findall(r"([\d,]+) B \(", line)]


def planned_bytes(x, placements) -> int:
    return sum(s.bytes_per_rank for s in plan_redistribute(x.device_mesh, x.shape, x.placements,
                                                           placements, x.dtype.itemsize)
               if s.is_collective)


@pytest.mark.parametrize("shape", [(10, 3), (3, 5), (2, 4), (7,)], ids=str)
def test_centering_a_batch_sharded_tensor_all_reduces_the_mean(mesh1d, shape):
    """``x - x.mean(0)``: the mean is Partial(sum), so gathering x cannot fix it (R - P(sum) is
    no Partial op); the fix is the all_reduce of the small mean, never an all_gather of x."""
    t = torch.randn(shape)
    x = make(t, mesh1d, (Shard(0),))
    m = x.mean(0)
    assert m.placements == (Partial("sum"),)
    err = illegal(lambda: x - m)
    assert fix_lines(err) == ["fix: other.redistribute(placements=[Replicate()])   # all_reduce"]
    assert "all_gather" not in str(err)
    assert listed_bytes(err) == [planned_bytes(m, [R])]
    out, counts = counted(lambda: x - m.redistribute(placements=[R]))
    assert counts == {"all_reduce": 1} and out.placements == (Shard(0),)
    torch.testing.assert_close(out.to_torch(), t - t.mean(0))


@pytest.mark.parametrize("rows", [10, 5, 3], ids=str)
def test_the_small_all_reduce_comes_before_the_big_all_gather(mesh1d, rows):
    """``x * x.sum(0)``: both fixes are legal (R * P(sum) -> P(sum)); the sum's all_reduce
    (3 floats) is listed before the all_gather of x's shard (3 floats per row it holds)."""
    t = torch.randn(rows, 3)
    x = make(t, mesh1d, (Shard(0),))
    s = x.sum(0)
    err = illegal(lambda: x * s)
    assert fix_lines(err) == ["fix: other.redistribute(placements=[Replicate()])   # all_reduce",
                              "or: input.redistribute(placements=[Replicate()])   # all_gather"]
    assert listed_bytes(err) == [planned_bytes(s, [R]), planned_bytes(x, [R])]
    assert listed_bytes(err) == sorted(listed_bytes(err))
    expected = t * t.sum(0)
    out, counts = counted(lambda: x * s.redistribute(placements=[R]))
    assert counts == {"all_reduce": 1}
    torch.testing.assert_close(out.to_torch(), expected, rtol=1e-5, atol=1e-5)
    out, counts = counted(lambda: (x.redistribute(placements=[R]) * s).full_tensor())
    assert counts == {"all_gather": 1, "all_reduce": 1}  # the product stays P(sum)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("reduce_op,kind", [("avg", "sub"), ("sum", "mul")])
def test_a_big_partial_puts_the_gather_first(mesh1d, reduce_op, kind):
    """A Partial as big as x: gathering x's shard is cheapest, then the all_reduce, then the
    reduce_scatter (the planner counts its whole padded input per rank)."""
    t, u = torch.randn(10, 3), torch.randn(10, 3)
    x, p = make(t, mesh1d, (Shard(0),)), make(u, mesh1d, (Partial(reduce_op),))
    fn = (lambda a, b: a - b) if kind == "sub" else (lambda a, b: a * b)
    err = illegal(lambda: fn(x, p))
    assert fix_lines(err) == [
        "fix: input.redistribute(placements=[Replicate()])   # all_gather",
        "or: other.redistribute(placements=[Replicate()])   # all_reduce",
        "or: other.redistribute(placements=[Shard(0)])   # reduce_scatter"]
    assert listed_bytes(err) == [planned_bytes(x, [R]), planned_bytes(p, [R]),
                                 planned_bytes(p, [Shard(0)])] == [36, 120, 144]
    assert err.fixes == (((0, "input", (R,)),), ((1, "other", (R,)),),  # the same, as data
                         ((1, "other", (Shard(0),)),))
    expected = fn(t, u)
    for fixed, want in ((lambda: fn(x.redistribute(placements=[R]), p), {"all_gather": 1}),
                        (lambda: fn(x, p.redistribute(placements=[R])), {"all_reduce": 1}),
                        (lambda: fn(x, p.redistribute(placements=[Shard(0)])),
                         {"reduce_scatter": 1})):
        out, counts = counted(fixed)
        assert counts == want
        torch.testing.assert_close(out.to_torch(), expected, rtol=1e-5, atol=1e-5)


def test_on_a_2d_mesh(mesh2d):
    """x [Shard(0) on dp, Shard(1) on tp]: the mean over dim 0 is Partial on dp; the fix
    all-reduces it along dp only."""
    t = torch.randn(5, 6)
    x = make(t, mesh2d, (Shard(0), Shard(1)))
    m = x.mean(0)
    assert m.placements == (Partial("sum"), Shard(0))
    err = illegal(lambda: x - m)
    assert "mesh dim 0 ('dp')" in str(err)
    assert fix_lines(err) == [
        "fix: other.redistribute(placements=[Replicate(), Shard(0)])   # all_reduce"]
    out, counts = counted(lambda: x - m.redistribute(placements=[R, Shard(0)]))
    assert counts == {"all_reduce": 1} and out.placements == (Shard(0), Shard(1))
    torch.testing.assert_close(out.to_torch(), t - t.mean(0))


def test_the_op_db_report_reads_the_first_fix(mesh1d):
    """The report groups refusals by the first fix's collective: the bytes line must not
    change what it reads, so refusals with different sizes share a row."""
    reasons = set()
    for rows in (10, 6):
        x = make(torch.randn(rows, 3), mesh1d, (Shard(0),))
        p = make(torch.randn(rows, 3), mesh1d, (Partial("sum"),))
        err = illegal(lambda: x * p)
        assert fix_collective(str(err)) == "all_gather"
        reason = f"PlacementError: {str(err).splitlines()[0]} [fix: {fix_collective(str(err))}]"
        reasons.add(_generic_reason(Outcome("placement-refused", reason, True)))
    assert reasons == {"PlacementError; the fix costs: all_gather"}


def test_ranking_is_by_bytes_then_the_rules_order(m4):
    """Pure: explain.ranked sorts alternatives by the planner's bytes; equal bytes keep the
    order the rule gave (softmax's all_to_all before its all_gather)."""
    from dtorch.ops.registry import TArg
    from dtorch.spec import make_spec
    x = TArg(0, "input", make_spec((8, 4), torch.float32, m4, [Shard(0)]))
    m = TArg(1, "other", make_spec((4,), torch.float32, m4, [Partial()]))
    gather, reduce = {x: (R,)}, {m: (R,)}
    assert explain.ranked([gather, reduce]) == explain.ranked([reduce, gather]) == \
        [((m, (R,)),), ((x, (R,)),)]
    assert explain.fix_cost(((m, (R,)),)) == (16, ["all_reduce"])
    assert explain.fix_cost(((x, (R,)),)) == (32, ["all_gather"])
    tie = [{x: (Shard(1),)}, {x: (R,)}]  # all_to_all and all_gather: 32 bytes each
    assert [alt[0][1] for alt in explain.ranked(tie)] == [(Shard(1),), (R,)]
    assert [alt[0][1] for alt in explain.ranked(tie[::-1])] == [(R,), (Shard(1),)]
    assert explain.ranked({x: [(Shard(1),), (R,)]}) == explain.ranked(tie)  # the older form


@pytest.mark.parametrize("big", ["other", "input"])
def test_operands_sharded_on_different_dims(mesh1d, big):
    """x sharded on dim 0 beside y sharded on dim 1: move either onto the other's dim; the
    cheaper move is listed first, and either fix gives torch's numbers."""
    t, u = torch.randn(8, 1), torch.randn(8, 30)  # x broadcasts along dim 1: its fix gathers
    if big == "input":
        t, u = torch.randn(9, 30), torch.randn(1, 30)
    x, y = make(t, mesh1d, (Shard(0),)), make(u, mesh1d, (Shard(1),))
    err = illegal(lambda: x + y)
    y_fix = [R] if big == "input" else [Shard(0)]
    x_fix = [Shard(1)] if big == "input" else [R]
    lines = {"other": f"other.redistribute(placements={explain.code_placements(y_fix)})",
             "input": f"input.redistribute(placements={explain.code_placements(x_fix)})"}
    cheap = "input" if big == "other" else "other"
    assert [line.split("   #")[0] for line in fix_lines(err)] == \
        [f"fix: {lines[cheap]}", f"or: {lines[big]}"]
    listed = listed_bytes(err)
    assert listed == sorted(listed) and listed[0] < listed[1]
    assert sorted(listed) == sorted([planned_bytes(x, x_fix), planned_bytes(y, y_fix)])
    for fixed in (lambda: x.redistribute(placements=x_fix) + y,
                  lambda: x + y.redistribute(placements=y_fix)):
        torch.testing.assert_close(fixed().to_torch(), t + u)
