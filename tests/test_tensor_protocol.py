"""The Python and NumPy protocol of DTensor (dtorch/tensor_protocol.py) against torch.Tensor's:
``np.asarray``, iteration and unpacking, ``len``, ``bool``/``float``/``int``/``complex``,
``__index__``, ``format`` and ``in``; the refusals raise before anything is sent."""

import re

import numpy as np
import pytest
import torch

import dtorch
from dtorch import Partial, PlacementError, Replicate, Shard
from dtorch.runtime import session
from ledgers import counted
from test_ops_support import illegal, make

R = Replicate()

ARRAY_CASES = [  # (shape, placements on the 1-D mesh); 10 rows: 3, 3, 3, 1; 3 rows: one empty
    ((10, 3), (Shard(0),)), ((3, 5), (Shard(0),)), ((2, 7), (Shard(1),)), ((3, 5), (R,)),
    ((10, 3), (Partial("sum"),)), ((5,), (Partial("avg"),)), ((), (R,)), ((0, 3), (Shard(0),)),
]
ARRAY_2D = [((5, 3), (Shard(0), Shard(1))), ((3, 2), (R, Shard(0))),
            ((6, 3), (Partial("sum"), Shard(1))), ((2, 3), (Shard(1), Partial("max")))]


def sends_nothing(fn, exc_type, match):
    """``fn`` raises ``exc_type`` (matching) with no instruction issued and no value fetched
    (``request`` is the controller's only way to ask ranks for values)."""
    c = session.get_controller()
    before, requests, real = c.issued, [], c.request

    def spy(*args):  # counts, then the real request: nothing is replaced
        requests.append(args)
        return real(*args)
    c.request = spy
    try:
        with pytest.raises(exc_type, match=match) as info:
            fn()
    finally:
        del c.request
    assert c.issued == before and not requests, "a refused call sent something"
    return info.value


def torch_error(fn):
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the error to compare with
        return exc
    raise AssertionError("torch did not raise")


