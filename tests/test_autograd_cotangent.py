"""The gradient placement rules (pure, no cluster): dtorch.autograd.cotangent."""

import pytest

from dtorch import Partial, Replicate, Shard
from dtorch.autograd import cotangent as ct

R = Replicate()


@pytest.mark.parametrize("inp,outs,want", [
    ((Shard(0),), [(Shard(0),)], (Shard(0),)),            # elementwise on a shard
    ((Shard(1),), [(Partial(),)], (Shard(1),)),           # S(1) @ S(0) -> P: lhs grad S(1)
    ((R,), [(R,)], (R,)),                                 # all-Replicate
    ((R,), [(Shard(0),)], (Partial("sum"),)),             # DP weight: grad Partial
    ((R,), [(Partial("avg"),)], (Partial("sum"),)),       # the 1/n sits on the incoming grad
    ((R,), [(R,), (Shard(0),)], (Partial("sum"),)),       # any non-Replicate output
    ((Partial(),), [(Partial(),)], (R,)),                 # Partial input -> Replicate
    ((Partial("avg"),), [(Partial("avg"),)], (R,)),
    ((R, Shard(0)), [(Shard(0), Shard(0))], (Partial(), Shard(0))),  # per mesh dim
    ((Shard(1), R), [(Shard(1), R)], (Shard(1), R)),
])
def test_grad_placements(inp, outs, want):
    assert ct.grad_placements(inp, outs) == want


def test_incoming_placements_and_scales():
    assert ct.incoming_placements((Partial(), Shard(1), R)) == (R, Shard(1), R)
    assert ct.incoming_scale((4,), (Partial("avg"),)) == 0.25
    assert ct.incoming_scale((4,), (Partial("sum"),)) is None
    assert ct.incoming_scale((2, 2), (Partial("avg"), Shard(0))) == 0.5
    assert ct.outgoing_scale((2, 3), (Partial("avg"), Partial("avg"))) == 6.0
    assert ct.outgoing_scale((4,), (Shard(0),)) is None


def test_redistribute_grad_placements_and_blockers():
    assert ct.redistribute_grad_placements((Partial(), Shard(0), R)) == (R, Shard(0), R)
    assert ct.not_differentiable((R, Partial("max"))) == Partial("max")
    assert ct.not_differentiable((Partial("min"),)) == Partial("min")
    assert ct.not_differentiable((Partial("avg"), Shard(0))) is None
