"""Reductions with dim/keepdim on a real cluster: Partial(sum/avg/max/min) over sharded dims."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dtorch import Partial, Replicate, Shard
from dtorch.layout import local_shape
from test_ops_support import PARTIALS, Batch, dt, illegal, make, no_comm, placements_1d

R = Replicate()
SETTINGS = settings(max_examples=20, deadline=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture,
                                           HealthCheck.too_slow])

# name -> (call, kind of the pending reduction over a sharded dim, Partial inputs kept)
OPS = {
    "sum": (lambda x, d, k: x.sum(d, keepdim=k) if d is not None else x.sum(), "sum"),
    "mean": (lambda x, d, k: torch.mean(x, d, keepdim=k) if d is not None else x.mean(), "avg"),
    "amax": (lambda x, d, k: torch.amax(x, d if d is not None else (), keepdim=k), "max"),
    "amin": (lambda x, d, k: x.amin(d if d is not None else (), k), "min"),
    "max": (lambda x, d, k: torch.max(x) if d is None else torch.max(x, d, k), None),
    "min": (lambda x, d, k: x.min() if d is None else x.min(d, keepdim=k), None),
    "prod": (lambda x, d, k: x.prod() if d is None else x.prod(d, keepdim=k), None),
    "argmax": (lambda x, d, k: x.argmax(d, keepdim=k), None),
    "norm": (lambda x, d, k: torch.norm(x, dim=d, keepdim=k), None),
    "norm_inf": (lambda x, d, k: torch.linalg.vector_norm(x, float("inf"), d, k), "max"),
    "logsumexp": (lambda x, d, k: torch.logsumexp(x, d if d is not None else 0, k), None),
    "std": (lambda x, d, k: x.std(d, keepdim=k), None),
}
ALL_KIND = {"max": "max", "min": "min"}  # max()/min() without dim reduce like amax/amin


# along a sharded dim with no Partial input these run as composites (dtorch.ops.sharded_*)
COMPOSITE = {"max", "min", "argmax", "norm", "logsumexp", "std"}


def oracle(name, x_shape, placements, dim, dims, keepdim, mesh):
    """Expected output placements, None when illegal, "composite" when it communicates."""
    _, kind = OPS[name]
    if name in ALL_KIND and dim is None:
        kind = ALL_KIND[name]
    elif name in COMPOSITE and not any(p.is_partial() for p in placements) and any(
            isinstance(p, Shard) and p.dim in dims for p in placements):
        return "composite"
    if name == "norm_inf" and any(p.is_partial() for p in placements):
        return None
    out = []
    split = []
    for m, p in enumerate(placements):
        if isinstance(p, Shard):
            if p.dim in dims:
                if kind is None:
                    return None
                out.append(Partial(kind))
                split.append(m)
            else:
                out.append(Shard(p.dim if keepdim else p.dim - sum(d < p.dim for d in dims)))
        elif p.is_partial():
            ok = (kind in ("sum", "avg") and p.reduce_op in ("sum", "avg")) or (
                kind in ("max", "min") and p.reduce_op == kind)
            if not ok:
                return None
            out.append(p)
        else:
            out.append(R)
    if kind == "avg" and split:
        sizes = {tuple(local_shape(x_shape, mesh, placements, mesh.get_coordinate(r))[d]
                       for d in dims) for r in mesh.ranks}
        if len(sizes) != 1 or 0 in next(iter(sizes)):
            out = [Partial("sum") if m in split else p for m, p in enumerate(out)]
    return tuple(out)


@st.composite
def reduction_case(draw):
    shape = tuple(draw(st.lists(st.integers(1, 6), min_size=1, max_size=3)))
    name = draw(st.sampled_from(sorted(OPS)))
    if name in ("argmax", "std", "logsumexp"):
        dim = draw(st.integers(0, len(shape) - 1))
    else:
        dim = draw(st.one_of(st.none(), st.integers(0, len(shape) - 1)))
        if dim is not None and name in ("sum", "mean", "amax", "amin", "norm", "norm_inf") \
                and len(shape) > 1 and draw(st.booleans()):
            dim = (0, len(shape) - 1)
    keepdim = draw(st.booleans()) if dim is not None else False
    return shape, name, dim, keepdim


def _run(mesh, shape, name, dim, keepdim, placement_list, seed=0):
    fn = OPS[name][0]
    x = torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    expected = fn(x, dim, keepdim)
    dims = tuple(range(len(shape))) if dim is None else (
        tuple(sorted(d % len(shape) for d in dim)) if isinstance(dim, tuple) else (dim,))
    batch = Batch()
    for pl in placement_list:
        d = make(x, mesh, pl, seed)
        want = oracle(name, shape, pl, dim, dims, keepdim, mesh)
        if want is None:
            illegal(lambda: fn(d, dim, keepdim))
            continue
        if want == "composite":  # values against torch (tests/test_sharded_reductions.py)
            out = fn(d, dim, keepdim)
            batch.add(list(out) if isinstance(expected, tuple) else out,
                      list(expected) if isinstance(expected, tuple) else expected)
            continue
        out = no_comm(lambda: fn(d, dim, keepdim))
        if isinstance(expected, tuple):
            batch.add(list(out), list(expected), want)
        else:
            batch.add(out, expected, want)
    batch.check()


@SETTINGS
@given(case=reduction_case(), seed=st.integers(0, 99))
def test_every_placement_1d(mesh1d, case, seed):
    shape, name, dim, keepdim = case
    _run(mesh1d, shape, name, dim, keepdim, placements_1d(len(shape)), seed)


@SETTINGS
@given(case=reduction_case(), data=st.data())
def test_sampled_placements_2d(mesh2d, case, data):
    shape, name, dim, keepdim = case
    choices = ([R] + [Shard(d) for d in range(len(shape))]) * 3 + PARTIALS

    def pl():
        return tuple(data.draw(st.sampled_from(choices)) for _ in range(2))
    _run(mesh2d, shape, name, dim, keepdim, [pl() for _ in range(6)])


def test_design_examples_and_messages(mesh1d):
    x = torch.randn(8, 6)
    xs = dt(x, mesh1d, [Shard(0)])
    batch = Batch()
    batch.add(no_comm(lambda: xs.sum(0)), x.sum(0), [Partial("sum")])
    batch.add(no_comm(lambda: xs.amax(0)), x.amax(0), [Partial("max")])
    batch.add(no_comm(lambda: xs.amin(0, keepdim=True)), x.amin(0, keepdim=True),
              [Partial("min")])
    batch.add(no_comm(lambda: xs.mean(0)), x.mean(0), [Partial("avg")])
    batch.add(no_comm(lambda: xs.sum(1)), x.sum(1), [Shard(0)])
    batch.add(no_comm(lambda: xs.max(1).values), x.max(1).values, [Shard(0)])
    batch.add(xs.argmax(0), x.argmax(0))  # along the sharded dim: a composite
    batch.add(list(xs.max(0)), list(x.max(0)))
    batch.check()
    err = illegal(lambda: xs.prod(0))
    assert "Tensor.prod" in str(err) and "input [S(0)]" in str(err)


def test_uneven_shards(mesh1d):
    x = torch.randn(3, 5)  # 3 rows on 4 ranks: 1, 1, 1, 0 -- rank 3 holds nothing
    xs = dt(x, mesh1d, [Shard(0)])
    batch = Batch()
    batch.add(no_comm(lambda: xs.mean(0)), x.mean(0), [Partial("sum")])  # uneven mean
    batch.add(no_comm(lambda: xs.amax(0)), x.amax(0), [Partial("max")])  # empty shard: -inf
    batch.add(no_comm(lambda: xs.amin(0)), x.amin(0), [Partial("min")])
    batch.add(no_comm(lambda: xs.sum()), x.sum(), [Partial("sum")])
    xi = torch.randint(-9, 9, (3, 5))
    batch.add(no_comm(lambda: dt(xi, mesh1d, [Shard(0)]).amax(0)), xi.amax(0), [Partial("max")])
    batch.check()


def test_any_and_all_over_sharded_dims_are_partial_max_and_min(mesh1d, mesh2d):
    """Each rank answers for its block; the pending max (any) / min (all) is the answer. Rows
    mix zeros and ones so that swapping max and min, or reading any as all, is caught; 3 rows
    on 4 ranks leave one block empty (any: False, all: True by themselves)."""
    x = torch.tensor([[0, 1, 0, 0, 1], [0, 0, 0, 1, 1], [0, 0, 0, 0, 1]], dtype=torch.int64)
    batch = Batch()
    for mesh, placements in [(mesh1d, [Shard(0)]), (mesh2d, [Shard(0), Shard(1)])]:
        xs = dt(x, mesh, placements)
        pending = [Partial("max") if isinstance(p, Shard) else p for p in placements]
        batch.add(no_comm(lambda: xs.any()), x.any(), pending)
        batch.add(no_comm(lambda: xs.all()), x.all(), [Partial("min")] * len(placements))
        batch.add(no_comm(lambda: xs.bool().any(0)), x.bool().any(0),
                  [Partial("max")] + [Shard(0)] * (len(placements) - 1))
        batch.add(no_comm(lambda: torch.all(xs, 0, keepdim=True)), x.all(0, keepdim=True),
                  [Partial("min")] + [Shard(1)] * (len(placements) - 1))
        batch.add(no_comm(lambda: (xs > 0).all(1)), (x > 0).all(1),
                  [Shard(0)] + [Partial("min")] * (len(placements) - 1))
    batch.check()
    pending_max = make(x.double(), mesh1d, [Partial("max")], 1)
    illegal(lambda: pending_max.any(0))


def test_cumsum_and_integer_sum(mesh2d):
    x = torch.randint(-5, 5, (5, 6))
    xs = dt(x, mesh2d, [Shard(0), Shard(1)])
    batch = Batch()
    batch.add(no_comm(lambda: xs.sum(1)), x.sum(1), [Shard(0), Partial()])
    batch.add(no_comm(lambda: dt(x, mesh2d, [Shard(0), R]).cumsum(1)), x.cumsum(1),
              [Shard(0), R])
    batch.add(xs.cumsum(1), x.cumsum(1))  # along a sharded dim: a composite
    batch.check()
    illegal(lambda: xs.cummax(1))


@pytest.mark.parametrize("placements", [[Partial("sum")], [Partial("avg")]], ids=str)
def test_sum_of_partial_stays_partial(mesh1d, placements):
    x = torch.randn(4, 5, dtype=torch.float64)
    p = make(x, mesh1d, placements, 3)
    batch = Batch()
    batch.add(no_comm(lambda: p.sum(1)), x.sum(1), placements)
    batch.add(no_comm(lambda: p.mean()), x.mean(), placements)
    batch.check()
    illegal(lambda: p.amax(0))


def test_sort_and_topk_along_unsharded_dims(mesh1d, mesh2d):
    x = torch.randn(6, 7, dtype=torch.float64)
    s0 = dt(x, mesh1d, [Shard(0)])
    batch = Batch()
    batch.add(list(no_comm(lambda: s0.topk(3, dim=1))), list(x.topk(3, dim=1)), [Shard(0)])
    batch.add(list(no_comm(lambda: torch.sort(s0, -1, descending=True))),
              list(torch.sort(x, -1, descending=True)), [Shard(0)])
    batch.add(no_comm(lambda: s0.argsort(1)), x.argsort(1), [Shard(0)])
    batch.add(list(no_comm(lambda: dt(x, mesh2d, [Shard(1), R]).kthvalue(2, 0))),
              list(x.kthvalue(2, 0)), [Shard(0), R])
    batch.check()
    illegal(lambda: s0.topk(2, dim=0))
    illegal(lambda: s0.sort(0))


ALL_OPS = {"sum", "avg", "max", "min"}
# name -> (call on a 0-dim x with dim and keepdim, the Partial reduce ops whose placement it keeps)
ZERO_DIM = {
    "sum": (lambda x, d, k: x.sum(d, keepdim=k), ALL_OPS),
    "nansum": (lambda x, d, k: torch.nansum(x, d, k), ALL_OPS),
    "mean": (lambda x, d, k: torch.mean(x, d, k), ALL_OPS),
    "amax": (lambda x, d, k: torch.amax(x, d, k), ALL_OPS),
    "amin": (lambda x, d, k: x.amin(d, k), ALL_OPS),
    "max": (lambda x, d, k: torch.max(x, d, k), ALL_OPS),
    "min": (lambda x, d, k: x.min(d, keepdim=k), ALL_OPS),
    "prod": (lambda x, d, k: x.prod(d, keepdim=k), ALL_OPS),
    "argmax": (lambda x, d, k: x.argmax(d, keepdim=k), ALL_OPS),
    "argmin": (lambda x, d, k: torch.argmin(x, d, k), ALL_OPS),
    "logsumexp": (lambda x, d, k: torch.logsumexp(x, d, k), ALL_OPS),
    "median": (lambda x, d, k: x.median(d, k), ALL_OPS),
    "std": (lambda x, d, k: x.std(d, correction=0, keepdim=k), set()),
    "var": (lambda x, d, k: torch.var(x, d, keepdim=k, correction=0), set()),
    "any": (lambda x, d, k: x.any(d, keepdim=k), set()),
    "all": (lambda x, d, k: torch.all(x, d, k), set()),
    "norm": (lambda x, d, k: torch.norm(x, dim=d, keepdim=k), set()),
    "norm_inf": (lambda x, d, k: torch.linalg.vector_norm(x, float("inf"), d, k), set()),
    "norm_1": (lambda x, d, k: x.norm(1, d, k), set()),
    "count_nonzero": (lambda x, d, k: x.count_nonzero(d), set()),
    "cumsum": (lambda x, d, k: x.cumsum(d), {"sum", "avg"}),
    "cumprod": (lambda x, d, k: torch.cumprod(x, d), set()),
    "sort": (lambda x, d, k: x.sort(d, descending=k), set()),
}


@pytest.mark.parametrize("name", sorted(ZERO_DIM))
def test_zero_dim_input_with_dim_0_or_minus_1(mesh1d, name):
    """torch accepts dim 0 / -1 on a 0-dim tensor (nothing is reduced): so does every rule,
    keeping a Partial where the op returns the input itself."""
    fn, keeps = ZERO_DIM[name]
    x = torch.tensor(-1.75, dtype=torch.float64)
    batch = Batch()
    for placements in [(R,)] + [(p,) for p in PARTIALS]:
        d = make(x, mesh1d, placements, 5)
        for dim, keepdim in ((0, False), (-1, False), (0, True), (-1, True)):
            if placements[0].is_partial() and placements[0].reduce_op not in keeps:
                illegal(lambda: fn(d, dim, keepdim))
                continue
            expected = fn(x, dim, keepdim)
            out = no_comm(lambda: fn(d, dim, keepdim))
            if isinstance(expected, tuple):
                batch.add(list(out), list(expected), placements)
            else:
                batch.add(out, expected, placements)
    batch.check()