# np.asarray ---------------------------------------------------------------------------------
@pytest.mark.parametrize("shape,placements", ARRAY_CASES, ids=str)
def test_asarray_is_the_gathered_value(mesh1d, shape, placements):
    t = torch.randn(shape)
    x = make(t, mesh1d, placements)
    a = np.asarray(x)
    assert isinstance(a, np.ndarray) and a.dtype == np.float32 and a.shape == shape
    np.testing.assert_allclose(a, np.asarray(x.to_torch()), rtol=0, atol=0)
    np.testing.assert_allclose(a, t.numpy(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape,placements", ARRAY_2D, ids=str)
def test_asarray_on_a_2d_mesh(mesh2d, shape, placements):
    t = torch.randn(shape)
    x = make(t, mesh2d, placements)
    np.testing.assert_allclose(np.asarray(x), t.numpy(), rtol=1e-5, atol=1e-5)


def test_asarray_dtypes_and_copy(mesh1d):
    t = torch.arange(10).view(5, 2)
    x = make(t, mesh1d, (Shard(0),))
    a = np.asarray(x)
    assert a.dtype == np.int64 and (a == t.numpy()).all()
    b = np.asarray(x, dtype=np.float64)
    assert b.dtype == np.float64 and (b == t.numpy().astype(np.float64)).all()
    assert x.__array__(np.float32).dtype == np.float32  # the protocol itself (numpy would cast)
    assert (np.array(x, copy=True) == t.numpy()).all()
    assert np.asarray(make(torch.tensor([True, False, True]), mesh1d, (Shard(0),))).tolist() \
        == [True, False, True]
    sends_nothing(lambda: np.asarray(x, copy=False), ValueError, "always a gathered copy")
    bf = make(torch.randn(4, 2).bfloat16(), mesh1d, (Shard(0),))
    expected = torch_error(lambda: np.asarray(torch.randn(4, 2).bfloat16()))
    sends_nothing(lambda: np.asarray(bf), type(expected), re.escape(str(expected)))
    ones = make(torch.ones(6), mesh1d, (Shard(0),))
    assert np.concatenate([ones, ones]).tolist() == [1.0] * 12  # numpy functions gather


def test_asarray_costs_what_to_torch_costs(mesh1d, mesh2d):
    """Shards come to the controller block by block (no collective among ranks); a Partial is
    all-reduced first, once per Partial mesh dim."""
    t = torch.randn(10, 3)
    a, counts = counted(lambda: np.asarray(make(t, mesh1d, (Shard(0),))))
    assert counts == {} and np.allclose(a, t.numpy())
    p = make(t, mesh1d, (Partial("sum"),))
    a, counts = counted(lambda: np.asarray(p))
    assert counts == {"all_reduce": 1} and np.allclose(a, t.numpy(), atol=1e-5)
    q = make(t, mesh2d, (Partial("sum"), Shard(1)))
    a, counts = counted(lambda: np.asarray(q))
    assert counts == {"all_reduce": 1} and np.allclose(a, t.numpy(), atol=1e-5)


# iteration ------------------------------------------------------------------------------------
ITER_CASES = [((5, 3), (Shard(1),)), ((3, 2), (Shard(1),)), ((4, 6), (R,)), ((5,), (R,)),
              ((3, 4), (Partial("sum"),)), ((0, 2), (Shard(1),)), ((2, 3, 5), (Shard(2),))]


@pytest.mark.parametrize("shape,placements", ITER_CASES, ids=str)
def test_iteration_along_an_unsharded_dim0(mesh1d, shape, placements):
    t = torch.randn(shape)
    x = make(t, mesh1d, placements)
    rows, counts = counted(lambda: list(x))
    assert counts == {} and len(rows) == len(t) == len(x)
    for i, row in enumerate(rows):
        assert isinstance(row, dtorch.DTensor)
        assert row.placements == x[i].placements and row.shape == t[i].shape
        torch.testing.assert_close(row.to_torch(), t[i])
    assert [tuple(r.shape) for r in tuple(x)] == [tuple(r.shape) for r in t]


def test_iteration_on_a_2d_mesh(mesh2d):
    t = torch.randn(3, 5)  # dim 1 on tp: 3, 2; dim 0 unsharded
    x = make(t, mesh2d, (Partial("sum"), Shard(1)))
    for i, row in enumerate(x):
        assert row.placements == (Partial("sum"), Shard(0))
        torch.testing.assert_close(row.to_torch(), t[i], rtol=1e-5, atol=1e-5)
    y = make(t, mesh2d, (R, Shard(0)))
    err = illegal(lambda: iter(y), "iterate over x.to_torch")
    assert "mesh dim 1 ('tp')" in str(err)
    assert "x.redistribute(placements=[Replicate(), Replicate()]) first   # all_gather" in str(err)


def test_unpacking_and_sum(mesh1d):
    t = torch.randn(2, 7)
    a, b = make(t, mesh1d, (Shard(1),))
    assert a.placements == (Shard(0),)
    torch.testing.assert_close((a - b).to_torch(), t[0] - t[1])
    with pytest.raises(ValueError, match="too many values to unpack"):
        a, b = make(torch.randn(3, 7), mesh1d, (Shard(1),))
    c, = make(torch.tensor([4.0]), mesh1d, (R,))
    assert float(c) == 4.0
    total = sum(make(t, mesh1d, (Shard(1),)))  # 0 + row0 + row1: a Python scalar then DTensors
    torch.testing.assert_close(total.to_torch(), t.sum(0))


@pytest.mark.parametrize("shape", [(10, 3), (3, 2), (2,)], ids=str)
def test_iteration_along_a_sharded_dim0_is_refused(mesh1d, shape):
    x = make(torch.randn(shape), mesh1d, (Shard(0),))
    for fn in (lambda: iter(x), lambda: list(x), lambda: tuple(x), lambda: [r for r in x]):
        err = illegal(fn, r"iterate over x\.to_torch\(\)")
        assert "dim 0, which is sharded on mesh dim 0" in str(err)
        assert "fix: x.redistribute(placements=[Replicate()]) first   # all_gather" in str(err)
    rows = list(x.redistribute(placements=[R]))  # the fix it names works
    assert len(rows) == shape[0] and all(r.placements == (R,) for r in rows)


def test_iteration_over_a_0d_tensor(mesh1d):
    x = make(torch.tensor(3.0), mesh1d, (R,))
    expected = torch_error(lambda: iter(torch.tensor(3.0)))
    sends_nothing(lambda: iter(x), TypeError, re.escape(str(expected)))
    sends_nothing(lambda: len(x), TypeError, re.escape(str(torch_error(
        lambda: len(torch.tensor(3.0))))))


def test_iteration_gradient(mesh1d):
    t = torch.randn(3, 6)
    x = make(t, mesh1d, (Shard(1),)).requires_grad_()
    a, b, c = ((row * row * (i + 1)).sum() for i, row in enumerate(x))  # Partial(sum) each
    loss = a + b + c  # (sum() would start from 0 + Partial: refused, as 0 + P is no Partial op)
    loss.backward()
    ref = t.clone().requires_grad_()
    sum((row * row * (i + 1)).sum() for i, row in enumerate(ref)).backward()
    assert x.grad.placements == (Shard(1),)
    torch.testing.assert_close(x.grad.to_torch(), ref.grad)
    torch.testing.assert_close(float(loss), float(sum((r * r * (i + 1)).sum()
                                                      for i, r in enumerate(t))))


def test_contains(mesh1d):
    t = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])
    x = make(t, mesh1d, (Shard(0),))
    assert (4.0 in x) is (4.0 in t) is True
    assert (7.0 in x) is (7.0 in t) is False


