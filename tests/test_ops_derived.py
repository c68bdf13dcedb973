"""Rules derived from torch's op metadata (dtorch/ops/derived.py) and ops whose result size
depends on the values (dtorch/ops/value_shapes.py), against plain torch."""

import pytest
import torch

import dtorch
from dtorch import Partial, Replicate, Shard
from dtorch.ops import dispatch, lookup
from dtorch.ops.derived import pointwise_call
from test_ops_support import Batch, dt, illegal, no_comm

R = Replicate()
META = torch.empty(3, 4, device="meta")

# name -> (function, extra arguments after the sharded input); none has a hand-written rule
UNARY = {
    "special.erfcx": (torch.special.erfcx, ()), "special.i1e": (torch.special.i1e, ()),
    "special.ndtr": (torch.special.ndtr, ()), "special.log_ndtr": (torch.special.log_ndtr, ()),
    "special.entr": (torch.special.entr, ()), "special.bessel_j0": (torch.special.bessel_j0, ()),
    "angle": (torch.angle, ()), "frexp": (torch.frexp, ()),
    "float_power": (torch.float_power, (2,)), "mvlgamma": (lambda x: torch.mvlgamma(
        x.abs() + 2, 2), ()),
    "polygamma": (lambda x: torch.polygamma(1, x.abs() + 0.5), ()),
}
BINARY = {  # (function, the second operand's shape relative to the first's (None: the same))
    "special.xlog1py": torch.special.xlog1py, "special.zeta": lambda a, b: torch.special.zeta(
        a.abs() + 1.5, b.abs() + 0.5), "ldexp": lambda a, b: torch.ldexp(a, b.round()),
    "complex": torch.complex, "igamma": lambda a, b: torch.igamma(a.abs() + 0.1, b.abs()),
    "special.chebyshev_polynomial_t": lambda a, b: torch.special.chebyshev_polynomial_t(
        a, b.abs().round()),
}
SHAPES = [(8, 6), (5, 3), (3, 6)]  # even, uneven, and a rank with an empty block


def test_pointwise_is_read_from_the_aten_tags():
    assert pointwise_call(torch.special.erfcx, (META,), {})
    assert pointwise_call(torch.nn.functional.softsign, (META,), {})  # a Python composite
    assert not pointwise_call(torch.cumsum, (META, 0), {})
    assert not pointwise_call(torch.special.softmax, (META, 0), {})
    assert not pointwise_call(torch.bernoulli, (META.abs(),), {})  # random: never derived
    assert not pointwise_call(lambda x: x * x.sum(), (META,), {})  # a reduction inside
    assert not pointwise_call(lambda x: x.t().contiguous(), (META,), {})  # a view inside


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("name", sorted(UNARY))
def test_unary_on_sharded_inputs_gives_torchs_result_without_communication(mesh1d, mesh2d,
                                                                           name, shape):
    fn, extra = UNARY[name]
    x = torch.randn(shape)
    batch = Batch()
    for mesh, placements in ((mesh1d, [Shard(0)]), (mesh1d, [Shard(1)]),
                             (mesh2d, [Shard(0), Shard(1)]), (mesh2d, [R, Shard(0)])):
        out = no_comm(lambda: fn(dt(x, mesh, placements), *extra))
        expected = fn(x, *extra)
        outs = out if isinstance(out, tuple) else (out,)
        for o in outs:
            assert o.placements == tuple(placements), (name, o.placements)
        batch.add(out, expected)
    batch.check()


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("name", sorted(BINARY))
def test_binary_narrows_a_replicate_operand_and_broadcasts(mesh1d, mesh2d, name, shape):
    fn = BINARY[name]
    a, b, row = torch.randn(shape), torch.randn(shape), torch.randn(shape[1])
    batch = Batch()
    cases = [(mesh1d, [Shard(0)], b, [R], [Shard(0)]),      # R operand narrowed to the rows
             (mesh1d, [Shard(1)], row, [R], [Shard(1)]),    # a broadcast row, narrowed
             (mesh1d, [Shard(0)], b, [Shard(0)], [Shard(0)]),
             (mesh2d, [Shard(0), Shard(1)], b, [R, R], [Shard(0), Shard(1)])]
    for mesh, pa, other, pb, want in cases:
        out = no_comm(lambda: fn(dt(a, mesh, pa), dt(other, mesh, pb)))
        batch.add(out, fn(a, other), want)
    batch.check()


def test_derived_in_place_keeps_the_handle(mesh1d):
    x, e = torch.randn(6, 4), torch.randint(-2, 3, (6, 4)).float()
    dx = dt(x, mesh1d, [Shard(0)])
    out = dx.ldexp_(dt(e, mesh1d, [R]))
    assert out is dx and dx.placements == (Shard(0),)
    batch = Batch()
    batch.add(dx, torch.ldexp(x, e))
    batch.check()