# scalars ----------------------------------------------------------------------------------------
SCALARS = (bool, float, int, complex)
ONE_ELEMENT = [(torch.tensor(2.5), (R,)), (torch.tensor([-3.0]), (Shard(0),)),
               (torch.tensor([[0.0]]), (Shard(1),)), (torch.tensor(7), (R,)),
               (torch.tensor(True), (R,)), (torch.tensor(1.5), (Partial("sum"),))]


@pytest.mark.parametrize("value,placements", ONE_ELEMENT, ids=str)
def test_scalar_conversions_of_one_element(mesh1d, value, placements):
    x = make(value, mesh1d, placements)
    for f in SCALARS:
        got, want = f(x), f(value)
        assert type(got) is type(want) and got == pytest.approx(want), f
    if not value.is_floating_point():
        assert x.__index__() == value.__index__()
    assert f"{x:.3f}" == f"{value:.3f}" if value.ndim == 0 else True


def test_scalars_of_a_reduction(mesh1d, mesh2d):
    t = torch.randn(10, 3)
    s = make(t, mesh1d, (Shard(0),)).sum()  # Partial(sum) on the ranks
    assert s.placements[0].is_partial()
    assert float(s) == pytest.approx(float(t.sum()), rel=1e-5, abs=1e-5)
    assert bool(make(t, mesh2d, (Shard(0), Shard(1))).abs().sum()) is True
    assert f"{s:.4f}" == f"{t.sum():.4f}"


@pytest.mark.parametrize("value", [torch.randn(3, 2), torch.randn(0), torch.randn(1, 2),
                                   torch.arange(2)], ids=lambda v: str(tuple(v.shape)))
def test_scalar_conversions_refuse_as_torch(mesh1d, value):
    x = make(value, mesh1d, (Shard(0),))
    for f in (*SCALARS, lambda v: v.__index__()):
        expected = torch_error(lambda: f(value))
        sends_nothing(lambda: f(x), type(expected), re.escape(str(expected)))


def test_index(mesh1d):
    n = make(torch.tensor(3), mesh1d, (R,))
    assert list(range(n)) == [0, 1, 2]
    assert ["a", "b", "c", "d"][n] == "d"
    assert [10, 20][make(torch.tensor(True), mesh1d, (R,))] == 20
    total = make(torch.arange(5), mesh1d, (Shard(0),)).sum()  # 10, Partial(sum) of int64
    assert range(total) == range(10)
    for value in (torch.tensor(2.0), torch.tensor([1, 2])):
        expected = torch_error(lambda: range(value))
        x = make(value, mesh1d, (R,))
        sends_nothing(lambda: range(x), type(expected), re.escape(str(expected)))


def test_numpy_operands_are_tensors_as_torch_takes_them(mesh1d):
    """``x + ndarray`` is ``x + torch.as_tensor(ndarray)`` (a Replicate constant beside any
    placements, see dtorch.ops.constants), never a silent gather into an ndarray; ``ndarray + x``
    defers to DTensor as torch.Tensor's ``__array_priority__`` makes numpy do."""
    t, a = torch.randn(4, 3), np.full((4, 3), 2.0, dtype=np.float32)
    rep = make(t, mesh1d, (R,), 1)
    got = rep + a
    assert isinstance(got, dtorch.DTensor) and got.placements == (R,)
    assert torch.equal(got.to_torch(), t + torch.as_tensor(a))
    got = rep * np.float32(3)
    assert isinstance(got, dtorch.DTensor) and torch.equal(got.to_torch(), t * 3)
    sharded = make(t, mesh1d, (Shard(0),), 1)
    with dtorch.CommDebugMode() as mode:  # a Replicate constant, narrowed on each rank
        got = sharded + a
    assert mode.get_total_counts() == 0 and got.placements == (Shard(0),)
    assert torch.equal(got.to_torch(), t + torch.as_tensor(a))
    assert type(sharded).__array_priority__ == torch.Tensor.__array_priority__