def test_a_partial_operand_refuses_with_the_fix(mesh1d):
    x = dt(torch.randn(6, 4), mesh1d, [R]).redistribute(placements=[Partial()])
    err = illegal(lambda: torch.special.erfcx(x), "does not commute")
    assert "special.erfcx" in str(err) and "redistribute(placements=[Replicate()])" in str(err)


def test_a_sharded_operand_on_a_broadcast_dim_refuses(mesh1d):
    a = dt(torch.randn(6, 4), mesh1d, [R])
    b = dt(torch.randn(1, 4), mesh1d, [Shard(0)])
    illegal(lambda: torch.special.xlog1py(a, b), "broadcasts")


def test_a_function_with_a_reduction_inside_is_not_derived(mesh1d):
    x = dt(torch.randn(6, 4), mesh1d, [Shard(0)])
    with pytest.raises(dtorch.ops.UnsupportedOpError, match="no dtorch placement rule"):
        torch.special.logsumexp(x, 0)


def test_a_derived_plan_is_cached_like_a_hand_written_one(mesh1d):
    x = dt(torch.randn(6, 4), mesh1d, [Shard(0)])
    first = dispatch.plan_of(torch.special.erfcx, (x,))
    assert dispatch.plan_of(torch.special.erfcx, (x,)) is first
    assert lookup(torch.special.erfcx) is None  # derived per call, not a registered rule


@pytest.mark.parametrize("shape", SHAPES)
def test_view_copies_share_their_view_rule_and_do_not_alias(mesh1d, shape):
    x = torch.randn(shape)
    batch = Batch()
    cases = [(torch.transpose_copy, (0, 1), [Shard(1)]), (torch.t_copy, (), [Shard(1)]),
             (torch.permute_copy, ((1, 0),), [Shard(1)]),
             (torch.unsqueeze_copy, (0,), [Shard(1)]),
             (torch.expand_copy, ((2, *shape),), [Shard(1)])]
    for fn, extra, want in cases:
        dx = dt(x, mesh1d, [Shard(0)])
        out = no_comm(lambda: fn(dx, *extra))
        batch.add(out, fn(x, *extra), want)
    dx = dt(x, mesh1d, [Shard(0)])
    copied = torch.transpose_copy(dx, 0, 1)
    copied.add_(1.0)  # a copy: the input must not change
    batch.add(dx, x)
    batch.add(copied, x.t() + 1.0)
    batch.check()
    dx = dt(x, mesh1d, [Shard(0)])
    illegal(lambda: torch.select_copy(dx, 0, 1), "sharded")


def test_gradients_flow_through_derived_rules(mesh1d):
    x, y = torch.randn(5, 3, dtype=torch.float64), torch.randn(5, 3, dtype=torch.float64)
    dx = dt(x, mesh1d, [Shard(0)]).requires_grad_()
    dy = dt(y, mesh1d, [R]).requires_grad_()
    (torch.special.erfcx(dx) * torch.special.xlog1py(dx, dy.abs())).sum().backward()
    tx, ty = x.clone().requires_grad_(), y.clone().requires_grad_()
    (torch.special.erfcx(tx) * torch.special.xlog1py(tx, ty.abs())).sum().backward()
    torch.testing.assert_close(dx.grad.to_torch(), tx.grad)
    torch.testing.assert_close(dy.grad.to_torch(), ty.grad)


# Build 0: results whose size depends on the values ---------------------------------------------
MASKED = {"x[x > 0]": lambda x, m: x[m], "where(x > 0)": lambda x, m: torch.where(m),
          "nonzero": lambda x, m: torch.nonzero(m),
          "masked_select": lambda x, m: torch.masked_select(x, m),
          "argwhere": lambda x, m: torch.argwhere(m)}


@pytest.mark.parametrize("name", sorted(MASKED))
def test_value_dependent_results_run_on_replicate_inputs(mesh2d, name):
    x = torch.randn(5, 4)
    dx = dt(x, mesh2d, [R, R])
    got = MASKED[name](dx, dx > 0)
    expected = MASKED[name](x, x > 0)
    gots = got if isinstance(got, tuple) else (got,)
    exps = expected if isinstance(expected, tuple) else (expected,)
    for g, e in zip(gots, exps):
        assert g.placements == (R, R)
        assert torch.equal(g.to_torch(), e)


@pytest.mark.parametrize("name", sorted(MASKED))
def test_value_dependent_results_on_sharded_inputs_refuse_with_the_fix(mesh1d, name):
    x = dt(torch.randn(6, 4), mesh1d, [Shard(0)])
    mask = x > 0
    err = illegal(lambda: MASKED[name](x, mask), "depends on the values")
    assert "torch.where(mask, x, other)" in str(err)
    kept = torch.where(mask, x, 0.0)  # the fix: keeps the layout, runs locally
    assert kept.placements == (Shard(0),)


def test_mask_indexing_differentiates_on_replicate_inputs(mesh1d):
    x = torch.randn(6, 4)
    dx = dt(x, mesh1d, [R]).requires_grad_()
    dx[dx > 0].sum().backward()
    assert torch.equal(dx.grad.to_torch(), (x > 0).float())
